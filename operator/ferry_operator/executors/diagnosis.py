"""Why a prepare Job is not making progress, told from what the API server holds. Pure.

The kubernetes executor reads a step's Job, its pods, the claims the pods mount
and whether a Pending claim's StorageClass exists, as the API serves them
(plain JSON dicts), and `diagnose` turns that into the StepState the planner
maps to conditions:

- FAILED, with a reason, when a human has to act: a Secret that does not
  exist, an image the node cannot get, a claim that cannot be provisioned, a
  worker that failed for good. Except for a Job that has itself failed, these
  are read from live state: once the cause is fixed (the Secret created, the
  StorageClass added) the kubelet or the scheduler carries on by itself and
  the next observation reports the step running again. A failed Job stays
  failed until it is deleted; the operator then starts it afresh.
- RUNNING, with a reason and a message, when the step waits on something that
  may resolve by itself (an unschedulable pod, an image pull being retried, a
  retry after a failed attempt): the planner shows it as the Reconciling
  message.

Messages name the object, quote the kubelet's or scheduler's own words, and
say which spec field or chart value to look at. Text a pod wrote (a crashed
worker's log tail, its status message) is redacted (`redact.py`) before it is
quoted: it ends up in conditions and Events.

Only the Job's own pods count: those whose ownerReferences name the Job (its
uid) as their controller. Anyone who may create pods can give one the Job's
labels; such a pod neither reports the step's result nor steers the diagnosis.
A step's result is read strictly (jobs.parse_result): a Complete Job whose own
pod reported none, or a malformed one, is a FAILED step, not an artifact.
"""
from __future__ import annotations

import json
import re
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from typing import Any, Mapping

from ..kubelet_words import MAX_LINE, MISSING_REFERENCE, MISSING_SECRET_KEY, PULL_RETRIED, REGISTRY_REFUSED, last_line
from ..planner import MAX_PROGRESS_REPORT_BYTES, StepPhase, StepState
from .jobs import LABEL_MW, LABEL_STEP, S3_WRITING_STEPS, WORKER_CONTAINER, MalformedResult, StepResult, parse_result
from .redact import redact

# Reasons (condition reasons: CamelCase).
SECRET_NOT_FOUND = "SecretNotFound"
CONTAINER_CONFIG_ERROR = "ContainerConfigError"
IMAGE_NOT_FOUND = "ImageNotFound"  # not on the node (pull policy Never), or the registry says no such image / no access
IMAGE_PULL_FAILED = "ImagePullFailed"  # pulls kept failing for another reason (network, registry down)
IMAGE_PULL_BACK_OFF = "ImagePullBackOff"  # (waiting) a failed pull the kubelet retries
INVALID_IMAGE_NAME = "InvalidImageName"
CLAIM_NOT_FOUND = "PersistentVolumeClaimNotFound"
CLAIM_LOST = "PersistentVolumeClaimLost"
CLAIM_PENDING = "PersistentVolumeClaimPending"  # (waiting)
STORAGE_CLASS_NOT_FOUND = "StorageClassNotFound"
UNSCHEDULABLE = "Unschedulable"  # (waiting)
CONTAINER_CREATING = "ContainerCreateError"  # (waiting) the kubelet retries creating the container
POD_NOT_CREATED = "PodNotCreated"  # (waiting) the Job controller made no pod
RETRYING = "Retrying"  # (waiting) an attempt failed; the Job retries
WORKER_FAILED = "WorkerFailed"
FORBIDDEN = "Forbidden"
DEADLINE_EXCEEDED = "DeadlineExceeded"  # the Job's activeDeadlineSeconds ran out
MALFORMED_RESULT = "MalformedResult"  # the Job's own pod reported something that is not a step result
RESULT_MISSING = "ResultMissing"  # the Job completed, but none of its own pods reported a result
WAITING_FOR_RESULT = "WaitingForResult"  # (waiting) completed a moment ago; its pod's update may still be on its way
UNSUPPORTED_SOURCE = "UnsupportedSource"  # a source this executor does not read (file://)

