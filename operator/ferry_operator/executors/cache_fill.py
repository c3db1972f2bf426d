"""Fill Jobs of the node cache (serving.nodeCache), built as plain dicts. Pure.

One Job per node and manifest digest, pinned to the node (a required node affinity on its name, with the
wired pod template's own tolerations, nodeSelector and required affinity: _place), in the
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
from ..placement import Placement, pinned_affinity
from ..serving.s3_env import s3_env
from ..serving.wiring import CACHE_DRIVER
from .jobs import (LABEL_MW, LABEL_STEP, RESULT_FILE, SOURCE_MOUNT, WORKER_CONTAINER, WorkerSettings,
                   _container_security, _pod_spec, instance_credentials_env, owner_reference, pod_failure_policy,
                   prepare_deadline, unique_env)

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
                      settings: WorkerSettings, placement: Placement | None = None) -> dict[str, Any]:
    """`placement`: the wired pod template's, which the planner found admits `node` (placement.py)."""
    if not (artifact.uri.startswith(("pvc://", "s3://")) and artifact.manifest_digest):
        raise ValueError(f"the node cache fills from an artifact with a manifest on a claim or in S3, "
                         f"not {artifact.uri}")
    digest = artifact.manifest_digest
    volumes = [{"name": "cache-slot", "csi": {"driver": CACHE_DRIVER, "volumeAttributes": {
        "digest": digest, "mode": "fill", "bytes": str(artifact.total_bytes)}}}]
    mounts = [{"name": "cache-slot", "mountPath": SLOT_MOUNT}]
    # Ferry's own entries first: unique_env keeps the first of a name.
    env = [{"name": "FERRY_RESULT_FILE", "value": RESULT_FILE}, *instance_credentials_env(settings)]
    if artifact.uri.startswith("pvc://"):
        claim, _, path = artifact.uri.removeprefix("pvc://").partition("/")
        source = f"{SOURCE_MOUNT}/{path}".rstrip("/")
        volumes.append({"name": "source", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": "source", "mountPath": SOURCE_MOUNT, "readOnly": True})
    else:
        source = artifact.uri.rstrip("/")
        env = unique_env(env, s3_env(mw.spec))
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
    _place(pod, node, placement or Placement())
    labels = {LABEL_MW: mw.metadata.name, LABEL_STEP: FILL_STEP}
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": fill_job_name(mw, node, digest, round_), "labels": labels,
                     "annotations": {NODE_ANNOTATION: node, DIGEST_ANNOTATION: digest, ROUND_ANNOTATION: str(round_)},
                     "ownerReferences": [owner_reference(mw, uid)]},
        "spec": {
            "backoffLimit": FILL_BACKOFF_LIMIT,
            # Capped: a tenant's storage.pvc.size must not keep a fill (and its reserved room) for years.
            "activeDeadlineSeconds": min(prepare_deadline(mw, settings), settings.fill_deadline_seconds),
            "podFailurePolicy": pod_failure_policy(),
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }


def _place(pod: dict[str, Any], node: str, placement: Placement) -> None:
    """Where the fill pod may run: exactly where a pod of the wired template may, on `node` only. The
    chart's worker nodeSelector and tolerations (for prepare Jobs) give way to the template's own, and
    there is no toleration of every taint. The pin is a required node affinity on the node's name
    (matchFields metadata.name, as DaemonSets pin), not `nodeName`: `nodeName` skips the scheduler, and
    the kubelet checks no NoSchedule taint, so a mistake in placement.py would land the pod anyway; with
    the affinity the scheduler checks the template's taints, nodeSelector and required affinity once more
    and leaves a pod it may not place Pending, with its reason in the pod's events."""
    pod.pop("nodeSelector", None)
    pod.pop("tolerations", None)
    pod.pop("nodeName", None)
    if placement.node_selector:
        pod["nodeSelector"] = dict(placement.node_selector)
    if placement.tolerations:
        pod["tolerations"] = [dict(t) for t in placement.tolerations]
    pod["affinity"] = pinned_affinity(placement, node)


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
    else:
        message = _unscheduled(pods)
    ended = status.get("completionTime") or (conditions.get("Failed") or {}).get("lastTransitionTime")
    return FillFacts(node=annotations.get(NODE_ANNOTATION, ""), digest=annotations.get(DIGEST_ANNOTATION, ""),
                     round=int(annotations.get(ROUND_ANNOTATION) or 0), confirmed=confirmed, phase=phase,
                     job=meta.get("name", ""), finished_at=datetime.fromisoformat(ended.replace("Z", "+00:00")) if ended else None,
                     message=message[-512:])


def _unscheduled(pods: list[dict[str, Any]]) -> str:
    """A running fill's pod the scheduler has not placed, in the scheduler's words ("" if none)."""
    for pod in pods:
        for c in (pod.get("status") or {}).get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False":
                return (f"pod {(pod.get('metadata') or {}).get('name', '?')} is not scheduled: "
                        f"{c.get('reason', '')} {c.get('message', '')}".strip())
    return ""


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
