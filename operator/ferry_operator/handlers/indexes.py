"""The kopf indexes a reconcile reads: workloads, serving pods, Ferry's Jobs and their pods, nodes, and who
wires which workload. Fed by watches on the event loop, so a reconcile costs the API server no read."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kopf

from ..api.types import GROUP, PLURAL, VERSION, WorkloadKind, target_key
from ..executors.cache_fill import FILL_STEP
from ..executors.warm_up import WARM_UP_STEP
from ..ownership import Wirer
from ..placement import NodeFacts, node_facts
from ..serving.weights_loaded import PodFacts, pod_facts
from ..serving.wiring import CACHE_AGENT_LABEL, CACHE_LABEL_PREFIX, OWNER_ANNOTATION, WorkloadFacts, deployment_facts
from ..serving.workloads import APIS, leaderworkerset_facts, statefulset_facts

LWS = APIS[WorkloadKind.LEADER_WORKER_SET.value]
# The kopf index that holds each workload kind's facts (the handlers below).
WORKLOAD_INDEXES = {WorkloadKind.DEPLOYMENT.value: "deployments", WorkloadKind.STATEFUL_SET.value: "statefulsets",
                    WorkloadKind.LEADER_WORKER_SET.value: "leaderworkersets"}


@kopf.index("apps", "v1", "deployments")
async def deployments(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[tuple[str, str], WorkloadFacts]:
    """Deployments in the watched namespaces, fed by a watch: reading one costs
    the API server nothing, so an idle Ready ModelWeights costs it nothing."""
    return {(namespace, name): deployment_facts(body)}


@kopf.index("apps", "v1", "statefulsets")
async def statefulsets(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[tuple[str, str], WorkloadFacts]:
    """StatefulSets in the watched namespaces, filed by ServingTarget.key."""
    return {(namespace, target_key(WorkloadKind.STATEFUL_SET.value, name)): statefulset_facts(body)}


@kopf.index(LWS.group, LWS.version, LWS.plural)
async def leaderworkersets(namespace: str, name: str, body: kopf.Body,
                           **_: Any) -> dict[tuple[str, str], WorkloadFacts]:
    """LeaderWorkerSets (kubernetes-sigs/lws; watched once its CRD exists), filed by ServingTarget.key."""
    return {(namespace, target_key(WorkloadKind.LEADER_WORKER_SET.value, name)): leaderworkerset_facts(body)}


def _wired_keys(spec: Any) -> list[str]:
    """The ServingTarget.key of every workload a ModelWeights' spec lists (from the raw body)."""
    serving = (spec or {}).get("serving") or {}
    keys = [d["name"] for d in serving.get("deployments") or [] if d.get("name")]
    return keys + [target_key(t.get("kind") or WorkloadKind.DEPLOYMENT.value, t["name"])
                   for t in serving.get("targets") or [] if t.get("name")]


@kopf.index(GROUP, VERSION, PLURAL)
async def wirings(namespace: str, name: str, spec: Any, meta: Any, **_: Any) -> dict[tuple[str, str], Wirer]:
    """Which ModelWeights list which workloads: who owns one that several name.
    One being deleted lists none: it lets go at once, not when its finalizer is gone."""
    if meta.get("deletionTimestamp"):
        return {}
    return {(namespace, key): Wirer(meta.get("creationTimestamp") or "", name) for key in _wired_keys(spec)}


@kopf.index("", "v1", "pods", annotations={OWNER_ANNOTATION: kopf.PRESENT})
async def serving_pods(namespace: str, body: kopf.Body, **_: Any) -> dict[tuple[str, str], PodFacts]:
    """Serving pods of wired Deployments (their template carries the owner
    annotation), by ModelWeights: what their loaders reported."""
    facts = pod_facts(body)
    return {(namespace, facts.owner): facts}