# A claim's binding is usually immediate (a matching static PersistentVolume
# binds even when its StorageClass object does not exist), so a missing class
# only counts once the claim has been Pending this long.
CLAIM_GRACE = timedelta(seconds=5)
# A pull that fails without a definite answer from the registry (timeouts,
# DNS, a registry that is down) is retried by the kubelet with back-off (10s,
# 20s, 40s, ...): about four attempts fit in this.
IMAGE_PULL_GRACE = timedelta(seconds=60)
# The Job controller creates a pod within a second; one that made none this
# long was refused (quota, PodSecurity, a missing ServiceAccount: see its events).
POD_CREATE_GRACE = timedelta(seconds=30)
# The Job's and its pods' watch events arrive independently: a Job seen Complete
# before its pod's final status gets this long before its missing result counts.
RESULT_GRACE = timedelta(seconds=10)

# The pod volumes jobs.py mounts, by the spec field that names their claim.
CLAIM_FIELDS = {"weights": "spec.storage.pvc", "source": "spec.source.uri"}
SECRET_FIELD = "spec.source.credentialsSecretRef"
STORE_SECRET_FIELD = "spec.storage.s3.credentialsSecretRef"
IMAGE_VALUES = "the chart's worker.image value (default: image.repository:image.tag)"
NODE_VALUES = "the chart's worker.nodeSelector, worker.tolerations and worker.resources values"
DEADLINE_VALUE = "the chart's worker.activeDeadlineSeconds value (FERRY_WORKER_ACTIVE_DEADLINE_SECONDS)"
_UNBOUND = "pod has unbound immediate PersistentVolumeClaims"  # the scheduler's VolumeBinding plugin
_RBAC_DENIED = re.compile(
    r'User "(?P<user>[^"]*)" cannot (?P<verb>\S+) resource "(?P<resource>[^"]+)" in API group "(?P<group>[^"]*)"'
    r'(?: in the namespace "(?P<namespace>[^"]+)"| at the cluster scope)'
)


def _time(text: str | None) -> datetime | None:
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _since(text: str | None, now: datetime) -> timedelta:
    at = _time(text)
    return now - at if at is not None else timedelta(0)


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj.get("metadata") or {}


