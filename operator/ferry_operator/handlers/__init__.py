"""kopf handlers: thin glue between the cluster, the executor and the planner.

One reconciler per ModelWeights (a kopf daemon) observes the executor's
steps, asks the planner what to do, starts what it says, and writes the
status it computed. It runs when the object appears, whenever a watch event
of what it depends on wakes it (wakeups.py), and otherwise only as often as
the planner asks: every RECONCILE_INTERVAL while work is in progress, every
RESYNC_INTERVAL (a safety net) once Ready or stalled.

This module holds the operator's settings and clients, the reconcile loop and
the delete handler; `indexes` the kopf indexes (what a reconcile reads, fed by
watches), `watches` the watch events that wake a reconciler, `status` the
status patch and the Events and metrics of a pass. Importing this package
registers them all.
"""
from __future__ import annotations

import asyncio
import collections
import contextvars
import functools
import json
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import kopf
from kubernetes.client.exceptions import ApiException

from .. import metrics
from ..serving import workload_api
from ..admission_policies import PolicyGuard, policy_names
from ..api.types import (GROUP, MAX_WORKLOADS, PLURAL, VERSION, Artifact, ModelWeights, ModelWeightsStatus,
                        ServingTarget, WorkloadKind)
from ..api.validation import InvalidSpec, parse
from ..events import NORMAL, transitions
from ..executors.diagnosis import FORBIDDEN, forbidden
from ..node_cache import FillNode, RemoveFill
from ..placement import NodeFacts, selected
from ..planner import (ArtifactFacts, Observed, PatchWorkload, RemoveArtifact, RetryPolicy, RetryStep, StartStep,
                      RemoveWarmUp, StepPhase, StepState, WarmUp, blocked, plan, recorded_artifact)
from ..serving.wiring import OWNER_ANNOTATION, WorkloadFacts, cache_evicted_label, cache_label
from ..serving.loader import REPORTER_CLUSTER_ROLE, LoaderSettings
from ..serving.compiled import pod_outcome
from ..serving.rollout import put_back
from ..steps import Step, UnsupportedSpec, prepare_steps
from ..ownership import Wirer, owner_of
from ..wakeups import sleep
from ..serving.weights_loaded import PodFacts
# Importing the submodules registers their kopf indexes and watch handlers.
from . import crds
from .indexes import WORKLOAD_INDEXES, IndexView, _cache_node_labels, _node_snapshot, _wired_keys
from .status import _format, _newer, _parse_status, _report, _status_patch
from .watches import REQUESTED_AT, WAKEUPS, _inputs

# While a step runs or a rollout is under way: a poll behind the watch events
# (a local worker that outlived a restarted operator sends none).
RECONCILE_INTERVAL = float(os.environ.get("FERRY_RECONCILE_INTERVAL", "2"))
# Ready or stalled: every change that matters arrives as an event; this is the safety net.
RESYNC_INTERVAL = float(os.environ.get("FERRY_RESYNC_INTERVAL", "300"))
ERROR_BACKOFF_MAX_S = 60.0
# A rollout sends a burst of Deployment, ReplicaSet-driven and pod events: a
# woken reconciler waits this long so the burst costs one reconcile, not twenty.
WAKE_COALESCE_S = float(os.environ.get("FERRY_WAKE_COALESCE_S", "0.5"))
RETRIES = RetryPolicy(limit=int(os.environ.get("FERRY_RETRY_LIMIT", "3")),
                      base_s=float(os.environ.get("FERRY_RETRY_BACKOFF_S", "30")))
