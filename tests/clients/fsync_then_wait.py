"""Writes a file with a known pattern, fsyncs it, says so, and waits.

Usage: fsync_then_wait.py PATH MIB
"""
import os
import sys
import time

path, mib = sys.argv[1], int(sys.argv[2])
block = bytes((i * 7 + 3) % 251 for i in range(1 << 20))
with open(path, "wb") as f:
    for _ in range(mib):
        f.write(block)
    f.flush()
    os.fsync(f.fileno())
print("fsynced", flush=True)
time.sleep(60)
