"""serving.compiledState.mode BeforeRollout: the warm-up Job, built as a plain dict, and what its status says.
Pure.

Before Ferry rolls a Deployment to a template with a new compiled-state key, one Job runs one pod of that
wired template (the strategic-merge patch Ferry is about to send, applied to the template it read): the same
image, command line, env, ServiceAccount, volumes, placement and requests as the replicas will have, so it
lands on a node of the kind they use and vLLM computes the same key. The pod is rearranged only so that it
ends once the state is kept:

- every container of the template (vLLM, and any other) becomes a native sidecar (an init container with
  `restartPolicy: Always`), started after Ferry's loader, which verified the weights (and restored any state
  already kept);
- Ferry's harvest (`ferry compiled-harvest --once`, the template's own sidecar moved) is the pod's one
  container: it waits for vLLM's /health, publishes the cache root on the claim, and exits, 1 if it could
  not keep it. The pod then completes and the kubelet stops the sidecars.

The template's annotations are kept (mesh and queue settings), except the owner annotation that makes a pod
one of the object's serving pods; so are its labels, except those the Deployment selects its pods by (as
`kubectl debug --copy-to` leaves them off): the Deployment's Services, autoscaler, disruption budget and
dashboards do not count it. A readiness gate nothing sets keeps it out of every Service's endpoints even so.
The Job carries the ModelWeights as its controller and the key in a label; one attempt (an eviction or preemption does not count), a deadline, and a
TTL once it has finished (the status records the outcome first). Templates that bind node ports
(hostNetwork, hostPort) get no warm-up (the planner's): its vLLM would answer on the replicas' ports.
"""
from __future__ import annotations

import copy
from datetime import datetime
from typing import Any

from ..api.types import ModelWeights
from ..locations import dns_name, identity
from ..serving.compiled import HARVEST_CONTAINER, WarmUpFacts
from ..serving.wiring import OWNER_ANNOTATION
from .jobs import LABEL_MW, LABEL_STEP, owner_reference

WARM_UP_STEP = "compiled-warm-up"
KEY_LABEL = "ferry.dev/compiled-key"
# vLLM's start (imports, weights, compile, warm-up) on a slow node; a pod that never gets there fails the Job.
WARM_UP_DEADLINE_S = 3600
WARM_UP_TTL_S = 3600
NEVER_READY = "ferry.dev/warm-up"  # a readiness gate no one sets: the pod never joins a Service's endpoints
# A Job with no pod this long after its creation: its pods are refused (a quota, a LimitRange, a webhook).
POD_CREATE_GRACE_S = 30
WAITING = ("ImagePullBackOff", "ErrImagePull", "CrashLoopBackOff", "CreateContainerConfigError",
           "CreateContainerError", "InvalidImageName")


def warm_up_job_name(mw: ModelWeights, key: str) -> str:
    return dns_name(mw.metadata.name, "warm", key[:12], identity(mw)[:8])


def warm_up_job_manifest(mw: ModelWeights, uid: str, key: str, template: dict[str, Any],
                         selector: dict[str, str]) -> dict[str, Any]:
    """The Job for `key` from the wired pod `template` (the one Ferry is about to roll out) of a Deployment
    that selects its pods by the labels `selector` (spec.selector.matchLabels)."""
    spec = copy.deepcopy(template.get("spec") or {})
    inits = list(spec.get("initContainers") or [])
    harvest = next((c for c in inits if c.get("name") == HARVEST_CONTAINER), None)
    if harvest is None:
        raise ValueError(f"the wired template has no {HARVEST_CONTAINER} sidecar: no compiled state to warm")
    inits.remove(harvest)
    harvest.pop("restartPolicy", None)
    harvest["args"] = [*harvest.get("args", []), "--once"]
    harvest["terminationMessagePolicy"] = "FallbackToLogsOnError"  # its outcome line, when it fails
    sidecars = [{**c, "restartPolicy": "Always"} for c in spec.get("containers") or []]
    spec.update(initContainers=inits + sidecars, containers=[harvest], restartPolicy="Never",
                readinessGates=[{"conditionType": NEVER_READY}])
    meta = template.get("metadata") or {}
    labels = {LABEL_MW: mw.metadata.name, LABEL_STEP: WARM_UP_STEP, KEY_LABEL: key[:63]}
    own = {k: v for k, v in (meta.get("labels") or {}).items() if k not in selector}
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items() if k != OWNER_ANNOTATION}
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": warm_up_job_name(mw, key), "namespace": mw.metadata.namespace, "labels": labels,
                     "ownerReferences": [owner_reference(mw, uid)]},
        "spec": {"backoffLimit": 0, "activeDeadlineSeconds": WARM_UP_DEADLINE_S,
                 "ttlSecondsAfterFinished": WARM_UP_TTL_S,
                 "podFailurePolicy": {"rules": [{"action": "Ignore",
                                                 "onPodConditions": [{"type": "DisruptionTarget"}]}]},
                 "template": {"metadata": {"labels": {**own, **labels},
                                           "annotations": annotations}, "spec": spec}},
    }


