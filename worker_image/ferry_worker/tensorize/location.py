"""Where an artifact goes: `s3://bucket/prefix` or a local directory (a path or `file:///path`)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Union

from ..paths import UnsafePathError, safe_relative_path
from .errors import ArtifactError


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str  # without leading or trailing "/", never empty

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def uri(self, name: str | None = None) -> str:
        base = f"s3://{self.bucket}/{self.prefix}"
        return f"{base}/{name}" if name else base


@dataclass(frozen=True)
class LocalLocation:
    path: Path

    def uri(self, name: str | None = None) -> str:
        return str(self.path / name) if name else str(self.path)


Location = Union[S3Location, LocalLocation]


def parse_location(text: str) -> Location:
    """An output URI, checked: an S3 prefix must name a bucket and a non-empty
    prefix of plain segments (the artifact never spreads over a whole bucket,
    so deleting it can never reach objects Ferry did not write)."""
    if text.startswith("s3://"):
        bucket, _, prefix = text[len("s3://"):].partition("/")
        prefix = prefix.strip("/")
        if not bucket:
            raise ArtifactError(f"{text}: no bucket")
        if not prefix:
            raise ArtifactError(f"{text}: give a prefix (s3://{bucket}/some/prefix); ferry never writes an "
                                f"artifact over a whole bucket")
        try:
            safe_relative_path(prefix, origin=text)
        except UnsafePathError as e:
            raise ArtifactError(str(e)) from None
        return S3Location(bucket, prefix)
    if "://" in text and not text.startswith("file://"):
        raise ArtifactError(f"{text}: unsupported output (s3://bucket/prefix, file:///path or a path)")
    return LocalLocation(Path(text[len("file://"):] if text.startswith("file://") else text).resolve())