# Superseded artifacts deletionPolicy Retain keeps (the newest ones); older ones are removed.
KEEP_PREVIOUS = int(os.environ.get("FERRY_RETAIN_PREVIOUS_ARTIFACTS", "1"))
# The chart sets it with nodeCache.enabled: the cluster runs Ferry's node agent. Without it, no fill Job.
NODE_AGENT = os.environ.get("FERRY_NODE_CACHE", "").lower() == "true"
# The node labels a prewarm may select by (the chart's nodeCache.prewarmNodeLabels); unset or empty: any.
PREWARM_LABELS = tuple(k.strip() for k in os.environ.get("FERRY_PREWARM_NODE_LABELS", "").split(",") if k.strip()) or None
# A prewarm holding the rollout is watched through its fill Jobs' and nodes' events: the poll behind them
# backs off, RECONCILE_INTERVAL doubling up to this.
PREWARM_BACKOFF_MAX_S = float(os.environ.get("FERRY_PREWARM_BACKOFF_MAX_S", "30"))
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
    def artifact_uri(self, mw: ModelWeights, last: Step) -> str: ...
    def artifact(self, mw: ModelWeights, last: Step) -> ArtifactFacts | None: ...
    def retry(self, mw: ModelWeights, step: Step) -> None: ...
    def remove_artifact(self, mw: ModelWeights, uid: str, artifact: Artifact) -> None: ...


def make_executor() -> Executor:
    kind = os.environ.get("FERRY_EXECUTOR", "local")
    if kind == "kubernetes":
        from ..executors.jobs import WorkerSettings, parse_deadline
        from ..executors.kubernetes import KubernetesExecutor

        return KubernetesExecutor(WorkerSettings(
            image=os.environ["FERRY_WORKER_IMAGE"],
            service_account=os.environ.get("FERRY_WORKER_SERVICE_ACCOUNT", "ferry-worker"),
            cluster_role=os.environ.get("FERRY_WORKER_CLUSTER_ROLE", "ferry-worker"),
            resources=json.loads(os.environ.get("FERRY_WORKER_RESOURCES", "{}")),
            node_selector=json.loads(os.environ.get("FERRY_WORKER_NODE_SELECTOR", "{}")),
            tolerations=json.loads(os.environ.get("FERRY_WORKER_TOLERATIONS", "[]")),
            tensorize_image=os.environ.get("FERRY_TENSORIZE_IMAGE", ""),
            progress_interval=os.environ.get("FERRY_WORKER_PROGRESS_INTERVAL", ""),
            # "" or unset: derived per step from the claim's size (jobs.prepare_deadline).
            active_deadline_seconds=parse_deadline(os.environ.get("FERRY_WORKER_ACTIVE_DEADLINE_SECONDS", "")),
            fill_deadline_seconds=parse_deadline(os.environ.get("FERRY_FILL_DEADLINE_SECONDS", ""), "FERRY_FILL_DEADLINE_SECONDS",
                                                 "nodeCache.fillDeadlineSeconds") or 4 * 3600,
            allow_instance_credentials=os.environ.get("FERRY_WORKER_ALLOW_INSTANCE_CREDENTIALS", "").lower() == "true",
        ))
    if kind == "local":
        from ..executors.local import LocalExecutor

        return LocalExecutor(
            root=Path(os.environ.get("FERRY_LOCAL_ROOT", ".ferry/artifacts")).resolve(),
            ferry_bin=shutil.which("ferry") or str(Path(sys.executable).with_name("ferry")),
        )
    raise SystemExit(f"FERRY_EXECUTOR={kind!r}: use local or kubernetes")


