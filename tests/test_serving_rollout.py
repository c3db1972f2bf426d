"""serving.rollout and the loader's resources, without a cluster: the strategy Ferry's rollouts use, the
annotation it is kept in (untrusted), the Unschedulable hint, and the loader's capped requests. Shares
nothing: pure functions and the planner on hand-made facts (the API server merges these patches in
test_serving_patch_apiserver.py; a real node runs them in tests/node/test_serving_failures_on_node.py)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from ferry_operator.api.validation import parse
from ferry_operator.planner import ArtifactFacts, Observed, PatchWorkload, StepPhase, StepState, plan
from ferry_operator.serving.loader import fitted_resources
from ferry_operator.serving.rollout import (IN_PLACE, Change, parse_saved, parse_strategy, put_back,
                                            rollout_patch, surge_hint, surges, with_strategy)
from ferry_operator.serving.diagnosis import PodTrouble
from ferry_operator.serving.weights_loaded import PodFacts
from ferry_operator.serving.wiring import SAVED_STRATEGY, WorkloadFacts
from ferry_operator.steps import prepare_steps
from spec_cases import with_

DEFAULT = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"}}
NAME = "llama-70b-vllm"


@pytest.mark.parametrize("strategy, ok", [
    (DEFAULT, True),
    ({"type": "Recreate"}, True),
    ({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}, True),
    ({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 0}}, False),
    ({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "0%", "maxUnavailable": 0}}, False),
    ({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": "101%"}}, False),
    ({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": True, "maxUnavailable": 1}}, False),
    ({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": -1, "maxUnavailable": 1}}, False),
    ({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "1", "maxUnavailable": 1}}, False),
    ({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "extra": 1}}, False),
    ({"type": "Recreate", "rollingUpdate": {"maxSurge": 1}}, False),
    ({"type": "Sideways"}, False),
    ({"type": "RollingUpdate", "rollingUpdate": DEFAULT["rollingUpdate"], "x": 1}, False),
    ([], False),
])
def test_only_a_strategy_the_api_server_takes_is_read(strategy, ok):
    assert (parse_strategy(strategy) is not None) == ok
    assert (parse_saved(json.dumps(strategy)) is not None) == ok


def test_a_saved_annotation_too_large_too_deep_or_not_json_holds_no_strategy():
    assert parse_saved(json.dumps(DEFAULT)) == DEFAULT
    assert parse_saved(json.dumps({**DEFAULT, "pad": "x" * 2000})) is None
    assert parse_saved(json.dumps(DEFAULT) + " " * 1024) is None  # over 1 KiB before it is parsed
    assert parse_saved("[" * 100_000 + "]" * 100_000) is None  # too big, and too deep for json
    deep = "[" * 500 + "]" * 500
    assert parse_saved(deep) is None
    assert parse_saved("{not json") is None and parse_saved(None) is None


@pytest.mark.parametrize("strategy, surging", [
    (None, True), ({}, True), (DEFAULT, True), (IN_PLACE, False), ({"type": "Recreate"}, False),
    ({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "0%", "maxUnavailable": 1}}, False),
    ({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 2, "maxUnavailable": 0}}, True),
])
def test_what_surges(strategy, surging):
    assert surges(strategy) == surging


def test_in_place_saves_the_deployments_own_strategy_and_only_when_it_surges():
    roll = rollout_patch("InPlace", "Deployment", NAME, DEFAULT, None, rolling=True, rolled_out=False)
    assert roll.change == Change.IN_PLACE
    assert roll.patch["spec"]["strategy"] == IN_PLACE
    assert json.loads(roll.patch["metadata"]["annotations"][SAVED_STRATEGY]) == DEFAULT
    assert rollout_patch("Workload", "Deployment", NAME, DEFAULT, None, True, False) is None
    assert rollout_patch("InPlace", "StatefulSet", NAME, DEFAULT, None, True, False) is None
    assert rollout_patch("InPlace", "Deployment", NAME, {"type": "Recreate"}, None, True, False) is None
    assert rollout_patch("InPlace", "Deployment", NAME, DEFAULT, None, rolling=False, rolled_out=True) is None


def test_the_saved_strategy_is_put_back_once_the_rollout_completes_and_not_before():
    saved = json.dumps(DEFAULT)
    assert rollout_patch("InPlace", "Deployment", NAME, IN_PLACE, saved, rolling=True, rolled_out=False) is None
    assert rollout_patch("InPlace", "Deployment", NAME, IN_PLACE, saved, rolling=False, rolled_out=False) is None
    # A second change while in place: the template patch goes, the saved strategy stays.
    assert rollout_patch("InPlace", "Deployment", NAME, IN_PLACE, saved, rolling=True, rolled_out=True) is None
    back = rollout_patch("InPlace", "Deployment", NAME, IN_PLACE, saved, rolling=False, rolled_out=True)
    assert back.change == Change.RESTORED
    assert back.patch == {"metadata": {"annotations": {SAVED_STRATEGY: None}}, "spec": {"strategy": DEFAULT}}
    # Also under Workload: turning InPlace off mid-rollout still gives the strategy back.
    assert rollout_patch("Workload", "Deployment", NAME, IN_PLACE, saved, False, True).change == Change.RESTORED


def test_a_recreate_put_back_drops_rolling_update():
    back = put_back(NAME, IN_PLACE, json.dumps({"type": "Recreate"}))
    assert back.patch["spec"]["strategy"] == {"type": "Recreate", "rollingUpdate": None}


def test_a_strategy_the_user_changed_or_an_unreadable_annotation_is_kept():
    mine = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 2}}
    kept = put_back(NAME, mine, json.dumps(DEFAULT))
    assert kept.change == Change.KEPT and "spec" not in kept.patch
    assert kept.patch == {"metadata": {"annotations": {SAVED_STRATEGY: None}}}
    bad = put_back(NAME, IN_PLACE, json.dumps({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0,
                                                                                           "maxUnavailable": 0}}))
    assert bad.change == Change.KEPT and "spec" not in bad.patch and SAVED_STRATEGY in bad.message


def test_one_patch_carries_the_template_and_the_strategy():
    roll = rollout_patch("InPlace", "Deployment", NAME, DEFAULT, None, True, False)
    template = {"spec": {"template": {"metadata": {"annotations": {"a": "b"}}}}}
    body = with_strategy(template, roll)
    assert body["spec"] == {"template": template["spec"]["template"], "strategy": IN_PLACE}
    assert SAVED_STRATEGY in body["metadata"]["annotations"]
    assert template == {"spec": {"template": {"metadata": {"annotations": {"a": "b"}}}}}  # not changed
    assert with_strategy(template, None) == template


# --- the planner -------------------------------------------------------------------------------------------

FACTS = ArtifactFacts(uri="pvc://llama-weights/llama/abc", total_bytes=3 << 30, manifest_digest="sha256:" + "0" * 64)


def mw(strategy="InPlace"):
    obj = with_("serving.rollout", {"strategy": strategy})
    return parse({**obj, "metadata": {**obj["metadata"], "generation": 2}})


def observed(m, current, pods=()):
    steps = {s.id: StepState(StepPhase.SUCCEEDED) for s in prepare_steps(m.spec)}
    return Observed(steps=steps, artifact=FACTS, workloads={NAME: current}, pods=list(pods))


def deployment(**kw):
    base = dict(name=NAME, containers={"vllm": ["--model", "m"]}, template_annotations={}, rolled_out=True,
                strategy=DEFAULT)
    return WorkloadFacts(**{**base, **kw})


def wired(m, **kw):
    """The Deployment as Ferry's patch leaves it."""
    (action,) = plan(m, observed(m, deployment())).actions
    template = action.patch["spec"]["template"]
    return deployment(containers={"vllm": template["spec"]["containers"][0]["args"]},
                      template_annotations=template["metadata"]["annotations"], **kw)


