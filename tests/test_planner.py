"""The reconcile planner, without a cluster: observed state in, actions and status out."""
from __future__ import annotations

import pytest

from ferry_operator.api.validation import parse
from ferry_operator.planner import ArtifactFacts, Observed, StartStep, StepPhase, StepState, human_bytes, plan
from ferry_operator.steps import prepare_steps, spec_digest
from spec_cases import manifest, with_


def mw(obj=None, generation=3):
    obj = obj or manifest()
    obj = {**obj, "metadata": {**obj["metadata"], "generation": generation}}
    return parse(obj)


def conds(p):
    return {c.type: (c.status, c.reason) for c in p.status.conditions}


def test_sharded_state_is_fetch_then_shard_with_the_spec():
    steps = prepare_steps(mw().spec)
    assert [s.name for s in steps] == ["fetch", "shard"]
    fetch, shard = steps
    assert fetch.argv[:5] == ("fetch", "--source", "{source}", "--output", "{staging}")
    assert "--revision" in fetch.argv
    assert shard.argv[shard.argv.index("--tensor-parallel-size") + 1] == "4"
    assert shard.argv[shard.argv.index("--max-part-size") + 1] == str(5 << 30)
    assert shard.argv[shard.argv.index("--output") + 1] == "{artifact}"


def test_a_new_object_starts_the_first_step_only():
    p = plan(mw(), Observed())
    assert [a.step.name for a in p.actions] == ["fetch"]
    assert conds(p)["Reconciling"] == ("True", "Fetch")
    assert conds(p)["Ready"][0] == "False"
    assert p.status.phase == "Fetching"
    assert p.status.observed_generation == 3
    assert all(c.observed_generation == 3 for c in p.status.conditions)


def test_running_step_is_not_started_twice():
    m = mw()
    fetch, shard = prepare_steps(m.spec)
    p = plan(m, Observed(steps={fetch.id: StepState(StepPhase.RUNNING)}))
    assert p.actions == []
    assert p.status.phase == "Fetching"


def test_after_fetch_the_shard_step_starts():
    m = mw()
    fetch, shard = prepare_steps(m.spec)
    p = plan(m, Observed(steps={fetch.id: StepState(StepPhase.SUCCEEDED)}))
    assert p.actions == [StartStep(shard)]
    assert conds(p)["Downloaded"] == ("True", "Fetched")
    assert p.status.phase == "Preparing"


def test_all_steps_done_with_a_manifest_is_ready():
    m = mw()
    steps = prepare_steps(m.spec)
    facts = ArtifactFacts(uri="file:///a", total_bytes=3 << 30, manifest_digest="sha256:" + "0" * 64)
    p = plan(m, Observed(steps={s.id: StepState(StepPhase.SUCCEEDED) for s in steps}, artifact=facts))
    assert p.actions == []
    assert conds(p)["Ready"] == ("True", "Prepared")
    assert conds(p)["Reconciling"][0] == "False"
    assert p.status.phase == "Ready"
    assert p.status.artifact.size == "3.0Gi" and p.status.artifact.tensor_parallel_size == 4


def test_steps_done_without_a_manifest_is_never_ready():
    m = mw()
    steps = prepare_steps(m.spec)
    p = plan(m, Observed(steps={s.id: StepState(StepPhase.SUCCEEDED) for s in steps}, artifact=None))
    assert conds(p)["Ready"][0] == "False"
    assert conds(p)["Stalled"] == ("True", "ArtifactIncomplete")


def test_a_failed_step_stalls_with_its_message():
    m = mw()
    fetch, _ = prepare_steps(m.spec)
    p = plan(m, Observed(steps={fetch.id: StepState(StepPhase.FAILED, "exit code 1: no weights found")}))
    assert p.actions == []
    assert conds(p)["Stalled"] == ("True", "FetchFailed")
    stalled = next(c for c in p.status.conditions if c.type == "Stalled")
    assert "no weights found" in stalled.message
    assert p.status.phase == "Failed"


def test_transition_time_kept_while_status_unchanged():
    m = mw()
    first = plan(m, Observed())
    m2 = m.model_copy(update={"status": first.status})
    second = plan(m2, Observed())
    t1 = {c.type: c.last_transition_time for c in first.status.conditions}
    t2 = {c.type: c.last_transition_time for c in second.status.conditions}
    assert t1 == t2


def test_spec_change_that_shapes_the_artifact_changes_the_step_ids():
    a = mw()
    b = mw(with_("format.tensorParallelSize", 8))
    c = mw(with_("serving.deployments", [{"name": "other"}]))
    assert spec_digest(a.spec) != spec_digest(b.spec)
    assert spec_digest(a.spec) == spec_digest(c.spec)  # serving does not reshape the artifact


def test_unsupported_format_stalls_clearly():
    m = mw(manifest(format={"type": "tensorizer"}, storage={"s3": {"uri": "s3://bucket/x"}}))
    p = plan(m, Observed())
    assert conds(p)["Stalled"] == ("True", "UnsupportedSpec")
    assert p.actions == []


def test_runai_streamer_from_s3_needs_no_preparation():
    m = mw(manifest(source={"uri": "s3://models/qwen"}, storage=None, format={"type": "runai_streamer"}))
    p = plan(m, Observed())
    assert p.actions == [] and conds(p)["Ready"][0] == "True"


@pytest.mark.parametrize("n,text", [(0, "0"), (1023, "1023"), (1536, "1.5Ki"), (141 << 30, "141Gi")])
def test_human_bytes(n, text):
    assert human_bytes(n) == text
