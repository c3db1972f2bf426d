"""kopf handlers: thin glue between the cluster, the executor and the planner.

One timer per ModelWeights observes the executor's steps, asks the planner
what to do, starts what it says, and writes the status it computed.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Protocol

import kopf
from kubernetes.client.exceptions import ApiException

from . import metrics
from .api.types import GROUP, PLURAL, VERSION, Artifact, ModelWeights, ModelWeightsStatus
from .api.validation import InvalidSpec, parse
from .events import WARNING, Event, transitions
from .executors.diagnosis import FORBIDDEN, forbidden
from .planner import (ArtifactFacts, Observed, PatchDeployment, RemoveArtifact, RetryPolicy, RetryStep, StartStep,
                      StepPhase, StepState, blocked, plan, recorded_artifact)
from .serving import OWNER_ANNOTATION, DeploymentFacts, deployment_facts
from .serving_loader import REPORTER_CLUSTER_ROLE, LoaderSettings
from .steps import Step, UnsupportedSpec, prepare_steps
from .weights_loaded import PodFacts, pod_facts

RECONCILE_INTERVAL = float(os.environ.get("FERRY_RECONCILE_INTERVAL", "2"))
RETRIES = RetryPolicy(limit=int(os.environ.get("FERRY_RETRY_LIMIT", "3")),
                      base_s=float(os.environ.get("FERRY_RETRY_BACKOFF_S", "30")))
REQUESTED_AT = "ferry.dev/requested-at"
# Superseded artifacts deletionPolicy Retain keeps (the newest ones); older ones are removed.
KEEP_PREVIOUS = int(os.environ.get("FERRY_RETAIN_PREVIOUS_ARTIFACTS", "1"))
log = logging.getLogger("ferry_operator")


def loader_settings() -> LoaderSettings:
    """The serving pods' `ferry load` init container: the worker image unless told otherwise."""
    return LoaderSettings(
        image=os.environ.get("FERRY_LOADER_IMAGE") or os.environ.get("FERRY_WORKER_IMAGE") or "ferry.local/ferry:dev",
        resources=json.loads(os.environ.get("FERRY_LOADER_RESOURCES", "{}")),
        image_pull_policy=os.environ.get("FERRY_LOADER_IMAGE_PULL_POLICY") or None,
    )


LOADER = loader_settings()
REPORTER_ROLE = os.environ.get("FERRY_REPORTER_CLUSTER_ROLE", REPORTER_CLUSTER_ROLE)


class Executor(Protocol):
    def start(self, mw: ModelWeights, uid: str, step: Step) -> None: ...
    def observe(self, mw: ModelWeights, step: Step) -> StepState: ...
    def artifact(self, mw: ModelWeights, last: Step) -> ArtifactFacts | None: ...
    def retry(self, mw: ModelWeights, step: Step) -> None: ...
    def remove_artifact(self, mw: ModelWeights, uid: str, artifact: Artifact) -> None: ...


def make_executor() -> Executor:
    kind = os.environ.get("FERRY_EXECUTOR", "local")
    if kind == "kubernetes":
        from .executors.jobs import WorkerSettings
        from .executors.kubernetes import KubernetesExecutor

        return KubernetesExecutor(WorkerSettings(
            image=os.environ["FERRY_WORKER_IMAGE"],
            service_account=os.environ.get("FERRY_WORKER_SERVICE_ACCOUNT", "ferry-worker"),
            cluster_role=os.environ.get("FERRY_WORKER_CLUSTER_ROLE", "ferry-worker"),
            resources=json.loads(os.environ.get("FERRY_WORKER_RESOURCES", "{}")),
            node_selector=json.loads(os.environ.get("FERRY_WORKER_NODE_SELECTOR", "{}")),
            tolerations=json.loads(os.environ.get("FERRY_WORKER_TOLERATIONS", "[]")),
            tensorize_image=os.environ.get("FERRY_TENSORIZE_IMAGE", ""),
        ))
    if kind == "local":
        from .executors.local import LocalExecutor

        return LocalExecutor(
            root=Path(os.environ.get("FERRY_LOCAL_ROOT", ".ferry/artifacts")).resolve(),
            ferry_bin=shutil.which("ferry") or str(Path(sys.executable).with_name("ferry")),
            kubeconfig=os.environ.get("KUBECONFIG"),
        )
    raise SystemExit(f"FERRY_EXECUTOR={kind!r}: use local or kubernetes")