def conds(p):
    return {c.type: (c.status, c.reason) for c in p.status.conditions}


def test_ferrys_rollout_starts_in_place_in_the_same_patch():
    m = mw()
    (action,) = plan(m, observed(m, deployment())).actions
    assert isinstance(action, PatchWorkload) and action.patch is not None
    assert action.rollout.change == Change.IN_PLACE
    (action,) = plan(mw("Workload"), observed(mw("Workload"), deployment())).actions
    assert action.rollout is None


def test_in_place_turned_on_during_a_stuck_rollout_applies_to_it_and_never_flaps_after_put_back():
    m = mw()
    stuck = wired(m, rolled_out=False, old_pods=1, available=1)
    (action,) = plan(m, observed(m, stuck)).actions
    assert action.patch is None and action.rollout.change == Change.IN_PLACE
    # Right after the strategy went back the controller has not observed it yet: not rolled out, but no old pod.
    restored = wired(m, rolled_out=False, old_pods=0)
    assert plan(m, observed(m, restored)).actions == []


def test_the_put_back_comes_after_the_rollout_and_ready_waits_for_it():
    m = mw()
    done = wired(m, strategy=IN_PLACE, saved_strategy=json.dumps(DEFAULT))
    p = plan(m, observed(m, done))
    (action,) = p.actions
    assert action.patch is None and action.rollout.change == Change.RESTORED
    assert conds(p)["Ready"][0] == "False"
    assert conds(p)["ServingUpdated"] == ("False", "RollingOut")
    p = plan(m, observed(m, wired(m)))
    assert p.actions == [] and conds(p)["Ready"] == ("True", "Ready")


