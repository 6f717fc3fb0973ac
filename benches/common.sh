# Helpers the comparison scripts share; sourced, not run.

drop_caches() { sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true; }

# touch_memory DIR MIB: fills MIB of page cache with a file in DIR and
# deletes it, right before a timed phase, on every side compared. This
# kind of virtual machine hands its free memory back to the host
# (virtio-balloon free page reporting, DAMON pageout), and the first write
# into such memory runs at ~0.5 GB/s against ~5 GB/s into memory a file
# held a moment ago; without this, a phase that fills the page cache
# measures the host's page faults. TOUCH=0 turns it off (for comparison).
touch_memory() {
  [ "${TOUCH:-1}" = 0 ] && return 0
  dd if=/dev/zero of="$1/.touch-memory" bs=1M count="$2" status=none 2>/dev/null || true
  rm -f "$1/.touch-memory"
}

# fio's JSON -> one number: MiB/s of a job, or a completion-latency percentile in µs.
bw() { python3 -c 'import json,sys; j=json.load(open(sys.argv[1]))["jobs"][0]; r=j[sys.argv[2]]; print(r["bw_bytes"]/1048576)' "$@"; }
lat() { python3 -c 'import json,sys; j=json.load(open(sys.argv[1]))["jobs"][0]; print(j["read"]["clat_ns"]["percentile"][sys.argv[2]]/1000)' "$@"; }
median() { python3 -c 'import statistics,sys; print(statistics.median(float(x) for x in sys.argv[1:]))' "$@"; }

# write_stream PATH MIB: MIB writes of 1 MiB of bytes that are not zeros
# to PATH opened write-only, then fsync, as a checkpoint writer makes them
# (torch.save, safetensors, numpy.save, dd; fio opens read-write); MiB/s.
write_stream() {
  python3 - "$1" "$2" <<'PY'
import os, sys, time
path, mib = sys.argv[1], int(sys.argv[2])
block = os.urandom(1 << 20)
t = time.perf_counter()
with open(path, "wb") as f:
    for _ in range(mib):
        f.write(block)
    f.flush()
    os.fsync(f.fileno())
print(mib / (time.perf_counter() - t))
PY
}

# smallfiles DIR N: create N files of 4 KiB, stat each, list, unlink each; files/s.
smallfiles() {
  python3 - "$1" "$2" <<'PY'
import os, sys, time
d, n = sys.argv[1], int(sys.argv[2])
sub = os.path.join(d, "small")
os.makedirs(sub, exist_ok=True)
t = time.perf_counter()
for i in range(n):
    with open(os.path.join(sub, f"f{i}"), "wb") as f:
        f.write(b"x" * 4096)
for i in range(n):
    os.stat(os.path.join(sub, f"f{i}"))
assert len(os.listdir(sub)) == n
for i in range(n):
    os.unlink(os.path.join(sub, f"f{i}"))
print(n / (time.perf_counter() - t))
PY
}

# row NAME UNIT BASELINE MEASURED TARGET: one markdown table row with the ratio.
row() {
  python3 -c 'import sys; n,u,l,a,t=sys.argv[1:]; l=float(l); a=float(a); print(f"| {n} | {l:.2f} {u} | {a:.2f} {u} | {a/l:.2f}× | {t} |")' "$@"
}

# metadata DIR N: stat/s over N files the kernel has seen, readdir entries/s
# (scandir + stat, as `ls -l` does; best of 3 passes, each a few ms), and
# create + 4 KiB write + fsync files/s.
metadata() {
  python3 - "$1" "$2" <<'PY'
import os, sys, time
d, n = sys.argv[1], int(sys.argv[2])
sub = os.path.join(d, "meta")
os.makedirs(sub, exist_ok=True)
names = [os.path.join(sub, f"f{i}") for i in range(n)]
t = time.perf_counter()
for p in names:
    fd = os.open(p, os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, b"x" * 4096)
    os.fsync(fd)
    os.close(fd)
cw = n / (time.perf_counter() - t)
for p in names:
    os.stat(p)
best_stat = 0.0
for _ in range(3):
    t = time.perf_counter()
    for p in names:
        os.stat(p)
    best_stat = max(best_stat, n / (time.perf_counter() - t))
rd = 0.0
for _ in range(3):
    t = time.perf_counter()
    seen = 0
    for e in os.scandir(sub):
        e.stat()
        seen += 1
    assert seen == n
    rd = max(rd, n / (time.perf_counter() - t))
for p in names:
    os.unlink(p)
os.rmdir(sub)
print(best_stat, rd, cw)
PY
}

# Timing: now (seconds), secs T0 T1, rate MIB T0 T1 (MiB/s).
now() { date +%s.%N; }
secs() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$@"; }
rate() { python3 -c "import sys; print(f'{float(sys.argv[1]) / (float(sys.argv[3]) - float(sys.argv[2])):.1f}')" "$@"; }

# stream DIR OUT: 40 files of 4 MiB in DIR, fsync each (a file whose write
# or fsync fails is saved again), the number of each one fsynced to OUT;
# in the background, $writer is its pid.
stream() {
  python3 - "$1" > "$2" <<'PY' & writer=$!
import os, sys
d = sys.argv[1]
os.makedirs(d, exist_ok=True)
for i in range(40):
    for attempt in range(3):
        try:
            with open(os.path.join(d, f"f{i}"), "wb") as f:
                for _ in range(4):
                    f.write(bytes([i]) * (1 << 20))
                f.flush(); os.fsync(f.fileno())
            print(i, flush=True)
            break
        except OSError as e:
            print(f"f{i}: {e}, saving again", file=sys.stderr)
PY
}
# whole DIR SAVED: how many of the files SAVED lists are whole in DIR.
whole() {
  python3 - "$1" "$2" <<'PY'
import os, sys
d, saved = sys.argv[1], [int(x) for x in open(sys.argv[2]).read().split()]
bad = [i for i in saved if open(os.path.join(d, f"f{i}"), "rb").read() != bytes([i]) * (4 << 20)]
print(f"{len(saved)} fsynced, {len(bad)} not whole")
PY
}
