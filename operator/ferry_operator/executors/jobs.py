"""Kubernetes objects for the kubernetes executor, built as plain dicts. Pure.

Layout on the claim (mounted at /weights in prepare Jobs):
    <subPath>/<spec-digest>/staging    fetched original checkpoint (sharded_state)
    <subPath>/<spec-digest>/artifact   what serving pods mount read-only
Object-store artifacts (tensorizer; runai_streamer published to storage.s3)
go to <storage.s3.uri>/<namespace>/<name>/<spec-digest>/ instead; their
staging stays on the claim.
A step's result (manifest digest, bytes) comes back through the pod's
termination message, so the operator never needs to read the volume.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from ..api.types import API_VERSION, KIND, ModelWeights
from ..steps import Step, s3_artifact_uri, s3_store_env

WEIGHTS_MOUNT = "/weights"
SOURCE_MOUNT = "/source"
RESULT_FILE = "/dev/termination-log"
LABEL_MW = "ferry.dev/modelweights"
LABEL_STEP = "ferry.dev/step"
# Once a step's result is recorded in the ModelWeights status, its Job is kept
# this long for `kubectl logs`, then removed by the TTL controller.
FINISHED_JOB_TTL_S = 600
WORKER_CONTAINER = "worker"
# The worker's exit status for input that is wrong (a bad source, no weights, a
# checkpoint it cannot shard): the same command would fail again, so the Job
# fails at once instead of retrying. ferry_worker.results.EXIT_INPUT (a test keeps them equal).
WORKER_EXIT_INPUT = 2
BACKOFF_LIMIT = 3
TENSORIZER_KEY_DIR = "/ferry/secrets/tensorizer"
# Steps that write to storage.s3 (with its credentials, not the source's).
S3_WRITING_STEPS = {"tensorize", "publish"}


@dataclass(frozen=True)
class WorkerSettings:
    image: str
    service_account: str = "ferry-worker"
    cluster_role: str = "ferry-worker"
    resources: dict[str, Any] = field(default_factory=dict)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    # `ferry tensorize` needs torch and tensorizer (the `tensorize` extra): an image of its own may carry them.
    tensorize_image: str = ""
    # FERRY_PROGRESS_INTERVAL of the workers ("": theirs).
    progress_interval: str = ""


def dns_name(*parts: str, limit: int = 63) -> str:
    """Join parts into a DNS-1123 label, hashing the tail when it is too long."""
    name = "-".join(parts)
    if len(name) <= limit:
        return name
    tail = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[: limit - 9].rstrip('-')}-{tail}"


def claim_name(mw: ModelWeights) -> str:
    pvc = mw.spec.storage.pvc if mw.spec.storage else None
    return (pvc.name if pvc and pvc.name else None) or dns_name(mw.metadata.name, "weights", limit=253)


def sub_path(mw: ModelWeights) -> str:
    pvc = mw.spec.storage.pvc if mw.spec.storage else None
    return (pvc.sub_path if pvc and pvc.sub_path else None) or mw.metadata.name


def step_paths(mw: ModelWeights, digest: str) -> dict[str, str]:
    base = f"{sub_path(mw)}/{digest}"
    return {"staging": f"{base}/staging", "artifact": f"{base}/artifact"}


def artifact_uri(mw: ModelWeights, digest: str) -> str:
    s3 = s3_artifact_uri(mw.spec, mw.metadata.namespace, mw.metadata.name, digest)
    return s3 or f"pvc://{claim_name(mw)}/{step_paths(mw, digest)['artifact']}"


def storage_s3_env(mw: ModelWeights) -> list[dict[str, Any]]:
    """storage.s3's endpoint, region and credentials (secretKeyRef: no secret value in the Job)."""
    s3 = mw.spec.storage.s3 if mw.spec.storage else None
    return s3_store_env(s3, s3.credentials_secret_ref) if s3 is not None else []


def owner_reference(mw: ModelWeights, uid: str) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "name": mw.metadata.name, "uid": uid,
            "controller": True, "blockOwnerDeletion": True}


def pvc_manifest(mw: ModelWeights, uid: str) -> dict[str, Any] | None:
    """The claim Ferry creates, or None when the spec reuses an existing one."""
    pvc = mw.spec.storage.pvc if mw.spec.storage else None
    if pvc is None or pvc.size is None:
        return None
    meta: dict[str, Any] = {"name": claim_name(mw), "labels": {LABEL_MW: mw.metadata.name}}
    # Retain keeps the claim past the ModelWeights; Delete lets garbage collection take it.
    if mw.spec.deletion_policy == "Delete":
        meta["ownerReferences"] = [owner_reference(mw, uid)]
    spec: dict[str, Any] = {
        "accessModes": list(pvc.access_modes),
        "resources": {"requests": {"storage": pvc.size}},
    }
    if pvc.storage_class_name:
        spec["storageClassName"] = pvc.storage_class_name
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": spec}


