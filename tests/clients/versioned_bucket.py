"""A bucket that keeps versions, on an S3 server (moto) at ENDPOINT, driven
as a team's own tools would: boto3, the AWS SDK for Python.

  versioned_bucket.py ENDPOINT make BUCKET            create it, versioning on
  versioned_bucket.py ENDPOINT put BUCKET KEY FILE    upload FILE; prints the version id
  versioned_bucket.py ENDPOINT delete BUCKET KEY      delete KEY (a delete marker)
  versioned_bucket.py ENDPOINT purge BUCKET KEY ID    delete version ID for good
"""
import sys

import boto3


def main():
    endpoint, cmd, bucket, *rest = sys.argv[1:]
    s3 = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="arbor-test-key",
        aws_secret_access_key="arbor-test-secret",
        region_name="us-east-1",
    )
    if cmd == "make":
        s3.create_bucket(Bucket=bucket)
        s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    elif cmd == "put":
        key, path = rest
        with open(path, "rb") as f:
            print(s3.put_object(Bucket=bucket, Key=key, Body=f.read())["VersionId"])
    elif cmd == "delete":
        (key,) = rest
        s3.delete_object(Bucket=bucket, Key=key)
    elif cmd == "purge":
        key, version = rest
        s3.delete_object(Bucket=bucket, Key=key, VersionId=version)
    else:
        sys.exit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()
