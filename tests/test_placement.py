"""Where a wired pod template's pods may go, so where Ferry's fill Jobs may go (placement.py): the
scheduler's rule for taints and tolerations, nodeSelector and required node affinity, failing closed on
what it does not know. The planner's use of it: tests/test_node_cache_plan.py."""
from __future__ import annotations

import pytest

from ferry_operator.placement import NodeFacts, Placement, node_facts, pinned_affinity, placement_of, refusal, selected

TEAM_B = {"key": "team", "value": "b", "effect": "NoSchedule"}
GPU = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


def node(labels=None, taints=()) -> NodeFacts:
    return NodeFacts("gpu-b", labels=dict(labels or {}), taints=list(taints))


def tolerating(*tolerations) -> Placement:
    return placement_of({"tolerations": list(tolerations)})


@pytest.mark.parametrize("toleration,ok", [
    ({"key": "team", "operator": "Equal", "value": "b", "effect": "NoSchedule"}, True),
    ({"key": "team", "value": "b"}, True),  # Equal is the default; no effect: every effect
    ({"key": "team", "operator": "Equal", "value": "a", "effect": "NoSchedule"}, False),
    ({"key": "team", "operator": "Exists"}, True),
    ({"key": "team", "operator": "Exists", "effect": "NoExecute"}, False),  # another effect
    ({"key": "other", "operator": "Exists"}, False),
    ({"operator": "Exists"}, False),  # tolerate-all: never carried, never counted
    ({"operator": "Exists", "effect": "NoSchedule"}, False),
])
def test_a_noschedule_taint_is_tolerated_only_by_its_own_key(toleration, ok):
    assert (refusal(node(taints=[TEAM_B]), tolerating(toleration)) is None) is ok


def test_noexecute_taints_count_and_prefernoschedule_ones_do_not():
    evict = {"key": "team", "value": "b", "effect": "NoExecute"}
    why = refusal(node(taints=[evict]), tolerating({"key": "team", "operator": "Equal", "value": "b",
                                                    "effect": "NoSchedule"}), "deployment x's pod template")
    assert why == "taint team=b:NoExecute is not tolerated by deployment x's pod template"
    assert refusal(node(taints=[evict]), tolerating({"key": "team", "operator": "Exists"})) is None
    assert refusal(node(taints=[{"key": "soft", "effect": "PreferNoSchedule"}]), Placement()) is None


def test_every_taint_must_be_tolerated_and_the_refusal_names_it():
    gpu_only = tolerating({"key": "nvidia.com/gpu", "operator": "Exists"})
    assert refusal(node(taints=[GPU]), gpu_only) is None
    assert refusal(node(taints=[GPU, TEAM_B]), gpu_only, "deployment x's pod template") == (
        "taint team=b:NoSchedule is not tolerated by deployment x's pod template")


def test_a_template_that_tolerates_everything_is_told_its_toleration_is_not_carried():
    everything = tolerating({"operator": "Exists"})
    assert everything.tolerations == [] and everything.tolerates_all
    assert "tolerate this taint by its key" in refusal(node(taints=[TEAM_B]), everything)
    assert refusal(node(), everything) is None  # an untainted node needs no toleration


def test_the_node_selector_must_match_every_label():
    placement = placement_of({"nodeSelector": {"pool": "h100", "zone": "a"}})
    assert refusal(node({"pool": "h100", "zone": "a", "x": "y"}), placement) is None
    assert refusal(node({"pool": "a100", "zone": "a"}), placement, "deployment x's pod template") == (
        "deployment x's pod template has nodeSelector pool=h100 and the node has pool=a100")
    assert "the node has no label zone" in refusal(node({"pool": "h100"}), placement)


