#!/usr/bin/env bash
# Write-only opens past the page cache (FOPEN_DIRECT_IO) against the same
# writes through it (ARBOR_DIRECT_WRITES=0), alternating on one disk, with
# the local disk beside them: MiB/s, and the CPU per MiB of the writer and
# of the mount (from /proc). The writer is a checkpoint writer's loop:
# open("wb"), 1 MiB writes, fsync. Prints a markdown table of medians.
#
#   benches/write_only.sh [WORKDIR]     (root; arbor built in release)
#   MIB=1024 RUNS=5 ARBOR_FUSE=ring benches/write_only.sh
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
arbor=${ARBOR:-$here/target/release/arbor}
mib=${MIB:-1024}
runs=${RUNS:-5}
work=${1:-$here/target/write-only-bench}
[ -x "$arbor" ] || (cd "$here" && cargo build --release -p arbor-cli)
. "$here/benches/common.sh"
param=/sys/module/fuse/parameters/enable_uring
was=$(cat "$param" 2>/dev/null || echo none)
[ "${ARBOR_FUSE:-auto}" != ring ] || echo Y > "$param"
rm -rf "$work" && mkdir -p "$work/mnt" "$work/local"
"$arbor" init "$work/disk" >/dev/null
cleanup() {
  "$arbor" unmount "$work/mnt" >/dev/null 2>&1 || true
  [ "$was" = none ] || echo "$was" > "$param" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

# write PATH: "MiB/s writer-CPU-ms-per-MiB" for one checkpoint-style write.
write() {
  python3 - "$1" "$mib" <<'PY'
import os, resource, sys, time
path, mib = sys.argv[1], int(sys.argv[2])
block = os.urandom(1 << 20)
r0, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
with open(path, "wb") as f:
    for _ in range(mib):
        f.write(block)
    f.flush()
    os.fsync(f.fileno())
t, r1 = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
print(f"{mib / t:.0f} {cpu * 1000 / mib:.3f}")
PY
}
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

declare -A R
for r in $(seq "$runs"); do
  for direct in 1 0; do
    touch_memory "$work" "$mib"
    ARBOR_DIRECT_WRITES=$direct "$arbor" mount "$work/disk" "$work/mnt" >/dev/null
    pid=$(pgrep -f "arbor mount $work/disk" | head -1)
    t0=$(ticks "$pid")
    read -r bw cpu <<<"$(write "$work/mnt/ckpt")"
    t1=$(ticks "$pid")
    rm -f "$work/mnt/ckpt"
    "$arbor" unmount "$work/mnt" >/dev/null
    R[$direct.bw]+=" $bw"; R[$direct.cpu]+=" $cpu"
    R[$direct.mount]+=" $(python3 -c "import os,sys; print((int(sys.argv[2]) - int(sys.argv[1])) * 1000 / os.sysconf('SC_CLK_TCK') / int(sys.argv[3]))" "$t0" "$t1" "$mib")"
    touch_memory "$work" "$mib"
    read -r bw cpu <<<"$(write "$work/local/ckpt")"
    rm -f "$work/local/ckpt"
    R[local.bw]+=" $bw"; R[local.cpu]+=" $cpu"
    echo "run $r/$runs direct=$direct: arbor $(echo ${R[$direct.bw]} | awk '{print $NF}') MiB/s, local $bw" >&2
  done
  # Deleted files keep their segments until compaction frees them.
  "$arbor" compact "$work/disk" >/dev/null 2>&1 || true
  "$arbor" gc "$work/disk" --grace 0 >/dev/null 2>&1 || true
done
m() { median ${R[$1]}; }
echo
echo "### Write-only opens: $mib MiB in 1 MiB writes + fsync, ${ARBOR_FUSE:-auto} transport (medians of $runs alternating runs)"
echo
echo "| writes | MiB/s | ÷ local disk | writer CPU ms/MiB | mount CPU ms/MiB |"
echo "| --- | ---: | ---: | ---: | ---: |"
python3 - "$(m local.bw)" "$(m local.cpu)" "$(m 1.bw)" "$(m 1.cpu)" "$(m 1.mount)" "$(m 0.bw)" "$(m 0.cpu)" "$(m 0.mount)" <<'PY'
import sys
lb, lc, db, dc, dm, cb, cc, cm = map(float, sys.argv[1:])
print(f"| local disk | {lb:.0f} | 1.00× | {lc:.3f} | |")
print(f"| arbor, past the page cache (default) | {db:.0f} | {db / lb:.2f}× | {dc:.3f} | {dm:.2f} |")
print(f"| arbor, through the page cache (`ARBOR_DIRECT_WRITES=0`) | {cb:.0f} | {cb / lb:.2f}× | {cc:.3f} | {cm:.2f} |")
PY