def warm_up_facts(job: dict[str, Any], pods: list[dict[str, Any]], now: datetime | None = None) -> WarmUpFacts:
    """What a warm-up Job says (untrusted words: shown, never acted on). `now`: when `pods` are all its pods
    (the handlers' index), a Job that made none within POD_CREATE_GRACE_S is said to."""
    meta, status = job.get("metadata") or {}, job.get("status") or {}
    key, name = (meta.get("labels") or {}).get(KEY_LABEL, ""), meta.get("name", "")
    conditions = {c.get("type"): c for c in status.get("conditions") or [] if c.get("status") == "True"}
    if "Complete" in conditions:
        return WarmUpFacts(key, name, "Succeeded")
    if "Failed" in conditions:
        words = _harvest_words(pods) or conditions["Failed"].get("message") or conditions["Failed"].get("reason", "")
        return WarmUpFacts(key, name, "Failed", words[-512:])
    if (job.get("spec") or {}).get("suspend") or "Suspended" in conditions:
        return WarmUpFacts(key, name, "Running", "the Job is suspended (a queue holds it)")
    return WarmUpFacts(key, name, "Running", _unscheduled(pods) or _stuck(pods) or _not_created(job, pods, now))


def _harvest_words(pods: list[dict[str, Any]]) -> str:
    for pod in pods:
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            ended = (cs.get("state") or {}).get("terminated") or {}
            if cs.get("name") == HARVEST_CONTAINER and ended:
                return ended.get("message") or ended.get("reason") or ""
    return ""


def _unscheduled(pods: list[dict[str, Any]]) -> str:
    for pod in pods:
        for c in (pod.get("status") or {}).get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False":
                return (f"its pod is not scheduled ({c.get('reason', '')}: {c.get('message', '')}): free room "
                        f"for one more pod")[:512]
    return ""


def _stuck(pods: list[dict[str, Any]]) -> str:
    """A container of its pod that cannot run (a bad image, a crashing vLLM: a sidecar restarts for ever)."""
    for pod in pods:
        status = pod.get("status") or {}
        for cs in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in WAITING:
                return (f"its container {cs.get('name', '?')} waits: {waiting['reason']} (restarted "
                        f"{cs.get('restartCount', 0)} times) {waiting.get('message', '')}").strip()[:512]
    return ""


def _not_created(job: dict[str, Any], pods: list[dict[str, Any]], now: datetime | None) -> str:
    """A Job whose pod the API server refuses never shows one: the Job controller's events say why."""
    meta = job.get("metadata") or {}
    try:
        created = datetime.fromisoformat(str(meta.get("creationTimestamp")).replace("Z", "+00:00"))
    except ValueError:
        return ""
    if pods or now is None or (now - created).total_seconds() < POD_CREATE_GRACE_S:
        return ""
    return (f"it has made no pod in {POD_CREATE_GRACE_S} s (a quota, a LimitRange or a webhook refuses it?): "
            f"kubectl describe job {meta.get('name', '')} -n {meta.get('namespace', '')}")[:512]
