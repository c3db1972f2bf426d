"""Expert parallelism through the operator: the format fields, the artifacts and
step flags they shape (and, at their defaults, do not), the serving flags Ferry
owns, and the data-parallel and EPLB flags a pre-cut MoE artifact cannot serve."""
from __future__ import annotations

import pytest

from ferry_operator.api.validation import parse
from ferry_operator.planner import (ArtifactFacts, Observed, PatchWorkload, StepPhase, StepState, plan,
                                    recorded_artifact)
from ferry_operator.serving.wiring import ParallelismUnsupported, template_patch, ferry_flags
from ferry_operator.steps import prepare_steps, spec_digest
from serving_cases import CONTAINER, HUB_ID, PARALLELISM_FLAGS, SPECS, apply, command_line, facts, spec_of, wire
from spec_cases import VALID, manifest, with_

# spec_digest of each VALID manifest before the MoE fields existed (commit 60bc7d1): an
# operator upgrade must not prepare an existing object's artifact again.
DIGESTS_BEFORE = {
    "sharded-state-tp4": "e1a7c11a17b2",
    "minimal-safetensors": "3bd400cfc606",
    "tensorizer-s3": "af46e52eade9",
    "runai-published-to-s3": "d62968181b88",
    "runai-from-s3-source": "0c3210b7fef2",
    "pp2-vllm-0.33": "28fd4d61010e",
    "pvc-source": "76c8f0fb0ed2",
    "local-file-source": "874bdee6b547",
}
MOE_FLAGS = ("--expert-parallel", "--expert-placement", "--target")
DIGEST = "sha256:" + "3" * 64
MOE_FACTS = ArtifactFacts(uri="pvc://llama-weights/llama/abc", total_bytes=1 << 30, manifest_digest=DIGEST,
                          experts=8, expert_parallel=True, target="hopper")


def with_defaults(obj: dict) -> dict:
    """The manifest with the MoE fields spelled out at their defaults."""
    for path, value in (("expertParallel", False), ("expertPlacement", "linear"), ("target", "hopper")):
        obj = with_(f"format.{path}", value, obj)
    return obj


@pytest.mark.parametrize("name", list(DIGESTS_BEFORE))
def test_a_spec_at_the_defaults_keeps_its_digest_and_its_step_flags(name):
    for obj in (VALID[name], with_defaults(VALID[name])):
        spec = parse(obj).spec
        assert spec_digest(spec) == DIGESTS_BEFORE[name]
        for step in prepare_steps(spec):
            assert step.digest == DIGESTS_BEFORE[name]
            assert not set(MOE_FLAGS) & set(step.argv), step.argv


def steps_of(fmt: dict, storage: dict | None = None):
    obj = manifest(format=fmt) if storage is None else manifest(format=fmt, storage=storage)
    return prepare_steps(parse(obj).spec)


S3 = {"pvc": {"size": "1Gi"}, "s3": {"uri": "s3://bucket/x"}}


def test_the_moe_fields_shape_a_sharded_state_artifact_and_reach_ferry_shard():
    base = {"type": "sharded_state", "tensorParallelSize": 4}
    digests = set()
    for extra, flags in [({}, []),
                         ({"expertParallel": True}, ["--expert-parallel"]),
                         ({"expertParallel": True, "expertPlacement": "round_robin"},
                          ["--expert-parallel", "--expert-placement", "round_robin"]),
                         ({"target": "blackwell"}, ["--target", "blackwell"])]:
        fetch, shard = steps_of({**base, **extra})
        assert list(shard.argv[shard.argv.index("--max-part-size") + 2:]) == flags
        assert not set(MOE_FLAGS) & set(fetch.argv)
        digests.add(shard.digest)
    assert len(digests) == 4  # each is another artifact, prepared beside the others


def test_tensorizer_passes_the_moe_fields_for_the_vllm_layout_only():
    fmt = {"type": "tensorizer", "tensorParallelSize": 2, "expertParallel": True, "target": "rocm"}
    _, tensorize = steps_of(fmt, S3)
    i = tensorize.argv.index("--vllm-version") + 2
    assert list(tensorize.argv[i:i + 3]) == ["--expert-parallel", "--target", "rocm"]
    assert tensorize.digest != steps_of({**fmt, "expertParallel": False, "target": "hopper"}, S3)[1].digest
    # The hf layout holds the checkpoint's tensors (vLLM cuts them in load_weights): EP is a serving flag there.
    hf = {**fmt, "tensorizer": {"layout": "hf"}}
    _, plain = steps_of(hf, S3)
    assert not set(MOE_FLAGS) & set(plain.argv)
    assert plain.digest == steps_of({"type": "tensorizer", "tensorParallelSize": 2, "tensorizer": {"layout": "hf"}},
                                    S3)[1].digest


