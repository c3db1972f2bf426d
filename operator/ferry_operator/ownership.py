"""Which ModelWeights owns a serving Deployment that several of them name. Pure.

Two ModelWeights that wire one Deployment would fight over it, each rolling
it back to its own artifact. One of them owns it: the one its pod template's
owner annotation names (the last to wire it), while that one still lists it;
otherwise the oldest that lists it (then by name), a rule every reconciler
computes alike, so a newcomer never takes over a Deployment in use.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True, order=True)
class Wirer:
    """A ModelWeights that lists a Deployment in serving.deployments."""

    created: str  # metadata.creationTimestamp (RFC 3339: sorts as time)
    name: str


def owner_of(annotated_owner: str | None, wirers: Iterable[Wirer]) -> str | None:
    """The owning ModelWeights' name; None if nothing lists the Deployment."""
    listed = sorted(set(wirers))
    if annotated_owner is not None and any(w.name == annotated_owner for w in listed):
        return annotated_owner
    return listed[0].name if listed else None