def test_a_ready_plan_keeps_serving_actions():
    """A node cache turned off removes its fill Jobs also when everything else is Ready."""
    from ferry_operator.node_cache import FillFacts, RemoveFill
    m = mw("Workload")
    fill = FillFacts(node="n1", digest=FACTS.manifest_digest, phase="Running")
    o = replace(observed(m, wired(m)), fills=[fill])
    p = plan(m, o)
    assert conds(p)["Ready"] == ("True", "Ready")
    assert p.actions == [RemoveFill("n1", FACTS.manifest_digest, 0)]


UNSCHEDULABLE = "pod llama-1 of deployment llama-70b-vllm cannot be scheduled: 0/1 nodes are available: " \
                "1 Insufficient cpu."


@pytest.mark.parametrize("facts, message, hinted", [
    (dict(old_pods=1, available=1), UNSCHEDULABLE, True),
    (dict(old_pods=1, available=1), "0/1 nodes: 1 node(s) didn't have free ports for the requested pod ports",
     True),
    (dict(old_pods=1, available=1), "0/2 nodes: 2 node(s) didn't match pod anti-affinity rules", True),
    (dict(old_pods=1, available=1), "0/1 nodes: 1 node(s) had untolerated taint {gpu: true}", False),
    (dict(old_pods=0, available=1), UNSCHEDULABLE, False),  # no old pod holds the room
    (dict(old_pods=1, available=0), UNSCHEDULABLE, False),  # the old pod is itself pending
    (dict(old_pods=1, available=1, strategy=IN_PLACE, saved_strategy="{}"), UNSCHEDULABLE, False),
    (dict(old_pods=1, available=1, strategy={"type": "Recreate"}), UNSCHEDULABLE, False),
])
def test_the_unschedulable_hint_names_in_place_only_where_it_helps(facts, message, hinted):
    hint = surge_hint("llama", deployment(**facts), message)
    assert bool(hint) == hinted
    if hinted:
        assert "spec.serving.rollout.strategy: InPlace in ModelWeights llama" in hint and NAME in hint


def test_the_planner_adds_the_hint_to_the_unschedulable_status():
    m = mw("Workload")
    current = wired(m, rolled_out=False, old_pods=1, available=1)
    pod = PodFacts(name="llama-1", owner="llama", digest=FACTS.manifest_digest, gate=None, workload=NAME,
                   trouble=PodTrouble("Unschedulable", UNSCHEDULABLE, False))
    p = plan(m, observed(m, current, [pod]))
    reconciling = next(c for c in p.status.conditions if c.type == "Reconciling")
    assert reconciling.reason == "Unschedulable" and "rollout.strategy: InPlace" in reconciling.message


# --- the loader's resources ---------------------------------------------------------------------------------

CHART = {"requests": {"cpu": "1", "memory": "512Mi"}, "limits": {"cpu": "2", "memory": "1Gi"}}


