"""The S3 endpoint of `arbor serve --s3`, driven as a team's own tools
would: boto3 with its defaults (since 1.36: CRC checksums in aws-chunked
trailers), virtual-host-style addressing, URL-encoded listings, managed
multipart transfers, and the AWS CLI's `aws s3 sync`.

  s3_endpoint.py ENDPOINT ACCESS_KEY SECRET WORKDIR

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
    endpoint, key, secret, work = sys.argv[1:]
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
    big = os.urandom(20 * 1024 * 1024 + 5)
    bigpath = os.path.join(work, "big.bin")
    with open(bigpath, "wb") as f:
        f.write(big)
    s3.upload_file(bigpath, "main", "py/big.bin")
    head = s3.head_object(Bucket="main", Key="py/big.bin")
    check(head["ETag"].endswith('-3"'), "upload_file went multipart (%s)" % head["ETag"])
    out = os.path.join(work, "big.out")
    s3.download_file("main", "py/big.bin", out)
    with open(out, "rb") as f:
        check(f.read() == big, "download_file reads it back")

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
    print("all checks passed")


if __name__ == "__main__":
    main()