EXECUTOR: Executor | None = None
APPS: Any = None  # kubernetes.client.AppsV1Api
RBAC: Any = None  # kubernetes.client.RbacAuthorizationV1Api
CUSTOM: Any = None  # kubernetes.client.CustomObjectsApi
POLICIES: PolicyGuard | None = None  # Ferry's admission policies, enforced (checked before acting)
# Reconciles are sync (the API client, forks): they run here, not on the event loop.
POOL: ThreadPoolExecutor | None = None
WRITERS: ThreadPoolExecutor | None = None  # status writes
_reporters: set[tuple[str, str]] = set()  # (namespace, ServiceAccount) bound to the reporter role
_held: dict[tuple[str, str], int] = {}  # (namespace, name) -> reconciles in a row that a prewarm held


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    global EXECUTOR, APPS, RBAC, CUSTOM, POOL, WRITERS, POLICIES
    import kubernetes

    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    threads = int(os.environ.get("FERRY_HANDLER_THREADS", "16"))
    # A connection per thread that may call the API server at once (urllib3's default is 10:
    # beyond it every call pays a new TLS handshake).
    client_config = kubernetes.client.Configuration.get_default_copy()
    client_config.connection_pool_maxsize = 2 * threads
    kubernetes.client.Configuration.set_default(client_config)
    APPS = kubernetes.client.AppsV1Api()
    RBAC = kubernetes.client.RbacAuthorizationV1Api()
    CUSTOM = kubernetes.client.CustomObjectsApi()
    POLICIES = PolicyGuard(kubernetes.client.AdmissionregistrationV1Api(), policy_names())
    EXECUTOR = make_executor()
    if settings.scanning.disabled:  # a namespaced operator (crds.py): which optional kinds it cannot watch
        crds.note_at_start(crds.reader(kubernetes.client.ApiextensionsV1Api()))
    if hasattr(EXECUTOR, "on_exit"):
        EXECUTOR.on_exit = WAKEUPS.wake_threadsafe  # a local worker's exit wakes its ModelWeights
    if os.environ.get("FERRY_METRICS_BIND"):
        metrics.serve(os.environ["FERRY_METRICS_BIND"])
    # Keep kopf's bookkeeping in annotations: status belongs to the API's schema.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="ferry.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="ferry.dev", key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING
    # Reconciles mostly wait on the API server or a fork: more threads than
    # cores keep a burst of new objects from queueing behind each other.
    POOL = ThreadPoolExecutor(threads, thread_name_prefix="reconcile")
    WRITERS = ThreadPoolExecutor(threads, thread_name_prefix="status")


@kopf.on.event("admissionregistration.k8s.io", "v1", "validatingadmissionpolicies")
@kopf.on.event("admissionregistration.k8s.io", "v1", "validatingadmissionpolicybindings")
async def admission_policy_changed(**_: Any) -> None:
    if POLICIES is not None:
        POLICIES.invalidate()  # the next action checks them again


@dataclass
class Reconciled:
    delay: float  # seconds until the next reconcile, unless woken earlier
    status_patch: dict[str, Any]  # what to write to the status subresource (empty: nothing changed)


# No kopf retries and no kopf-kept state: the loop below owns the schedule,
# and everything it needs is in the object's status.
@kopf.daemon(GROUP, VERSION, PLURAL, initial_delay=0, cancellation_timeout=60)
async def reconciler(stopped: kopf.DaemonStopped, body: kopf.Body, namespace: str, name: str, uid: str,
                     **kwargs: Any) -> None:
    key = (namespace, name)
    wake = WAKEUPS.register(key)
    loop = asyncio.get_running_loop()
    indexes = {k: kwargs.get(k) for k in ("deployments", "statefulsets", "leaderworkersets", "serving_pods",
                                          "prepare_jobs", "prepare_pods", "wirings", "fill_jobs", "cache_nodes",
                                          "all_nodes", "warm_up_jobs")}
    patched: dict[str, Any] | None = None
    failures = 0
    try:
        while not stopped:
            wake.clear()
            # A shallow copy is a snapshot: kopf replaces the live body's
            # contents on each event, it does not edit them in place.
            current = _newer(dict(body), patched)
            # A copied context: kopf.event() finds kopf's posting queue through it. The nodes' labels are
            # read here, on the loop that updates them: the reconcile thread iterates a snapshot.
            seen = {**indexes, "cache_nodes": _cache_node_labels(indexes.get("cache_nodes")),
                    "nodes": _node_snapshot(indexes.get("all_nodes"), current)}
            call = functools.partial(reconcile_once, current, namespace, name, uid, seen)
            try:
                outcome = await loop.run_in_executor(POOL, contextvars.copy_context().run, call)
                if outcome.status_patch:
                    # On threads of their own: a slow API server delays the
                    # status, not the next object's steps.
                    patched = await loop.run_in_executor(WRITERS, _write_status, namespace, name,
                                                         outcome.status_patch) or patched
            except Exception:  # noqa: BLE001 - logged; retried with a growing delay
                failures += 1
                delay = min(ERROR_BACKOFF_MAX_S, RECONCILE_INTERVAL * 2 ** failures)
                log.exception("%s/%s: reconcile failed (retrying in %.0fs)", namespace, name, delay)
            else:
                failures = 0
                delay = outcome.delay
            await sleep(wake, stopped, delay)
            if wake.is_set() and not stopped:
                await sleep(asyncio.Event(), stopped, WAKE_COALESCE_S)
    finally:
        WAKEUPS.unregister(key, wake)
        _held.pop(key, None)


