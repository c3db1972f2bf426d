"""s3://bucket/prefix through boto3: listing, per-object checksums, ranged GETs.

Listing is ListObjectsV2 alone (its Size and ETag): no request per object, so
a prefix holding a million objects costs a thousand pages, not a million HEADs.
A file is HEADed once, when its transfer starts (`describe`), for its checksum
and to see that it still has the listed ETag and size.

Consistency: every ranged GET carries `If-Match: <ETag from the listing>` and
its response ETag is compared again (some S3-compatible servers ignore
If-Match), so parts of two versions of an object are never stitched together.

Content check, the cheapest one the store offers per object (Ferry computes
sha256 anyway, so a sha256 the store advertises costs nothing):
1. `x-amz-checksum-sha256` of the full object;
2. full-object CRC64NVME (AWS's default for new objects), CRC32C, CRC32;
3. the ETag, when it is the MD5 of the content: single-part upload, not
   SSE-KMS / SSE-C encrypted.
Composite (per-part) checksums cannot be checked against the whole content and
are skipped, as are multipart ETags; size and ETag consistency still hold.

Endpoint and credentials come from the standard AWS environment
(AWS_ENDPOINT_URL[_S3], AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, web identity,
...). With a custom endpoint, path-style addressing is used: what MinIO-like
stores expect.
"""
from __future__ import annotations

import base64
import dataclasses
import os
import re
from typing import Any, Iterator

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError, IncompleteReadError, ResponseStreamingError
from botocore.exceptions import ConnectionError as BotoConnectionError

from ..paths import safe_relative_path
from .base import BadSourceError, RangedSource, RemoteFile, SourceError

_MD5_ETAG = re.compile(r'^"?([0-9a-f]{32})"?$')
_KMS = {"aws:kms", "aws:kms:dsse"}
# Cheapest to verify first (see fetch/digests.py).
_CRC_FIELDS = (("ChecksumCRC64NVME", "crc64nvme"), ("ChecksumCRC32C", "crc32c"), ("ChecksumCRC32", "crc32"))
# Connections beyond the ranged GETs: the HEAD of each file as its transfer starts.
DESCRIBE_CONNECTIONS = 4


def s3_client(max_connections: int) -> Any:
    custom_endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    config = Config(
        max_pool_connections=max_connections,
        retries={"mode": "standard", "max_attempts": 5},
        s3={"addressing_style": "path" if custom_endpoint else "auto"},
        # Ferry verifies whole-object checksums itself; botocore would check a
        # full-object checksum against each ranged part on stores that send one.
        response_checksum_validation="when_required",
        tcp_keepalive=True,
    )
    return boto3.session.Session().client("s3", config=config)


class S3Source(RangedSource):
    transient_errors = (BotoConnectionError, IncompleteReadError, ResponseStreamingError)

    def __init__(self, bucket: str, prefix: str, uri: str, client: Any) -> None:
        self.bucket = bucket
        self.prefix = prefix
        self.uri = uri
        self._client = client

    @classmethod
    def from_uri(cls, uri: str, max_connections: int) -> "S3Source":
        rest = uri[len("s3://"):]
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise BadSourceError(f"{uri}: no bucket")
        if prefix and not prefix.endswith("/"):
            prefix += "/"  # s3://b/llama must not match s3://b/llama-2/...
        return cls(bucket, prefix, uri, s3_client(max_connections + DESCRIBE_CONNECTIONS))

    def list_files(self) -> list[RemoteFile]:
        files: list[RemoteFile] = []
        for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix):
            for obj in page.get("Contents", []):
                key = obj["Key"]
                if key.endswith("/") and obj["Size"] == 0:
                    continue  # a "folder" marker, not a file
                rel = safe_relative_path(key[len(self.prefix):], origin=self.uri)
                files.append(RemoteFile(path=rel, size=obj["Size"], version=obj["ETag"]))
        if not files:
            raise BadSourceError(f"{self.uri}: no objects under this prefix")
        return files

    def describe(self, file: RemoteFile) -> RemoteFile:
        """The listed file with the checksum its HEAD advertises; refused if it changed since the listing."""
        head = self._client.head_object(Bucket=self.bucket, Key=self.prefix + file.path, ChecksumMode="ENABLED")
        if head["ETag"] != file.version or head["ContentLength"] != file.size:
            raise SourceError(f"{self.uri}: {file.path} changed since it was listed (ETag {head['ETag']}, "
                              f"{head['ContentLength']} bytes; listed {file.version}, {file.size} bytes)")
        sha256, digests = self._content_check(head)
        return dataclasses.replace(file, sha256=sha256, digests=digests)

    @staticmethod
    def _content_check(head: dict) -> tuple[str | None, dict[str, str]]:
        if head.get("ChecksumType", "FULL_OBJECT") == "FULL_OBJECT":
            # A composite (per-part) checksum reads "<base64>-<parts>": not a digest of the content.
            sha = head.get("ChecksumSHA256")
            if sha and "-" not in sha:
                return base64.b64decode(sha).hex(), {}
            for field, algorithm in _CRC_FIELDS:
                crc = head.get(field)
                if crc and "-" not in crc:
                    return None, {algorithm: base64.b64decode(crc).hex()}
        md5 = _MD5_ETAG.match(head["ETag"])
        if md5 and head.get("ServerSideEncryption") not in _KMS and not head.get("SSECustomerAlgorithm"):
            return None, {"md5": md5.group(1)}
        return None, {}

    def read_range(self, file: RemoteFile, start: int, end: int, buffer: memoryview) -> Iterator[memoryview]:
        key = self.prefix + file.path
        try:
            response = self._client.get_object(
                Bucket=self.bucket, Key=key, Range=f"bytes={start}-{end - 1}", IfMatch=file.version
            )
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("PreconditionFailed", "412"):
                raise SourceError(f"{self.uri}: {file.path} changed since it was listed (ETag no longer {file.version})") from None
            raise
        body = response["Body"]
        try:
            if response.get("ETag") != file.version:
                raise SourceError(
                    f"{self.uri}: {file.path} changed since it was listed (ETag {response.get('ETag')} != {file.version})"
                )
            if response["ContentLength"] != end - start:
                raise SourceError(f"{self.uri}: {file.path}: asked for {end - start} bytes at {start}, got {response['ContentLength']}")
            position = start
            while position < end:
                n = body.readinto(buffer[: min(len(buffer), end - position)])
                if n == 0:
                    raise SourceError(f"{self.uri}: {file.path}: response ended at byte {position} of [{start}, {end})")
                position += n
                yield buffer[:n]
        finally:
            body.close()
