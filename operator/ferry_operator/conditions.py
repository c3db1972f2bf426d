"""Status conditions with metav1.Condition semantics and kstatus summaries.

A condition's lastTransitionTime moves only when its status flips; every
condition carries the generation it was computed for. `Ready` is the summary;
`Reconciling` and `Stalled` follow kstatus so generic tooling (kubectl wait,
Flux, Argo CD) reads progress and failure the same way.
"""
from __future__ import annotations

from datetime import datetime, timezone

from .api.types import Condition, ConditionType, Phase


def now() -> datetime:
    return datetime.now(timezone.utc).replace(microsecond=0)


def set_condition(
    conditions: list[Condition], type_: ConditionType, status: bool | None, reason: str, message: str,
    generation: int, at: datetime | None = None,
) -> list[Condition]:
    """Return conditions with `type_` set; the transition time is kept unless the status changes."""
    value = {True: "True", False: "False", None: "Unknown"}[status]
    previous = next((c for c in conditions if c.type == type_.value), None)
    changed = previous is None or previous.status != value
    updated = Condition(
        type=type_.value,
        status=value,
        reason=reason,
        message=message[:32768],
        observed_generation=generation,
        last_transition_time=(at or now()) if changed else previous.last_transition_time,
    )
    return [c for c in conditions if c.type != type_.value] + [updated]


def get_condition(conditions: list[Condition], type_: ConditionType) -> Condition | None:
    return next((c for c in conditions if c.type == type_.value), None)


def is_true(conditions: list[Condition], type_: ConditionType) -> bool:
    c = get_condition(conditions, type_)
    return c is not None and c.status == "True"


def phase_of(conditions: list[Condition], running_step: str | None) -> Phase:
    """One word for the printer column, derived from the conditions (never stored separately)."""
    if is_true(conditions, ConditionType.READY):
        return Phase.READY
    if is_true(conditions, ConditionType.STALLED):
        return Phase.FAILED
    if running_step == "fetch":
        return Phase.FETCHING
    if running_step is not None:
        return Phase.PREPARING
    if is_true(conditions, ConditionType.PREPARED):
        return Phase.WIRING
    return Phase.PENDING