# One object's reconcile pass and its delete handler never act at once: the handler reads the Deployments
# after the pass's last patch (serving.rollout's strategy put back is then final).
_acting: dict[tuple[str, str], threading.Lock] = collections.defaultdict(threading.Lock)


def reconcile_once(body: dict[str, Any], namespace: str, name: str, uid: str,
                   indexes: dict[str, Any]) -> Reconciled:
    """One observe-plan-act pass: the status it computed, and when to look again."""
    started = time.monotonic()
    result = "error"
    try:
        _acting[(namespace, name)].acquire()
        # kopf passes each index under its handler's name.
        if hasattr(EXECUTOR, "view") and indexes.get("prepare_jobs") is not None:
            EXECUTOR.view = IndexView(indexes["prepare_jobs"], indexes["prepare_pods"], indexes.get("fill_jobs"),
                                      indexes.get("warm_up_jobs"))
        workload_indexes = {kind: indexes.get(index) for kind, index in WORKLOAD_INDEXES.items()}
        result, patch, delay = _reconcile_and_report(body, namespace, name, uid, workload_indexes,
                                                     indexes.get("serving_pods"), indexes.get("wirings"),
                                                     indexes.get("cache_nodes"), indexes.get("nodes"))
        WAKEUPS.record((namespace, name), _inputs(body), _wired_keys(body.get("spec")))
    finally:
        _acting[(namespace, name)].release()
        metrics.RECONCILES.labels(result).inc()
        metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
    return Reconciled(delay, patch)


def _next_look(requeue_after: float | None, acted: bool, held: int = 0) -> float:
    """Seconds until the reconciler looks again unless an event wakes it first. `held`: how many reconciles
    in a row a prewarm held the rollout (their fill Jobs' and nodes' events wake it: the poll backs off)."""
    if acted:
        return WAKE_COALESCE_S  # what it did may need a next step no event announces
    if requeue_after is not None and held:
        return min(PREWARM_BACKOFF_MAX_S, RECONCILE_INTERVAL * 2 ** min(held - 1, 16))
    return RESYNC_INTERVAL if requeue_after is None else RECONCILE_INTERVAL


def _write_status(namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any] | None:
    try:
        return CUSTOM.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, {"status": patch}, field_manager="ferry-operator",
            _content_type="application/merge-patch+json")
    except ApiException as exc:
        if exc.status == 404:  # deleted meanwhile
            return None
        raise