@pytest.mark.parametrize("fmt,storage", [
    ({"type": "safetensors", "tensorParallelSize": 2}, None),
    ({"type": "runai_streamer", "tensorParallelSize": 2}, S3),
])
def test_formats_vllm_cuts_itself_are_not_prepared_again_for_expert_parallelism(fmt, storage):
    plain = steps_of(fmt, storage)
    ep = steps_of({**fmt, "expertParallel": True, "expertPlacement": "round_robin", "target": "rocm"}, storage)
    assert [s.id for s in plain] == [s.id for s in ep] and [s.argv for s in plain] == [s.argv for s in ep]


def test_expert_parallel_is_a_serving_flag_for_every_format():
    for name in ("safetensors-expert-parallel", "tensorizer-expert-parallel", "moe-expert-parallel"):
        spec = parse(VALID[name]).spec
        flags = ferry_flags(spec, "s3://bucket/x")
        assert flags.count("--enable-expert-parallel") == 1
        placement = spec.format.expert_placement
        assert ("--expert-placement-strategy" in flags) == (placement != "linear")
        if placement != "linear":
            assert flags[flags.index("--expert-placement-strategy") + 1] == placement
    assert "--enable-expert-parallel" not in ferry_flags(parse(manifest()).spec)


def test_turning_expert_parallel_off_removes_the_flags_ferry_set():
    _, wired = wire("hf-ep", facts(["vllm", "serve"], [HUB_ID, "--max-model-len", "8192"]))
    assert "--enable-expert-parallel" in command_line(wired)[1]
    spec, artifact = SPECS["hf"]
    patch = template_patch(spec, "llama", artifact, CONTAINER, wired)
    unwired = apply(wired, patch)
    args = command_line(unwired)[1]
    assert "--enable-expert-parallel" not in args and "--expert-placement-strategy" not in args
    assert "--max-model-len" in args
    assert template_patch(spec, "llama", artifact, CONTAINER, unwired) is None


@pytest.mark.parametrize("user", [["-ep"], ["--enable-expert-parallel"], ["--enable_expert_parallel"],
                                  ["--no-enable-expert-parallel"], ["--expert-placement-strategy", "round_robin"]])
def test_the_users_expert_parallel_flags_give_way_to_the_spec(user):
    spec = spec_of(manifest(format={"type": "safetensors", "tensorParallelSize": 2}))
    artifact = SPECS["pvc"][1]
    current = facts(["vllm", "serve"], [HUB_ID, *user, "--max-model-len", "8192"])
    args = command_line(apply(current, template_patch(spec, "llama", artifact, CONTAINER, current)))[1]
    assert not {"-ep", "--enable-expert-parallel", "--enable_expert_parallel", "--no-enable-expert-parallel",
                "--expert-placement-strategy", "round_robin"} & set(args)
    assert args[:3] == ["/ferry/weights", "--max-model-len", "8192"]


@pytest.mark.parametrize("flags,refused", PARALLELISM_FLAGS, ids=[" ".join(f) or "none" for f, _ in PARALLELISM_FLAGS])
def test_data_parallel_and_eplb_are_refused_for_a_pre_cut_moe_artifact(flags, refused):
    current = facts(["vllm", "serve"], [HUB_ID, *flags])
    if not refused:
        assert wire("hf-ep", current)[0] is not None
        return
    with pytest.raises(ParallelismUnsupported) as err:
        wire("hf-ep", current)
    message = str(err.value)
    assert message.startswith("deployment llama-70b-vllm container 'vllm': `")
    assert "pre-cut sharded_state artifact of a MoE model (8 experts per layer)" in message
    word = next(f for f in reversed(flags) if f.replace("_", "-").split("=")[0] in (
        "-dp", "--data-parallel-size", "--enable-eplb"))
    assert f"`{word}" in message


@pytest.mark.parametrize("script,says", [
    (f"exec vllm serve {HUB_ID} -dp 2", "`-dp 2` asks vLLM for data parallelism"),
    (f'exec vllm serve {HUB_ID} --data-parallel-size "$DP"', "`--data-parallel-size \"$DP\"` sets vLLM's "
                                                             "data-parallel size from a variable"),
    (f"vllm serve {HUB_ID} --enable-eplb", "expert-parallel load balancer"),
])
def test_a_script_asking_for_them_is_refused_too(script, says):
    with pytest.raises(ParallelismUnsupported) as err:
        wire("hf-ep", facts(["sh", "-c", script], []))
    assert says in str(err.value)


