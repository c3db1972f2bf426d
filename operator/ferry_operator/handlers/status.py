"""What a reconcile pass reports: the status merge patch (only the fields the operator owns), and the
Events and metrics of its transitions."""
from __future__ import annotations

from typing import Any

import kopf

from .. import metrics
from ..api.types import ModelWeights, ModelWeightsStatus
from ..events import WARNING, Event
from ..steps import Step


def _status_patch(before: dict[str, Any], after: ModelWeightsStatus) -> dict[str, Any]:
    """The status fields the operator owns, as a merge patch; empty if nothing changed."""
    new = after.model_dump(by_alias=True, mode="json", exclude_none=True)
    patch: dict[str, Any] = {}
    for key in ("observedGeneration", "phase", "conditions", "progress", "artifact", "previousArtifacts", "retry",
                "lastHandledRequestedAt", "loaded", "cache", "compiledState"):
        if key in new and new[key] != before.get(key):
            old = before.get(key)
            # A merge patch merges maps: a field the operator no longer sets (e.g. forged `experts`) is nulled.
            gone = {k: None for k in old if k not in new[key]} if isinstance(old, dict) and isinstance(new[key], dict) else {}
            patch[key] = {**gone, **new[key]} if gone else new[key]
    for key in ("progress", "retry", "loaded", "cache", "compiledState"):  # cleared: null removes it (merge patch)
        if key in before and key not in new:
            patch[key] = None
    return patch


def _newer(live: dict[str, Any], patched: dict[str, Any] | None) -> dict[str, Any]:
    """The fresher of the watched body and the one the last status patch
    returned: the watch may not have delivered the operator's own write yet,
    and planning from the older status could act twice."""
    if patched is None:
        return live
    try:
        newer = int(patched["metadata"]["resourceVersion"]) > int(live["metadata"]["resourceVersion"])
    except (KeyError, TypeError, ValueError):
        return live
    return patched if newer else live


def _report(body: dict[str, Any], uid: str, mw: ModelWeights | None, events: list[Event], status: ModelWeightsStatus,
            steps: list[Step] = (), pod_uids: dict[str, str] | None = None) -> None:
    """Core Events on the ModelWeights, or on one of its serving pods (kopf posts them in the background),
    and metrics."""
    for e in events:
        target = body if e.pod is None else {"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": e.pod, "namespace": body["metadata"]["namespace"], "uid": (pod_uids or {}).get(e.pod)}}
        kopf.event(target, type=e.type, reason=e.reason, message=e.message[:1024])
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
