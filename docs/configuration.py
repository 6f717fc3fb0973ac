#!/usr/bin/env python3
"""Writes docs/configuration.md from `arbor <command> --help` (every flag)
and the environment variables arbor reads. Run after a flag changes:
    python3 docs/configuration.py path/to/arbor > docs/configuration.md
(a test checks that every flag of every command is in that file)."""
import re
import subprocess
import sys

ARBOR = sys.argv[1] if len(sys.argv) > 1 else "arbor"
COMMANDS = [
    ["init"], ["mount"], ["unmount"], ["status"],
    ["checkpoints", "create"], ["checkpoints", "list"], ["checkpoints", "delete"],
    ["branches", "create"], ["branches", "list"], ["branches", "delete"], ["branches", "reset"], ["branches", "rename"],
    ["diff"], ["prefetch"], ["gc"], ["compact"], ["serve"], ["warm"], ["import"], ["export"], ["fsck"],
    ["csi"], ["keeper"],
]

ENV = [
    ("ARBOR_TOKEN_FILE", "mount, serve, warm", "the token file, in place of `--token-file`"),
    ("ARBOR_CACHE_SERVERS", "mount, warm", "the cache servers, in place of `--cache-server`"),
    ("ARBOR_TLS_CA, ARBOR_TLS_FINGERPRINT, ARBOR_TLS_CERT, ARBOR_TLS_KEY", "mount, warm", "in place of the client TLS flags"),
    ("ARBOR_FUSE", "mount", "`ring` (FUSE over io_uring, or fail; such a mount does not survive the death of its serving process), `classic` (/dev/fuse); `auto` or unset: the ring where the kernel offers it, except under a keeper (the default), which serves on /dev/fuse"),
    ("ARBOR_DIRECT_WRITES", "mount", "`0`: write-only opens go through the page cache like any other; `1` or unset: past it (Linux 6.6 and later)"),
    ("ARBOR_READ_THROUGH_OWNER", "mount through an owner", "`1`: every read goes to the owner, none to the bucket or cache servers; `0` or unset: bytes already in the bucket are read from there"),
    ("ARBOR_CACHE_WIRE", "mount with cache servers", "`http`: every chunk over HTTP/2, no framed chunk connections; `framed` or unset: segment chunks over chunk connections"),
    ("ARBOR_CACHE_TIMEOUT_MS", "mount with cache servers", "how long a chunk request to a cache server may take before the bucket is read (default 2000)"),
    ("ARBOR_S3_RETRIES", "every command on an s3:// disk", "tries per bucket call before it fails, 1 or more (the disk's bucket and imported files' buckets)"),
    ("ARBOR_S3_PATH_STYLE", "every command on an s3:// disk", "`0`: virtual-hosted-style bucket addresses with `AWS_ENDPOINT_URL` (path style there by default; AWS itself: virtual-hosted)"),
    ("ARBOR_IO", "every command", "how segment writes reach the kernel: `uring`, `syscall`, `buffered` (never past the page cache), `auto` or unset"),
    ("AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3), AWS_REGION, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE", "every command on an s3:// disk", "the bucket's endpoint and credentials, as the AWS SDK reads them"),
    ("XDG_CACHE_HOME", "mount, serve", "where node folders live by default (`$XDG_CACHE_HOME/arbor`, else `~/.cache/arbor`)"),
    ("ARBOR_CACHE_SERVERS_CHECKED", "mount", "set by `arbor mount` for the mount process it starts in the background (the servers were checked already); not for users"),
    ("ARBOR_KEEPER_FD, ARBOR_RESUME_FD", "mount", "set by the keeper for the serving process it starts: its socket to the keeper, and the /dev/fuse file of a live mount to take over; not for users"),
    ("CSI_ENDPOINT, NODE_ID", "csi", "in place of `--endpoint` and `--node-id`"),
    ("NOTIFY_SOCKET", "mount, serve with --foreground", "set by systemd for a `Type=notify` unit: arbor says when it is ready and when it stops"),
]