def _reconcile_and_report(body: dict[str, Any], namespace: str, name: str, uid: str,
                          workload_indexes: dict[str, Any] | None, pod_index: Any = None,
                          wiring_index: Any = None, node_labels: dict[str, dict[str, str]] | None = None,
                          nodes: dict[str, NodeFacts] | None = None) -> tuple[str, dict[str, Any], float]:
    """(result for the metrics, the status merge patch, seconds until the next look)."""
    assert EXECUTOR is not None
    raw_status = dict(body.get("status") or {})
    try:
        mw = parse(dict(body))
        steps = prepare_steps(mw.spec)
    except (InvalidSpec, UnsupportedSpec) as exc:
        before = _parse_status(raw_status)
        status = blocked(before, body["metadata"].get("generation", 0), type(exc).__name__, str(exc))
        _report(body, uid, None, transitions(before, status, []), status)
        return "ok", _status_patch(raw_status, status), _next_look(None, False)  # only a spec change helps
    actions: list[StartStep | RetryStep | PatchWorkload | RemoveArtifact] = []
    result = "ok"
    try:
        status, requeue_after = _reconcile(mw, namespace, name, uid, steps, actions, workload_indexes, pod_index,
                                           wiring_index, node_labels, nodes)
        delay = _next_look(requeue_after, bool(actions), _held.get((namespace, name), 0))
    except ApiException as exc:
        if exc.status != 403:  # logged and retried by the reconciler
            raise
        result = "forbidden"
        # A permission the operator lacks (or a quota, an admission webhook):
        # say which, keep looking (a grant sends no event), converge once it is granted.
        message = forbidden(exc.body, str(exc))
        previous = raw_status.get("conditions") or []
        if not any(c.get("type") == "Stalled" and c.get("message") == message for c in previous):
            log.warning("%s/%s: %s", namespace, name, message)
        status, delay = blocked(mw.status, mw.metadata.generation or 0, FORBIDDEN, message), RECONCILE_INTERVAL
    except PoliciesNotEnforced as exc:
        result = "forbidden"
        log.warning("%s/%s: %s", namespace, name, exc)
        status, delay = blocked(mw.status, mw.metadata.generation or 0, "AdmissionPolicyMissing", str(exc)), \
            RECONCILE_INTERVAL
    pods = {p.name: p.uid for p in (pod_index.get((namespace, name), []) if pod_index is not None else [])}
    _report(body, uid, mw, transitions(mw.status, status, actions), status, steps, pods)
    return result, _status_patch(raw_status, status), delay


def _reconcile(mw: ModelWeights, namespace: str, name: str, uid: str, steps: list[Step],
               done: list[StartStep | RetryStep | PatchWorkload | RemoveArtifact],
               workload_indexes: dict[str, Any] | None = None, pod_index: Any = None,
               wiring_index: Any = None, node_labels: dict[str, dict[str, str]] | None = None,
               nodes: dict[str, NodeFacts] | None = None) -> tuple[ModelWeightsStatus, float | None]:
    """Observe, plan, act; the status the planner computed and when to look
    again. `done` collects the actions taken (for Events), also when a later one fails."""
    assert EXECUTOR is not None
    observed, recorded = _observe(mw, namespace, name, steps, workload_indexes, pod_index, wiring_index,
                                  node_labels, nodes)
    result = plan(mw, observed, RETRIES, KEEP_PREVIOUS, LOADER)
    _observe_starts(observed.pods, result.status)
    # Held with nothing to do: each such reconcile in a row doubles the poll (an action starts it afresh).
    _held[(namespace, name)] = _held.get((namespace, name), 0) + 1 if result.held and not result.actions else 0
    digest = result.status.cache.digest if result.status.cache else ""
    WAKEUPS.reads_labels((namespace, name), frozenset({cache_label(digest), cache_evicted_label(digest)})
                         if digest else frozenset())
    for step in steps:
        if observed.steps[step.id].phase == StepPhase.SUCCEEDED:
            metrics.step_succeeded(step.id, step.name, _format(mw))
    if recorded is None and result.status.artifact is not None and result.status.artifact.spec_digest:
        # Recorded from now on: the executor may let the steps' Jobs expire.
        finished = getattr(EXECUTOR, "finished", None)
        if finished is not None:
            finished(mw, steps)
    problem = POLICIES.problem() if POLICIES is not None and result.actions else None
    if problem:
        raise PoliciesNotEnforced(problem)  # fail closed: no Job, no patch, no binding
    going = bool((mw.metadata.model_extra or {}).get("deletionTimestamp"))
    for action in result.actions:
        if _act(mw, namespace, name, uid, action, going):
            done.append(action)
    return result.status, result.requeue_after


