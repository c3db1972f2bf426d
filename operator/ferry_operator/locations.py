"""Where a ModelWeights' artifacts live, derived from its spec and its identity. Pure.

Data belongs to one object. Every location carries the object's uid, so two
ModelWeights that share a claim (or a bucket), or a deleted one and its
namesake created later, can never write into, serve from or remove each
other's artifacts, whatever their specs say:

    claim:  <subPath>/<uid>/<spec-digest>/staging    fetched original checkpoint
            <subPath>/<uid>/<spec-digest>/artifact   what serving pods mount read-only
    S3:     <storage.s3.uri>/<namespace>/<name>/<uid>/<spec-digest>/

The operator acts only on locations it derives here: a recorded URI (the
status is writable by whoever may patch it) is used only when it equals the
derived one, so it is never wired, nor removed, if it points elsewhere.
"""
from __future__ import annotations

import hashlib

from .api.types import Artifact, FormatType, ModelWeights

OBJECT_STORE_FORMATS = (FormatType.TENSORIZER.value, FormatType.RUNAI_STREAMER.value,
                        FormatType.RUNAI_STREAMER_SHARDED.value)


def dns_name(*parts: str, limit: int = 63) -> str:
    """Join parts into a DNS-1123 label, hashing the tail when it is too long."""
    name = "-".join(parts)
    if len(name) <= limit:
        return name
    tail = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[: limit - 9].rstrip('-')}-{tail}"


def identity(mw: ModelWeights) -> str:
    """The object's uid: no location is ever made without it."""
    if not mw.metadata.uid:
        raise ValueError(f"ModelWeights {mw.metadata.namespace}/{mw.metadata.name} has no uid: "
                         "its artifacts' locations carry it")
    return mw.metadata.uid


def claim_name(mw: ModelWeights) -> str:
    pvc = mw.spec.storage.pvc if mw.spec.storage else None
    return (pvc.name if pvc and pvc.name else None) or dns_name(mw.metadata.name, "weights", limit=253)


def sub_path(mw: ModelWeights) -> str:
    pvc = mw.spec.storage.pvc if mw.spec.storage else None
    return (pvc.sub_path if pvc and pvc.sub_path else None) or mw.metadata.name


def digest_dir(mw: ModelWeights, digest: str) -> str:
    """One spec's directory on the claim (relative): all a cleanup of that spec may remove."""
    return f"{sub_path(mw)}/{identity(mw)}/{digest}"


def step_paths(mw: ModelWeights, digest: str) -> dict[str, str]:
    base = digest_dir(mw, digest)
    return {"staging": f"{base}/staging", "artifact": f"{base}/artifact"}


def s3_artifact_uri(mw: ModelWeights, digest: str) -> str | None:
    """Where an object-store artifact goes (tensorizer; runai_streamer published
    to storage.s3): a prefix of its own per object and spec digest, so deletion
    removes exactly what Ferry wrote. None: the artifact is on a claim."""
    s3 = mw.spec.storage.s3 if mw.spec.storage else None
    if s3 is None or mw.spec.format.type not in OBJECT_STORE_FORMATS:
        return None
    return f"{s3.uri.rstrip('/')}/{mw.metadata.namespace}/{mw.metadata.name}/{identity(mw)}/{digest}"


def s3_compiled_store_uri(mw: ModelWeights) -> str | None:
    """Where this object's compiled state is kept beside its S3 artifacts (serving/compiled.s3_store_of): its
    own prefix, `<storage.s3.uri>/<ns>/<name>/<uid>/compiled`; None when its artifacts are not in S3."""
    return s3_artifact_uri(mw, "compiled")  # no digest is "compiled": never an artifact's prefix


def claim_artifact_uri(mw: ModelWeights, digest: str) -> str:
    """The artifact of a spec as the Kubernetes executor writes it: S3, or pvc://claim/path."""
    return s3_artifact_uri(mw, digest) or f"pvc://{claim_name(mw)}/{step_paths(mw, digest)['artifact']}"


def is_ferry_s3_artifact(mw: ModelWeights, artifact: Artifact) -> bool:
    """An S3 prefix this object's Ferry wrote (its own per-digest prefix), never a user's bucket path."""
    return artifact.uri.startswith("s3://") and artifact.uri == s3_artifact_uri(mw, artifact.spec_digest or "")


def ferry_s3_artifacts(mw: ModelWeights) -> list[Artifact]:
    """The recorded artifacts (current and previous) that are S3 prefixes Ferry wrote."""
    status = mw.status
    recorded = ([status.artifact] if status and status.artifact else []) + (list(status.previous_artifacts)
                                                                           if status else [])
    return [a for a in recorded if is_ferry_s3_artifact(mw, a)]
