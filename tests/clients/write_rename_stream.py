"""A stream of checkpoint saves (write tmp, rename) with an fsync every
few steps; prints the last step covered by a returned fsync. Runs until
the mount dies under it.

Usage: write_rename_stream.py DIR
"""
import os
import sys

d = sys.argv[1]


def body(i):
    return (f"step {i} ".encode() * 3000)[: 20000 + i]


i = 0
try:
    while i < 100000:
        tmp = os.path.join(d, f"ckpt-{i}.tmp")
        with open(tmp, "wb") as f:
            f.write(body(i))
        os.rename(tmp, os.path.join(d, f"ckpt-{i}"))
        if i % 5 == 4:
            fd = os.open(d, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            print("durable", i, flush=True)
        i += 1
except OSError:
    pass
