"""Kubernetes objects for the kubernetes executor, built as plain dicts. Pure.

The claim is mounted at /weights in prepare Jobs; where on it (and in S3) an
object's artifacts go, with its uid in every path, is locations.py's.
A step's result (manifest digest, bytes, MoE facts) comes back through the pod's
termination message, so the operator never needs to read the volume.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from kubernetes.utils import parse_quantity

from ..api.types import API_VERSION, KIND, MAX_EXPERTS, GpuTarget, ModelWeights
from ..locations import claim_name, digest_dir, dns_name, identity, s3_artifact_uri, step_paths
from ..steps import Step, s3_store_env, secret_key_env, source_kind
from .redact import redact

WEIGHTS_MOUNT = "/weights"
SOURCE_MOUNT = "/source"
RESULT_FILE = "/dev/termination-log"
LABEL_MW = "ferry.dev/modelweights"
LABEL_STEP = "ferry.dev/step"
LABEL_MW_UID = "ferry.dev/modelweights-uid"  # on a claim Ferry created: whose it is
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
# Deadlines (activeDeadlineSeconds): a step moves at most its claim's bytes (staging and
# artifact both live there), at no less than a slow but working link or disk. The floor
# covers a small claim's startup, image pull and retries; a reused claim of unknown size
# gets what 500 GiB needs at that rate. A chart value overrides them all.
DEADLINE_RATE_BYTES_S = 25 * 2**20
DEADLINE_FLOOR_S = 2 * 3600
DEADLINE_UNKNOWN_SIZE_S = 6 * 3600
# Removing a directory, or the objects one manifest names, does not scale with the model's bytes.
CLEANUP_DEADLINE_S = 3600
# Sources a Job can read: file:// would read the node's or the worker's own files (its token).
KUBERNETES_SOURCES = ("hf://", "s3://", "pvc://")


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
    # activeDeadlineSeconds of every prepare Job; None: derived per step (prepare_deadline).
    active_deadline_seconds: int | None = None
    # Let Jobs fall back to the node's instance credentials (EC2 metadata) for S3; off: they never do.
    allow_instance_credentials: bool = False
    # A fill Job's deadline, whatever the artifact's size: the node agent holds its slot's room no longer
    # (the chart's nodeCache.fillDeadlineSeconds).
    fill_deadline_seconds: int = 4 * 3600


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
    meta: dict[str, Any] = {"name": claim_name(mw), "labels": {LABEL_MW: mw.metadata.name, LABEL_MW_UID: uid}}
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


def _job_name(mw: ModelWeights, kind: str, digest: str) -> str:
    # The object's uid is in the name: a namesake's (or an older Ferry's) Job of the
    # same spec is never taken for this object's.
    return dns_name(mw.metadata.name, kind, digest[:8], identity(mw)[:8])


def job_name(mw: ModelWeights, step: Step) -> str:
    return _job_name(mw, step.name, step.digest)


def unsupported_source(mw: ModelWeights) -> str | None:
    """Why a Job may not read this source, or None. A file:// source would copy
    whatever the pod sees at that path (its ServiceAccount token, the node's
    files through a volume) into the artifact."""
    uri = mw.spec.source.uri
    if uri.startswith(KUBERNETES_SOURCES):
        return None
    scheme = uri.split("://", 1)[0] + "://" if "://" in uri else uri
    return (f"spec.source.uri {uri!r}: {scheme} is for the local executor only; with the kubernetes executor "
            "use pvc://, s3:// or hf://")


def parse_deadline(text: str, name: str = "FERRY_WORKER_ACTIVE_DEADLINE_SECONDS",
                   value: str = "worker.activeDeadlineSeconds") -> int | None:
    """A deadline variable (FERRY_WORKER_ACTIVE_DEADLINE_SECONDS): "" for the default, else a positive whole
    number of seconds."""
    if not text.strip():
        return None
    if not text.strip().isdecimal() or int(text) <= 0:
        raise SystemExit(f"{name}={text!r}: a positive whole number of seconds, or empty for the default "
                         f"(the chart's {value})")
    return int(text)


def prepare_deadline(mw: ModelWeights, settings: WorkerSettings) -> int:
    """activeDeadlineSeconds of a prepare Job: the chart's value, or derived from the claim's size."""
    if settings.active_deadline_seconds:
        return settings.active_deadline_seconds
    pvc = mw.spec.storage.pvc if mw.spec.storage else None
    if pvc is None or pvc.size is None:
        return DEADLINE_UNKNOWN_SIZE_S
    return max(DEADLINE_FLOOR_S, int(parse_quantity(pvc.size)) // DEADLINE_RATE_BYTES_S)


def instance_credentials_env(settings: WorkerSettings) -> list[dict[str, Any]]:
    """Keep the AWS SDKs off the node's instance metadata (a node role's credentials), unless the chart
    allows it. In every Job's container, whether or not this step talks to S3: one rule to audit. No Job
    takes envFrom and no Secret key of that name is passed (SECRET_KEYS), so a Secret cannot switch it
    back on."""
    return [] if settings.allow_instance_credentials else [{"name": "AWS_EC2_METADATA_DISABLED", "value": "true"}]


def _container_security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}


def _pod_spec(settings: WorkerSettings, containers: list[dict[str, Any]], volumes: list[dict[str, Any]],
              token: bool, claim: bool = True) -> dict[str, Any]:
    """What the pods of every Ferry Job share: the worker ServiceAccount (its token mounted only for a
    worker that reports progress), non-root under the runtime's seccomp profile, a writable /tmp on a
    read-only root, the chart's placement."""
    security: dict[str, Any] = {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
                                "seccompProfile": {"type": "RuntimeDefault"}}
    if claim:
        security["fsGroup"] = 65532  # the claim's files are the worker's
    tmp = {"name": "tmp", "mountPath": "/tmp"}
    spec: dict[str, Any] = {"serviceAccountName": settings.service_account, "restartPolicy": "Never",
                            "securityContext": security,
                            "containers": [{**c, "volumeMounts": [*c.get("volumeMounts", []), tmp]}
                                           for c in containers],
                            "volumes": volumes + [{"name": "tmp", "emptyDir": {}}]}
    if not token:
        spec["automountServiceAccountToken"] = False
    if settings.node_selector:
        spec["nodeSelector"] = settings.node_selector
    if settings.tolerations:
        spec["tolerations"] = settings.tolerations
    return spec


