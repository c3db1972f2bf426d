"""Why a wired serving pod is not serving, told from the pod as the API serves it. Pure.

Prepare Jobs get the same treatment in executors/diagnosis.py; here the pod
is the user's vLLM pod, so the hints point at the Deployment, not at the
chart. `pod_trouble` returns the first thing wrong with a pod, or None:

- a human has to act (`stalls`): an image the node cannot get (pull policy
  Never and not on the node, an invalid reference, a registry that says no
  such image or no access), a missing Secret or ConfigMap, a container in
  CrashLoopBackOff (quoting its last termination: vLLM's own error line,
  which the kubelet keeps when the container's terminationMessagePolicy is
  FallbackToLogsOnError, as Ferry wires it), or one the kernel killed for
  memory (OOMKilled);
- it may resolve by itself (shown in the Reconciling message): a pull the
  kubelet retries, a pod the scheduler cannot place yet (its words), a
  container the kubelet cannot create yet, a running container whose
  readiness probe has not passed yet.

Ferry's own loader (the init container) reports through its readiness gate
(weights_loaded.py); only what keeps that container from running at all
(its image, its configuration) is diagnosed here. Everything quoted from the
pod is redacted (kubelet_words.last_line): it ends up in conditions and Events.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..api.types import WorkloadKind, target_key
from ..kubelet_words import MISSING_REFERENCE, PULL_RETRIED, REGISTRY_REFUSED, error_line, last_line

# Reasons (condition reasons and Event reasons: CamelCase).
IMAGE_NOT_FOUND = "ImageNotFound"
INVALID_IMAGE_NAME = "InvalidImageName"
IMAGE_PULL_BACK_OFF = "ImagePullBackOff"  # (waiting)
CONTAINER_CONFIG_ERROR = "ContainerConfigError"
CRASH_LOOP = "CrashLoopBackOff"
OOM_KILLED = "OOMKilled"
UNSCHEDULABLE = "Unschedulable"  # (waiting)
CONTAINER_CREATING = "ContainerCreateError"  # (waiting)
NOT_READY = "ContainerNotReady"  # (waiting)
# Waiting causes worth an Event and their own Reconciling reason; a container
# not ready yet is what every rollout goes through (vLLM starts for minutes):
# it only adds to the message.
WAITING_REASONS = frozenset({IMAGE_PULL_BACK_OFF, UNSCHEDULABLE, CONTAINER_CREATING})


@dataclass(frozen=True)
class PodTrouble:
    reason: str
    message: str  # names the pod (and its Deployment) and says what to look at
    stalls: bool  # a human has to act; otherwise it may resolve by itself


LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"


def workload_of(body: Mapping[str, Any]) -> str:
    """The serving workload that made the pod, as the operator files it (ServingTarget.key): a Deployment by
    name (its ReplicaSet's name less the template hash), a StatefulSet as statefulset/NAME, a LeaderWorkerSet's
    pod (leader or worker: LWS labels both) as leaderworkerset/NAME."""
    meta = body.get("metadata") or {}
    labels = meta.get("labels") or {}
    if labels.get(LWS_NAME_LABEL):
        return target_key(WorkloadKind.LEADER_WORKER_SET.value, labels[LWS_NAME_LABEL])
    owner = next((r for r in meta.get("ownerReferences") or [] if r.get("controller")), {})
    if owner.get("kind") == WorkloadKind.STATEFUL_SET.value:
        return target_key(WorkloadKind.STATEFUL_SET.value, owner.get("name", ""))
    rs = owner.get("name", "") if owner.get("kind") == "ReplicaSet" else ""
    suffix = "-" + (labels.get("pod-template-hash") or "")
    return rs[:-len(suffix)] if suffix != "-" and rs.endswith(suffix) else ""


def describe_workload(key: str) -> str:
    """`deployment NAME`, `statefulset NAME`, `leaderworkerset NAME` from a workload key."""
    kind, _, name = key.rpartition("/")
    return f"{kind or 'deployment'} {name or '?'}"


@dataclass(frozen=True)
class _Pod:
    namespace: str
    name: str
    workload: str

    def __str__(self) -> str:
        return f"pod {self.namespace}/{self.name}" + (f" ({describe_workload(self.workload)})" if self.workload else "")


def pod_trouble(body: Mapping[str, Any]) -> PodTrouble | None:
    meta, status = body.get("metadata") or {}, body.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("phase") in ("Succeeded", "Failed"):
        return None
    pod = _Pod(meta.get("namespace") or "", meta.get("name") or "", workload_of(body))
    init = list(status.get("initContainerStatuses") or [])
    main = list(status.get("containerStatuses") or [])
    for cs in init + main:
        trouble = _waiting(body, pod, cs)
        if trouble is not None:
            return trouble
    for cs in main:
        trouble = _crashed(pod, cs)
        if trouble is not None:
            return trouble
    scheduled = next((c for c in status.get("conditions") or [] if c.get("type") == "PodScheduled"), None)
    if scheduled is not None and scheduled.get("status") == "False":
        return PodTrouble(UNSCHEDULABLE, f"{pod} cannot be scheduled: "
                                         f"{last_line(scheduled.get('message')) or scheduled.get('reason')}", False)
    for cs in main:
        if (cs.get("state") or {}).get("running") and not cs.get("ready"):
            return PodTrouble(NOT_READY, f"{pod}: container {cs.get('name')} is running but not ready yet "
                                         f"({_probe(body, cs.get('name'))})", False)
    return None


def _image(body: Mapping[str, Any], cs: Mapping[str, Any]) -> str:
    spec = body.get("spec") or {}
    for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
        if c.get("name") == cs.get("name"):
            return c.get("image") or cs.get("image") or "?"
    return cs.get("image") or "?"


def _waiting(body: Mapping[str, Any], pod: _Pod, cs: Mapping[str, Any]) -> PodTrouble | None:
    """What keeps a container from starting, if anything."""
    waiting = (cs.get("state") or {}).get("waiting") or {}
    why, text = waiting.get("reason") or "", (waiting.get("message") or "").strip()
    name, image = cs.get("name"), _image(body, cs)
    node = (body.get("spec") or {}).get("nodeName") or "?"
    fix = f"fix the image of container {name} in {describe_workload(pod.workload)}"
    if why == "ErrImageNeverPull":
        return PodTrouble(IMAGE_NOT_FOUND, f'{pod}: image "{image}" of container {name} is not on node {node} and '
                                           f"its pull policy is Never: load it onto the node, or {fix} "
                                           f"(kubelet: {last_line(text)})", True)
    if why == "InvalidImageName":
        return PodTrouble(INVALID_IMAGE_NAME, f'{pod}: image "{image}" of container {name} is not a valid image '
                                              f"reference: {fix} (kubelet: {last_line(text)})", True)
    if why in PULL_RETRIED:
        if why == "SignatureValidationFailed" or REGISTRY_REFUSED.search(text):
            return PodTrouble(IMAGE_NOT_FOUND, f'{pod}: image "{image}" of container {name} cannot be pulled on '
                                               f"node {node}: {fix} or its imagePullSecrets "
                                               f"(kubelet: {last_line(text)})", True)
        return PodTrouble(IMAGE_PULL_BACK_OFF, f'{pod}: pulling image "{image}" of container {name} on node {node} '
                                               f"failed, the kubelet retries: {last_line(text)}", False)
    if why == "CreateContainerConfigError":
        found = MISSING_REFERENCE.match(text)
        if found is None:  # e.g. a secret cache that timed out: the kubelet retries
            return PodTrouble(CONTAINER_CREATING, f"{pod} cannot configure container {name} yet, the kubelet "
                                                  f"retries: {last_line(text)}", False)
        kind, missing = found.groups()
        what = "Secret" if kind == "secret" else "ConfigMap"
        return PodTrouble(CONTAINER_CONFIG_ERROR, f"{pod}: {what} {missing} referenced by container {name} does "
                                                  f"not exist: create it, or fix {describe_workload(pod.workload)} "
                                                  f"(kubelet: {last_line(text)})", True)
    if why in ("CreateContainerError", "PreCreateHookError", "PreStartHookError", "RunContainerError"):
        return PodTrouble(CONTAINER_CREATING, f"{pod} cannot create container {name} yet, the kubelet retries: "
                                              f"{last_line(text)}", False)
    return None


def _crashed(pod: _Pod, cs: Mapping[str, Any]) -> PodTrouble | None:
    """A serving container that keeps exiting: its last termination, in its own words."""
    state = cs.get("state") or {}
    waiting = state.get("waiting") or {}
    last = (cs.get("lastState") or {}).get("terminated") or state.get("terminated") or {}
    if waiting.get("reason") != "CrashLoopBackOff" and last.get("reason") != "OOMKilled":
        return None
    name, code, restarts = cs.get("name"), last.get("exitCode"), cs.get("restartCount", 0)
    if last.get("reason") == "OOMKilled":
        return PodTrouble(OOM_KILLED, f"{pod}: container {name} ran out of memory (OOMKilled, exit code {code}, "
                                      f"restarted {restarts} times): raise its resources.limits.memory in "
                                      f"{describe_workload(pod.workload)}, or lower vLLM's memory use", True)
    words = error_line(last.get("message"))
    said = f": {words}" if words else " and left no termination message"
    return PodTrouble(CRASH_LOOP, f"{pod}: container {name} keeps crashing (restarted {restarts} times; last exit "
                                  f"code {code}){said}; see kubectl logs -n {pod.namespace} {pod.name} -c {name} "
                                  f"--previous", True)


def _probe(body: Mapping[str, Any], container: str | None) -> str:
    spec = next((c for c in (body.get("spec") or {}).get("containers") or [] if c.get("name") == container), {})
    probe = spec.get("readinessProbe") or {}
    get = probe.get("httpGet")
    if get:
        return f"its readiness probe GET {get.get('path', '/')} on port {get.get('port')} has not passed"
    return "its readiness probe has not passed" if probe else "no readiness probe"
