"""Which core Events a reconcile posts on its ModelWeights. Pure.

An Event marks a transition (`kubectl describe mw` tells the story): a step
started, a step or the artifact finished, a Deployment was patched, the object
stalled or became Ready. Derived from the status before and after a reconcile
and from the actions taken, so a steady state posts nothing. They go on the
ModelWeights, except one for each serving pod whose node cache entry was
found corrupt under it, which goes on that pod.
"""
from __future__ import annotations

from dataclasses import dataclass

from .api.types import ConditionType, ModelWeightsStatus
from .conditions import get_condition
from .planner import PatchWorkload, RemoveArtifact, RetryStep, StartStep
from .serving.diagnosis import WAITING_REASONS

NORMAL, WARNING = "Normal", "Warning"


@dataclass(frozen=True)
class Event:
    type: str
    reason: str
    message: str
    pod: str | None = None  # posted on this serving pod (of the ModelWeights' namespace) instead


def _turned(before: ModelWeightsStatus | None, after: ModelWeightsStatus, kind: ConditionType, value: str) -> bool:
    new = get_condition(after.conditions, kind)
    if new is None or new.status != value:
        return False
    old = get_condition(before.conditions, kind) if before else None
    # A new reason or message while still True is a new story (another step failed).
    return old is None or old.status != value or (value == "True" and kind == ConditionType.STALLED
                                                   and (old.reason, old.message) != (new.reason, new.message))


def _serving_pod_waits(before: ModelWeightsStatus | None, after: ModelWeightsStatus) -> Event | None:
    """A serving pod that waits on something (a pull the kubelet retries, the
    scheduler): a Warning when that cause first shows (one that needs a human
    stalls, and is posted as Stalled)."""
    new = get_condition(after.conditions, ConditionType.RECONCILING)
    if new is None or new.status != "True" or new.reason not in WAITING_REASONS:
        return None
    old = get_condition(before.conditions, ConditionType.RECONCILING) if before else None
    if old is not None and old.status == "True" and old.reason == new.reason:
        return None
    return Event(WARNING, new.reason, new.message)


EVICTION_WORDS = {
    "lru": (NORMAL, "evicted as least recently used, to make room for another fill"),
    "corrupt": (WARNING, "removed as corrupt: a mount, the agent's scrub or an admin's check found a file that "
                         "does not match the manifest (the next pod there fills it again)"),
    "removed": (NORMAL, "removed by an admin (ferry cache evict)"),
    "unknown": (NORMAL, "gone, for no reason its node agent still remembers (removed by hand, or the agent's "
                        "record of it expired)"),
}


def _cache_evictions(before: ModelWeightsStatus | None, after: ModelWeightsStatus) -> list[Event]:
    """An Event for each node the artifact left since the last reconcile (status.cache.evictions)."""
    if after.cache is None:
        return []
    seen = before.cache.evictions if before and before.cache and before.cache.digest == after.cache.digest else []
    out = []
    for e in after.cache.evictions:
        if e in seen:
            continue
        kind, words = EVICTION_WORDS.get(e.reason, EVICTION_WORDS["unknown"])
        if e.pods:
            words += (f"; pods {', '.join(e.pods)} there still have it mounted: what they loaded was verified, "
                      f"but a restarted container would read the damaged files: delete them (kubectl delete pod "
                      f"{' '.join(e.pods)}) to mount a refilled entry")
        left = after.cache.warm_nodes
        still = f"{left} node still holds it" if left == 1 else f"{left} nodes still hold it"
        out.append(Event(kind, "NodeCacheEvicted", f"the node cache on {e.node} no longer holds the artifact: "
                                                   f"{words}; {still}"))
        out += [Event(WARNING, "NodeCacheCorrupt", f"the node cache entry this pod has mounted on {e.node} is "
                                                   f"corrupt (found by its node agent): what it loaded was "
                                                   f"verified, but a restarted container would read the damaged "
                                                   f"files: delete the pod to mount a refilled entry", pod=pod)
                for pod in e.pods]
    return out


def transitions(before: ModelWeightsStatus | None, after: ModelWeightsStatus,
                actions: list[StartStep | RetryStep | PatchWorkload | RemoveArtifact]) -> list[Event]:
    events = []
    if _turned(before, after, ConditionType.DOWNLOADED, "True"):
        events.append(Event(NORMAL, "StepSucceeded", "step fetch succeeded: weights fetched and verified"))
    for action in actions:
        if isinstance(action, StartStep):
            events.append(Event(NORMAL, "StepStarted", f"step {action.step.name} started ({action.step.id})"))
        elif isinstance(action, RetryStep):
            error = after.retry.last_error if after.retry else ""
            events.append(Event(WARNING, "StepRetrying", f"retry {action.attempt} of step {action.step.name}: {error}"))
        elif isinstance(action, RemoveArtifact):
            events.append(Event(NORMAL, "ArtifactRemoved",
                                f"superseded artifact {action.artifact.uri} removed (deletionPolicy)"))
        elif isinstance(action, PatchWorkload):
            if action.patch is not None:
                events.append(Event(NORMAL, "DeploymentPatched", f"deployment {action.name} wired to the artifact"))
            if action.rollout is not None:
                events.append(Event(NORMAL, action.rollout.change.value, action.rollout.message))
    if _turned(before, after, ConditionType.PREPARED, "True"):
        prepared = get_condition(after.conditions, ConditionType.PREPARED)
        events.append(Event(NORMAL, "ArtifactReady", prepared.message if prepared else "artifact ready"))
    if _turned(before, after, ConditionType.STALLED, "True"):
        stalled = get_condition(after.conditions, ConditionType.STALLED)
        events.append(Event(WARNING, stalled.reason, stalled.message))
    events += _cache_evictions(before, after)
    trouble = _serving_pod_waits(before, after)
    if trouble is not None:
        events.append(trouble)
    if _turned(before, after, ConditionType.READY, "True"):
        ready = get_condition(after.conditions, ConditionType.READY)
        events.append(Event(NORMAL, "Ready", ready.message))
    return events
