"""Which Events a reconcile posts: transitions only, nothing in a steady state."""
from __future__ import annotations

from ferry_operator.api.validation import parse
from ferry_operator.events import NORMAL, WARNING, transitions
from ferry_operator.planner import ArtifactFacts, Observed, StepPhase, StepState, plan
from ferry_operator.steps import prepare_steps
from spec_cases import manifest

FACTS = ArtifactFacts(uri="pvc://w/llama/abc/artifact", total_bytes=3 << 30, manifest_digest="sha256:" + "0" * 64)


def reasons(events):
    return [(e.type, e.reason) for e in events]


def test_a_whole_preparation_tells_its_story_once():
    m = parse(manifest())
    m.spec.serving = None
    fetch, shard = prepare_steps(m.spec)
    story = []
    observations = [
        Observed(),
        Observed(steps={fetch.id: StepState(StepPhase.RUNNING)}),
        Observed(steps={fetch.id: StepState(StepPhase.SUCCEEDED)}),
        Observed(steps={fetch.id: StepState(StepPhase.SUCCEEDED), shard.id: StepState(StepPhase.SUCCEEDED)},
                 artifact=FACTS),
        Observed(steps={fetch.id: StepState(StepPhase.SUCCEEDED), shard.id: StepState(StepPhase.SUCCEEDED)},
                 artifact=FACTS),
    ]
    for observed in observations:
        p = plan(m, observed)
        story += reasons(transitions(m.status, p.status, p.actions))
        m.status = p.status
    assert story == [(NORMAL, "StepStarted"), (NORMAL, "StepSucceeded"), (NORMAL, "StepStarted"),
                     (NORMAL, "ArtifactReady"), (NORMAL, "Ready")]


def test_a_failure_is_a_warning_with_its_reason_once():
    m = parse(manifest())
    fetch, _ = prepare_steps(m.spec)
    failed = Observed(steps={fetch.id: StepState(StepPhase.FAILED, "secret missing", "SecretNotFound")})
    p = plan(m, failed)
    (event,) = transitions(m.status, p.status, p.actions)
    assert (event.type, event.reason) == (WARNING, "SecretNotFound") and "secret missing" in event.message
    m.status = p.status
    assert transitions(m.status, plan(m, failed).status, []) == []  # still the same failure: no new Event
