"""Fill Jobs of the node cache (serving.nodeCache), built as plain dicts. Pure.

One Job per node and manifest digest, pinned to the node (nodeName), in the
ModelWeights' namespace under the worker's ServiceAccount: it reads the
artifact with the worker's rights, never the agent's (the claim, mounted
read-only; or the storage.s3 prefix, with the ModelWeights' S3 credentials
from its Secret, as the serving pods would stream it), and copies it into
the slot the node's agent mounts (`ferry cache fill-slot`). The agent
trusts none of it: it verifies every byte again before it publishes the
entry. On a node that already holds the entry, the agent mounts the entry
itself and the Job ends at once, so a fill Job run once too often costs
nothing but its pod: that is how a node's warmth is confirmed. A fill Job
completes when its pod ends, a moment before the kubelet unmounts the slot
and the agent publishes the entry; so a node is warm only once a fill Job's
pod found the entry already there (the next round, run at once). Rounds have
names of their own, so a new one never waits for an old one to be deleted.
"""
from __future__ import annotations

import hashlib
from typing import Any

from ..api.types import Artifact, ModelWeights
from ..locations import dns_name, identity
from ..serving import CACHE_DRIVER, s3_env
from .jobs import (LABEL_MW, LABEL_STEP, RESULT_FILE, SOURCE_MOUNT, WORKER_CONTAINER, WorkerSettings,
                   _container_security, _pod_spec, owner_reference, pod_failure_policy, prepare_deadline)

FILL_STEP = "cache-fill"
NODE_ANNOTATION = "ferry.dev/node"
DIGEST_ANNOTATION = "ferry.dev/cache-digest"
ROUND_ANNOTATION = "ferry.dev/fill-round"
ALREADY_COMPLETE = "cache entry already complete"  # ferry_worker.cache.fill_slot's (a test keeps them equal)
SLOT_MOUNT = "/ferry/cache-slot"
FILL_BACKOFF_LIMIT = 2


def fill_job_name(mw: ModelWeights, node: str, digest: str, round_: int) -> str:
    which = hashlib.sha256(f"{node}\0{digest}".encode()).hexdigest()[:10]
    return dns_name(mw.metadata.name, "cache", which, str(round_), identity(mw)[:8])


def fill_job_manifest(mw: ModelWeights, uid: str, node: str, artifact: Artifact, round_: int,
                      settings: WorkerSettings) -> dict[str, Any]:
    if not (artifact.uri.startswith(("pvc://", "s3://")) and artifact.manifest_digest):
        raise ValueError(f"the node cache fills from an artifact with a manifest on a claim or in S3, "
                         f"not {artifact.uri}")
    digest = artifact.manifest_digest
    volumes = [{"name": "cache-slot", "csi": {"driver": CACHE_DRIVER, "volumeAttributes": {
        "digest": digest, "mode": "fill", "bytes": str(artifact.total_bytes)}}}]
    mounts = [{"name": "cache-slot", "mountPath": SLOT_MOUNT}]
    env = [{"name": "FERRY_RESULT_FILE", "value": RESULT_FILE}]
    if artifact.uri.startswith("pvc://"):
        claim, _, path = artifact.uri.removeprefix("pvc://").partition("/")
        source = f"{SOURCE_MOUNT}/{path}".rstrip("/")
        volumes.append({"name": "source", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": "source", "mountPath": SOURCE_MOUNT, "readOnly": True})
    else:
        source = artifact.uri.rstrip("/")
        env += s3_env(mw.spec)
    container = {
        "name": WORKER_CONTAINER, "image": settings.image, "command": ["ferry"],
        "args": ["cache", "fill-slot", "--slot", SLOT_MOUNT, "--source", source, "--digest", digest],
        "volumeMounts": mounts,
        "env": env,
        "resources": settings.resources,
        "terminationMessagePath": RESULT_FILE,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": _container_security(),
    }
    pod = _pod_spec(settings, [container], volumes, token=False, claim=False)
    pod.pop("nodeSelector", None)  # the node is chosen: a selector it does not match would be refused
    pod["nodeName"] = node
    # It must run where the serving pods run, GPU nodes with their taints included.
    pod["tolerations"] = [{"operator": "Exists"}]
    labels = {LABEL_MW: mw.metadata.name, LABEL_STEP: FILL_STEP}
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": fill_job_name(mw, node, digest, round_), "labels": labels,
                     "annotations": {NODE_ANNOTATION: node, DIGEST_ANNOTATION: digest, ROUND_ANNOTATION: str(round_)},
                     "ownerReferences": [owner_reference(mw, uid)]},
        "spec": {
            "backoffLimit": FILL_BACKOFF_LIMIT,
            "activeDeadlineSeconds": prepare_deadline(mw, settings),
            "podFailurePolicy": pod_failure_policy(),
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }


def fill_facts(job: dict[str, Any], pods: list[dict[str, Any]]):
    """What a fill Job says: Running, Succeeded (with when, and whether its pod found the entry already
    published) or Failed (with its last pod's own words)."""
    from datetime import datetime

    from ..node_cache import FillFacts

    meta, status = job.get("metadata") or {}, job.get("status") or {}
    annotations = meta.get("annotations") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or [] if c.get("status") == "True"}
    phase, message, confirmed = "Running", "", False
    if "Complete" in conditions:
        phase = "Succeeded"
        confirmed = any(ALREADY_COMPLETE in _termination(p) for p in pods)
    elif "Failed" in conditions:
        phase = "Failed"
        message = _last_words(pods) or conditions["Failed"].get("message") or conditions["Failed"].get("reason", "")
    ended = status.get("completionTime") or (conditions.get("Failed") or {}).get("lastTransitionTime")
    return FillFacts(node=annotations.get(NODE_ANNOTATION, ""), digest=annotations.get(DIGEST_ANNOTATION, ""),
                     round=int(annotations.get(ROUND_ANNOTATION) or 0), confirmed=confirmed, phase=phase,
                     job=meta.get("name", ""), finished_at=datetime.fromisoformat(ended.replace("Z", "+00:00")) if ended else None,
                     message=message[-512:])


def _termination(pod: dict[str, Any]) -> str:
    return "".join(((cs.get("state") or {}).get("terminated") or {}).get("message") or ""
                   for cs in (pod.get("status") or {}).get("containerStatuses") or [])


def _last_words(pods: list[dict[str, Any]]) -> str:
    """The newest failed pod's worker, in its own words (its termination message: the log tail)."""
    from ..kubelet_words import error_line

    failed = sorted((p for p in pods if (p.get("status") or {}).get("phase") == "Failed"),
                    key=lambda p: (p.get("metadata") or {}).get("creationTimestamp") or "")
    for pod in reversed(failed):
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            words = error_line(((cs.get("state") or {}).get("terminated") or {}).get("message"))
            if words:
                return words
    return ""