def test_a_data_parallel_size_kubernetes_expands_is_refused_as_unreadable():
    with pytest.raises(ParallelismUnsupported, match=r"`-dp \$\(DP\)` sets vLLM's data-parallel size from a "
                                                     r"variable, which Ferry cannot read"):
        wire("hf-ep", facts(None, [HUB_ID, "-dp", "$(DP)"]))


@pytest.mark.parametrize("artifact", [
    SPECS["hf-ep"][1].model_copy(update={"experts": None}),  # a dense model
    SPECS["hf-ep"][1].model_copy(update={"experts": 0}),
])
def test_a_dense_artifact_serves_with_data_parallelism(artifact):
    spec = SPECS["hf-ep"][0]
    current = facts(["vllm", "serve"], [HUB_ID, "-dp", "2", "--enable-eplb"])
    assert template_patch(spec, "llama", artifact, CONTAINER, current) is not None


@pytest.mark.parametrize("obj", [
    manifest(format={"type": "safetensors", "tensorParallelSize": 2, "expertParallel": True}),
    manifest(format={"type": "tensorizer", "tensorParallelSize": 2, "tensorizer": {"layout": "hf"}}, storage=S3),
])
def test_vllm_cuts_the_experts_itself_where_nothing_is_pre_cut(obj):
    spec = spec_of(obj)
    artifact = SPECS["hf-ep"][1].model_copy(update={"format": spec.format.type})
    current = facts(["vllm", "serve"], [HUB_ID, "-dp", "2", "--enable-eplb"])
    assert template_patch(spec, "llama", artifact, CONTAINER, current) is not None


def mw(obj, generation=2):
    return parse({**obj, "metadata": {**obj["metadata"], "generation": generation}})


def conds(p):
    return {c.type: (c.status, c.reason) for c in p.status.conditions}


def test_the_planner_stalls_a_deployment_asking_for_data_parallelism_and_records_the_moe_facts():
    m = mw(VALID["moe-expert-parallel"])
    done = {s.id: StepState(StepPhase.SUCCEEDED) for s in prepare_steps(m.spec)}
    dp = facts(["vllm", "serve"], [HUB_ID, "--data-parallel-size", "2"])
    p = plan(m, Observed(steps=done, artifact=MOE_FACTS, workloads={"llama-70b-vllm": dp}))
    assert p.actions == []
    assert conds(p)["Stalled"] == ("True", "ParallelismUnsupported")
    assert conds(p)["ServingUpdated"] == ("False", "ParallelismUnsupported")
    assert conds(p)["Ready"][0] == "False" and conds(p)["Reconciling"][0] == "False"
    stalled = next(c for c in p.status.conditions if c.type == "Stalled")
    assert "deployment llama-70b-vllm" in stalled.message and "`--data-parallel-size 2`" in stalled.message
    assert "tensor x data-parallel ranks (8 x 2)" in stalled.message
    art = p.status.artifact
    assert (art.experts, art.expert_parallel, art.target) == (8, True, "hopper")
    assert p.status.model_dump(by_alias=True, mode="json")["artifact"]["expertParallel"] is True
    # Without the flag the Deployment is wired, with Ferry's expert-parallel flags, and the stall ends.
    fixed = facts(["vllm", "serve"], [HUB_ID])
    m.status = p.status
    p = plan(m, Observed(steps=done, artifact=MOE_FACTS, workloads={"llama-70b-vllm": fixed}))
    (action,) = p.actions
    assert isinstance(action, PatchWorkload)
    args = action.patch["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--enable-expert-parallel") + 1:][:2] == ["--expert-placement-strategy", "round_robin"]
    assert conds(p)["Stalled"] == ("False", "Progressing")


def test_the_moe_facts_of_a_recorded_artifact_come_from_the_executors_record_first():
    m = mw(with_("serving", None, VALID["moe-expert-parallel"]))
    steps = prepare_steps(m.spec)
    done = {s.id: StepState(StepPhase.SUCCEEDED) for s in steps}
    ready = plan(m, Observed(steps=done, artifact=MOE_FACTS))
    assert conds(ready)["Ready"] == ("True", "Ready")
    m.status = ready.status
    # The executor keeps the last step's validated result (its Job stays; its record outlives the pod).
    assert recorded_artifact(m, steps, MOE_FACTS.uri, MOE_FACTS) == MOE_FACTS
    # Without it (restarted, the Job gone): the status's, which shape only this object's own flags.
    unverified = recorded_artifact(m, steps, MOE_FACTS.uri)
    assert unverified.manifest_digest == MOE_FACTS.manifest_digest
    assert (unverified.experts, unverified.expert_parallel, unverified.target) == (
        MOE_FACTS.experts, MOE_FACTS.expert_parallel, MOE_FACTS.target)