@pytest.mark.parametrize("serving, requests", [
    ({"requests": {"cpu": "100m", "memory": "8Gi"}}, {"cpu": "100m", "memory": "512Mi"}),
    ({"limits": {"cpu": "500m", "memory": "256Mi"}}, {"cpu": "500m", "memory": "256Mi"}),
    ({"requests": {"cpu": "4", "nvidia.com/gpu": "1"}}, {"cpu": "1", "memory": "512Mi"}),
    ({}, {"cpu": "1", "memory": "512Mi"}),
    ({"requests": {"cpu": "not-a-quantity"}}, {"cpu": "1", "memory": "512Mi"}),
])
def test_the_loader_never_asks_for_more_than_the_serving_container(serving, requests):
    fitted = fitted_resources(CHART, serving)
    assert fitted["requests"] == requests
    assert fitted["limits"] == CHART["limits"]
    assert CHART["requests"] == {"cpu": "1", "memory": "512Mi"}  # not changed


def test_a_limit_only_loader_and_extended_resources():
    fitted = fitted_resources({"limits": {"cpu": "2", "hugepages-2Mi": "1Gi"}}, {"requests": {"cpu": "250m"}})
    assert fitted == {"requests": {"cpu": "250m"}, "limits": {"cpu": "2", "hugepages-2Mi": "1Gi"}}
    assert fitted_resources({}, {"requests": {"cpu": "1"}}) == {}


# --- review findings ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("own", [
    {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "05%", "maxUnavailable": "25%"}},
    {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "1000000000%", "maxUnavailable": 0}},
    {"type": "RollingUpdate"},  # the API server defaults rollingUpdate
])
def test_every_strategy_ferry_saves_it_can_put_back(own):
    roll = rollout_patch("InPlace", "Deployment", NAME, own, None, True, False)
    saved = roll.patch["metadata"]["annotations"][SAVED_STRATEGY]
    assert put_back(NAME, IN_PLACE, saved).change == Change.RESTORED


@pytest.mark.parametrize("odd", ["RollingUpdate", ["x"], {"type": "RollingUpdate", "rollingUpdate": "x"},
                                 {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "5%\n"}}])
def test_a_strategy_ferry_could_not_put_back_is_never_replaced(odd):
    assert not surges(odd)
    assert rollout_patch("InPlace", "Deployment", NAME, odd, None, True, False) is None


def test_a_saved_strategy_that_is_not_text_ferry_can_encode_holds_none():
    assert parse_saved("\ud800") is None


def test_the_put_back_is_refused_if_the_deployment_changed_since_it_was_read():
    back = rollout_patch("InPlace", "Deployment", NAME, IN_PLACE, json.dumps(DEFAULT), False, True, "4711")
    assert back.patch["metadata"]["resourceVersion"] == "4711"


def test_a_held_rollout_still_puts_the_last_strategy_back():
    from ferry_operator.node_cache import CachePlan
    import ferry_operator.planner as planner
    m = mw()
    done = wired(m, strategy=IN_PLACE, saved_strategy=json.dumps(DEFAULT))
    other = replace(FACTS, manifest_digest="sha256:" + "1" * 64)
    held = CachePlan(actions=[], hold="prewarm of the next artifact")
    original = planner._node_cache
    planner._node_cache = lambda *a, **k: held
    try:
        p = plan(m, replace(observed(m, done), artifact=other))
    finally:
        planner._node_cache = original
    (action,) = p.actions
    assert action.patch is None and action.rollout.change == Change.RESTORED


@pytest.mark.parametrize("q", ["NaN", "Infinity", "-1", True, None, ["1"]])
def test_quantities_that_are_not_one_are_left_alone(q):
    fitted = fitted_resources({"requests": {"cpu": "1"}}, {"requests": {"cpu": q}})
    assert fitted == {"requests": {"cpu": "1"}}
    assert fitted_resources({"requests": {"cpu": q}}, {"requests": {"cpu": "1"}}) == {"requests": {"cpu": q}}


def test_the_delete_handler_reads_the_deployments_of_a_spec_that_no_longer_parses():
    from ferry_operator.handlers import _deployments_named
    spec = {"serving": {"deployments": [{"name": "a"}, {"name": 7}, "x", {"name": "a"}],
                        "targets": [{"kind": "StatefulSet", "name": "s"}, {"name": "b"}], "bogus": 1},
            "format": "not a format"}
    assert _deployments_named(spec) == ["a", "b"]
    assert _deployments_named({"serving": "x"}) == [] and _deployments_named({}) == []