def _observe(mw: ModelWeights, namespace: str, name: str, steps: list[Step], workload_indexes: dict[str, Any] | None,
             pod_index: Any, wiring_index: Any, node_labels: dict[str, dict[str, str]] | None,
             nodes: dict[str, NodeFacts] | None) -> tuple[Observed, Artifact | None]:
    """What the planner sees of the object's world, and the artifact its status had recorded (None: not
    yet, so its steps are observed)."""
    assert EXECUTOR is not None
    targets = mw.spec.serving.workloads() if mw.spec.serving else []
    # The executor's own record of the last step's validated result: the only source of the artifact's
    # size and MoE facts (a status write could forge them; they size fills and shape serving patches).
    verified = EXECUTOR.artifact(mw, steps[-1]) if steps else None
    recorded = recorded_artifact(mw, steps, EXECUTOR.artifact_uri(mw, steps[-1]) if steps else None, verified)
    if recorded is not None:
        # The status says which artifact is done once it records it: the steps are
        # not observed again (their Jobs may have expired).
        step_states = {s.id: StepState(StepPhase.SUCCEEDED) for s in steps}
    else:
        step_states = {s.id: EXECUTOR.observe(mw, s) for s in steps}
    workloads = {t.key: workload_api.read(APPS, CUSTOM, namespace, t, (workload_indexes or {}).get(t.kind))
                 for t in targets}
    return Observed(
        steps=step_states,
        artifact=recorded or verified,
        workloads=workloads,
        requested_at=(mw.metadata.model_extra or {}).get("annotations", {}).get(REQUESTED_AT),
        pods=list(pod_index.get((namespace, name), [])) if pod_index is not None else [],
        owners=workload_owners(mw, workloads, wiring_index),
        fills=EXECUTOR.fills(mw) if hasattr(EXECUTOR, "fills") else None,
        warm_ups=EXECUTOR.warm_ups(mw) if hasattr(EXECUTOR, "warm_ups") else None,
        prewarm_nodes=prewarm_nodes(mw, nodes or {}),
        cache_nodes=dict(node_labels or {}),
        nodes=dict(nodes or {}),
        node_agent=NODE_AGENT,
        prewarm_labels=PREWARM_LABELS,
    ), recorded


def _act(mw: ModelWeights, namespace: str, name: str, uid: str, action: Any, going: bool) -> bool:
    """Carry out one of the planner's actions; False if it was not (`going`: the object is being deleted:
    no pod, no patch)."""
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
    elif isinstance(action, FillNode):
        log.info("%s/%s: filling the node cache on %s (round %d)", namespace, name, action.node, action.round)
        EXECUTOR.fill(mw, uid, action.node, action.artifact, action.round, action.placement)
    elif isinstance(action, RemoveFill):
        EXECUTOR.remove_fill(mw, action.node, action.digest, action.round)
    elif isinstance(action, WarmUp):
        if going:
            return False  # no pod for an object that is going
        log.info("%s/%s: warming up %s's compiled state (key %s)", namespace, name, action.name, action.key)
        if action.reporter_service_account:  # the Job's loader reports as the replicas' will
            ensure_reporter(namespace, action.reporter_service_account)
        EXECUTOR.warm_up(mw, uid, action.name, action.patch, action.key, action.resource_version)
    elif isinstance(action, RemoveWarmUp):
        log.info("%s/%s: removing warm-up Job %s (its key is no longer wanted)", namespace, name, action.job)
        EXECUTOR.remove_warm_up(mw, action.job)
    elif isinstance(action, PatchWorkload):
        if going:
            return False  # going: the delete handler puts strategies back; nothing is wired any more
        log.info("%s/%s: wiring %s %s", namespace, name, action.kind.lower(), action.name)
        for account in {action.reporter_service_account, action.leader_service_account} - {None}:
            ensure_reporter(namespace, account)
        workload_api.patch(APPS, CUSTOM, namespace, action)
    return True


def prewarm_nodes(mw: ModelWeights, nodes: dict[str, NodeFacts]) -> list[str]:
    """The nodes serving.nodeCache.prewarm.nodeSelector selects, from the node index (no API call)."""
    cache = mw.spec.serving.node_cache if mw.spec.serving else None
    if cache is None or not cache.enabled or cache.prewarm is None:
        return []
    return selected(nodes, cache.prewarm.node_selector)


class PoliciesNotEnforced(Exception):
    """Ferry's admission policies are missing or not enforced: the operator does nothing."""


