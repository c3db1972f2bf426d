"""compressed-tensors pack-quantized checkpoints without vLLM: what ferry shard
refuses before a byte is written, what its manifest records, and `unshard`
rebuilding every tensor bit for bit. The layout itself is proven against
vLLM 0.32 in test_shard_vllm_quantized.py; these checkpoints hold random packed
words (checkpoints.pack_quantized). Shares nothing heavier than a generated
checkpoint per test."""
from __future__ import annotations

import copy

import pytest

from checkpoints import LLAMA3, MIXTRAL, ModelCase, read_checkpoint, read_safetensors
from expert_cuts import MIXTRAL_STACK, cut_and_rebuilt
from ferry_worker.manifest import read_manifest
from ferry_worker.shard.job import ShardJob
from ferry_worker.shard.model import ShardError
from ferry_worker.shard.unshard import unshard

WEIGHTS = {"num_bits": 4, "type": "int", "symmetric": True, "group_size": 32, "strategy": "group",
           "block_structure": None, "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {}}


ATTENTION = tuple(f"model.layers.{i}.self_attn.{m}_proj" for i in range(3) for m in "qkvo")


def packed(case: ModelCase, files: int = 1, ignore=("lm_head",), group: dict | None = None, top: dict | None = None,
           **weights) -> ModelCase:
    config = copy.deepcopy(case.config)
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**WEIGHTS, **weights},
                                      "input_activations": None, "output_activations": None,
                                      "format": "pack-quantized", **(group or {})}},
        "ignore": list(ignore), "kv_cache_scheme": None, **(top or {})}
    return ModelCase(f"{case.name}-packed", config, case.dtype, files=files)


@pytest.mark.parametrize("case", [
    packed(LLAMA3, files=2), packed(LLAMA3, symmetric=False), packed(LLAMA3, strategy="channel", group_size=None),
    packed(LLAMA3, num_bits=8, group_size=16),
], ids=["group-two-files", "asymmetric", "channel", "int8"])
def test_every_tensor_comes_back_bit_for_bit(make_checkpoint, tmp_path, case):
    """unshard rebuilds each tensor the cut read, and each part's weight_shape no rank holds (a fused module
    keeps the part vLLM loads last) from its weight_packed, which the cut checked it against."""
    source, _ = make_checkpoint(case)
    ShardJob.prepare(source, tmp_path / "tp2", tp=2).run()
    unshard(tmp_path / "tp2", tmp_path / "back")
    original, back = read_checkpoint(source), read_checkpoint(tmp_path / "back")
    assert {k: v for k, v in back.items()} == {k: v for k, v in original.items() if "rotary" not in k}
    facts = read_manifest(tmp_path / "tp2").extra["quantization"]
    args = case.config["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert facts["bits"] == args["num_bits"] and facts["zeroPoint"] is not args["symmetric"]
    assert facts["strategy"] == args["strategy"] and facts.get("groupSize") == args["group_size"]


def test_a_weight_shape_that_contradicts_its_packed_weight_is_refused(make_checkpoint, tmp_path):
    source, weights = make_checkpoint(packed(LLAMA3))
    import numpy as np
    name = "model.layers.1.self_attn.k_proj.weight_shape"
    weights[name] = ("I64", [2], np.array([999, 128], dtype="<i8").tobytes())
    source, _ = make_checkpoint(packed(LLAMA3), name="lying", weights=weights)
    with pytest.raises(ShardError, match=rf"{name} does not hold the shape of its packed weight \[32, 128\]"):
        ShardJob.prepare(source, tmp_path / "out", tp=2).run()
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case, tp, message", [
    # o_proj's 128 inputs at TP 4: 32 per rank, not whole 64-input groups (vLLM would refuse at load).
    (packed(LLAMA3, group_size=64), 4, r"o_proj.weight_scale at tensor parallel size 4: rank 0 would hold "
                                       r"columns \[0, 32\).*not whole 64-wide quantization blocks"),
    (packed(LLAMA3, kv_cache_scheme=None), 2, "keys ferry shard does not know \\(kv_cache_scheme\\)"),
    (packed(LLAMA3, actorder="group"), 2, r"act-order \(g_idx\) checkpoints are not cut"),
    (packed(LLAMA3, group={"input_activations": {"num_bits": 8, "type": "int"}}), 2,
     "input_activations is set; pack-quantized with quantized activations"),
    (packed(LLAMA3, ignore=["re:.*self_attn.*"]), 2, "ignore holds patterns"),
    (packed(LLAMA3, num_bits=3), 2, "pack-quantized is int4 or int8"),
    (packed(LLAMA3, surprise=1), 2, "keys ferry shard does not know \\(surprise\\)"),
    # Experts at TP 4: 64 expert rows per rank, not whole 128-input groups of w2 (vLLM refuses it at load).
    (packed(MIXTRAL, group_size=128, ignore=("lm_head", *ATTENTION)), 4,
     r"w2_weight_scale at tensor parallel size 4: rank 0 would hold columns \[0, 64\).*128-wide"),
    (packed(LLAMA3, num_bits=4.0), 2, "pack-quantized is int4 or int8"),
    # vLLM allocates in // pack words and in // group scales: 128 inputs are not whole 48-input groups.
    (packed(LLAMA3, group_size=48), 2, r"q_proj.weight_scale: its weight has 128 columns, not a multiple of the "
                                       r"48-wide blocks"),
    (packed(LLAMA3, top={"transform_config": {"hadamard": {}}}), 2, "transform_config is set"),
    (packed(LLAMA3, top={"surprise": 1}), 2, r"quantization_config has keys ferry shard does not know \(surprise\)"),
], ids=["group-split", "misplaced-key", "actorder", "w8a8", "regex-ignore", "int3", "unknown-key", "moe",
        "float-bits", "group-not-dividing", "transform", "unknown-config-key"])