def _step_volumes(mw: ModelWeights, step: Step) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str]:
    """(volumes, mounts, the source as the worker reads it): the claim, a pvc:// source (read-only), the
    tensorizer key."""
    source = mw.spec.source.uri
    volumes = [{"name": "weights", "persistentVolumeClaim": {"claimName": claim_name(mw)}}]
    mounts = [{"name": "weights", "mountPath": WEIGHTS_MOUNT}]
    if source.startswith("pvc://"):
        claim, _, path = source.removeprefix("pvc://").partition("/")
        volumes.append({"name": "source", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": "source", "mountPath": SOURCE_MOUNT, "readOnly": True})
        source = f"file://{SOURCE_MOUNT}/{path}".rstrip("/")
    key = mw.spec.format.tensorizer.encryption_secret_ref if mw.spec.format.tensorizer else None
    if key is not None and step.name == "tensorize":
        volumes.append({"name": "tensorizer-key", "secret": {"secretName": key.name, "defaultMode": 0o400,
                                                             "items": [{"key": "key", "path": "key"}]}})
        mounts.append({"name": "tensorizer-key", "mountPath": TENSORIZER_KEY_DIR, "readOnly": True})
    return volumes, mounts, source


def source_env(mw: ModelWeights) -> list[dict[str, Any]]:
    """The source's credentials for the step that reads the source (fetch): the keys its kind uses
    (api.types.SECRET_KEYS), each by secretKeyRef; the Secret's other keys are ignored."""
    secret = mw.spec.source.credentials_secret_ref
    kind = source_kind(mw.spec.source.uri)
    return secret_key_env(kind, secret) if secret is not None and kind else []


def unique_env(*parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Env entries in order, the first of each name kept: Ferry's own entries come first and win."""
    seen: set[str] = set()
    out = []
    for entry in (e for part in parts for e in part):
        if entry["name"] not in seen:
            seen.add(entry["name"])
            out.append(entry)
    return out


def _step_env(mw: ModelWeights, step: Step, settings: WorkerSettings) -> list[dict[str, Any]]:
    """A step's worker env: storage.s3's credentials for the steps that write there, the source's for the
    fetch, none for the others. No envFrom: a Secret reaches a pod only key by key."""
    env = [
        # The worker reports progress as a condition of its own pod (the only write it may make).
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "FERRY_RESULT_FILE", "value": RESULT_FILE},
        # Hub downloads cache on the claim, so a retried Job resumes instead of restarting.
        {"name": "HF_HOME", "value": f"{WEIGHTS_MOUNT}/.hf-cache"},
        *instance_credentials_env(settings),
    ]
    if settings.progress_interval:
        env.append({"name": "FERRY_PROGRESS_INTERVAL", "value": settings.progress_interval})
    if step.name in S3_WRITING_STEPS:
        return unique_env(env, storage_s3_env(mw))
    return unique_env(env, source_env(mw) if step.name == "fetch" else [])


def pod_failure_policy() -> dict[str, Any]:
    """Which pod failures count (batch/v1, GA since 1.31; needs restartPolicy Never)."""
    return {"rules": [
        # The worker rejected its input: fail the Job now, not after its retries with back-off.
        {"action": "FailJob", "onExitCodes": {"containerName": WORKER_CONTAINER, "operator": "In",
                                              "values": [WORKER_EXIT_INPUT]}},
        # Evicted, preempted, drained: not the worker's fault; retry without spending backoffLimit.
        # (Crashes and OOM kills count against backoffLimit as usual.)
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
    ]}


def job_manifest(mw: ModelWeights, step: Step, uid: str, settings: WorkerSettings) -> dict[str, Any]:
    refused = unsupported_source(mw)
    if refused is not None:  # the executor reports it (observe) before it would start a Job
        raise ValueError(refused)
    paths = {k: f"{WEIGHTS_MOUNT}/{v}" for k, v in step_paths(mw, step.digest).items()}
    artifact = s3_artifact_uri(mw, step.digest)
    if artifact is not None:
        paths["artifact"] = artifact
    volumes, mounts, source = _step_volumes(mw, step)
    env = _step_env(mw, step, settings)
    container = {
        "name": WORKER_CONTAINER,
        "image": (settings.tensorize_image or settings.image) if step.name == "tensorize" else settings.image,
        "command": ["ferry"],
        "args": [a.format(source=source, tensorizer_key=f"{TENSORIZER_KEY_DIR}/key", **paths) for a in step.argv],
        "env": env,
        "volumeMounts": mounts,
        "resources": settings.resources,
        "terminationMessagePath": RESULT_FILE,
        # On a crash the log tail becomes the message the operator reports (redacted: diagnosis.py).
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": _container_security(),
    }
    labels = {LABEL_MW: mw.metadata.name, LABEL_STEP: step.name}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": job_name(mw, step), "labels": labels, "ownerReferences": [owner_reference(mw, uid)],
                     "annotations": {"ferry.dev/step-id": step.id}},
        "spec": {
            # Retries resume: complete files are kept, partial ones re-fetched.
            "backoffLimit": BACKOFF_LIMIT,
            # All attempts together; past it the Job fails with reason DeadlineExceeded (diagnosis.py).
            "activeDeadlineSeconds": prepare_deadline(mw, settings),
            # batch/v1 (GA since 1.31; needs restartPolicy Never): which pod failures count.
            "podFailurePolicy": pod_failure_policy(),
            "template": {"metadata": {"labels": labels}, "spec": _pod_spec(settings, [container], volumes, token=True)},
        },
    }


