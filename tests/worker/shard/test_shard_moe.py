"""MoE cuts: which experts each rank holds, FusedMoE's stacked shapes, and the
combinations refused before any byte is written. (That the bytes are the ones
vLLM builds is test_shard_vllm's job; that nothing is lost, the round trip's.)"""
from __future__ import annotations

import json

import numpy as np
import pytest

from ferry_worker.safetensors_header import validate_safetensors
from ferry_worker.shard.experts import MoeTarget, expert_ranks
from ferry_worker.shard.job import ShardJob
from ferry_worker.shard.model import ShardError

from checkpoints import DEEPSEEK_V3, MIXTRAL, QWEN3, QWEN3_MOE, read_safetensors, write_weights

HIDDEN, INTER = MIXTRAL.config["hidden_size"], MIXTRAL.config["intermediate_size"]


@pytest.mark.parametrize("experts, ep, placement, expected", [
    (8, 2, "linear", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    # vLLM gives the remainder to the first ranks (its docstring says the last; the code does not).
    (10, 4, "linear", [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]),
    (10, 4, "round_robin", [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]]),
    (4, 1, "linear", [[0, 1, 2, 3]]),
])
def test_expert_placement_follows_vllms_expert_map(experts, ep, placement, expected):
    assert [expert_ranks(experts, ep, r, placement) for r in range(ep)] == expected
    assert sorted(e for r in range(ep) for e in expert_ranks(experts, ep, r, placement)) == list(range(experts))


def _rank_tensors(directory, rank: int) -> dict:
    return read_safetensors(directory / f"model-rank-{rank}-part-0.safetensors")


def _expert(weights, layer: int, e: int, name: str) -> np.ndarray:
    _, shape, raw = weights[f"model.layers.{layer}.block_sparse_moe.experts.{e}.{name}.weight"]
    return np.frombuffer(raw, dtype=np.uint16).reshape(shape)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_mixtral_experts_are_stacked_per_rank(make_checkpoint, tmp_path, expert_parallel):
    source, weights = make_checkpoint(MIXTRAL)
    job = ShardJob.prepare(source, tmp_path / "out", tp=2, moe=MoeTarget(expert_parallel=expert_parallel))
    manifest = job.run()
    assert (manifest.extra["experts"], manifest.extra["expertParallel"], manifest.extra["target"]) == (
        4, expert_parallel, "hopper")
    for rank in range(2):
        files = _rank_tensors(tmp_path / "out", rank)
        w13 = files["model.layers.1.block_sparse_moe.experts.routed_experts.w13_weight"]
        w2 = files["model.layers.1.block_sparse_moe.experts.routed_experts.w2_weight"]
        held = [2 * rank, 2 * rank + 1] if expert_parallel else [0, 1, 2, 3]
        rows = INTER if expert_parallel else INTER // 2
        assert w13[1] == [len(held), 2 * rows, HIDDEN] and w2[1] == [len(held), HIDDEN, rows]
        stacked13 = np.frombuffer(w13[2], dtype=np.uint16).reshape(w13[1])
        stacked2 = np.frombuffer(w2[2], dtype=np.uint16).reshape(w2[1])
        cut = slice(0, rows) if expert_parallel else slice(rank * rows, (rank + 1) * rows)
        for local, e in enumerate(held):  # gate (w1) rows first, then up (w3); down (w2) by columns
            assert np.array_equal(stacked13[local, :rows], _expert(weights, 1, e, "w1")[cut])
            assert np.array_equal(stacked13[local, rows:], _expert(weights, 1, e, "w3")[cut])
            assert np.array_equal(stacked2[local], _expert(weights, 1, e, "w2")[:, cut])
        router = files["model.layers.1.block_sparse_moe.gate.weight"]
        assert router == weights["model.layers.1.block_sparse_moe.gate.weight"]  # replicated


def test_dense_layers_of_a_moe_model_stay_dense(make_checkpoint, tmp_path):
    source, _ = make_checkpoint(QWEN3_MOE)  # mlp_only_layers: [0]
    ShardJob.prepare(source, tmp_path / "out", tp=2).run()
    names = {t.name for t in validate_safetensors(tmp_path / "out" / "model-rank-0-part-0.safetensors").tensors}
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any(n.startswith("model.layers.0.mlp.experts") for n in names)
    assert {"model.layers.1.mlp.experts.gate.weight", "model.layers.1.mlp.experts.routed_experts.w13_weight"} <= names
    assert "model.layers.1.mlp.gate_up_proj.weight" not in names


