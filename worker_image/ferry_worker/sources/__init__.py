"""Checkpoint sources, chosen by URI scheme.

    hf://org/name          the Hugging Face Hub (HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE honoured)
    s3://bucket/prefix     S3 or an S3-compatible store (standard AWS environment)
    file:///abs/path       a local directory
    pvc://claim/path       a PersistentVolumeClaim mounted in the Job at $FERRY_PVC_ROOT/claim
"""
from __future__ import annotations

import os
from pathlib import Path

from .base import BadSourceError, DownloadSource, RangedSource, RemoteFile, Source, SourceError
from .local import LocalSource

# Where a prepare Job mounts the claim of a pvc:// source (claim name below it).
DEFAULT_PVC_ROOT = "/mnt/ferry/source"

__all__ = ["BadSourceError", "DownloadSource", "RangedSource", "RemoteFile", "Source", "SourceError", "open_source", "pvc_path"]


def pvc_path(uri: str) -> Path:
    """The local path of pvc://claim/path inside a Job: $FERRY_PVC_ROOT/claim/path."""
    claim, _, sub = uri[len("pvc://"):].partition("/")
    if not claim or ".." in sub.split("/"):
        raise BadSourceError(f"{uri}: expected pvc://claim/path without '..'")
    return Path(os.environ.get("FERRY_PVC_ROOT", DEFAULT_PVC_ROOT), claim, sub)


def open_source(uri: str, *, revision: str | None, staging: Path, max_connections: int) -> Source:
    """The source for `uri`. `staging` is a scratch directory on the output's filesystem."""
    scheme = uri.partition("://")[0]
    if revision is not None and scheme != "hf":
        raise BadSourceError(f"{uri}: --revision applies to hf:// sources only")
    if scheme == "file":
        path = Path(uri[len("file://"):])
        if not path.is_absolute() or ".." in path.parts:
            raise BadSourceError(f"{uri}: file:// needs an absolute path without '..' (file:///path)")
        return LocalSource(path, uri)
    if scheme == "pvc":
        return LocalSource(pvc_path(uri), uri)
    # The remote sources are imported on use: each pulls in its SDK.
    if scheme == "s3":
        from .s3 import S3Source

        return S3Source.from_uri(uri, max_connections)
    if scheme == "hf":
        repo_id = uri[len("hf://"):].strip("/")
        if repo_id.count("/") != 1:
            raise BadSourceError(f"{uri}: expected hf://org/name")
        from huggingface_hub import constants

        from .hub import HubSource, offline_snapshot

        if constants.HF_HUB_OFFLINE:
            return offline_snapshot(repo_id, revision or "main", uri)
        return HubSource(repo_id, revision or "main", uri, staging)
    raise BadSourceError(f"{uri}: unsupported source (expected hf://, s3://, file:// or pvc://)")
