"""Serving workloads through the API server, by kind: read one (from the operator's watch index when it
has one) and apply a PatchWorkload. Thin: what to read and write is workloads.py's and the planner's."""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from kubernetes.client.exceptions import ApiException

from . import strategic
from ..api.types import ServingTarget, WorkloadKind
from .wiring import WorkloadFacts
from .rollout import with_strategy
from .workloads import APIS, workload_facts

if TYPE_CHECKING:  # the planner imports serving; only its type is named here
    from ..planner import PatchWorkload

STRATEGIC = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"


def read(apps: Any, custom: Any, namespace: str, target: ServingTarget, index: Any = None) -> WorkloadFacts | None:
    """The target's facts; None if it does not exist. `index`: the kopf index of its kind, by (namespace, key)."""
    if index is not None:
        found = list(index.get((namespace, target.key), []))
        return found[-1] if found else None
    api = APIS[target.kind]
    try:
        if target.kind == WorkloadKind.DEPLOYMENT.value:
            raw = apps.read_namespaced_deployment(target.name, namespace, _preload_content=False)
        elif target.kind == WorkloadKind.STATEFUL_SET.value:
            raw = apps.read_namespaced_stateful_set(target.name, namespace, _preload_content=False)
        else:
            raw = custom.get_namespaced_custom_object(api.group, api.version, namespace, api.plural, target.name,
                                                      _preload_content=False)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return workload_facts(target.kind, json.loads(raw.data))


def patch(apps: Any, custom: Any, namespace: str, action: PatchWorkload) -> None:
    """Deployments and StatefulSets take the strategic-merge patch as it is. A LeaderWorkerSet is a custom
    resource (JSON merge and JSON patch only): its templates are merged here (strategic.py) and replaced in
    one JSON patch that first tests the resourceVersion the patch was planned from (and merged onto), so a
    change since fails it (422) and the next reconcile plans again instead of overwriting the change."""
    if action.kind == WorkloadKind.DEPLOYMENT.value:
        body = with_strategy(action.patch, action.rollout)  # one patch: the rollout starts with its strategy
        apps.patch_namespaced_deployment(action.name, namespace, body, _content_type=STRATEGIC)
        return
    if action.kind == WorkloadKind.STATEFUL_SET.value:
        apps.patch_namespaced_stateful_set(action.name, namespace, action.patch, _content_type=STRATEGIC)
        return
    api = APIS[action.kind]
    body = json.loads(custom.get_namespaced_custom_object(api.group, api.version, namespace, api.plural,
                                                          action.name, _preload_content=False).data)
    ops: list[dict[str, Any]] = [{"op": "test", "path": "/metadata/resourceVersion",
                                  "value": action.resource_version or body["metadata"]["resourceVersion"]}]
    lwt = body["spec"]["leaderWorkerTemplate"]
    for field, template_patch in (("workerTemplate", action.patch), ("leaderTemplate", action.leader_patch)):
        if template_patch is not None:
            merged = strategic.apply(lwt.get(field) or {}, template_patch["spec"]["template"])
            ops.append({"op": "replace", "path": f"/spec/leaderWorkerTemplate/{field}", "value": merged})
    custom.patch_namespaced_custom_object(api.group, api.version, namespace, api.plural, action.name, ops,
                                          _content_type=JSON_PATCH)
