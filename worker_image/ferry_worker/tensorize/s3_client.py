"""The boto3 client every object-store operation of this package uses.

- Endpoint: `--endpoint`, else AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL; with a
  custom endpoint, path-style addressing (what MinIO-like stores expect).
- Credentials: boto3's standard chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY
  from the Job's Secret, web identity, ...). Never logged.
- Retries: botocore's `standard` mode (5xx, throttling, connection errors and
  timeouts, with backoff), `attempts` in all per request; then the error ends the step.
- Integrity is Ferry's own: every body goes with Content-MD5 (the store
  rejects a damaged part), and the SDK's default CRC trailers are off, which
  some S3-compatible stores mishandle.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

DEFAULT_ATTEMPTS = 5
DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class S3Options:
    endpoint: str | None = None
    attempts: int = DEFAULT_ATTEMPTS
    timeout_s: float = DEFAULT_TIMEOUT_S
    concurrency: int = 4  # part uploads (and read-back GETs) in flight per object

    def resolved_endpoint(self) -> str | None:
        return self.endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def make_client(options: S3Options) -> Any:
    import boto3
    from botocore.config import Config

    endpoint = options.resolved_endpoint()
    config = Config(
        max_pool_connections=max(10, 2 * options.concurrency + 2),
        retries={"mode": "standard", "total_max_attempts": options.attempts},  # the first try included
        connect_timeout=options.timeout_s,
        read_timeout=options.timeout_s,
        s3={"addressing_style": "path" if endpoint else "auto"},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        tcp_keepalive=True,
    )
    return boto3.session.Session().client("s3", endpoint_url=endpoint, config=config)


def error_code(error: BaseException) -> str | None:
    """The S3 error code of a botocore ClientError ("NoSuchKey", "404", ...), else None."""
    response = getattr(error, "response", None)
    # botocore raises modeled errors (NoSuchKey, NoSuchBucket, ...) as ClientError subclasses.
    if "ClientError" not in {c.__name__ for c in type(error).__mro__} or not isinstance(response, dict):
        return None
    return response.get("Error", {}).get("Code")


def is_not_found(error: BaseException) -> bool:
    return error_code(error) in ("NoSuchKey", "404", "NotFound", "NoSuchUpload")