def job_name(mw: ModelWeights, step: Step) -> str:
    return dns_name(mw.metadata.name, step.name, step.digest[:8])


def job_manifest(mw: ModelWeights, step: Step, uid: str, settings: WorkerSettings) -> dict[str, Any]:
    paths = {k: f"{WEIGHTS_MOUNT}/{v}" for k, v in step_paths(mw, step.digest).items()}
    source = mw.spec.source.uri
    volumes = [{"name": "weights", "persistentVolumeClaim": {"claimName": claim_name(mw)}}]
    mounts = [{"name": "weights", "mountPath": WEIGHTS_MOUNT}]
    if source.startswith("pvc://"):
        claim, _, path = source.removeprefix("pvc://").partition("/")
        volumes.append({"name": "source", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": "source", "mountPath": SOURCE_MOUNT, "readOnly": True})
        source = f"file://{SOURCE_MOUNT}/{path}".rstrip("/")
    artifact = s3_artifact_uri(mw.spec, mw.metadata.namespace, mw.metadata.name, step.digest)
    if artifact is not None:
        paths["artifact"] = artifact
    key = mw.spec.format.tensorizer.encryption_secret_ref if mw.spec.format.tensorizer else None
    if key is not None and step.name == "tensorize":
        volumes.append({"name": "tensorizer-key", "secret": {"secretName": key.name, "defaultMode": 0o400,
                                                             "items": [{"key": "key", "path": "key"}]}})
        mounts.append({"name": "tensorizer-key", "mountPath": TENSORIZER_KEY_DIR, "readOnly": True})
    argv = [a.format(source=source, tensorizer_key=f"{TENSORIZER_KEY_DIR}/key", **paths) for a in step.argv]
    env = [
        {"name": "FERRY_MODELWEIGHTS_NAME", "value": mw.metadata.name},
        {"name": "FERRY_MODELWEIGHTS_NAMESPACE", "value": mw.metadata.namespace},
        {"name": "FERRY_RESULT_FILE", "value": RESULT_FILE},
        # Hub downloads cache on the claim, so a retried Job resumes instead of restarting.
        {"name": "HF_HOME", "value": f"{WEIGHTS_MOUNT}/.hf-cache"},
    ]
    if settings.progress_interval:
        env.append({"name": "FERRY_PROGRESS_INTERVAL", "value": settings.progress_interval})
    env_from = []
    if step.name in S3_WRITING_STEPS:
        env += storage_s3_env(mw)
    elif mw.spec.source.credentials_secret_ref is not None:
        env_from.append({"secretRef": {"name": mw.spec.source.credentials_secret_ref.name}})
    container = {
        "name": WORKER_CONTAINER,
        "image": (settings.tensorize_image or settings.image) if step.name == "tensorize" else settings.image,
        "command": ["ferry"],
        "args": argv,
        "env": env,
        "volumeMounts": mounts,
        "resources": settings.resources,
        "terminationMessagePath": RESULT_FILE,
        # On a crash the log tail becomes the message the operator reports.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
    }
    if env_from:
        container["envFrom"] = env_from
    labels = {LABEL_MW: mw.metadata.name, LABEL_STEP: step.name}
    pod_spec: dict[str, Any] = {
        "serviceAccountName": settings.service_account,
        "restartPolicy": "Never",
        "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532, "fsGroup": 65532,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": volumes + [{"name": "tmp", "emptyDir": {}}],
    }
    container["volumeMounts"] = mounts + [{"name": "tmp", "mountPath": "/tmp"}]
    if settings.node_selector:
        pod_spec["nodeSelector"] = settings.node_selector
    if settings.tolerations:
        pod_spec["tolerations"] = settings.tolerations
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": job_name(mw, step), "labels": labels, "ownerReferences": [owner_reference(mw, uid)],
                     "annotations": {"ferry.dev/step-id": step.id}},
        "spec": {
            # Retries resume: complete files are kept, partial ones re-fetched.
            "backoffLimit": BACKOFF_LIMIT,
            # batch/v1 (GA since 1.31; needs restartPolicy Never): which pod failures count.
            "podFailurePolicy": {"rules": [
                # The worker rejected its input: fail the Job now, not after 3 retries with back-off.
                {"action": "FailJob", "onExitCodes": {"containerName": WORKER_CONTAINER, "operator": "In",
                                                      "values": [WORKER_EXIT_INPUT]}},
                # Evicted, preempted, drained: not the worker's fault; retry without spending backoffLimit.
                # (Crashes and OOM kills count against backoffLimit as usual.)
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            ]},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


def cleanup_job_name(mw: ModelWeights, digest: str) -> str:
    return dns_name(mw.metadata.name, "gc", digest[:8])


def cleanup_job_manifest(mw: ModelWeights, digest: str, uid: str, settings: WorkerSettings,
                         s3_uri: str | None = None) -> dict[str, Any]:
    """A Job that removes a superseded artifact's directory (staging and artifact) from the claim:
    the operator never mounts claims itself. With `s3_uri`, also the objects of
    that artifact's manifest (`ferry delete-artifact`: exactly what Ferry wrote)."""
    target = f"{WEIGHTS_MOUNT}/{sub_path(mw)}/{digest}"
    labels = {LABEL_MW: mw.metadata.name, LABEL_STEP: "gc"}
    command = ["rm", "-rf", "--one-file-system", target]
    if s3_uri is not None:
        command = ["sh", "-c", 'ferry delete-artifact "$0" && exec rm -rf --one-file-system "$1"', s3_uri, target]
    container = {
        "name": "gc", "image": settings.image, "command": command,
        "env": storage_s3_env(mw) if s3_uri is not None else [],
        "volumeMounts": [{"name": "weights", "mountPath": WEIGHTS_MOUNT}, {"name": "tmp", "mountPath": "/tmp"}],
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}},
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": settings.service_account, "automountServiceAccountToken": False,
        "restartPolicy": "Never",
        "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532, "fsGroup": 65532,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": [{"name": "weights", "persistentVolumeClaim": {"claimName": claim_name(mw)}},
                    {"name": "tmp", "emptyDir": {}}],
    }
    if settings.node_selector:
        pod_spec["nodeSelector"] = settings.node_selector
    if settings.tolerations:
        pod_spec["tolerations"] = settings.tolerations
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": cleanup_job_name(mw, digest), "labels": labels,
                         "ownerReferences": [owner_reference(mw, uid)], "annotations": {"ferry.dev/removes": digest}},
            "spec": {"backoffLimit": 3, "ttlSecondsAfterFinished": FINISHED_JOB_TTL_S,
                     "template": {"metadata": {"labels": labels}, "spec": pod_spec}}}