def affinity(*terms) -> Placement:
    return placement_of({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": list(terms)}}}})


def expr(key, op, *values):
    return {"matchExpressions": [{"key": key, "operator": op, **({"values": list(values)} if values else {})}]}


@pytest.mark.parametrize("term,labels,ok", [
    (expr("pool", "In", "h100", "a100"), {"pool": "a100"}, True),
    (expr("pool", "In", "h100"), {"pool": "a100"}, False),
    (expr("pool", "In", "h100"), {}, False),
    (expr("team", "NotIn", "b"), {"team": "a"}, True),
    (expr("team", "NotIn", "b"), {}, True),
    (expr("team", "NotIn", "b"), {"team": "b"}, False),
    (expr("gpu", "Exists"), {"gpu": ""}, True),
    (expr("gpu", "Exists"), {}, False),
    (expr("dedicated", "DoesNotExist"), {}, True),
    (expr("dedicated", "DoesNotExist"), {"dedicated": "b"}, False),
    (expr("gpus", "Gt", "4"), {"gpus": "8"}, True),
    (expr("gpus", "Gt", "4"), {"gpus": "two"}, False),
    (expr("gpus", "Lt", "4"), {"gpus": "2"}, True),
    (expr("pool", "Like", "h100"), {"pool": "h100"}, False),  # unknown operator: fail closed
    ({}, {"pool": "h100"}, False),  # an empty term matches no node
])
def test_required_node_affinity_expressions(term, labels, ok):
    assert (refusal(node(labels), affinity(term)) is None) is ok


def test_required_terms_are_ored_and_a_refusal_says_each_terms_reason():
    either = affinity(expr("pool", "In", "h100"), expr("team", "In", "a"))
    assert refusal(node({"team": "a"}), either) is None
    why = refusal(node({"team": "b"}), either, "deployment x's pod template")
    assert why.startswith("deployment x's pod template's required node affinity matches no term: ")
    assert "pool In ['h100'] does not match (the node's label pool is absent)" in why
    assert "team In ['a'] does not match (the node's label team is 'b')" in why
    assert "operator 'Like' of pool is not understood" in refusal(node({"pool": "h"}), affinity(expr("pool", "Like")))
    assert "no nodeSelectorTerms" in refusal(node(), affinity())


def test_match_fields_on_the_node_name_and_nothing_else():
    by_name = affinity({"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-b"]}]})
    assert refusal(node(), by_name) is None
    other = affinity({"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-a"]}]})
    assert refusal(node(), other) is not None
    unknown = affinity({"matchFields": [{"key": "spec.podCIDR", "operator": "Exists"}]})
    assert "not understood" in refusal(node(), unknown)


def test_the_pin_narrows_every_template_term_to_the_node():
    required = pinned_affinity(Placement(), "gpu-b")["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert required == {"nodeSelectorTerms": [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-b"]}]}]}
    placement = affinity(expr("pool", "In", "h100"), expr("team", "In", "a"))
    terms = pinned_affinity(placement, "gpu-b")["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert [t["matchExpressions"] for t in terms] == [expr("pool", "In", "h100")["matchExpressions"],
                                                     expr("team", "In", "a")["matchExpressions"]]
    assert all(t["matchFields"] == [{"key": "metadata.name", "operator": "In", "values": ["gpu-b"]}] for t in terms)


def test_nodes_are_read_and_selected_by_their_labels():
    body = {"metadata": {"name": "gpu-b", "labels": {"pool": "h100", "team": "b"}},
            "spec": {"taints": [{**TEAM_B, "timeAdded": "2026-01-01T00:00:00Z"}]}}
    facts = node_facts(body)
    assert facts == NodeFacts("gpu-b", {"pool": "h100", "team": "b"}, [TEAM_B])
    nodes = {"gpu-b": facts, "gpu-a": NodeFacts("gpu-a", {"pool": "h100"}), "cpu": NodeFacts("cpu", {})}
    assert selected(nodes, {"pool": "h100"}) == ["gpu-a", "gpu-b"]
    assert selected(nodes, {"pool": "h100", "team": "b"}) == ["gpu-b"]


def test_a_gpu_request_tolerates_its_resources_taint_as_admission_would():
    """ExtendedResourceToleration gives a pod requesting nvidia.com/gpu the toleration of that taint: GPU pools
    tainted so take the workload's pods, and the fill Job (which requests no GPU) carries it explicitly."""
    gpu_pod = {"containers": [{"name": "vllm", "resources": {"limits": {"nvidia.com/gpu": "8", "cpu": "4"}}}]}
    placement = placement_of(gpu_pod)
    assert placement.tolerations == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert refusal(node(taints=[GPU]), placement) is None
    assert refusal(node(taints=[GPU, TEAM_B]), placement) == "taint team=b:NoSchedule is not tolerated by the pod template"
    assert refusal(node(taints=[GPU]), placement_of({"containers": [{"name": "cpu-only"}]})) is not None


def test_the_nodes_own_condition_taints_refuse_no_node():
    """Cordoned, not ready, under pressure: Kubernetes' own taints, for the scheduler to wait on, not a rule of
    the tenant's that would remove a running fill."""
    for key in ("node.kubernetes.io/unschedulable", "node.kubernetes.io/disk-pressure", "node.kubernetes.io/not-ready"):
        assert refusal(node(taints=[{"key": key, "effect": "NoSchedule"}]), tolerating()) is None
    assert refusal(node(taints=[{"key": "node.example.com/team", "effect": "NoSchedule"}]), tolerating()) is not None


def test_a_result_is_read_only_from_pods_created_before_the_job_completed():
    """A pod planted after the Job completed (its owner reference forged) is no worker of it."""
    from ferry_operator.executors.kubernetes import _before_completion

    job = {"status": {"completionTime": "2026-12-04T09:00:00Z"}}
    worker = {"metadata": {"name": "w", "creationTimestamp": "2026-12-04T08:59:00Z"}}
    planted = {"metadata": {"name": "p", "creationTimestamp": "2026-12-04T09:00:01Z"}}
    assert _before_completion(job, [worker, planted]) == [worker]
    assert _before_completion({"status": {}}, [worker, planted]) == [worker, planted]  # still running