def test_what_cannot_be_cut_is_refused_before_a_byte_is_written(make_checkpoint, tmp_path, case, tp, message):
    source, _ = make_checkpoint(case)
    with pytest.raises(ShardError, match=message):
        ShardJob.prepare(source, tmp_path / "out", tp=tp)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case, expert_parallel", [
    (packed(MIXTRAL), False), (packed(MIXTRAL, symmetric=False), True),
    (packed(MIXTRAL, strategy="channel", group_size=None), False),
], ids=["tp2", "asymmetric-ep2", "channel"])
def test_experts_are_stacked_n_first_and_come_back_bit_for_bit(make_checkpoint, tmp_path, case, expert_parallel):
    """FusedMoE's int4 stacks (CompressedTensorsWNA16MoEMethod): each expert's packed gate and up rows cut like
    a dense gate_up, down's packed columns like a dense down_proj, and each expert's weight_shape [2] in the
    model dtype (bf16 here), from the part vLLM loads last; unshard narrows those back to int64."""
    source, _ = make_checkpoint(case)
    _, rank, (experts, rows) = cut_and_rebuilt(source, tmp_path, expert_parallel)
    stack = MIXTRAL_STACK
    assert rank[stack + "w13_weight_packed"][:2] == ("I32", [experts, 2 * rows, 128 // 8])
    assert rank[stack + "w2_weight_packed"][:2] == ("I32", [experts, 128, rows // 8])
    assert rank[stack + "w13_weight_shape"][:2] == ("BF16", [experts, 2])
    import numpy as np
    shapes = np.frombuffer(rank[stack + "w13_weight_shape"][2], dtype="<u2").astype("<u4") << 16
    assert shapes.view("<f4").tolist() == [256.0, 128.0] * experts  # the whole checkpoint shape, not the rank's
    assert (stack + "w13_weight_zero_point" in rank) is expert_parallel  # the asymmetric case


@pytest.mark.parametrize("value, dtype, exact", [
    (768, "BF16", True), (14336, "BF16", True), (257, "BF16", False), (2049, "F16", False), (2049, "F32", True),
])
def test_experts_weight_shape_must_be_exact_in_the_model_dtype(value, dtype, exact):
    from ferry_worker.shard.tensors import exactly_representable

    assert exactly_representable(value, dtype) is exact


def test_an_ignored_module_keeps_its_unquantized_weight(make_checkpoint, tmp_path):
    """A module the config leaves unquantized (ignore) stays a plain weight, cut as unquantized, as vLLM
    builds it; the others are packed."""
    source, _ = make_checkpoint(packed(LLAMA3, ignore=["lm_head", "model.layers.0.mlp.down_proj"]))
    ShardJob.prepare(source, tmp_path / "tp2", tp=2).run()
    rank0 = read_safetensors(tmp_path / "tp2" / "model-rank-0-part-0.safetensors")
    assert rank0["model.layers.0.mlp.down_proj.weight"][:2] == ("BF16", [128, 128])
    assert "model.layers.0.mlp.down_proj.weight_packed" not in rank0
    assert rank0["model.layers.1.mlp.down_proj.weight_packed"][:2] == ("I32", [128, 16])
    assert rank0["model.layers.0.self_attn.qkv_proj.weight_packed"][:2] == ("I32", [96, 16])