def worker_identity(namespace: str, settings: WorkerSettings) -> list[dict[str, Any]]:
    """The ServiceAccount prepare Jobs run as, bound to the status-only worker role."""
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": {"name": settings.service_account, "namespace": namespace}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": settings.service_account, "namespace": namespace},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": settings.cluster_role},
         "subjects": [{"kind": "ServiceAccount", "name": settings.service_account, "namespace": namespace}]},
    ]


def parse_result(message: str | None) -> dict[str, Any] | None:
    """A step's result from its termination message; None if absent or not Ferry's JSON."""
    if not message:
        return None
    try:
        result = json.loads(message)
    except ValueError:
        return None
    if not isinstance(result, dict) or "manifestDigest" not in result:
        return None
    return result


def s3_delete_job_manifest(mw: ModelWeights, uri: str, settings: WorkerSettings) -> dict[str, Any]:
    """At deletion (deletionPolicy Delete): `ferry delete-artifact` of one S3
    artifact. No owner reference: the ModelWeights is going away, and garbage
    collection would take the Job with it before it ran; the TTL removes it."""
    digest = uri.rstrip("/").rsplit("/", 1)[-1]
    labels = {LABEL_MW: mw.metadata.name, LABEL_STEP: "delete"}
    container = {
        "name": "delete", "image": settings.image, "command": ["ferry"], "args": ["delete-artifact", uri],
        "env": storage_s3_env(mw), "resources": {"requests": {"cpu": "10m", "memory": "64Mi"}},
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": settings.service_account, "automountServiceAccountToken": False,
        "restartPolicy": "Never",
        "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container], "volumes": [{"name": "tmp", "emptyDir": {}}],
    }
    if settings.node_selector:
        pod_spec["nodeSelector"] = settings.node_selector
    if settings.tolerations:
        pod_spec["tolerations"] = settings.tolerations
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": dns_name(mw.metadata.name, "delete", digest[:8]), "labels": labels,
                         "annotations": {"ferry.dev/removes": uri}},
            "spec": {"backoffLimit": 3, "ttlSecondsAfterFinished": FINISHED_JOB_TTL_S,
                     "template": {"metadata": {"labels": labels}, "spec": pod_spec}}}
