"""What the serving pods' loaders reported, summed up for the ModelWeights. Pure.

A serving pod carries the artifact digest its template was wired for (the
`ferry.dev/artifact-digest` annotation) and, once its init container ran, the
condition `ferry.dev/weights-loaded`. Only pods of the current digest count:
an old ReplicaSet's pods loaded an older artifact. Load seconds are the init
container's run as the kubelet recorded it (started to finished), not a
number the pod reports about itself.
"""
from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .wiring import DIGEST_ANNOTATION, OWNER_ANNOTATION
from .diagnosis import PodTrouble, pod_trouble, workload_of
from .loader import GATE, LOADER_CONTAINER


@dataclass(frozen=True)
class PodFacts:
    name: str
    owner: str  # the ModelWeights whose artifact the template was wired for
    digest: str
    gate: str | None  # the condition's status: True, False, Unknown; None: not set yet
    reason: str = ""
    message: str = ""
    load_seconds: float | None = None
    terminating: bool = False
    loader_waiting: str = ""  # the init container's waiting reason (CrashLoopBackOff, ImagePullBackOff)
    workload: str = ""  # the workload that made it, as ServingTarget.key files it
    trouble: PodTrouble | None = None  # what keeps it from serving (serving_diagnosis.py)
    node: str = ""  # where it was scheduled ("" while it is not)
    awaiting_volumes: bool = False  # scheduled, and no container started: the kubelet is still mounting
    created: datetime | None = None
    uid: str = ""
    group: str = ""  # the serving group it belongs to (group_of); a Deployment's pod is a group of its own
    ready_seconds: float | None = None  # created -> Ready, once Ready
    ready: bool = False  # its Ready condition is True
    # (container, imageID): the image bytes the kubelet runs each started container from (its digest)
    image_ids: tuple[tuple[str, str], ...] = ()
    images: tuple[tuple[str, str], ...] = ()  # (container, image) as its spec names it


LWS_GROUP_LABEL = "leaderworkerset.sigs.k8s.io/group-index"


def group_of(body: Mapping[str, Any], workload: str) -> str:
    """The serving group a pod belongs to: an LWS group (its group-index label), a StatefulSet (all its pods:
    a group when its target's groupSize > 1), else the pod itself."""
    meta = body.get("metadata") or {}
    index = (meta.get("labels") or {}).get(LWS_GROUP_LABEL)
    if index is not None:
        return f"{workload}#{index}"
    return workload if workload.startswith("statefulset/") else meta.get("name", "")


def _time(text: str | None) -> datetime | None:
    return datetime.fromisoformat(text.replace("Z", "+00:00")) if text else None


def pod_facts(body: Mapping[str, Any]) -> PodFacts:
    meta, status = body.get("metadata") or {}, body.get("status") or {}
    annotations = meta.get("annotations") or {}
    gate = next((c for c in status.get("conditions") or [] if c.get("type") == GATE), None)
    seconds, waiting = None, ""
    for s in status.get("initContainerStatuses") or []:
        if s.get("name") != LOADER_CONTAINER:
            continue
        state = s.get("state") or {}
        done = state.get("terminated") or {}
        start, end = _time(done.get("startedAt")), _time(done.get("finishedAt"))
        if done.get("exitCode") == 0 and start and end:
            seconds = max(0.0, (end - start).total_seconds())
        waiting = (state.get("waiting") or {}).get("reason", "")
    return PodFacts(
        name=meta.get("name", ""), uid=meta.get("uid", ""), owner=annotations.get(OWNER_ANNOTATION, ""),
        digest=annotations.get(DIGEST_ANNOTATION, ""),
        gate=gate.get("status") if gate else None, reason=(gate or {}).get("reason", ""),
        message=(gate or {}).get("message", ""), load_seconds=seconds,
        terminating=bool(meta.get("deletionTimestamp")), loader_waiting=waiting,
        workload=workload_of(body), trouble=pod_trouble(body),
        node=(body.get("spec") or {}).get("nodeName") or "", awaiting_volumes=_awaiting_volumes(status),
        created=_time(meta.get("creationTimestamp")), group=group_of(body, workload_of(body)),
        ready=any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []),
        ready_seconds=_ready_seconds(meta, status),
        image_ids=tuple((str(c.get("name", "")), str(c.get("imageID") or "")[:512])
                        for c in (status.get("containerStatuses") or [])[:64] if c.get("imageID")),
        images=tuple((str(c.get("name", "")), str(c.get("image") or "")[:512])
                     for c in ((body.get("spec") or {}).get("containers") or [])[:64]),
    )


def _ready_seconds(meta: Mapping[str, Any], status: Mapping[str, Any]) -> float | None:
    """Created -> Ready, for a Ready pod (the kubelet's Ready condition)."""
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    if ready is None or ready.get("status") != "True":
        return None
    try:
        created, at = _time(meta.get("creationTimestamp")), _time(ready.get("lastTransitionTime"))
    except ValueError:
        return None
    return (at - created).total_seconds() if created and at else None


def _awaiting_volumes(status: Mapping[str, Any]) -> bool:
    """No container (init containers included) has started, and none waits for anything but its volumes
    (ContainerCreating; PodInitializing in a pod with init containers, Ferry's loader among them): what a
    pod whose node cache mount is refused looks like."""
    states = [s.get("state") or {} for s in [*(status.get("initContainerStatuses") or []),
                                             *(status.get("containerStatuses") or [])]]
    if any(st.get("running") or st.get("terminated") for st in states):
        return False
    return all((st.get("waiting") or {}).get("reason", "ContainerCreating") in VOLUME_WAITS for st in states)


VOLUME_WAITS = ("ContainerCreating", "PodInitializing")


@dataclass(frozen=True)
class LoadSummary:
    replicas: int
    loaded: int
    p50_seconds: float | None
    failing: PodFacts | None  # the first pod (by name) whose loader reported a failure
    groups: tuple[int, int] | None = None  # (groups whose every pod loaded, groups), with multi-pod groups

    @property
    def complete(self) -> bool:
        return self.loaded >= self.replicas

    @property
    def text(self) -> str:
        return f"{self.loaded}/{self.replicas}"

    def describe(self) -> str:
        """`3/4 replicas loaded`, or with multi-pod groups `3/4 pods loaded, 1/2 groups`."""
        if self.groups is None:
            return f"{self.text} replicas loaded"
        return f"{self.text} pods loaded, {self.groups[0]}/{self.groups[1]} groups"


def summarize(pods: list[PodFacts], digest: str, replicas: int,
              group_sizes: Mapping[str, tuple[int, int]] | None = None) -> LoadSummary:
    """`group_sizes`: for workloads whose pods form groups, workload key -> (pods per group, groups)."""
    current = sorted((p for p in pods if p.digest == digest and not p.terminating), key=lambda p: p.name)
    loaded = [p for p in current if p.gate == "True"]
    seconds = [p.load_seconds for p in loaded if p.load_seconds is not None]
    failing = next((p for p in current if p.gate == "False" and p.reason not in ("", "Loading")), None)
    groups = None
    if group_sizes:
        per_group: dict[str, int] = {}
        for p in loaded:
            if p.workload in group_sizes:
                per_group[p.group] = per_group.get(p.group, 0) + 1
        full = sum(1 for g, n in per_group.items() if n >= group_sizes[g.split("#")[0]][0])
        groups = (full, sum(total for _, total in group_sizes.values()))
    return LoadSummary(replicas=replicas, loaded=len(loaded),
                       p50_seconds=round(statistics.median(seconds), 2) if seconds else None, failing=failing,
                       groups=groups)
