"""A fill pod's S3 source (`ferry cache fill-slot --source s3://bucket/prefix`):
an artifact Ferry published to S3 (runai_streamer with storage.s3), copied
into the slot the node agent mounted.

Each object's ETag is compared with the one the manifest recorded first (an
object replaced since is named as changed), then it is downloaded with boto3's
managed transfer (ranged GETs in parallel, written to a temporary name and
renamed when whole) and read back from the slot (from the page cache)
against the manifest's digests, so a corrupt object, or one replaced between
the two, fails the pod with the file named and leaves nothing. Hashing in the
transfer instead, through a non-seekable target that boto3 feeds in order,
hung after ten 64 MiB parts against the local S3 server, so it is not used.
The agent trusts none of it and verifies every byte again before it
publishes the entry. Each file is written beneath the slot (its directories
made or opened without following a symlink) and removed the same way.
"""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from ..load.reader import ReadOptions, read_files
from ..manifest import MANIFEST_NAME, IntegrityError, Manifest, atomic_file
from ..paths import unlink_beneath
from ..tensorize.location import parse_location
from ..tensorize.s3_client import S3Options
from ..tensorize.s3_store import S3Store
from .store import PENDING_MANIFEST, CacheError, install_manifest, is_digest

log = logging.getLogger(__name__)
PART_BYTES = 64 << 20  # each ranged GET; a file larger than this is fetched in parallel parts
CONCURRENCY = 8


def open_source(uri: str) -> S3Store:
    return S3Store(parse_location(uri), S3Options(concurrency=CONCURRENCY))


def s3_manifest_bytes(store: S3Store, digest: str) -> bytes:
    """The artifact's manifest, trusted only if its sha256 is the digest the entry is keyed by."""
    data = store.read(MANIFEST_NAME)
    if data is None:
        raise CacheError(f"{store.uri()} holds no {MANIFEST_NAME}: not a complete Ferry artifact")
    if not is_digest(data, digest):
        raise CacheError(f"{store.uri(MANIFEST_NAME)} has digest sha256:{hashlib.sha256(data).hexdigest()}, not "
                         f"{digest}: the artifact changed under its record")
    return data


def download_into(slot: Path, store: S3Store, manifest_bytes: bytes, entries) -> None:
    """Download `entries` into `slot`, each verified once whole; the manifest goes first under
    PENDING_MANIFEST (a killed fill is resumed against it) and under its own name last."""
    from boto3.s3.transfer import TransferConfig

    config = TransferConfig(multipart_threshold=PART_BYTES, multipart_chunksize=PART_BYTES,
                            max_concurrency=CONCURRENCY)
    etags = Manifest.from_json(manifest_bytes).extra.get("etags") or {}
    with atomic_file(slot / PENDING_MANIFEST) as f:
        f.write(manifest_bytes)
    for entry in entries:
        _check_head(store, entry, etags.get(entry.path))
        try:
            with atomic_file(slot / entry.path, beneath=slot) as dest:  # renamed into place once whole
                store.client.download_fileobj(store.location.bucket, store.location.key(entry.path), dest,
                                              Config=config)
        except Exception as exc:  # botocore's words name the endpoint, the object and the status
            raise CacheError(f"{store.uri(entry.path)}: download failed: {exc}") from exc
        try:
            read_files(slot, [entry], ReadOptions())
        except IntegrityError:
            unlink_beneath(slot, entry.path)
            raise
    install_manifest(slot, manifest_bytes)


def _check_head(store: S3Store, entry, etag: str | None) -> None:
    head = store.head(entry.path)
    if head is None:
        raise CacheError(f"{store.uri(entry.path)} is missing: the artifact changed under its record")
    size, found = head
    if size != entry.size:
        raise IntegrityError(f"{entry.path}: {store.uri(entry.path)} holds {size} bytes, the manifest says "
                             f"{entry.size}")
    if etag is not None and found != etag:
        raise IntegrityError(f"{entry.path}: {store.uri(entry.path)} changed since it was published (ETag "
                             f"{found}, the manifest says {etag})")
