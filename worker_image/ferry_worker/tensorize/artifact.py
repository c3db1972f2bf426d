"""An artifact's life in a store: begun, written, published, reused, deleted.

- `begin`: before any object is written, `.ferry-pending.json` records every
  name the run may write (so `delete-artifact` can remove an unfinished run's
  objects, and only those), and half-written uploads of those names from an
  earlier run are aborted.
- `publish`: `ferry-manifest.json` (the same format as a local artifact's:
  path, size, sha256 per file; for S3 also each object's ETag in `extra`),
  written last; then the pending record goes. No manifest, no artifact.
- `reuse`: a rerun (a retried Job) finding a complete artifact made by the
  same request checks it (S3: every object's size and ETag; local: every
  file's sha256) and keeps it instead of rewriting objects a Deployment may be
  reading; made by another request, it is refused. A damaged one loses its
  manifest and is written again.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field

from ..manifest import MANIFEST_NAME, NOT_FERRYS, IntegrityError, Manifest, entry_problem, verify
from .errors import ArtifactError, StoreError
from ..results import RESULT_FACTS
from .location import LocalLocation
from .store import Store, StoredObject

log = logging.getLogger(__name__)

PENDING_NAME = ".ferry-pending.json"


@dataclass(frozen=True)
class Published:
    manifest: Manifest
    digest: str  # sha256:<hex> of the manifest's bytes
    uri: str
    reused: bool = False
    facts: dict = field(default_factory=dict)  # step-specific, e.g. the tensorizer_uri to serve

    def step_result(self) -> dict:
        """What the operator learns (the termination message): as `ferry fetch`/`shard` report, plus the URI.
        A published `ferry shard` cut keeps its expert facts (results.RESULT_FACTS): the operator refuses the
        serving flags its rank files cannot honour (data parallelism, EPLB)."""
        extra = self.manifest.extra
        cut = {key: extra[key] for key in RESULT_FACTS if extra.get(key) is not None}
        return {"manifestDigest": self.digest, "totalBytes": self.manifest.total_bytes,
                "files": len(self.manifest.files), "uri": self.uri, **cut, **self.facts}


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def read_manifest(store: Store) -> tuple[Manifest, str] | None:
    data = store.read(MANIFEST_NAME)
    if data is None:
        return None
    try:
        return Manifest.from_json(data), digest_of(data)
    except (IntegrityError, ValueError, KeyError, TypeError) as e:
        raise StoreError(f"{store.uri(MANIFEST_NAME)}: unreadable manifest: {e}") from None


def pending_names(store: Store) -> list[str]:
    data = store.read(PENDING_NAME)
    if data is None:
        return []
    try:
        names = json.loads(data)["files"]
        if not isinstance(names, list):
            raise TypeError("its files are not a list")
        problem = next((f"{n!r}: {p}" for n in names if (p := entry_problem(n, 0))), None)
    except (ValueError, KeyError, TypeError) as e:
        raise StoreError(f"{store.uri(PENDING_NAME)}: unreadable pending record: {e}") from None
    if problem:  # the names become keys and paths to delete: held to a manifest entry's rules
        raise StoreError(f"{store.uri(PENDING_NAME)}: refusing the name {problem[:300]}; {NOT_FERRYS}")
    return names


def reuse(store: Store, request: dict) -> Published | None:
    """The complete artifact this request already made, checked; None if there is none (or it was damaged)."""
    found = read_manifest(store)
    if found is None:
        return None
    manifest, digest = found
    if manifest.extra.get("request") != _jsonable(request):
        raise ArtifactError(f"{store.uri()} already holds a complete artifact made by another request "
                            f"({json.dumps(manifest.extra.get('request'), sort_keys=True)}); remove it with "
                            f"`ferry delete-artifact {store.uri()}` or choose another output")
    problem = damage(store, manifest)
    if problem is None:
        log.info("%s: complete artifact of this request found and checked; kept as it is", store.uri())
        return Published(manifest, digest, store.uri(), reused=True)
    log.warning("%s: the existing artifact is damaged (%s): writing it again", store.uri(), problem)
    store.delete([MANIFEST_NAME])
    return None


def damage(store: Store, manifest: Manifest) -> str | None:
    """Why the artifact no longer matches its manifest, or None."""
    if isinstance(store.location, LocalLocation):
        try:
            verify(store.location.path)
        except IntegrityError as e:
            return str(e)
        return None
    etags = manifest.extra.get("etags") or {}
    for entry in manifest.files:
        head = store.head(entry.path)
        if head is None:
            return f"{entry.path} is missing"
        size, etag = head
        if size != entry.size:
            return f"{entry.path} holds {size} bytes, the manifest says {entry.size}"
        if entry.path in etags and etag != etags[entry.path]:
            return f"{entry.path} changed (ETag {etag}, the manifest says {etags[entry.path]})"
    return None


def begin(store: Store, names: list[str]) -> None:
    store.abort_unfinished(names)
    store.put_bytes(PENDING_NAME, (json.dumps({"files": sorted(names)}, indent=2) + "\n").encode())
    store.delete([MANIFEST_NAME])  # an older, damaged one (reuse() removed it already; idempotent)


def publish(store: Store, manifest: Manifest, stored: list[StoredObject]) -> Published:
    etags = {o.path: o.etag for o in stored if o.etag}
    if etags:
        manifest.extra["etags"] = dict(sorted(etags.items()))
    data = manifest.to_json()
    store.put_bytes(MANIFEST_NAME, data)
    store.delete([PENDING_NAME])
    return Published(manifest, digest_of(data), store.uri())


def _jsonable(value: dict) -> dict:
    return json.loads(json.dumps(value))
