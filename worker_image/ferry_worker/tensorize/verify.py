"""`ferry verify s3://bucket/prefix`: re-check an artifact in S3 against its manifest.

Sizes (and the ETags the manifest recorded) first, so a missing or replaced
object is named without reading anything; then every object is read and its
sha256 compared.
"""
from __future__ import annotations

from ..manifest import IntegrityError, Manifest
from . import artifact
from .location import LocalLocation, parse_location
from .s3_client import S3Options
from .store import open_store


def verify_artifact(uri: str, s3: S3Options | None = None) -> Manifest:
    location = parse_location(uri)
    if isinstance(location, LocalLocation):
        from ..manifest import verify

        return verify(location.path)
    store = open_store(location, s3)
    found = artifact.read_manifest(store)
    if found is None:
        raise IntegrityError(f"{uri}: no ferry-manifest.json (incomplete, or not prepared by ferry)")
    manifest = found[0]
    problem = artifact.damage(store, manifest)
    if problem:
        raise IntegrityError(f"{uri}: {problem}")
    for entry in sorted(manifest.files, key=lambda e: e.path):
        if not entry.sha256:
            # Ferry's S3 manifests record each object's sha256 (computed as it is stored); block digests
            # alone come only from `ferry shard`, which writes a directory.
            raise IntegrityError(f"{entry.path}: the manifest records only block digests; objects in a store are "
                                 "checked by their whole sha256, which it lacks")
        size, etag = store.head(entry.path)
        digest = store.sha256_of(entry.path, size, etag)
        if digest != entry.sha256:
            raise IntegrityError(f"{entry.path}: sha256 {digest} != {entry.sha256} in manifest")
    return manifest
