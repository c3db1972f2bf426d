"""How the rollouts Ferry triggers replace a Deployment's pods (serving.rollout). Pure.

A Deployment that surges (RollingUpdate with maxSurge > 0, the default 25%)
needs room for one more pod than it runs. On a full GPU pool, or a node with
room for one vLLM pod, that surge pod stays Pending and the rollout never ends.
With `serving.rollout.strategy: InPlace` Ferry sends, in the same patch as the
template change that starts its rollout, `maxSurge: 0, maxUnavailable: 1`,
keeps the Deployment's own strategy in the annotation SAVED_STRATEGY, and puts
it back once the rollout completes (or when the ModelWeights goes).

The annotation lives on an object the user can write, so it is parsed as
untrusted: a value the API server would refuse as a strategy is dropped, never
sent. A strategy the user changed during the rollout is theirs: Ferry only
drops the annotation.
"""
from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ..api.types import RolloutStrategy, WorkloadKind
from .wiring import SAVED_STRATEGY, WorkloadFacts

IN_PLACE = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
MAX_SAVED_BYTES = 1024
DEFAULT_SURGE = "25%"  # the API server's default maxSurge and maxUnavailable
_PERCENT = re.compile(r"[0-9]{1,10}%")  # the API server's ^[0-9]+%$, bounded


class Change(str, Enum):
    """What a rollout patch does, each with the event it sends."""

    IN_PLACE = "RollingInPlace"  # the Deployment's strategy set to IN_PLACE, its own saved
    RESTORED = "RolloutStrategyRestored"  # the saved strategy put back
    KEPT = "RolloutStrategyKept"  # the strategy is the user's (changed during the rollout, or unreadable saved)


@dataclass(frozen=True)
class RolloutPatch:
    """A strategic-merge patch of the Deployment object (metadata and spec.strategy), and why."""

    change: Change
    patch: dict[str, Any]
    message: str


