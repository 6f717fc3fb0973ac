"""The workloads arbor is for, run against a mounted directory.

Usage: ml_workloads.py MOUNTDIR   (prints "ok NAME" per workload; exits non-zero on any mismatch)
"""
import hashlib
import io
import os
import shutil
import sys
import tarfile

import numpy as np

root = sys.argv[1]


def ok(name):
    print("ok", name, flush=True)


def tokens():
    # A uint16 token file, read through numpy.memmap in random windows.
    path = os.path.join(root, "tokens.bin")
    n = 24 * 1024 * 1024
    data = (np.arange(n, dtype=np.uint64) * 2654435761 % 65521).astype(np.uint16)
    data.tofile(path)
    mm = np.memmap(path, dtype=np.uint16, mode="r")
    assert mm.shape[0] == n
    rng = np.random.default_rng(7)
    for start in rng.integers(0, n - 4097, size=300):
        window = mm[start : start + 4097]
        assert np.array_equal(window, data[start : start + 4097]), f"window at {start}"
    del mm
    ok("numpy.memmap token windows")


def tar_shards():
    # WebDataset-style shards: written once, read sequentially.
    shard_dir = os.path.join(root, "shards")
    os.makedirs(shard_dir)
    digests = {}
    for s in range(4):
        with tarfile.open(os.path.join(shard_dir, f"shard-{s:05d}.tar"), "w") as tar:
            for i in range(50):
                body = os.urandom(1000 + 997 * i)
                info = tarfile.TarInfo(f"{s}-{i}.bin")
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
                digests[info.name] = hashlib.sha256(body).hexdigest()
    seen = 0
    for s in range(4):
        with tarfile.open(os.path.join(shard_dir, f"shard-{s:05d}.tar"), "r|") as tar:
            for member in tar:
                body = tar.extractfile(member).read()
                assert hashlib.sha256(body).hexdigest() == digests[member.name], member.name
                seen += 1
    assert seen == len(digests)
    ok("tar shards read sequentially")


def safe_checkpoint():
    # The safe way to save a model checkpoint: tmp, fsync, rename.
    ckpt = os.path.join(root, "ckpt")
    os.makedirs(ckpt)
    for step in range(3):
        weights = np.random.default_rng(step).standard_normal(3_000_000).astype(np.float32)
        tmp = os.path.join(ckpt, "step.pt.tmp")
        with open(tmp, "wb") as f:
            f.write(weights.tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, os.path.join(ckpt, "step.pt"))
        dfd = os.open(ckpt, os.O_RDONLY)
        os.fsync(dfd)
        os.close(dfd)
        back = np.fromfile(os.path.join(ckpt, "step.pt"), dtype=np.float32)
        assert np.array_equal(back, weights)
    assert sorted(os.listdir(ckpt)) == ["step.pt"]
    ok("checkpoint saved with tmp + fsync + rename")


def trees():
    base = os.path.join(root, "tree")
    for a in range(5):
        for b in range(5):
            d = os.path.join(base, f"a{a}", f"b{b}")
            os.makedirs(d)
            for c in range(8):
                with open(os.path.join(d, f"f{c}.txt"), "w") as f:
                    f.write(f"{a}/{b}/{c}")
    assert sorted(os.listdir(base)) == [f"a{a}" for a in range(5)]
    assert len(os.listdir(os.path.join(base, "a3", "b2"))) == 8
    os.rename(os.path.join(base, "a3"), os.path.join(base, "moved"))
    with open(os.path.join(base, "moved", "b2", "f7.txt")) as f:
        assert f.read() == "3/2/7"
    count = sum(len(files) for _, _, files in os.walk(base))
    assert count == 5 * 5 * 8
    shutil.rmtree(base)
    assert not os.path.exists(base)
    ok("directory trees created, listed, renamed, removed")


def sparse():
    path = os.path.join(root, "sparse.bin")
    far = 5 * 1024**3 + 12345
    with open(path, "wb") as f:
        f.write(b"head")
        f.seek(far)
        f.write(b"tail past 4 GiB")
    st = os.stat(path)
    assert st.st_size == far + 15
    assert st.st_blocks * 512 < 1024 * 1024, "holes must not take space"
    with open(path, "rb") as f:
        assert f.read(4) == b"head"
        f.seek(3 * 1024**3)
        assert f.read(65536) == bytes(65536)
        f.seek(far)
        assert f.read() == b"tail past 4 GiB"
    ok("sparse file with data past 4 GiB")


for workload in (tokens, tar_shards, safe_checkpoint, trees, sparse):
    workload()
