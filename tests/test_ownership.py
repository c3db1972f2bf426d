"""Who owns a Deployment that several ModelWeights name: one rule every reconciler computes alike."""
from __future__ import annotations

from ferry_operator.ownership import Wirer, owner_of

A = Wirer("2026-12-01T10:00:00Z", "a")
B = Wirer("2026-12-01T11:00:00Z", "b")
EARLY_Z = Wirer("2026-12-01T10:00:00Z", "z")


def test_the_annotated_owner_keeps_it_while_it_still_lists_it():
    assert owner_of("b", [A, B]) == "b"  # b wired it last: a newcomer or an older one does not take over


def test_an_owner_that_let_go_or_is_gone_passes_it_to_the_oldest():
    assert owner_of("gone", [B, A]) == "a"
    assert owner_of(None, [EARLY_Z, B, A]) == "a"  # same age: by name


def test_nothing_lists_it():
    assert owner_of("a", []) is None
