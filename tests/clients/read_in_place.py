"""Reads imported objects in place, as ML loaders do: WebDataset-style tar
shards member by member (tarfile, streaming), and a token file through
numpy.memmap windows. Prints "ok" or exits non-zero.

Usage: read_in_place.py make DIR         write the shards and the token file into DIR
       read_in_place.py check DIR        read them back (DIR: where they are mounted)
"""
import io
import os
import sys
import tarfile

SHARDS, SAMPLES, TOKENS = 3, 50, 3_000_000


def sample(shard, i):
    return (f"shard {shard} sample {i} " * (1 + i % 40)).encode()


def make(d):
    for s in range(SHARDS):
        with tarfile.open(os.path.join(d, f"shard-{s:04d}.tar"), "w") as t:
            for i in range(SAMPLES):
                for ext, body in (("txt", sample(s, i)), ("cls", str(i % 10).encode())):
                    info = tarfile.TarInfo(f"{s:04d}{i:06d}.{ext}")
                    info.size = len(body)
                    t.addfile(info, io.BytesIO(body))
    import numpy as np
    np.arange(TOKENS, dtype=np.uint32).astype(np.uint16).tofile(os.path.join(d, "tokens.u16"))


def check(d):
    for s in range(SHARDS):
        seen = 0
        with tarfile.open(os.path.join(d, f"shard-{s:04d}.tar"), "r|") as t:
            for m in t:
                body = t.extractfile(m).read()
                i = int(m.name[4:10])
                want = sample(s, i) if m.name.endswith(".txt") else str(i % 10).encode()
                if body != want:
                    sys.exit(f"shard {s}: {m.name} differs")
                seen += 1
        if seen != 2 * SAMPLES:
            sys.exit(f"shard {s}: {seen} members")
    import numpy as np
    tokens = np.memmap(os.path.join(d, "tokens.u16"), dtype=np.uint16, mode="r")
    if tokens.shape[0] != TOKENS:
        sys.exit(f"{tokens.shape[0]} tokens")
    for start in (0, 12_345, 1_048_573, TOKENS - 2048):
        window = np.asarray(tokens[start:start + 2048])
        want = (np.arange(start, start + 2048, dtype=np.uint32) % 65536).astype(np.uint16)
        if not np.array_equal(window, want):
            sys.exit(f"window at {start} differs")
    print("ok")


{"make": make, "check": check}[sys.argv[1]](sys.argv[2])