EXECUTOR: Executor | None = None
APPS: Any = None  # kubernetes.client.AppsV1Api
RBAC: Any = None  # kubernetes.client.RbacAuthorizationV1Api
_reporters: set[tuple[str, str]] = set()  # (namespace, ServiceAccount) bound to the reporter role


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    global EXECUTOR, APPS, RBAC
    import kubernetes

    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    APPS = kubernetes.client.AppsV1Api()
    RBAC = kubernetes.client.RbacAuthorizationV1Api()
    EXECUTOR = make_executor()
    if os.environ.get("FERRY_METRICS_BIND"):
        metrics.serve(os.environ["FERRY_METRICS_BIND"])
    # Keep kopf's bookkeeping in annotations: status belongs to the API's schema.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="ferry.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="ferry.dev", key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING
    # Handlers are sync and mostly wait on the API server or a fork: more
    # threads than cores keep a burst of new objects from queueing behind each other.
    settings.execution.max_workers = int(os.environ.get("FERRY_HANDLER_THREADS", "16"))


@kopf.index("apps", "v1", "deployments")
def deployments(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[tuple[str, str], DeploymentFacts]:
    """Deployments in the watched namespaces, fed by a watch: reading one costs
    the API server nothing, so an idle Ready ModelWeights costs it nothing."""
    return {(namespace, name): deployment_facts(body)}


@kopf.index("", "v1", "pods", annotations={OWNER_ANNOTATION: kopf.PRESENT})
def serving_pods(namespace: str, body: kopf.Body, **_: Any) -> dict[tuple[str, str], PodFacts]:
    """Serving pods of wired Deployments (their template carries the owner
    annotation), by ModelWeights: what their loaders reported."""
    facts = pod_facts(body)
    return {(namespace, facts.owner): facts}


@kopf.index("batch", "v1", "jobs", labels={"ferry.dev/modelweights": kopf.PRESENT})
def prepare_jobs(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
    """Ferry's Jobs (prepare steps, cleanup), fed by a watch."""
    return {(namespace, name): dict(body)}


@kopf.index("", "v1", "pods", labels={"ferry.dev/modelweights": kopf.PRESENT, "job-name": kopf.PRESENT})
def prepare_pods(namespace: str, body: kopf.Body, labels: Any, **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
    """The pods of Ferry's Jobs, by Job: their phases and termination messages."""
    return {(namespace, labels["job-name"]): dict(body)}


class IndexView:
    """The kubernetes executor's view of Jobs and pods, from the indexes above."""

    def __init__(self, job_index: Any, pod_index: Any) -> None:
        self._jobs, self._pods = job_index, pod_index

    def job(self, namespace: str, name: str) -> dict[str, Any] | None:
        found = list(self._jobs.get((namespace, name), []))
        return found[-1] if found else None

    def pods(self, namespace: str, job_name: str) -> list[dict[str, Any]]:
        return list(self._pods.get((namespace, job_name), []))


def read_deployment(namespace: str, name: str, index: Any = None) -> DeploymentFacts | None:
    if index is not None:
        found = list(index.get((namespace, name), []))
        return found[-1] if found else None
    from kubernetes.client.exceptions import ApiException

    try:
        raw = APPS.read_namespaced_deployment(name, namespace, _preload_content=False)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return deployment_facts(json.loads(raw.data))


def _status_patch(before: dict[str, Any], after: ModelWeightsStatus) -> dict[str, Any]:
    """The status fields the operator owns, as a merge patch; empty if nothing changed."""
    new = after.model_dump(by_alias=True, mode="json", exclude_none=True)
    patch: dict[str, Any] = {}
    for key in ("observedGeneration", "phase", "conditions", "artifact", "previousArtifacts", "retry",
                "lastHandledRequestedAt", "loaded"):
        if key in new and new[key] != before.get(key):
            patch[key] = new[key]
    for key in ("progress", "retry", "loaded"):  # cleared: null removes it (merge patch)
        if key in before and key not in new:
            patch[key] = None
    return patch


@kopf.timer(GROUP, VERSION, PLURAL, interval=RECONCILE_INTERVAL, initial_delay=0)
def reconcile(body: kopf.Body, namespace: str, name: str, uid: str, patch: kopf.Patch, **kwargs: Any) -> None:
    started = time.monotonic()
    result = "error"
    try:
        # kopf passes each index under its handler's name.
        if hasattr(EXECUTOR, "view") and "prepare_jobs" in kwargs:
            EXECUTOR.view = IndexView(kwargs["prepare_jobs"], kwargs["prepare_pods"])
        result = _reconcile_and_report(body, namespace, name, uid, patch, kwargs.get("deployments"),
                                       kwargs.get("serving_pods"))
    finally:
        metrics.RECONCILES.labels(result).inc()
        metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)


def _reconcile_and_report(body: kopf.Body, namespace: str, name: str, uid: str, patch: kopf.Patch,
                          deployment_index: Any, pod_index: Any = None) -> str:
    assert EXECUTOR is not None
    raw_status = dict(body.get("status") or {})
    try:
        mw = parse(dict(body))
        steps = prepare_steps(mw.spec)
    except (InvalidSpec, UnsupportedSpec) as exc:
        before = _parse_status(raw_status)
        status = blocked(before, body["metadata"].get("generation", 0), type(exc).__name__, str(exc))
        _report(body, uid, None, transitions(before, status, []), status)
        patch.status.update(_status_patch(raw_status, status))
        return "ok"
    actions: list[StartStep | RetryStep | PatchDeployment | RemoveArtifact] = []
    result = "ok"
    try:
        status = _reconcile(mw, namespace, name, uid, steps, actions, deployment_index, pod_index)
    except ApiException as exc:
        if exc.status != 403:  # kopf logs it and retries
            raise
        result = "forbidden"
        # A permission the operator lacks (or a quota, an admission webhook):
        # say which, keep the timer going, converge once it is granted.
        message = forbidden(exc.body, str(exc))
        previous = raw_status.get("conditions") or []
        if not any(c.get("type") == "Stalled" and c.get("message") == message for c in previous):
            log.warning("%s/%s: %s", namespace, name, message)
        status = blocked(mw.status, mw.metadata.generation or 0, FORBIDDEN, message)
    _report(body, uid, mw, transitions(mw.status, status, actions), status, steps)
    patch.status.update(_status_patch(raw_status, status))
    return result


def _report(body: kopf.Body, uid: str, mw: ModelWeights | None, events: list[Event], status: ModelWeightsStatus,
            steps: list[Step] = ()) -> None:
    """Core Events on the ModelWeights (kopf posts them in the background), and metrics."""
    for e in events:
        kopf.event(body, type=e.type, reason=e.reason, message=e.message[:1024])
        if e.type == WARNING and e.reason != "StepRetrying":
            metrics.ERRORS.labels(e.reason).inc()
        if e.reason == "ArtifactReady" and steps and mw is not None:
            size = status.artifact.total_bytes if status.artifact else 0
            metrics.STEP_BYTES.labels(steps[-1].name, _format(mw)).inc(size)
    metrics.phase(uid, getattr(status.phase, "value", status.phase))


def _format(mw: ModelWeights) -> str:
    return getattr(mw.spec.format.type, "value", mw.spec.format.type)


def _parse_status(raw: dict[str, Any]) -> ModelWeightsStatus:
    return ModelWeightsStatus.model_validate(raw) if raw else ModelWeightsStatus()


def _reconcile(mw: ModelWeights, namespace: str, name: str, uid: str, steps: list[Step],
               done: list[StartStep | RetryStep | PatchDeployment | RemoveArtifact],
               deployment_index: Any = None, pod_index: Any = None) -> ModelWeightsStatus:
    """Observe, plan, act; the status the planner computed. `done` collects the
    actions taken (for Events), also when a later one fails."""
    assert EXECUTOR is not None
    refs = mw.spec.serving.deployments if mw.spec.serving else []
    recorded = recorded_artifact(mw, steps)
    if recorded is not None:
        # The status is the source of truth once it records the artifact: the
        # executor is not asked again (its Jobs may have expired).
        step_states = {s.id: StepState(StepPhase.SUCCEEDED) for s in steps}
    else:
        step_states = {s.id: EXECUTOR.observe(mw, s) for s in steps}
    observed = Observed(
        steps=step_states,
        artifact=recorded or (EXECUTOR.artifact(mw, steps[-1]) if steps else None),
        deployments={r.name: read_deployment(namespace, r.name, deployment_index) for r in refs},
        requested_at=(mw.metadata.model_extra or {}).get("annotations", {}).get(REQUESTED_AT),
        pods=list(pod_index.get((namespace, name), [])) if pod_index is not None else [],
    )
    result = plan(mw, observed, RETRIES, KEEP_PREVIOUS, LOADER)
    for step in steps:
        if step_states[step.id].phase == StepPhase.SUCCEEDED:
            metrics.step_succeeded(step.id, step.name, _format(mw))
    if recorded is None and result.status.artifact is not None and result.status.artifact.spec_digest:
        # Recorded from now on: the executor may let the steps' Jobs expire.
        finished = getattr(EXECUTOR, "finished", None)
        if finished is not None:
            finished(mw, steps)
    for action in result.actions:
        if isinstance(action, StartStep):
            log.info("%s/%s: starting step %s", namespace, name, action.step.id)
            EXECUTOR.start(mw, uid, action.step)
            metrics.step_started(action.step.id)
        elif isinstance(action, RetryStep):
            log.info("%s/%s: retrying step %s (retry %d)", namespace, name, action.step.id, action.attempt)
            EXECUTOR.retry(mw, action.step)
        elif isinstance(action, RemoveArtifact):
            log.info("%s/%s: removing superseded artifact %s", namespace, name, action.artifact.uri)
            EXECUTOR.remove_artifact(mw, uid, action.artifact)
        elif isinstance(action, PatchDeployment):
            log.info("%s/%s: wiring deployment %s", namespace, name, action.name)
            if action.reporter_service_account:
                ensure_reporter(namespace, action.reporter_service_account)
            APPS.patch_namespaced_deployment(action.name, namespace, action.patch,
                                             _content_type="application/strategic-merge-patch+json")
        done.append(action)
    return result.status


def ensure_reporter(namespace: str, service_account: str) -> None:
    """Bind the weights-reporter role to a serving ServiceAccount (once per
    operator process; the binding is deterministic, so 409 is success)."""
    if (namespace, service_account) in _reporters:
        return
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": f"ferry-weights-reporter-{service_account}"[:253], "namespace": namespace,
                     "labels": {"app.kubernetes.io/managed-by": "ferry"}},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": REPORTER_ROLE},
        "subjects": [{"kind": "ServiceAccount", "name": service_account, "namespace": namespace}],
    }
    try:
        RBAC.create_namespaced_role_binding(namespace, binding)
    except ApiException as exc:
        if exc.status != 409:
            raise
    _reporters.add((namespace, service_account))


# No finalizer of its own (optional=True): the timer's finalizer already routes
# deletion through the operator. On a cluster, deletionPolicy Delete is carried
# out by garbage collection of the claim's owner reference; the local executor
# removes its directory here.
@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
def delete(body: kopf.Body, uid: str, **_: Any) -> None:
    assert EXECUTOR is not None
    metrics.phase(uid, None)
    remove = getattr(EXECUTOR, "delete", None)
    if body.get("spec", {}).get("deletionPolicy") == "Delete" and remove is not None:
        log.info("%s/%s: deletionPolicy Delete: removing prepared data", body["metadata"]["namespace"],
                 body["metadata"]["name"])
        remove(parse(dict(body)))