@kopf.index("batch", "v1", "jobs", labels={"ferry.dev/modelweights": kopf.PRESENT})
async def prepare_jobs(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
    """Ferry's Jobs (prepare steps, cleanup), fed by a watch."""
    return {(namespace, name): dict(body)}


@kopf.index("batch", "v1", "jobs", labels={"ferry.dev/modelweights": kopf.PRESENT, "ferry.dev/step": "cache-fill"})
async def fill_jobs(namespace: str, labels: Any, body: kopf.Body, **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
    """The node cache's fill Jobs, by ModelWeights."""
    return {(namespace, labels["ferry.dev/modelweights"]): dict(body)}


@kopf.index("batch", "v1", "jobs",
            labels={"ferry.dev/modelweights": kopf.PRESENT, "ferry.dev/step": "compiled-warm-up"})
async def warm_up_jobs(namespace: str, labels: Any, body: kopf.Body, **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
    """serving.compiledState BeforeRollout's warm-up Jobs, by ModelWeights."""
    return {(namespace, labels["ferry.dev/modelweights"]): dict(body)}


@kopf.index("", "v1", "pods", labels={"ferry.dev/modelweights": kopf.PRESENT, "job-name": kopf.PRESENT})
async def prepare_pods(namespace: str, body: kopf.Body, labels: Any, **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
    """The pods of Ferry's Jobs, by Job: their phases and termination messages."""
    return {(namespace, labels["job-name"]): dict(body)}


@kopf.index("", "v1", "nodes", labels={CACHE_AGENT_LABEL: kopf.PRESENT})
async def cache_nodes(name: str, labels: Any, **_: Any) -> dict[str, dict[str, str]]:
    """The nodes whose node cache agent keeps their cache labels, with those labels: which hold which
    artifact (status.cache), and why one left."""
    return {name: _cache_labels(labels)}


@kopf.index("", "v1", "nodes")
async def all_nodes(name: str, body: kopf.Body, **_: Any) -> dict[str, NodeFacts]:
    """Every Node's name, labels and taints, from the watch of nodes: which nodes a prewarm selects and
    which a wired pod may use (placement.py), with no LIST per reconcile."""
    return {name: node_facts(body)}


def _node_snapshot(index: Any, body: Mapping[str, Any]) -> dict[str, NodeFacts]:
    """name -> NodeFacts from the all_nodes index, for an object with serving.nodeCache on (on the event
    loop, which updates the index: the reconcile thread gets a snapshot)."""
    cache = ((body.get("spec") or {}).get("serving") or {}).get("nodeCache") or {}
    if index is None or not cache.get("enabled"):
        return {}
    return {name: facts for name, store in index.items() for facts in store}


def _cache_node_labels(index: Any) -> dict[str, dict[str, str]]:
    """node -> its cache labels, from the cache_nodes index (on the event loop, which updates it)."""
    return {node: dict(labels) for node, store in (index or {}).items() for labels in store}


def _cache_labels(labels: Any) -> dict[str, str]:
    return {k: v for k, v in (labels or {}).items() if k.startswith(CACHE_LABEL_PREFIX)}


class IndexView:
    """The kubernetes executor's view of Jobs and pods, from the indexes above."""

    def __init__(self, job_index: Any, pod_index: Any, fill_index: Any = None, warm_up_index: Any = None) -> None:
        self._jobs, self._pods = job_index, pod_index
        self._by_step = {FILL_STEP: fill_index, WARM_UP_STEP: warm_up_index}

    def job(self, namespace: str, name: str) -> dict[str, Any] | None:
        found = list(self._jobs.get((namespace, name), []))
        return found[-1] if found else None

    def pods(self, namespace: str, job_name: str) -> list[dict[str, Any]]:
        return list(self._pods.get((namespace, job_name), []))

    def step_jobs(self, namespace: str, mw_name: str, step: str) -> list[dict[str, Any]]:
        """One ModelWeights' Jobs of one kind (their ferry.dev/step label), from that kind's index."""
        index = self._by_step.get(step)
        return list(index.get((namespace, mw_name), [])) if index is not None else []