def _status(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj.get("status") or {}


def _conditions(obj: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {c.get("type"): c for c in _status(obj).get("conditions") or []}


def _true(obj: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    c = _conditions(obj).get(type_)
    return c if c is not None and c.get("status") == "True" else None


def _pod_template(job: Mapping[str, Any]) -> Mapping[str, Any]:
    return ((job.get("spec") or {}).get("template") or {}).get("spec") or {}


def _phase(pod: Mapping[str, Any]) -> str:
    return _status(pod).get("phase") or "Pending"


def _ordered(pods: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return sorted(pods, key=lambda p: (_meta(p).get("creationTimestamp") or "", _meta(p).get("name") or ""))


def _live(pods: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [p for p in pods if _phase(p) not in ("Succeeded", "Failed") and not _meta(p).get("deletionTimestamp")]


def _scheduled(pod: Mapping[str, Any]) -> bool:
    return bool((pod.get("spec") or {}).get("nodeName")) or _true(pod, "PodScheduled") is not None


def owned_pods(job: Mapping[str, Any], pods: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The pods the Job controller made for this Job: their controller reference is the Job's uid."""
    uid = _meta(job).get("uid")
    return [p for p in pods if uid and any(
        ref.get("kind") == "Job" and ref.get("controller") is True and ref.get("uid") == uid
        for ref in _meta(p).get("ownerReferences") or [])]


def claim_names(job: Mapping[str, Any]) -> list[str]:
    """The claims a Job's pods mount, in the template's order."""
    return [v["persistentVolumeClaim"]["claimName"] for v in _pod_template(job).get("volumes") or []
            if v.get("persistentVolumeClaim")]


def claims_to_read(job: Mapping[str, Any], pods: list[Mapping[str, Any]]) -> list[str]:
    """The claims worth reading: only while no pod of an unfinished Job has been scheduled
    (a scheduled pod's claims are bound)."""
    if _true(job, "Complete") or _true(job, "Failed") or _true(job, "FailureTarget"):
        return []
    if any(_scheduled(p) for p in _live(owned_pods(job, pods))):
        return []
    return claim_names(job)


def storage_classes_to_check(claims: Mapping[str, Mapping[str, Any] | None]) -> list[str]:
    """The StorageClasses of Pending claims, whose existence `diagnose` needs."""
    names = []
    for claim in claims.values():
        if claim is None or _status(claim).get("phase", "Pending") != "Pending":
            continue
        name = (claim.get("spec") or {}).get("storageClassName")
        if name and name not in names:
            names.append(name)
    return names


def diagnose(job: Mapping[str, Any], pods: list[Mapping[str, Any]],
             claims: Mapping[str, Mapping[str, Any] | None] | None = None,
             storage_classes: Mapping[str, bool] | None = None, now: datetime | None = None,
             needs_result: bool = False) -> StepState:
    """The step's state from its Job (as the API serves it), the pods carrying its
    labels (only its own count), the claims read (name -> the claim, or None: it
    does not exist; a claim not read is simply absent) and whether StorageClasses
    exist (name -> bool). `needs_result`: the step's result is the artifact's, so
    a Complete Job succeeded only once its own pod reported a valid one."""
    now = now or datetime.now(timezone.utc)
    state = _diagnose(job, owned_pods(job, pods), claims or {}, storage_classes or {}, now, needs_result)
    # Every message may quote a pod's words: redacted once more as a whole, whatever path built it.
    return replace(state, message=redact(state.message)) if state.message else state


PROGRESS_CONDITION = "ferry.dev/progress"  # ferry_worker.progress_report.CONDITION (a test keeps them equal)


def reported_progress(job: Mapping[str, Any], pods: list[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The newest progress report a pod of the Job's own set on itself (untrusted:
    the planner validates it against the CRD's Progress type), if any."""
    newest = None
    for pod in owned_pods(job, pods):
        for c in (pod.get("status") or {}).get("conditions") or []:
            if c.get("type") == PROGRESS_CONDITION and len(c.get("message") or "") <= MAX_PROGRESS_REPORT_BYTES:
                if newest is None or (c.get("lastTransitionTime") or "") >= (newest.get("lastTransitionTime") or ""):
                    newest = c
    try:
        report = json.loads(newest["message"]) if newest else None
    except ValueError:
        return None
    return report if isinstance(report, dict) else None


def step_result(job: Mapping[str, Any], pods: list[Mapping[str, Any]]) -> StepResult | None:
    """The result the Job's own Succeeded pod reported, if any (MalformedResult if it is not one, or if
    two of its pods disagree)."""
    results = set()
    for pod in owned_pods(job, pods):
        term = ((_worker_status(pod) or {}).get("state") or {}).get("terminated") or {}
        if _phase(pod) == "Succeeded" and (result := parse_result(term.get("message"))) is not None:
            results.add(result)
    if len(results) > 1:
        raise MalformedResult(f"its pods report {len(results)} different results")
    return results.pop() if results else None


def _result_state(job: Mapping[str, Any], pods: list[Mapping[str, Any]], now: datetime) -> StepState:
    """A Complete Job's step: SUCCEEDED once its own pod reported a valid result."""
    ns, name = _meta(job).get("namespace"), _meta(job).get("name")
    try:
        result = step_result(job, pods)
    except MalformedResult as exc:
        return StepState(StepPhase.FAILED, reason=MALFORMED_RESULT, message=(
            f"Job {ns}/{name} completed, but its result (the worker's termination message) is malformed: {exc}; "
            "the worker image may not match the operator (check the chart's worker.image value)"))
    if result is not None:
        return StepState(StepPhase.SUCCEEDED)
    if _since(_status(job).get("completionTime"), now) < RESULT_GRACE:
        return StepState(StepPhase.RUNNING, reason=WAITING_FOR_RESULT,
                         message=f"Job {ns}/{name} completed; reading its result")
    return StepState(StepPhase.FAILED, reason=RESULT_MISSING, message=(
        f"Job {ns}/{name} completed, but none of its pods reported a result (the worker's termination message): "
        "the worker image may not match the operator (check the chart's worker.image value)"))


def _diagnose(job: Mapping[str, Any], pods: list[Mapping[str, Any]], claims: Mapping[str, Mapping[str, Any] | None],
              storage_classes: Mapping[str, bool], now: datetime, needs_result: bool) -> StepState:
    pods = _ordered(pods)
    failed = [p for p in pods if _phase(p) == "Failed"]

    if _true(job, "Complete"):
        return _result_state(job, pods, now) if needs_result else StepState(StepPhase.SUCCEEDED)
    for type_ in ("Failed", "FailureTarget"):  # FailureTarget: failed, its pods still terminating
        cond = _true(job, type_)
        if cond is not None:
            return _job_failed(job, cond, failed)

    live = _live(pods)
    current = live[-1] if live else None
    if current is not None:
        state = _container_problem(job, current, now)
        if state is not None and state.phase == StepPhase.FAILED:
            return state
        if not _scheduled(current):
            claim = _claim_problem(job, claims, storage_classes, now)
            if claim is not None and claim.phase == StepPhase.FAILED:
                return claim
            unscheduled = _unscheduled(current)
            # A claim waiting for its volume explains "unbound immediate PersistentVolumeClaims"; for
            # any other reason (a claim that waits for its first consumer included) the scheduler's words do.
            if unscheduled is not None and (claim is None or _UNBOUND not in unscheduled.message):
                return unscheduled
            state = claim or unscheduled or state
        if state is not None:
            return state
    elif not failed:
        state = _claim_problem(job, claims, storage_classes, now)
        if state is not None:
            return state
        if not pods and _since(_meta(job).get("creationTimestamp"), now) >= POD_CREATE_GRACE:
            ns, name = _meta(job).get("namespace"), _meta(job).get("name")
            return StepState(StepPhase.RUNNING, reason=POD_NOT_CREATED, message=(
                f"Job {ns}/{name} has created no pod for {int(_since(_meta(job).get('creationTimestamp'), now).total_seconds())}s: "
                f"see its events (kubectl describe job -n {ns} {name}): a ResourceQuota, PodSecurity or a "
                "missing ServiceAccount can refuse its pods"))
    if failed:
        limit = (job.get("spec") or {}).get("backoffLimit")
        of = f" of {limit + 1}" if isinstance(limit, int) else ""
        running = "running" if current is not None else "pending"
        return StepState(StepPhase.RUNNING, reason=RETRYING, message=(
            f"attempt {len(failed)}{of} failed: {_pod_failure(job, failed[-1])}; attempt {len(failed) + 1} {running}"))
    return StepState(StepPhase.RUNNING)


def _job_failed(job: Mapping[str, Any], cond: Mapping[str, Any], failed: list[Mapping[str, Any]]) -> StepState:
    reason = cond.get("reason") or ""
    if reason == "DeadlineExceeded":
        return _deadline_exceeded(job)
    if not failed:
        detail = cond.get("message") or reason or "the Job failed"
        return StepState(StepPhase.FAILED, detail, reason=WORKER_FAILED, retryable=True)
    what = _pod_failure(job, failed[-1])
    if reason == "PodFailurePolicy":
        # Running it again as it is would fail the same way: fix the input first.
        return StepState(StepPhase.FAILED, f"{what}; the worker rejected its input, so the Job did not retry",
                         reason=WORKER_FAILED)
    if reason == "BackoffLimitExceeded":
        how = f"all {len(failed)} attempts failed" if len(failed) > 1 else "the attempt failed"
    else:
        how = cond.get("message") or reason
    return StepState(StepPhase.FAILED, f"{what}; {how}", reason=WORKER_FAILED, retryable=True)


def _deadline_exceeded(job: Mapping[str, Any]) -> StepState:
    """Not retried by itself: the same step would run into the same deadline."""
    ns, name = _meta(job).get("namespace"), _meta(job).get("name")
    deadline = (job.get("spec") or {}).get("activeDeadlineSeconds")
    mw = (_meta(job).get("labels") or {}).get(LABEL_MW) or "NAME"
    return StepState(StepPhase.FAILED, reason=DEADLINE_EXCEEDED, message=(
        f"Job {ns}/{name} ran past its deadline of {deadline}s (activeDeadlineSeconds) and was stopped: "
        f"raise {DEADLINE_VALUE} (helm upgrade), then retry: "
        f"kubectl annotate mw/{mw} -n {ns} ferry.dev/requested-at=$(date +%s) --overwrite"))


def _worker_status(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    statuses = list(_status(pod).get("containerStatuses") or [])
    return next((s for s in statuses if s.get("name") == WORKER_CONTAINER), statuses[0] if statuses else None)


def _pod_failure(job: Mapping[str, Any], pod: Mapping[str, Any]) -> str:
    """One line: why this pod failed, in the worker's own words where it left any."""
    ns, name = _meta(pod).get("namespace"), _meta(pod).get("name")
    status = _status(pod)
    if status.get("reason"):  # Evicted, DeadlineExceeded, NodeLost, ...: the node or the control plane ended it
        return f"pod {ns}/{name} {status['reason']}: {last_line(status.get('message')) or 'no message'}"
    cs = _worker_status(pod) or {}
    term = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated")
    disrupted = _true(pod, "DisruptionTarget")
    if term:
        code, why = term.get("exitCode"), term.get("reason") or ""
        line = _worker_words(job, term.get("message"))
        if why == "OOMKilled":
            return (f"the worker ran out of memory (OOMKilled, exit code {code}): raise the chart's "
                    "worker.resources.limits.memory")
        if disrupted is not None:
            return f"pod {ns}/{name} was disrupted ({disrupted.get('reason')}: {last_line(disrupted.get('message'))})"
        if why in ("StartError", "ContainerCannotRun"):  # the runtime could not start the command
            return (f"the worker container could not start ({why}, exit code {code}): {line or 'no message'}; "
                    f"check {IMAGE_VALUES}")
        if line:
            return f"{line} (exit code {code})"
        return f"the worker exited with code {code}" + (f" ({why})" if why else "")
    if disrupted is not None:
        return f"pod {ns}/{name} was disrupted ({disrupted.get('reason')}: {last_line(disrupted.get('message'))})"
    return f"pod {ns}/{name} failed: {last_line(status.get('message')) or 'no message'}"


def _worker_words(job: Mapping[str, Any], message: str | None) -> str:
    """The worker's error from a termination message: its own report ("<step> failed: ...", which
    may span lines: an SDK's error) as one line, or else (a crash: the log tail) the last line."""
    step = (_meta(job).get("labels") or {}).get(LABEL_STEP)
    text = redact(message or "").strip()
    if step and text.startswith(f"{step} failed: "):
        # The planner says "<step> failed: " already.
        line = " ".join(text[len(step) + len(" failed: "):].split())
        return line if len(line) <= 2 * MAX_LINE else line[: 2 * MAX_LINE - 3] + "..."
    return last_line(text)


def _image_of(pod: Mapping[str, Any], container: str, status: Mapping[str, Any]) -> str:
    for c in (pod.get("spec") or {}).get("containers") or []:
        if c.get("name") == container:
            return c.get("image") or status.get("image") or "?"
    return status.get("image") or "?"


def _container_problem(job: Mapping[str, Any], pod: Mapping[str, Any], now: datetime) -> StepState | None:
    """What keeps a scheduled pod's container from starting, if anything."""
    ns, name = _meta(pod).get("namespace"), _meta(pod).get("name")
    node = (pod.get("spec") or {}).get("nodeName") or "?"
    st = _status(pod)
    for cs in list(st.get("initContainerStatuses") or []) + list(st.get("containerStatuses") or []):
        waiting = (cs.get("state") or {}).get("waiting") or {}
        why, text = waiting.get("reason") or "", (waiting.get("message") or "").strip()
        image = _image_of(pod, cs.get("name", ""), cs)
        if why == "CreateContainerConfigError":
            return _config_error(job, pod, text)
        if why == "ErrImageNeverPull":
            return StepState(StepPhase.FAILED, reason=IMAGE_NOT_FOUND, message=(
                f'image "{image}" is not on node {node} and its pull policy is Never: load it onto the node, '
                f"or set {IMAGE_VALUES} to an image the node has (kubelet: {text})"))
        if why == "InvalidImageName":
            return StepState(StepPhase.FAILED, reason=INVALID_IMAGE_NAME, message=(
                f'image "{image}" is not a valid image reference: fix {IMAGE_VALUES} (kubelet: {text})'))
        if why in PULL_RETRIED:
            tried = _since(st.get("startTime") or _meta(pod).get("creationTimestamp"), now)
            if why == "SignatureValidationFailed" or REGISTRY_REFUSED.search(text):
                return StepState(StepPhase.FAILED, reason=IMAGE_NOT_FOUND, message=(
                    f'image "{image}" cannot be pulled on node {node}: check {IMAGE_VALUES} '
                    f"(kubelet: {last_line(text)})"))
            if tried >= IMAGE_PULL_GRACE:
                return StepState(StepPhase.FAILED, reason=IMAGE_PULL_FAILED, message=(
                    f'image "{image}" could not be pulled on node {node} for {int(tried.total_seconds())}s: '
                    f"check {IMAGE_VALUES} and the node's access to the registry (kubelet: {last_line(text)})"))
            return StepState(StepPhase.RUNNING, reason=IMAGE_PULL_BACK_OFF, message=(
                f'pulling image "{image}" on node {node} failed, the kubelet retries: {last_line(text)}'))
        if why in ("CreateContainerError", "PreCreateHookError", "PreStartHookError", "RunContainerError"):
            return StepState(StepPhase.RUNNING, reason=CONTAINER_CREATING, message=(
                f"pod {ns}/{name} cannot create its container yet, the kubelet retries: {last_line(text)}"))
    return None


def _secret_fields(job: Mapping[str, Any]) -> dict[str, str]:
    """Secret name -> the spec field that names it, for the Secrets whose keys the Job's containers take
    (secretKeyRef: jobs.py imports no Secret whole). A step that writes to storage.s3 takes the store's."""
    step = (_meta(job).get("labels") or {}).get(LABEL_STEP)
    field = STORE_SECRET_FIELD if step in S3_WRITING_STEPS else SECRET_FIELD
    return {e["valueFrom"]["secretKeyRef"]["name"]: field
            for c in _pod_template(job).get("containers") or [] for e in c.get("env") or []
            if (e.get("valueFrom") or {}).get("secretKeyRef")}


def _config_error(job: Mapping[str, Any], pod: Mapping[str, Any], text: str) -> StepState:
    ns, name = _meta(pod).get("namespace"), _meta(pod).get("name")
    fields = _secret_fields(job)
    no_key = MISSING_SECRET_KEY.match(text)
    if no_key is not None:
        key, secret = no_key.groups()
        field = fields.get(secret, f"the Secret referenced by pod {ns}/{name}")
        return StepState(StepPhase.FAILED, reason=SECRET_NOT_FOUND, message=(
            f"Secret {ns}/{secret} ({field}) has no key {key}, which Ferry passes to the worker by name "
            f"(other keys are ignored); add it to the Secret, or fix {field} (kubelet: {text})"))
    found = MISSING_REFERENCE.match(text)
    if found is None:
        # e.g. "failed to sync secret cache: timed out waiting for the condition": the kubelet retries.
        return StepState(StepPhase.RUNNING, reason=CONTAINER_CONFIG_ERROR, message=(
            f"pod {ns}/{name} cannot configure its container yet, the kubelet retries: {last_line(text)}"))
    kind, missing = found.groups()
    if kind == "configmap":
        return StepState(StepPhase.FAILED, reason=CONTAINER_CONFIG_ERROR, message=(
            f"ConfigMap {ns}/{missing} referenced by pod {ns}/{name} does not exist (kubelet: {text})"))
    if missing in fields:
        field = fields[missing]
        return StepState(StepPhase.FAILED, reason=SECRET_NOT_FOUND, message=(
            f"Secret {ns}/{missing} ({field}) does not exist: create it in namespace {ns}, "
            f"or fix {field} (kubelet: {text})"))
    return StepState(StepPhase.FAILED, reason=SECRET_NOT_FOUND, message=(
        f"Secret {ns}/{missing} referenced by pod {ns}/{name} does not exist (kubelet: {text})"))


def _claim_problem(job: Mapping[str, Any], claims: Mapping[str, Mapping[str, Any] | None],
                   storage_classes: Mapping[str, bool], now: datetime) -> StepState | None:
    """What keeps the Job's claims from binding, if anything (and if they were read)."""
    ns = _meta(job).get("namespace")
    waiting: StepState | None = None
    for volume in _pod_template(job).get("volumes") or []:
        ref = volume.get("persistentVolumeClaim")
        if not ref or ref["claimName"] not in claims:
            continue
        name, claim = ref["claimName"], claims[ref["claimName"]]
        field = CLAIM_FIELDS.get(volume.get("name"), "the Job's volumes")
        if claim is None:
            return StepState(StepPhase.FAILED, reason=CLAIM_NOT_FOUND, message=(
                f"PersistentVolumeClaim {ns}/{name} ({field}) does not exist: create it, or fix {field}"))
        phase = _status(claim).get("phase", "Pending")
        if phase == "Lost":
            volume_name = (claim.get("spec") or {}).get("volumeName") or "?"
            return StepState(StepPhase.FAILED, reason=CLAIM_LOST, message=(
                f"PersistentVolumeClaim {ns}/{name} ({field}) is Lost: its PersistentVolume {volume_name} "
                "no longer exists"))
        if phase != "Pending":
            continue
        sc = (claim.get("spec") or {}).get("storageClassName")
        ours = LABEL_MW in (_meta(claim).get("labels") or {})
        if sc and storage_classes.get(sc) is False and _since(_meta(claim).get("creationTimestamp"), now) >= CLAIM_GRACE:
            if ours:
                hint = (f'create StorageClass "{sc}", or delete the ModelWeights and PersistentVolumeClaim {ns}/{name} '
                        "and recreate it with a storageClassName that exists (kubectl get storageclass)")
                where = "spec.storage.pvc.storageClassName"
            else:
                hint = f'create StorageClass "{sc}", or give {field} a claim that can bind'
                where = f"the claim's spec.storageClassName, named by {field}"
            return StepState(StepPhase.FAILED, reason=STORAGE_CLASS_NOT_FOUND, message=(
                f'PersistentVolumeClaim {ns}/{name} is Pending: StorageClass "{sc}" does not exist ({where}); {hint}'))
        if waiting is None:
            why = (f'waiting for a volume of StorageClass "{sc}"' if sc else
                   "it names no StorageClass and no PersistentVolume matches it yet")
            waiting = StepState(StepPhase.RUNNING, reason=CLAIM_PENDING,
                                message=f"PersistentVolumeClaim {ns}/{name} ({field}) is Pending: {why}")
    return waiting


def _unscheduled(pod: Mapping[str, Any]) -> StepState | None:
    cond = _conditions(pod).get("PodScheduled")
    if cond is None or cond.get("status") != "False":
        return None
    ns, name = _meta(pod).get("namespace"), _meta(pod).get("name")
    return StepState(StepPhase.RUNNING, reason=cond.get("reason") or UNSCHEDULABLE, message=(
        f"pod {ns}/{name} cannot be scheduled: {last_line(cond.get('message')) or cond.get('reason')} "
        f"(check {NODE_VALUES})"))


def api_message(body: str | bytes | None, fallback: str = "") -> str:
    """The message of an API server's error Status (untrusted words: shown, never acted on)."""
    try:
        status = json.loads(body) if body else {}
        return str(status.get("message") or fallback)
    except (ValueError, AttributeError):
        return fallback


def rbac_denied(body: str | bytes | None) -> bool:
    """Whether a 403 is RBAC's (a permission the operator lacks), not a quota's or a webhook's."""
    return _RBAC_DENIED.search(api_message(body)) is not None


def forbidden(body: str | bytes | None, fallback: str = "") -> str:
    """A human's message for a 403 from the API server: who may not do what, and where to grant it."""
    text = api_message(body, fallback)
    denied = _RBAC_DENIED.search(text or "")
    if denied is None:  # not RBAC: e.g. "exceeded quota", an admission webhook's refusal
        return f"the API server refused a request of the operator: {text}"
    user, verb, resource, group, namespace = denied.group("user", "verb", "resource", "group", "namespace")
    base, _, sub = resource.partition("/")
    what = f"{base}.{group}" if group else base
    what += f"/{sub}" if sub else ""
    if user.startswith("system:serviceaccount:"):
        sa_ns, _, sa = user.removeprefix("system:serviceaccount:").partition(":")
        who = f"the operator's ServiceAccount {sa_ns}/{sa}"
    else:
        who = f"the operator's identity {user!r}"
    where = f"in namespace {namespace}" if namespace else "at the cluster scope"
    return (f"{who} may not {verb} {what} {where}: grant it in the operator's ClusterRole (the chart's "
            "templates/rbac.yaml; helm upgrade) and check its ClusterRoleBinding; the operator retries by itself")