def _int_or_percent(value: Any) -> int | None:
    """maxSurge/maxUnavailable as the API server takes them: an int >= 0, or "N%"; the number (percent
    for a string, count for an int), or None if it is neither."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int) and 0 <= value < 2**31:
        return value
    if isinstance(value, str) and _PERCENT.fullmatch(value):
        return int(value[:-1])
    return None


def parse_strategy(value: Any) -> dict[str, Any] | None:
    """A Deployment strategy the API server would take, or None."""
    if not isinstance(value, dict) or not set(value) <= {"type", "rollingUpdate"}:
        return None
    kind = value.get("type", "RollingUpdate")
    rolling = value.get("rollingUpdate")
    if kind == "RollingUpdate" and rolling is None:
        rolling = {}
    if kind == "Recreate":
        return {"type": "Recreate"} if rolling is None else None
    if kind != "RollingUpdate" or not isinstance(rolling, dict) or not set(rolling) <= {"maxSurge", "maxUnavailable"}:
        return None
    surge, unavailable = rolling.get("maxSurge", DEFAULT_SURGE), rolling.get("maxUnavailable", DEFAULT_SURGE)
    n_surge, n_unavailable = _int_or_percent(surge), _int_or_percent(unavailable)
    if n_surge is None or n_unavailable is None or (n_surge == 0 and n_unavailable == 0):
        return None
    if isinstance(unavailable, str) and n_unavailable > 100:
        return None
    return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": surge, "maxUnavailable": unavailable}}


def parse_saved(raw: str | None) -> dict[str, Any] | None:
    """The strategy SAVED_STRATEGY holds, or None when it holds none the API server would take."""
    try:
        if raw is None or len(raw.encode()) > MAX_SAVED_BYTES:
            return None
        return parse_strategy(json.loads(raw))
    except (ValueError, RecursionError):  # UnicodeEncodeError (a lone surrogate) is a ValueError
        return None


def surges(strategy: dict[str, Any] | None) -> bool:
    """Whether a Deployment with this strategy makes a pod before removing an old one (False for anything
    that is not a strategy Ferry could put back: it is then never replaced)."""
    parsed = parse_strategy(strategy if strategy is not None else {})
    if parsed is None or parsed["type"] != "RollingUpdate":
        return False
    return _int_or_percent(parsed["rollingUpdate"]["maxSurge"]) > 0


def in_place(strategy: dict[str, Any] | None) -> bool:
    return parse_strategy(strategy) == IN_PLACE


def rollout_patch(policy: str, kind: str, name: str, strategy: dict[str, Any] | None, saved: str | None,
                  rolling: bool, rolled_out: bool, resource_version: str = "") -> RolloutPatch | None:
    """The patch of a Deployment's strategy. `rolling`: a rollout Ferry starts now (its template patch) or
    one under way with old pods left; `rolled_out`: it is complete. None: nothing to change."""
    if kind != WorkloadKind.DEPLOYMENT.value:
        return None
    if saved is not None:
        return put_back(name, strategy, saved, resource_version) if rolled_out and not rolling else None
    if policy != RolloutStrategy.IN_PLACE.value or not rolling or not surges(strategy):
        return None
    own = json.dumps(strategy or {}, sort_keys=True, separators=(",", ":"))
    patch = {"metadata": {"annotations": {SAVED_STRATEGY: own}}, "spec": {"strategy": IN_PLACE}}
    return RolloutPatch(Change.IN_PLACE, patch, f"deployment {name} rolls in place (maxSurge 0, maxUnavailable 1: "
                                                f"serving.rollout.strategy InPlace); its own strategy {own} is put "
                                                f"back when the rollout completes")


def put_back(name: str, strategy: dict[str, Any] | None, saved: str, resource_version: str = "") -> RolloutPatch:
    """The patch that ends a rollout in place. With `resource_version` (the Deployment as read) the API server
    refuses it (409) if the Deployment changed since, and the next reconcile decides again."""
    drop: dict[str, Any] = {"metadata": {"annotations": {SAVED_STRATEGY: None}}}
    if resource_version:
        drop["metadata"]["resourceVersion"] = resource_version
    own = parse_saved(saved)
    if own is None:
        return RolloutPatch(Change.KEPT, drop, f"deployment {name}: annotation {SAVED_STRATEGY} holds no strategy "
                                               f"the API server would take; the strategy is left as it is "
                                               f"({json.dumps(strategy)}) and the annotation removed")
    if not in_place(strategy):
        return RolloutPatch(Change.KEPT, drop, f"deployment {name}: its strategy was changed during the rollout; "
                                               f"Ferry keeps that change and removes {SAVED_STRATEGY}")
    rolling = own.get("rollingUpdate")
    put = {"type": own["type"], "rollingUpdate": rolling}  # None removes rollingUpdate for Recreate
    return RolloutPatch(Change.RESTORED, {**drop, "spec": {"strategy": put}},
                        f"deployment {name}: rollout complete, its own strategy {json.dumps(own)} is back")


def with_strategy(patch: dict[str, Any] | None, rollout: RolloutPatch | None) -> dict[str, Any]:
    """A template patch and a strategy patch as one strategic-merge patch of the Deployment."""
    out = copy.deepcopy(patch or {})
    if rollout is not None:
        out.setdefault("metadata", {}).update(rollout.patch["metadata"])
        if "spec" in rollout.patch:
            out.setdefault("spec", {}).update(rollout.patch["spec"])
    return out


# The scheduler's words for a node that lacks room a running pod could free (not a taint or a selector).
ROOM_WORDS = ("Insufficient ", "free ports", "anti-affinity")


def surge_hint(mw_name: str, current: WorkloadFacts, unschedulable: str) -> str:
    """What to add to an Unschedulable message when the pod waits on room its own Deployment's old pods hold
    (a surge pod on a full node or pool); "" when rolling in place would not help."""
    if (current.kind != WorkloadKind.DEPLOYMENT.value or not surges(current.strategy)
            or current.saved_strategy is not None or current.old_pods == 0 or current.available == 0
            or not any(w in unschedulable for w in ROOM_WORDS)):
        return ""
    return (f"; the rollout's new pod needs room that {current.old_pods} old pod(s) of deployment {current.name} "
            f"still hold (its strategy surges): set spec.serving.rollout.strategy: InPlace in ModelWeights "
            f"{mw_name} (each old pod then makes room before its replacement starts), or free capacity")