# Written by hand: what tests, benchmarks and scripts read.
TESTS_SECTION = """## Tests, benchmarks and scripts

Variables the test suites, the benchmark harnesses and `scripts/` read
(not the `arbor` binary). How to run them: [testing.md](testing.md),
[benchmarks.md](benchmarks.md).

| variable | read by | meaning |
| --- | --- | --- |
| `ARBOR_BIN` | `tests/` | the `arbor` binary the end-to-end tests spawn, in place of the workspace's build |
| `ARBOR_TEST_DIR` | `tests/` | where the end-to-end tests make their scratch folders (default: `e2e-scratch` in the target folder) |
| `ARBOR_FAULT_SEED`, `ARBOR_FAULT_SECS`, `ARBOR_FAULT_ONLY` | `tests/tests/fault_schedule.rs` | the fault schedule's seed, its length in seconds (default 30; a longer soak: 600), and `N`: keep one kind of fault |
| `ARBOR_TEST_REQUIRE_URING` | `engine` unit tests | set: a kernel without io_uring fails the ring's test instead of skipping it (`.ci/run` sets it) |
| `ARBOR_FUZZ_CASES` | `net/tests/fuzz_frames.rs` | how many cases (default 20,000) |
| `ARBOR_WRITE_SEEDS` | `net/tests/fuzz_frames.rs`, `engine/tests/fuzz_corpus.rs` | `1`: write the seed corpora |
| `ARBOR_WRITE_FIXTURE` | `engine/tests/format_fixture.rs` | `1`: write the format fixture anew |
| `ARBOR_BENCH_MIB`, `ARBOR_BENCH_RUNS` | `engine_compare`, `bucket_bench`, `import_bench`, `cache_bench`, `compact_bench` | the data size in MiB and the runs per row |
| `ARBOR_BENCH_FILES`, `ARBOR_BENCH_READS`, `ARBOR_BENCH_COLD` | `engine_compare` | small files (10,000), random reads (100,000); `0`: no cold-cache rows |
| `ARBOR_BENCH_SIZES`, `ARBOR_BENCH_REPS`, `ARBOR_BENCH_COLD_REPS`, `ARBOR_BENCH_DIFF_REPS` | `snapshot_bench` | disk sizes (`1000,100000,1000000`), creates per cell (30), cold and warm diffs (300 each) |
| `ARBOR_BENCH_REPS`, `ARBOR_BENCH_ROWS` | `remote_ops` | operations per row (2000); only the rows whose name contains it |
| `ARBOR_BENCH_RANGE_MIB` | the plain parallel ranged download the bucket benches compare against (`benches/src/lib.rs`) | its GET size in MiB (8) |
| `ARBOR_BENCH_READ_AHEAD_MIB` | `bucket_bench` | arbor's read-ahead in MiB |
| `ARBOR_BENCH_OBJECTS` | `import_bench` | objects imported (20,000) |
| `ARBOR_BENCH_RANDOM`, `ARBOR_BENCH_SERVER_US`, `ARBOR_BENCH_SKIP_N` | `cache_bench` | random reads per path (300); the proxy's delay in front of the server (`0`: no proxy); `1`: skip the N-clients rows |
| `ARBOR_BENCH_ROUNDS` | `compact_bench` | shards (8) |
| `TOUCH`, `RUNS`, `FILES`, `CLIENTS`, `CKPT_MIB`, `SIZE_GIB`, `TLS`, `ONLY_TLS`, `TLS_ROUNDS`, `PERF_OUT` | `benches/*.sh` | touched memory before each phase (`0`: off); runs, files, client mounts, checkpoint MiB, file GiB; TLS phases; a system-wide profile's output |
| `ARBOR_DISK`, `ARBOR_MNT` | `scripts/quickstart.sh` | where the disk lives (`./arbor-disk`) and where it is mounted (`./arbor-mnt`) |"""


def options(cmd):
    out = subprocess.run([ARBOR, *cmd, "--help"], capture_output=True, text=True, check=True).stdout
    rows, cur = [], None
    section = out.split("Options:", 1)[1].split("\n\n", 1)[0] if "Options:" in out else ""
    for line in section.splitlines():
        m = re.match(r"\s{2,6}(?:-\w, )?(--[\w-]+)(?: <[^>]+>)?(?:\s{2,}(.*))?$", line)
        if m:
            cur = [m.group(1), (m.group(2) or "").strip()]
            rows.append(cur)
        elif cur and line.strip():
            cur[1] = (cur[1] + " " + line.strip()).strip()
    return [(f, d) for f, d in rows if f not in ("--help", "--version")]


print("# Configuration\n")
print("Every flag of every `arbor` command, and every environment variable it")
print("reads. Generated by `python3 docs/configuration.py target/debug/arbor`")
print("from the commands' own `--help`; `tests/tests/cli.rs` checks that no flag")
print("is missing here.\n")
print("## Environment\n")
print("The `arbor` command reads these once, when it starts; a variable set to a value it cannot")
print("take stops the command with a one-line error naming it. The library crates read none of them:")
print("the command hands them on as options (`arbor_node::settings` for a front end's process).\n")
print("| variable | read by | meaning |")
print("| --- | --- | --- |")
for name, who, what in ENV:
    print(f"| `{name}` | {who} | {what} |")
for cmd in COMMANDS:
    rows = options(cmd)
    print(f"\n## arbor {' '.join(cmd)}\n")
    if not rows:
        print("No flags.")
        continue
    print("| flag | meaning |")
    print("| --- | --- |")
    for flag, desc in rows:
        cell = desc.replace("|", "\\|")
        print(f"| `{flag}` | {cell} |")

print()
print(TESTS_SECTION)