def cleanup_job_name(mw: ModelWeights, digest: str) -> str:
    return _job_name(mw, "gc", digest)


def cleanup_job_manifest(mw: ModelWeights, digest: str, uid: str, settings: WorkerSettings,
                         s3_uri: str | None = None) -> dict[str, Any]:
    """A Job that removes a superseded artifact's directory (staging and artifact) from the claim:
    the operator never mounts claims itself. With `s3_uri`, also the objects of
    that artifact's manifest (`ferry delete-artifact`: exactly what Ferry wrote)."""
    target = f"{WEIGHTS_MOUNT}/{digest_dir(mw, digest)}"  # this object's own: its uid is in the path
    if s3_uri is None:
        return _claim_cleanup_job(mw, uid, settings, "gc", digest, digest, ["rm", "-rf", "--one-file-system", target])
    command = ["sh", "-c", 'ferry delete-artifact "$0" && exec rm -rf --one-file-system "$1"', s3_uri, target]
    return _claim_cleanup_job(mw, uid, settings, "gc", digest, digest, command, storage_s3_env(mw))


def staging_cleanup_job_manifest(mw: ModelWeights, digest: str, uid: str, settings: WorkerSettings) -> dict[str, Any]:
    """Once the artifact is recorded, the fetched original in <digest dir>/staging is
    dead weight (a whole second copy of the checkpoint on the claim): a Job removes it."""
    target = f"{WEIGHTS_MOUNT}/{step_paths(mw, digest)['staging']}"
    return _claim_cleanup_job(mw, uid, settings, "staging", digest, f"{digest}/staging",
                              ["rm", "-rf", "--one-file-system", target])


