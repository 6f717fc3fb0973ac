"""Holds one file open on a mount and, round after round, writes a block,
fsyncs it and reads it back, and lists and statvfs's the mount: any error
ends it with a traceback. Prints "ready" after the first round and, at the
end, "ok ROUNDS WORST_ROUND_MS".

Round i writes block(i) at slot i % SLOTS (4 KiB slots); every 32nd round
also creates FILE.i (its name, as its bytes) and fsyncs it.

Usage: hold_open_loop.py FILE SECONDS MAX_ROUNDS
"""
import os
import struct
import sys
import time

SLOTS = 1024


def block(i):
    return struct.pack("<Q", i) + bytes([i % 251]) * 4088


path, seconds, max_rounds = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
mount = os.path.dirname(path)
fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
start = time.monotonic()
worst = 0.0
i = 0
while i < max_rounds and time.monotonic() - start < seconds:
    t = time.monotonic()
    b = block(i)
    at = (i % SLOTS) * 4096
    assert os.pwrite(fd, b, at) == 4096
    os.fsync(fd)
    back = os.pread(fd, 4096, at)
    assert back == b, "round %d read back other bytes" % i
    if i % 32 == 0:
        small = "%s.%d" % (path, i)
        with open(small, "w") as f:
            f.write(os.path.basename(small))
            f.flush()
            os.fsync(f.fileno())
    if i % 16 == 0:
        assert os.path.basename(path) in os.listdir(mount)
        os.statvfs(mount)
        os.fstat(fd)
    worst = max(worst, time.monotonic() - t)
    if i == 0:
        print("ready", flush=True)
    i += 1
    time.sleep(0.001)
os.close(fd)
print("ok %d %d" % (i, worst * 1000), flush=True)