@pytest.mark.parametrize("case, tp, moe, message", [
    (QWEN3_MOE, 8, MoeTarget(), "tensor parallel size 8 is larger than the 4 experts"),
    (MIXTRAL, 8, MoeTarget(expert_parallel=True), "expert parallel size 8 is larger than the 4 experts"),
    (MIXTRAL, 1, MoeTarget(expert_parallel=True), "needs a tensor-parallel size above 1"),
    (MIXTRAL, 2, MoeTarget(expert_parallel=True, placement="round_robin"), "only for models with expert groups"),
    (MIXTRAL, 2, MoeTarget(gpu="blackwell"), None),  # 128 rows per rank: padding to 128 changes nothing
    (MIXTRAL, 4, MoeTarget(gpu="blackwell"), "pads the per-rank expert intermediate size 64 to a multiple of 128"),
    (MIXTRAL, 4, MoeTarget(gpu="rocm"), None),  # 64 rows per rank: AITER's 64-alignment already holds
    (MIXTRAL, 8, MoeTarget(gpu="rocm"), "size 32 to a multiple of 64"),
    (QWEN3, 2, MoeTarget(expert_parallel=True), "qwen3 has no experts"),
    (DEEPSEEK_V3, 2, MoeTarget(gpu="rocm"), "may fuse the shared experts"),
])
def test_combinations_vllm_refuses_or_ferry_cannot_know_are_refused(make_checkpoint, tmp_path, case, tp, moe,
                                                                      message):
    source, _ = make_checkpoint(case)
    if message is None:
        ShardJob.prepare(source, tmp_path / "out", tp=tp, moe=moe)
        return
    with pytest.raises(ShardError, match=message):
        ShardJob.prepare(source, tmp_path / "out", tp=tp, moe=moe)
    assert not (tmp_path / "out").exists()


def test_expert_count_the_checkpoint_contradicts_is_refused_before_tables_are_sized(make_checkpoint, tmp_path):
    source, _ = make_checkpoint(MIXTRAL)
    (source / "config.json").write_text(json.dumps({**MIXTRAL.config, "num_local_experts": 10 ** 9}))
    with pytest.raises(ShardError, match="num_local_experts is 1000000000, but the checkpoint's "
                                         "model.layers.0.block_sparse_moe.gate.weight has 4 on dim 0"):
        ShardJob.prepare(source, tmp_path / "out", tp=2)


def test_a_missing_expert_is_named(make_checkpoint, tmp_path):
    source, weights = make_checkpoint(MIXTRAL)
    del weights["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    write_weights(source, weights)
    with pytest.raises(ShardError, match=r"missing tensor\(s\): model.layers.1.block_sparse_moe.experts.3.w2.weight"):
        ShardJob.prepare(source, tmp_path / "out", tp=2)


def test_deepseek_v3_mtp_layer_is_skipped_and_said_so(make_checkpoint, tmp_path):
    source, _ = make_checkpoint(DEEPSEEK_V3)  # 3 layers + multi-token-prediction layer 3
    manifest = ShardJob.prepare(source, tmp_path / "out", tp=2, moe=MoeTarget(expert_parallel=True)).run()
    skipped = manifest.extra["skippedTensors"]
    assert sorted(skipped) == ["model.layers.3.eh_proj.weight", "model.layers.3.enorm.weight"]
    assert "num_nextn_predict_layers" in skipped["model.layers.3.enorm.weight"]
    names = {t.name for t in validate_safetensors(tmp_path / "out" / "model-rank-1-part-0.safetensors").tensors}
    assert not any(n.startswith("model.layers.3.") for n in names)
    assert {"model.layers.1.self_attn.fused_qkv_a_proj.weight", "model.layers.1.mlp.experts.gate.e_score_correction_bias",
            "model.layers.1.mlp.experts._shared_experts._layer.gate_up_proj.weight",
            "model.layers.1.self_attn.mla_attn.mla_attn._k_scale"} <= names