def workload_owners(mw: ModelWeights, workloads: dict[str, WorkloadFacts | None],
                    wiring_index: Any) -> dict[str, str]:
    """Who owns each workload this ModelWeights names, by key (itself included: the index may lag its own
    creation)."""
    me = Wirer((mw.metadata.model_extra or {}).get("creationTimestamp") or "", mw.metadata.name or "")
    owners = {}
    for name, facts in workloads.items():
        if facts is None:
            continue
        listed = list(wiring_index.get((mw.metadata.namespace, name), [])) if wiring_index is not None else []
        owner = owner_of(facts.template_annotations.get(OWNER_ANNOTATION), [me, *listed])
        if owner is not None:
            owners[name] = owner
    return owners


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


# No finalizer of its own (optional=True): the reconciler's finalizer already routes
# deletion through the operator. On a cluster, deletionPolicy Delete is carried
# out by garbage collection of the claim's owner reference; the local executor
# removes its directory here.
@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
def delete(body: kopf.Body, uid: str, **_: Any) -> None:
    assert EXECUTOR is not None
    metrics.phase(uid, None)
    restore_strategies(body)
    remove = getattr(EXECUTOR, "delete", None)
    if body.get("spec", {}).get("deletionPolicy") == "Delete" and remove is not None:
        problem = POLICIES.problem() if POLICIES is not None else None
        if problem:  # fail closed: no delete Job either; kopf retries, the object waits
            raise kopf.TemporaryError(problem, delay=30)
        log.info("%s/%s: deletionPolicy Delete: removing prepared data", body["metadata"]["namespace"],
                 body["metadata"]["name"])
        remove(parse(dict(body)))


def restore_strategies(body: Mapping[str, Any]) -> None:
    """A ModelWeights that goes mid-rollout gives its Deployments their own strategy back (serving.rollout);
    an API error is logged, never blocks the deletion."""
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    with _acting[(namespace, name)]:
        _restore_named(body, namespace, name)
    _acting.pop((namespace, name), None)


def _restore_named(body: Mapping[str, Any], namespace: str, name: str) -> None:
    for deployment in _deployments_named(body.get("spec") or {}):
        target = ServingTarget(name=deployment)
        try:
            current = workload_api.read(APPS, CUSTOM, namespace, target)
            if current is None or current.saved_strategy is None \
                    or current.template_annotations.get(OWNER_ANNOTATION) != name:
                continue
            back = put_back(target.name, current.strategy, current.saved_strategy)
            workload_api.patch(APPS, CUSTOM, namespace, PatchWorkload(target.name, None, rollout=back))
            kopf.event(dict(body), type=NORMAL, reason=back.change.value, message=back.message[:1024])
        except Exception as exc:  # noqa: BLE001 - never blocks the deletion; the annotation keeps the strategy
            log.warning("%s/%s: could not put back the strategy of deployment %s: %s", namespace, name,
                        target.name, getattr(exc, "reason", None) or exc)


def _deployments_named(spec: Mapping[str, Any]) -> list[str]:
    """The Deployments a ModelWeights' spec names, read leniently (a spec that no longer parses still names
    them): serving.deployments[].name and serving.targets[] of kind Deployment, at most MAX_WORKLOADS."""
    serving = spec.get("serving") if isinstance(spec.get("serving"), Mapping) else {}
    names = [d.get("name") for d in serving.get("deployments") or [] if isinstance(d, Mapping)]
    names += [t.get("name") for t in serving.get("targets") or [] if isinstance(t, Mapping)
              and t.get("kind", WorkloadKind.DEPLOYMENT.value) == WorkloadKind.DEPLOYMENT.value]
    return [n for n in dict.fromkeys(names) if isinstance(n, str) and n][:MAX_WORKLOADS]


def _observe_starts(pods: list[PodFacts], status: ModelWeightsStatus) -> None:
    """ferry_serving_pod_start_seconds for each Ready wired pod, once, by its loader's compiled-state outcome."""
    using = status.compiled_state is not None and bool(status.compiled_state.key)
    for p in pods:
        if p.ready and p.ready_seconds is not None:
            outcome = pod_outcome(p.message) if using else None
            metrics.pod_started(p.uid, p.ready_seconds, outcome[0] if outcome else "off")