def _claim_cleanup_job(mw: ModelWeights, uid: str, settings: WorkerSettings, kind: str, digest: str, removes: str,
                       command: list[str], env: list[dict[str, Any]] = ()) -> dict[str, Any]:
    """A Job (step label `kind`) that runs `command` with the object's claim mounted."""
    labels = {LABEL_MW: mw.metadata.name, LABEL_STEP: kind}
    env = [*env, *instance_credentials_env(settings)]
    container = {
        "name": "gc", "image": settings.image, "command": command, "env": env,
        "volumeMounts": [{"name": "weights", "mountPath": WEIGHTS_MOUNT}],
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}},
        "securityContext": _container_security(),
    }
    volumes = [{"name": "weights", "persistentVolumeClaim": {"claimName": claim_name(mw)}}]
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": _job_name(mw, kind, digest), "labels": labels,
                         "ownerReferences": [owner_reference(mw, uid)], "annotations": {"ferry.dev/removes": removes}},
            "spec": {"backoffLimit": 3, "ttlSecondsAfterFinished": FINISHED_JOB_TTL_S,
                     "activeDeadlineSeconds": CLEANUP_DEADLINE_S,
                     "template": {"metadata": {"labels": labels},
                                  "spec": _pod_spec(settings, [container], volumes, token=False)}}}


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


@dataclass(frozen=True)
class StepResult:
    """What a step's worker reports (its termination message): the manifest's digest and size,
    and for a MoE artifact how its experts were cut (absent: a dense model, or an older worker)."""

    manifest_digest: str
    total_bytes: int
    experts: int | None = None
    expert_parallel: bool | None = None
    target: str | None = None


class MalformedResult(ValueError):
    """A termination message that is not a step result as the worker writes it."""


_TARGETS = frozenset(t.value for t in GpuTarget)


