"""Wake-ups: the watch events of what a ModelWeights depends on. On the event loop (async), cheap, and
never an API call: each wakes the reconcilers it concerns (wakeups.py)."""
from __future__ import annotations

from typing import Any

import kopf

from ..api.types import GROUP, PLURAL, VERSION, WorkloadKind, target_key
from ..serving.wiring import CACHE_AGENT_LABEL, OWNER_ANNOTATION
from ..wakeups import Wakeups
from .indexes import LWS, _cache_labels

REQUESTED_AT = "ferry.dev/requested-at"
WAKEUPS = Wakeups()
_node_labels_seen: dict[str, dict[str, str]] = {}  # node -> its cache labels at the last event (on the loop)


@kopf.on.event("", "v1", "nodes", labels={CACHE_AGENT_LABEL: kopf.PRESENT})
async def cache_node_changed(name: str, labels: Any, type: str | None, **_: Any) -> None:
    now = {} if type == "DELETED" else _cache_labels(labels)
    before = _node_labels_seen.pop(name, {})
    if now:
        _node_labels_seen[name] = now
    WAKEUPS.wake_label_readers({k for k in before.keys() | now.keys() if before.get(k) != now.get(k)})


@kopf.on.event(GROUP, VERSION, PLURAL)
async def modelweights_changed(body: kopf.Body, namespace: str, name: str, **_: Any) -> None:
    if WAKEUPS.inputs_changed((namespace, name), _inputs(body)):  # not its own status write
        WAKEUPS.wake((namespace, name))


@kopf.on.event("batch", "v1", "jobs", labels={"ferry.dev/modelweights": kopf.PRESENT})
async def prepare_job_changed(namespace: str, labels: Any, **_: Any) -> None:
    WAKEUPS.wake((namespace, labels["ferry.dev/modelweights"]))


@kopf.on.event("", "v1", "pods", labels={"ferry.dev/modelweights": kopf.PRESENT, "job-name": kopf.PRESENT})
async def prepare_pod_changed(namespace: str, labels: Any, **_: Any) -> None:
    WAKEUPS.wake((namespace, labels["ferry.dev/modelweights"]))


@kopf.on.event("", "v1", "pods", annotations={OWNER_ANNOTATION: kopf.PRESENT})
async def serving_pod_changed(namespace: str, annotations: Any, **_: Any) -> None:
    WAKEUPS.wake((namespace, annotations[OWNER_ANNOTATION]))


@kopf.on.event("apps", "v1", "deployments")
async def deployment_changed(namespace: str, name: str, **_: Any) -> None:
    WAKEUPS.wake_wirers((namespace, name))


@kopf.on.event("apps", "v1", "statefulsets")
async def statefulset_changed(namespace: str, name: str, **_: Any) -> None:
    WAKEUPS.wake_wirers((namespace, target_key(WorkloadKind.STATEFUL_SET.value, name)))


@kopf.on.event(LWS.group, LWS.version, LWS.plural)
async def leaderworkerset_changed(namespace: str, name: str, **_: Any) -> None:
    WAKEUPS.wake_wirers((namespace, target_key(WorkloadKind.LEADER_WORKER_SET.value, name)))


def _inputs(body: Any) -> tuple[Any, ...]:
    """What of the ModelWeights itself the planner acts on; a change to
    anything else (the status it or a worker wrote) needs no reconcile."""
    meta = body.get("metadata") or {}
    return meta.get("generation"), (meta.get("annotations") or {}).get(REQUESTED_AT), meta.get("deletionTimestamp")
