"""The kinds of serving workload Ferry wires, and what it reads of each. Pure.

| kind | pod template(s) | a group | the pod's index in its group |
|---|---|---|---|
| Deployment | spec.template | one pod | - |
| StatefulSet | spec.template | all its replicas (groupSize > 1), or one pod | label apps.kubernetes.io/pod-index |
| LeaderWorkerSet | spec.leaderWorkerTemplate.leaderTemplate (optional) and .workerTemplate | leaderWorkerTemplate.size pods | label leaderworkerset.sigs.k8s.io/worker-index (leader: 0) |

Deployments and StatefulSets take a strategic-merge patch of their template;
a LeaderWorkerSet is a custom resource (no strategic merge), so the handlers
apply the same patch to its templates locally (strategic.py) and send the
result as a merge patch guarded by its resourceVersion.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..api.types import ServingTarget, WorkloadKind
from .loader import health_endpoint
from .wiring import Group, ServingError, WorkloadFacts, deployment_facts, template_facts

STATEFULSET_INDEX_LABEL = "apps.kubernetes.io/pod-index"
LWS_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
# LWS's pod webhook sets this in every container of a group's pods: the leader pod's DNS name.
LWS_LEADER_ADDRESS = "$(LWS_LEADER_ADDRESS)"


@dataclass(frozen=True)
class Api:
    group: str
    version: str
    plural: str


APIS = {
    WorkloadKind.DEPLOYMENT.value: Api("apps", "v1", "deployments"),
    WorkloadKind.STATEFUL_SET.value: Api("apps", "v1", "statefulsets"),
    WorkloadKind.LEADER_WORKER_SET.value: Api("leaderworkerset.x-k8s.io", "v1", "leaderworkersets"),
}


def statefulset_facts(body: Mapping[str, Any]) -> WorkloadFacts:
    """A StatefulSet: rolled out once the controller saw this generation and every replica is on the update
    revision and ready. Its group (when its target has groupSize > 1) is all its replicas."""
    meta, spec, status = body.get("metadata") or {}, body.get("spec") or {}, body.get("status") or {}
    want = spec.get("replicas", 1) if spec.get("replicas") is not None else 1
    rolled_out = (
        (status.get("observedGeneration") or 0) >= (meta.get("generation") or 0)
        and (status.get("updatedReplicas") or 0) == want
        and (status.get("replicas") or 0) == want
        and (status.get("readyReplicas") or 0) == want
        and status.get("currentRevision") == status.get("updateRevision")
    )
    return template_facts(meta.get("name", ""), spec.get("template") or {}, kind=WorkloadKind.STATEFUL_SET.value,
                          rolled_out=rolled_out, replicas=want, group_size=want, groups=1,
                          service_name=spec.get("serviceName") or "")


def leaderworkerset_facts(body: Mapping[str, Any]) -> WorkloadFacts:
    """A LeaderWorkerSet: its worker template's wiring, the leader template's in `leader`. Rolled out once
    every group is updated and ready and no update is in progress (LWS keeps no observedGeneration)."""
    meta, spec, status = body.get("metadata") or {}, body.get("spec") or {}, body.get("status") or {}
    lwt = spec.get("leaderWorkerTemplate") or {}
    groups = spec.get("replicas", 1) if spec.get("replicas") is not None else 1
    size = lwt.get("size", 1) if lwt.get("size") is not None else 1
    updating = any(c.get("type") == "UpdateInProgress" and c.get("status") == "True"
                   for c in status.get("conditions") or [])
    rolled_out = (not updating and (status.get("updatedReplicas") or 0) == groups
                  and (status.get("readyReplicas") or 0) == groups and (status.get("replicas") or 0) == groups)
    name = meta.get("name", "")
    workload = {"kind": WorkloadKind.LEADER_WORKER_SET.value, "rolled_out": rolled_out, "replicas": groups * size,
                "group_size": size, "groups": groups, "resource_version": meta.get("resourceVersion", "")}
    leader = lwt.get("leaderTemplate")
    return template_facts(name, lwt.get("workerTemplate") or {}, **workload,
                          leader=template_facts(name, leader, **workload) if leader else None)


READERS = {
    WorkloadKind.DEPLOYMENT.value: deployment_facts,
    WorkloadKind.STATEFUL_SET.value: statefulset_facts,
    WorkloadKind.LEADER_WORKER_SET.value: leaderworkerset_facts,
}


def workload_facts(kind: str, body: Mapping[str, Any]) -> WorkloadFacts:
    return READERS[kind](body)


def groups_of(target: ServingTarget, facts: WorkloadFacts) -> tuple[Group | None, Group | None]:
    """(the group wiring of the workload's template, of an LWS's leader template) for a target whose pods
    form groups (groupSize > 1); (None, None) otherwise. ServingError when the workload cannot be wired so."""
    size = target.pods_per_group
    if size == 1:
        return None, None
    if facts.group_size != size:
        what = "leaderWorkerTemplate.size" if facts.kind == WorkloadKind.LEADER_WORKER_SET.value else "replicas"
        raise GroupSizeMismatch(f"{target.describe()} runs groups of {facts.group_size} pods ({what}) and "
                                f"serving.targets says groupSize {size}: make them equal")
    if facts.kind == WorkloadKind.STATEFUL_SET.value:
        if not facts.service_name:
            raise ServingError(f"{target.describe()} has no serviceName: its pods need stable DNS names for "
                               f"vLLM's --master-addr (pod 0 of the group); set spec.serviceName to a headless "
                               f"Service")
        master = f"{facts.name}-0.{facts.service_name}"
        port, scheme = _health(facts, target.container)
        return Group(size, STATEFULSET_INDEX_LABEL, master, leader_port=port, leader_scheme=scheme), None
    if facts.leader is None:
        raise ServingError(f"{target.describe()} has no leaderTemplate: in vLLM's multi-node launch the leader "
                           f"runs the API server and the workers run --headless; give it a leaderTemplate")
    port, scheme = _health(facts.leader, target.container)
    return (Group(size, LWS_INDEX_LABEL, LWS_LEADER_ADDRESS, headless=True, leader_port=port, leader_scheme=scheme),
            Group(size, LWS_INDEX_LABEL, LWS_LEADER_ADDRESS, probe=True, leader_port=port, leader_scheme=scheme))


def _health(facts: WorkloadFacts, container: str | None) -> tuple[int, str]:
    """The port and scheme the template's vLLM serves /health on."""
    return health_endpoint(facts.served(container)[1])


class GroupSizeMismatch(ServingError):
    reason = "GroupSizeMismatch"
