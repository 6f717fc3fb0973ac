"""The S3 endpoint of `arbor serve --s3`, driven as a team's own tools
would: boto3 with its defaults (since 1.36: CRC checksums in aws-chunked
trailers), virtual-host-style addressing, URL-encoded listings, managed
multipart transfers, and the AWS CLI's `aws s3 sync`.

  s3_endpoint.py ENDPOINT ACCESS_KEY SECRET WORKDIR MOUNTDIR

MOUNTDIR is a FUSE mount of the same branch: what boto3 put is read back
there byte for byte, and a file written there is listed and read by boto3.

Prints one line per check; exits non-zero on the first failure.
"""
import hashlib
import os
import socket
import subprocess
import sys

import boto3
import botocore
from botocore.config import Config


def check(cond, what):
    if not cond:
        raise SystemExit(f"FAILED: {what}")
    print(f"ok: {what}")


def main():
    endpoint, key, secret, work, mount = sys.argv[1:]
    port = endpoint.rsplit(":", 1)[1]
    sent = []

    def record(request, **_):
        sent.append(dict(request.headers, url=request.url))

    def client(**cfg):
        c = boto3.client(
            "s3",
            endpoint_url=cfg.pop("endpoint", endpoint),
            aws_access_key_id=key,
            aws_secret_access_key=cfg.pop("secret", secret),
            region_name="us-east-1",
            config=Config(**cfg),
        )
        c.meta.events.register("before-send.s3.*", record)
        return c

    # boto3 puts a streaming body's checksum in an aws-chunked trailer
    # (STREAMING-UNSIGNED-PAYLOAD-TRAILER) only over TLS, and in a header
    # over plain HTTP: it is told this endpoint is TLS for that choice
    # alone, so that it sends here what it sends to an https endpoint.
    import botocore.httpchecksum as hc
    from urllib.parse import urlparse

    class Tls:
        def __init__(self, u):
            self.scheme = "https" if urlparse(u).scheme == "http" else urlparse(u).scheme

    hc.urlparse = Tls
    s3 = client()
    # Defaults: a body sent aws-chunked with its CRC in a trailer.
    body = os.urandom(3 * 1024 * 1024 + 17)
    path = os.path.join(work, "body.bin")
    with open(path, "wb") as f:
        f.write(body)
    sent.clear()
    with open(path, "rb") as f:
        s3.put_object(Bucket="main", Key="py/put.bin", Body=f)
    trailer = [h for h in sent if h.get("x-amz-trailer") or b"aws-chunked" in str(h.get("Content-Encoding", "")).encode()]
    print("PUT headers:", {k: v for k, v in sent[-1].items() if k.lower().startswith(("x-amz", "content"))})
    check(trailer, "boto3's default PUT sends an aws-chunked body with a checksum trailer")
    got = s3.get_object(Bucket="main", Key="py/put.bin")
    check(got["Body"].read() == body, "the trailer-checksummed body reads back")
    check(got["ETag"] == '"%s"' % hashlib.md5(body).hexdigest(), "its ETag is its MD5")

    # A checksum that does not match the body is refused.
    try:
        s3.put_object(Bucket="main", Key="py/bad.bin", Body=b"hello", ChecksumCRC32="AAAAAA==")
        check(False, "a wrong CRC32 is refused")
    except botocore.exceptions.ClientError as e:
        check(e.response["Error"]["Code"] == "BadDigest", "a wrong CRC32 is refused (BadDigest)")
    check("Contents" not in s3.list_objects_v2(Bucket="main", Prefix="py/bad"), "and leaves no object")

    # Managed transfers: multipart (with trailers per part), and ranged
    # parallel downloads.
    # 100 MiB in 8 MiB parts.
    from boto3.s3.transfer import TransferConfig

    big = os.urandom(100 * 1024 * 1024 + 5)
    bigpath = os.path.join(work, "big.bin")
    with open(bigpath, "wb") as f:
        f.write(big)
    mib8 = 8 * 1024 * 1024
    s3.upload_file(bigpath, "main", "py/big.bin", Config=TransferConfig(multipart_threshold=mib8, multipart_chunksize=mib8))
    head = s3.head_object(Bucket="main", Key="py/big.bin")
    check(head["ETag"].endswith('-13"'), "upload_file of 100 MiB went multipart in 13 parts (%s)" % head["ETag"])
    check(head["ContentLength"] == len(big), "of the whole length")
    out = os.path.join(work, "big.out")
    s3.download_file("main", "py/big.bin", out)
    with open(out, "rb") as f:
        check(f.read() == big, "download_file reads it back")

    # 5,000 keys across folders, listed page by page in byte order, with
    # and without a delimiter.
    from concurrent.futures import ThreadPoolExecutor

    many = [f"py/many/{d}/{n}" for d in ("a", "a-b", "a.b", "a0", "b") for n in (f"k{i:04}" for i in range(1000))]
    many[7] = "py/many/a/k0007-x"
    many[8] = "py/many/a/k0007/deeper"
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: s3.put_object(Bucket="main", Key=k, Body=k.encode()), many))
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket="main", Prefix="py/many/")
    listed = [o["Key"] for p in pages for o in p.get("Contents", [])]
    check(listed == sorted(many, key=lambda k: k.encode()), "5,000 keys listed in byte order, 1,000 a page (%d)" % len(listed))
    pages = s3.get_paginator("list_objects_v2").paginate(
        Bucket="main", Prefix="py/many/a/", Delimiter="/", PaginationConfig={"PageSize": 333}
    )
    listed, folders = [], []
    for p in pages:
        listed += [o["Key"] for o in p.get("Contents", [])]
        folders += [c["Prefix"] for c in p.get("CommonPrefixes", [])]
    want = sorted((k for k in many if k.startswith("py/many/a/") and "/" not in k[len("py/many/a/") :]), key=lambda k: k.encode())
    check(listed == want and folders == ["py/many/a/k0007/"], "a delimiter folds `k0007/` into a common prefix, pages of 333")
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket="main", Prefix="py/many/", Delimiter="/")
    folders = [c["Prefix"] for p in pages for c in p.get("CommonPrefixes", [])]
    check(folders == sorted(["py/many/a/", "py/many/a-b/", "py/many/a.b/", "py/many/a0/", "py/many/b/"], key=lambda k: k.encode()), "folders in byte order: %r" % folders)
    r = s3.list_objects_v2(Bucket="main", Prefix="py/many/", StartAfter="py/many/a0/k0998")
    check([o["Key"] for o in r["Contents"]][:2] == ["py/many/a0/k0999", "py/many/b/k0000"], "start-after")

    # Ranges and conditional gets.
    r = s3.get_object(Bucket="main", Key="py/big.bin", Range="bytes=8388600-8388615")
    check(r["Body"].read() == big[8388600:8388616] and r["ResponseMetadata"]["HTTPStatusCode"] == 206, "a range across parts")
    etag = head["ETag"]
    try:
        s3.get_object(Bucket="main", Key="py/put.bin", IfNoneMatch=got["ETag"])
        check(False, "If-None-Match of the ETag is 304")
    except botocore.exceptions.ClientError as e:
        check(e.response["Error"]["Code"] == "304", "If-None-Match of the ETag is 304")
    try:
        s3.get_object(Bucket="main", Key="py/big.bin", IfMatch='"0123"')
        check(False, "If-Match of another ETag is 412")
    except botocore.exceptions.ClientError as e:
        check(e.response["Error"]["Code"] == "PreconditionFailed", "If-Match of another ETag is 412")
    check(s3.get_object(Bucket="main", Key="py/big.bin", IfMatch=etag, Range="bytes=0-9")["Body"].read() == big[:10], "If-Match of its ETag")

    # What boto3 put, read on the mount; what the mount writes, read by boto3.
    with open(os.path.join(mount, "py", "big.bin"), "rb") as f:
        check(f.read() == big, "the 100 MiB object is byte for byte on the mount")
    with open(os.path.join(mount, "py", "put.bin"), "rb") as f:
        check(f.read() == body, "the trailer-checksummed object too")
    on_mount = sorted(
        os.path.relpath(os.path.join(d, n), mount) for d, _, names in os.walk(os.path.join(mount, "py", "many")) for n in names
    )
    check(on_mount == sorted(many), "the 5,000 keys are the mount's files")
    for k in many[::50]:
        with open(os.path.join(mount, k), "rb") as f:
            if f.read() != k.encode():
                raise SystemExit(f"FAILED: {k} differs on the mount")
    check(True, "every 50th of them reads back on the mount")
    mine = os.urandom(3 * 1024 * 1024)
    with open(os.path.join(mount, "py", "from-mount.bin"), "wb") as f:
        f.write(mine)
    check(s3.get_object(Bucket="main", Key="py/from-mount.bin")["Body"].read() == mine, "a file written on the mount is a GET away")

    # Keys a URL-encoded listing must carry intact (boto3 asks for it).
    odd = ["py/odd/a b+c%d", "py/odd/ü€", "py/odd/x&y=z?", "py/odd/tab\there"]
    for k in odd:
        s3.put_object(Bucket="main", Key=k, Body=k.encode())
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket="main", Prefix="py/odd/", PaginationConfig={"PageSize": 2})
    keys = [o["Key"] for p in pages for o in p.get("Contents", [])]
    check(keys == sorted(odd, key=lambda k: k.encode()), "URL-encoded listings keep odd keys, in byte order: %r" % keys)
    for k in odd:
        check(s3.get_object(Bucket="main", Key=k)["Body"].read() == k.encode(), "get %r" % k)

    # Virtual-host style: BUCKET.localhost names the bucket.
    real = socket.getaddrinfo

    def resolve(host, *a, **kw):
        if isinstance(host, str) and host.endswith(".localhost"):
            host = "127.0.0.1"
        return real(host, *a, **kw)

    socket.getaddrinfo = resolve
    vh = client(endpoint=f"http://localhost:{port}", s3={"addressing_style": "virtual"})
    sent.clear()
    vh.put_object(Bucket="main", Key="py/vhost.txt", Body=b"virtual")
    check(sent[-1]["url"].startswith(f"http://main.localhost:{port}/"), "the request went to main.localhost")
    check(vh.get_object(Bucket="main", Key="py/vhost.txt")["Body"].read() == b"virtual", "virtual-host style get")
    check([o["Key"] for o in vh.list_objects_v2(Bucket="main", Prefix="py/vh")["Contents"]] == ["py/vhost.txt"], "and list")
    socket.getaddrinfo = real

    # A wrong secret is refused.
    try:
        client(secret="wrong").list_objects_v2(Bucket="main")
        check(False, "a wrong secret is refused")
    except botocore.exceptions.ClientError as e:
        check(e.response["Error"]["Code"] == "SignatureDoesNotMatch", "a wrong secret is refused")

    # The AWS CLI: a folder synced up twice; the second time sends nothing.
    tree = os.path.join(work, "tree")
    for i in range(40):
        p = os.path.join(tree, f"d{i % 4}", f"sub{i % 3}", f"f{i}.txt")
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(os.urandom(1000 + i * 37))
    with open(os.path.join(tree, "large.bin"), "wb") as f:
        f.write(os.urandom(12 * 1024 * 1024))
    env = dict(os.environ, AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret, AWS_DEFAULT_REGION="us-east-1")
    cmd = ["aws", "--endpoint-url", endpoint, "s3", "sync", tree, "s3://main/synced/"]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True)
    check(first.returncode == 0, "aws s3 sync up: %s" % first.stderr[-2000:])
    uploads = [l for l in first.stdout.splitlines() if "upload:" in l]
    check(len(uploads) == 41, "the first sync uploads 41 files (%d)" % len(uploads))
    second = subprocess.run(cmd, env=env, capture_output=True, text=True)
    check(second.returncode == 0, "aws s3 sync again: %s" % second.stderr[-2000:])
    check("upload:" not in second.stdout, "the second sync uploads nothing: %r" % second.stdout[-2000:])
    down = os.path.join(work, "down")
    third = subprocess.run(["aws", "--endpoint-url", endpoint, "s3", "sync", "s3://main/synced/", down], env=env, capture_output=True, text=True)
    check(third.returncode == 0, "aws s3 sync down: %s" % third.stderr[-2000:])
    diff = subprocess.run(["diff", "-r", tree, down], capture_output=True, text=True)
    check(diff.returncode == 0, "what came down is what went up: %s" % diff.stdout[-2000:])
    fourth = subprocess.run(["aws", "--endpoint-url", endpoint, "s3", "sync", "s3://main/synced/", down], env=env, capture_output=True, text=True)
    check(fourth.returncode == 0, "aws s3 sync down again: %s" % fourth.stderr[-2000:])
    check("download:" not in fourth.stdout, "the second sync down downloads nothing: %r" % fourth.stdout[-2000:])
    print("all checks passed")


if __name__ == "__main__":
    main()
