"""Training pipelines' own writers against the S3 endpoint of `arbor serve
--s3`, read back on a FUSE mount of the same branch:

- MosaicML Streaming: `MDSWriter(out=(local, "s3://main/mds/train"))`
  uploads its shards and index through the endpoint (`S3_ENDPOINT_URL`),
  then `StreamingDataset(local=MOUNT/mds/train)` reads them in place.
- torch distributed checkpoint: `FsspecWriter("s3://main/dcp/step-N")`
  (fsspec's s3fs: a PUT per rank's file, `.metadata.tmp` PUT, the rename
  to `.metadata` as CopyObject + DeleteObject), every S3 call the writer
  made recorded; then `torch.distributed.checkpoint.load` reads the
  checkpoint from the mount.

  ml_s3_writers.py ENDPOINT ACCESS_KEY SECRET MOUNTDIR WORKDIR

Prints one line per check; exits non-zero on the first failure.
"""
import hashlib
import os
import sys


def check(cond, what):
    if not cond:
        raise SystemExit(f"FAILED: {what}")
    print(f"ok: {what}", flush=True)


def mds(endpoint, mount, work):
    from streaming import MDSWriter, StreamingDataset

    samples = []
    for i in range(3000):
        body = hashlib.sha256(f"sample {i}".encode()).digest() * (1 + i % 37)
        samples.append({"id": i, "text": f"sample number {i}", "body": body})
    columns = {"id": "int", "text": "str", "body": "bytes"}
    local = os.path.join(work, "mds-local")
    # Shards of at most 64 KiB: many shards, each its own PUT.
    with MDSWriter(out=(local, "s3://main/mds/train"), columns=columns, size_limit=1 << 16, keep_local=True) as w:
        for s in samples:
            w.write(s)
    shards = sorted(n for n in os.listdir(os.path.join(mount, "mds", "train")) if n.endswith(".mds"))
    check(len(shards) > 10, f"MDSWriter uploaded {len(shards)} shards through S3, listed on the mount")
    check(os.path.exists(os.path.join(mount, "mds", "train", "index.json")), "the index is on the mount")
    for name in shards:
        with open(os.path.join(local, name), "rb") as a, open(os.path.join(mount, "mds", "train", name), "rb") as b:
            if a.read() != b.read():
                raise SystemExit(f"FAILED: shard {name} differs on the mount")
    check(True, "every shard on the mount is byte for byte the one MDSWriter wrote")
    ds = StreamingDataset(local=os.path.join(mount, "mds", "train"), remote=None, shuffle=False, batch_size=1)
    check(len(ds) == len(samples), f"StreamingDataset on the mount has {len(ds)} samples")
    for i in range(len(ds)):
        got = ds[i]
        want = samples[i]
        if got["id"] != want["id"] or got["text"] != want["text"] or got["body"] != want["body"]:
            raise SystemExit(f"FAILED: sample {i} differs when read in place on the mount")
    check(True, "every sample read in place on the mount is the one written through S3")


def dcp(endpoint, key, secret, mount):
    import torch
    import torch.distributed.checkpoint as dist_cp
    from torch.distributed.checkpoint import FsspecWriter

    import aiobotocore.client
    import s3fs

    calls = []
    # Every S3 call the writer makes, by operation: s3fs sends each one
    # through aiobotocore's client.
    orig_call = aiobotocore.client.AioBaseClient._make_api_call

    async def record(self, operation, params):
        keys = [o.get("Key", "") for o in params.get("Delete", {}).get("Objects", [])]
        calls.append((operation, params.get("Key", " ".join(keys)), str(params.get("CopySource", ""))))
        return await orig_call(self, operation, params)

    aiobotocore.client.AioBaseClient._make_api_call = record

    g = torch.Generator().manual_seed(11)
    state = {
        "model": {
            "layer1.weight": torch.randn(256, 512, generator=g),
            "layer1.bias": torch.randn(512, generator=g),
            "embed": torch.randn(1000, 64, generator=g).to(torch.bfloat16),
        },
        "step": torch.tensor(9000),
    }
    path = "s3://main/dcp/step-9000"
    writer = FsspecWriter(path, single_file_per_rank=True, sync_files=False)
    dist_cp.save(state, storage_writer=writer, no_dist=True)
    aiobotocore.client.AioBaseClient._make_api_call = orig_call
    print("the writer's S3 calls:", ", ".join(f"{op} {k}" for op, k, _ in calls), flush=True)

    puts = [c for c in calls if c[0] in ("PutObject", "CompleteMultipartUpload")]
    check(any(k.endswith(".distcp") for _, k, _ in puts), "a rank's data file was PUT through S3")
    check(any(k.endswith(".metadata.tmp") for _, k, _ in puts), "`.metadata.tmp` was PUT through S3")
    copies = [c for c in calls if c[0] in ("CopyObject", "UploadPartCopy")]
    check(
        any(k.endswith("/.metadata") and ".metadata.tmp" in src for _, k, src in copies),
        "the rename of `.metadata.tmp` to `.metadata` was a CopyObject",
    )
    check(
        any(op in ("DeleteObject", "DeleteObjects") and k.endswith(".metadata.tmp") for op, k, _ in calls),
        "then a delete of `.metadata.tmp`",
    )
    names = sorted(os.listdir(os.path.join(mount, "dcp", "step-9000")))
    check(".metadata" in names and ".metadata.tmp" not in names, f"the mount lists {names}")

    # HEAD of a missing `.metadata` is a 404 the writer's exists() sees as False.
    fs = s3fs.S3FileSystem(key=key, secret=secret, client_kwargs={"endpoint_url": endpoint})
    check(not fs.exists("main/dcp/no-such-step/.metadata"), "HEAD of a missing `.metadata` is 404")
    check(fs.exists("main/dcp/step-9000/.metadata"), "HEAD of the written `.metadata` is 200")

    # Loaded from the mount, as a trainer on any node would.
    target = {
        "model": {
            "layer1.weight": torch.zeros(256, 512),
            "layer1.bias": torch.zeros(512),
            "embed": torch.zeros(1000, 64, dtype=torch.bfloat16),
        },
        "step": torch.tensor(0),
    }
    dist_cp.load(target, checkpoint_id=os.path.join(mount, "dcp", "step-9000"), no_dist=True)
    for name, t in state["model"].items():
        check(torch.equal(target["model"][name], t), f"{name} loaded from the mount equals what was saved")
    check(int(target["step"]) == 9000, "the step loaded from the mount")


def main():
    endpoint, key, secret, mount, work = sys.argv[1:]
    os.environ["AWS_ACCESS_KEY_ID"] = key
    os.environ["AWS_SECRET_ACCESS_KEY"] = secret
    os.environ["AWS_DEFAULT_REGION"] = "us-east-1"
    os.environ["S3_ENDPOINT_URL"] = endpoint
    # fsspec's s3fs reads the endpoint from its own variable.
    os.environ["FSSPEC_S3_ENDPOINT_URL"] = endpoint
    mds(endpoint, mount, work)
    dcp(endpoint, key, secret, mount)
    print("all checks passed")


if __name__ == "__main__":
    main()