def parse_moe_facts(body: dict[str, Any]) -> dict[str, Any]:
    """`experts`, `expertParallel` and `target` of a step result (or a manifest's
    extra), as StepResult fields; MalformedResult names one that is not what the
    worker writes (they decide which vLLM flags a Deployment may keep)."""
    facts: dict[str, Any] = {}
    experts = body.get("experts")
    if experts is not None:
        if type(experts) is not int or not 0 <= experts <= MAX_EXPERTS:  # not bool
            raise MalformedResult(f"experts {redact(repr(experts))[:40]} is not an integer in [0, {MAX_EXPERTS}]")
        facts["experts"] = experts
    expert_parallel = body.get("expertParallel")
    if expert_parallel is not None:
        if type(expert_parallel) is not bool:
            raise MalformedResult(f"expertParallel {redact(repr(expert_parallel))[:40]} is not true or false")
        facts["expert_parallel"] = expert_parallel
    target = body.get("target")
    if target is not None:
        if not isinstance(target, str) or target not in _TARGETS:  # a list is not hashable
            raise MalformedResult(f"target {redact(repr(target))[:40]} is not one of {', '.join(sorted(_TARGETS))}")
        facts["target"] = target
    return facts


_MANIFEST_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")  # fullmatch: "$" would let a trailing newline by


def parse_result(message: str | None) -> StepResult | None:
    """A step's result from its termination message; None if there is none. Strict: the operator records
    these facts and the loaders check files against the digest, so anything else raises MalformedResult."""
    if not message or not message.strip():
        return None
    try:
        result = json.loads(message)
    except ValueError:
        raise MalformedResult(f"not JSON: {redact(message.strip())[:80]!r}") from None
    if not isinstance(result, dict):
        raise MalformedResult(f"not a JSON object but {type(result).__name__}")
    for key in ("manifestDigest", "totalBytes"):
        if key not in result:
            raise MalformedResult(f"no {key} in {redact(str(sorted(result)[:8]))}")
    digest, size = result["manifestDigest"], result["totalBytes"]
    if not isinstance(digest, str) or not _MANIFEST_DIGEST.fullmatch(digest):
        raise MalformedResult(f"manifestDigest {redact(repr(digest))[:80]} is not sha256:<64 hex digits>")
    if type(size) is not int or size < 0:  # not bool, not float
        raise MalformedResult(f"totalBytes {redact(repr(size))[:40]} is not a non-negative integer")
    return StepResult(manifest_digest=digest, total_bytes=size, **parse_moe_facts(result))


def s3_delete_job_manifest(mw: ModelWeights, uri: str, settings: WorkerSettings,
                           compiled: bool = False) -> dict[str, Any]:
    """At deletion (deletionPolicy Delete): `ferry delete-artifact` of one S3
    artifact, or with `compiled` `ferry compiled-delete` of the object's compiled
    state beside its artifacts. No owner reference: the ModelWeights is going away, and garbage
    collection would take the Job with it before it ran; the TTL removes it."""
    digest = uri.rstrip("/").rsplit("/", 1)[-1]
    labels = {LABEL_MW: mw.metadata.name, LABEL_STEP: "delete"}
    args = ["compiled-delete", "--store", uri] if compiled else ["delete-artifact", uri]
    container = {
        "name": "delete", "image": settings.image, "command": ["ferry"], "args": args,
        "env": storage_s3_env(mw) + instance_credentials_env(settings),
        "resources": {"requests": {"cpu": "10m", "memory": "64Mi"}},
        "securityContext": _container_security(),
    }
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": _job_name(mw, "delete", digest), "labels": labels,
                         "annotations": {"ferry.dev/removes": uri}},
            "spec": {"backoffLimit": 3, "ttlSecondsAfterFinished": FINISHED_JOB_TTL_S,
                     "activeDeadlineSeconds": CLEANUP_DEADLINE_S,
                     "template": {"metadata": {"labels": labels},
                                  "spec": _pod_spec(settings, [container], [], token=False, claim=False)}}}
