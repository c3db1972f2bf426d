"""`ferry delete-artifact URI`: remove what Ferry wrote there, and nothing else.

The objects named by the artifact's manifest and by an unfinished run's
pending record, then the manifest, then the pending record (last, so an
interrupted delete can be run again). Other objects under the prefix (another
tool's, a user's) are left alone and listed in the log.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from ..manifest import MANIFEST_NAME
from . import artifact
from .location import LocalLocation, parse_location
from .s3_client import S3Options
from .store import open_store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Deleted:
    uri: str
    objects: list[str]


def delete_artifact(uri: str, s3: S3Options | None = None) -> Deleted:
    store = open_store(parse_location(uri), s3)
    found = artifact.read_manifest(store)
    names = {e.path for e in found[0].files} if found else set()
    names |= set(artifact.pending_names(store))
    store.abort_unfinished(sorted(names))
    deleted = store.delete(sorted(names))
    deleted += store.delete([MANIFEST_NAME])
    deleted += store.delete([artifact.PENDING_NAME])
    if isinstance(store.location, LocalLocation):
        _remove_empty_dirs(store.location)
    if not found and not names:
        log.warning("%s: no ferry-manifest.json and no pending record: nothing of Ferry's to delete", uri)
    return Deleted(store.uri(), sorted(deleted))


def _remove_empty_dirs(location: LocalLocation) -> None:
    root = location.path
    if not root.is_dir():
        return
    for path in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        if not any(path.iterdir()):
            path.rmdir()
    if not any(root.iterdir()):
        root.rmdir()
