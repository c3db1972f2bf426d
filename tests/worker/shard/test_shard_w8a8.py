"""compressed-tensors W8A8 checkpoints (int-quantized INT8, float-quantized
FP8), and per-tensor FP8 under quant_method "fp8" (AutoFP8's 0-d scales),
without vLLM: what ferry shard refuses before a byte is written, scales
widened from the checkpoint's bf16 to the float32 vLLM allocates, and
`unshard` narrowing them back bit for bit (refusing a value that was not
widened). The layout itself is proven against vLLM 0.32 in
test_shard_vllm_quantized.py; these checkpoints hold random 8-bit values
(checkpoints.naive_quantized). Shares nothing heavier than a generated
checkpoint per test."""
from __future__ import annotations

import copy
import json
import struct

import pytest

from checkpoints import DEEPSEEK_V3, LLAMA3, MIXTRAL, QWEN2, ModelCase, read_checkpoint, read_safetensors, write_weights
from ferry_worker.shard.job import ShardJob
from ferry_worker.shard.model import ShardError
from ferry_worker.shard.tensors import narrow, widen
from ferry_worker.shard.unshard import unshard


def w8a8(case: ModelCase, kind: str = "int", strategy: str = "channel", static: bool = False,
         input_symmetric: bool = True, **weights) -> ModelCase:
    fmt = "int-quantized" if kind == "int" else "float-quantized"
    inputs = {"strategy": "tensor", "dynamic": False} if static else {"strategy": "token", "dynamic": True}
    inputs["symmetric"] = input_symmetric
    config = copy.deepcopy(case.config)
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "format": fmt, "output_activations": None,
                                      "weights": {"num_bits": 8, "type": kind, "strategy": strategy,
                                                  "symmetric": True, "dynamic": False, **weights},
                                      "input_activations": {"num_bits": 8, "type": kind, **inputs}}},
        "ignore": ["lm_head"], "kv_cache_scheme": None}
    return ModelCase(f"{case.name}-{kind}8", config, case.dtype, files=2)


def fp8_tensor(case: ModelCase, scheme: str) -> ModelCase:
    config = copy.deepcopy(case.config)
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": scheme, "ignored_layers": ["lm_head"]}
    return ModelCase(f"{case.name}-fp8-tensor", config, case.dtype, files=2)


@pytest.mark.parametrize("case,tp", [
    (w8a8(LLAMA3), 4), (w8a8(QWEN2, strategy="tensor"), 2), (w8a8(LLAMA3, "float", "tensor", static=True), 4),
    (w8a8(QWEN2, "float"), 2),
], ids=["int8-channel-tp4", "int8-tensor", "fp8-tensor-static-tp4", "fp8-channel"])
def test_every_tensor_comes_back_bit_for_bit_and_scales_are_float32(make_checkpoint, tmp_path, case, tp):
    source, _ = make_checkpoint(case)
    ShardJob.prepare(source, tmp_path / "cut", tp=tp).run()
    unshard(tmp_path / "cut", tmp_path / "back")
    original = read_checkpoint(source)
    assert read_checkpoint(tmp_path / "back") == {k: v for k, v in original.items() if "rotary" not in k}
    rank = read_safetensors(tmp_path / "cut" / "model-rank-0-part-0.safetensors")
    layer = "model.layers.0.self_attn."
    assert rank[layer + "qkv_proj.weight_scale"][0] == "F32"
    if case.config["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] == "tensor":
        # one per logical part, each the checkpoint's bf16 widened exactly (the high half of a float32)
        values = struct.unpack("<3f", rank[layer + "qkv_proj.weight_scale"][2])
        parts = [struct.unpack("<f", b"\0\0" + original[layer + f"{p}_proj.weight_scale"][2])[0] for p in "qkv"]
        assert list(values) == parts


@pytest.mark.parametrize("source", ["BF16", "F16"])
def test_widening_is_exact_and_narrowing_refuses_what_was_not_widened(source):
    """unshard narrows each float32 scale back to the checkpoint's dtype; a value that dtype cannot hold (a
    rank file not written by this cut, whose digest was forged too) is refused, not rounded."""
    import numpy as np

    values = np.array([1e-3, 0.5, -2.0, 7.25e-5], dtype="<f4")
    stored = values.astype("<f2").tobytes() if source == "F16" else (values.view("<u4") >> 16).astype("<u2").tobytes()
    wide = widen(memoryview(stored), source, "F32")
    assert narrow(memoryview(wide), "F32", source) == stored
    forged = bytearray(wide)
    forged[0] ^= 1  # a low mantissa bit
    with pytest.raises(ShardError, match="not"):
        narrow(memoryview(bytes(forged)), "F32", source)


@pytest.mark.parametrize("case,words", [
    (w8a8(LLAMA3, "float", static=True, input_symmetric=False), "asymmetric for INT8 only"),
    (w8a8(LLAMA3, symmetric=False), "vLLM's W8A8 schemes load symmetric channel or tensor weights"),
    (w8a8(LLAMA3, strategy="group", group_size=32), "groups, blocks or act-order belong to another scheme"),
    (w8a8(LLAMA3, block_structure=[16, 16]), "groups, blocks or act-order belong to another scheme"),
    (w8a8(LLAMA3, num_bits=4), "8-bit int values"),
    (w8a8(MIXTRAL, strategy="tensor"), "INT8 experts with per-tensor weight scales and dynamic activations"),
    (w8a8(MIXTRAL, static=True), "INT8 experts with channel weight scales and static activations"),
    (w8a8(MIXTRAL, "float", static=True), "FP8 experts with channel weight scales and static activations"),
    (w8a8(DEEPSEEK_V3, "float", "tensor", static=True), "static activations is cut for mixtral and qwen3_moe"),
    (fp8_tensor(DEEPSEEK_V3, "static"), "static activations is cut for mixtral and qwen3_moe"),
], ids=["fp8-static-asymmetric", "asymmetric", "group", "block-structure", "4-bit", "experts-int8-tensor",
        "experts-int8-static", "experts-fp8-channel-static", "deepseek-fp8-static", "deepseek-autofp8-static"])
def test_what_vllm_would_not_load_or_ferry_could_not_undo_is_refused(make_checkpoint, tmp_path, case, words):
    source, _ = make_checkpoint(case)
    with pytest.raises(ShardError) as refused:
        ShardJob.prepare(source, tmp_path / "out", tp=2)
    assert words in str(refused.value)
    assert not (tmp_path / "out").exists()


INT8_STATIC = [(w8a8(LLAMA3, static=True), 4), (w8a8(QWEN2, "int", "tensor", static=True, input_symmetric=False), 2)]


@pytest.mark.parametrize("case,tp", INT8_STATIC, ids=["symmetric-tp4", "asymmetric"])
def test_int8_static_inputs_keep_one_value_per_fused_module_and_come_back(make_checkpoint, tmp_path, case, tp):
    """vLLM's CompressedTensorsW8A8Int8 holds one input scale [1] (and zero point, int8) per module, which each
    part of a fused module overwrites: the rank files hold that one value, widened to float32, and unshard
    rebuilds every part's from it."""
    source, _ = make_checkpoint(case)
    manifest = ShardJob.prepare(source, tmp_path / "cut", tp=tp).run()
    asymmetric = manifest.extra["quantization"]["inputZeroPoint"]
    assert manifest.extra["quantization"]["activations"] == "static"
    unshard(tmp_path / "cut", tmp_path / "back")
    original = read_checkpoint(source)
    assert read_checkpoint(tmp_path / "back") == {k: v for k, v in original.items() if "rotary" not in k}
    rank = read_safetensors(tmp_path / "cut" / f"model-rank-{tp - 1}-part-0.safetensors")
    layer = "model.layers.1."
    for fused, part in (("self_attn.qkv_proj", "self_attn.v_proj"), ("mlp.gate_up_proj", "mlp.up_proj"),
                        ("mlp.down_proj", "mlp.down_proj")):
        dtype, shape, raw = rank[f"{layer}{fused}.input_scale"]
        assert (dtype, shape) == ("F32", [1]) and raw == b"\0\0" + original[f"{layer}{part}.input_scale"][2]
        assert (f"{layer}{fused}.input_zero_point" in rank) is asymmetric
        if asymmetric:
            assert rank[f"{layer}{fused}.input_zero_point"] == ("I8", [1], original[f"{layer}{part}.input_zero_point"][2])


@pytest.mark.parametrize("case, expert_parallel", [
    (w8a8(MIXTRAL), False), (w8a8(MIXTRAL, "float"), True), (fp8_tensor(MIXTRAL, "dynamic"), False),
    (fp8_tensor(MIXTRAL, "dynamic"), True), (fp8_tensor(MIXTRAL, "static"), True),
    (w8a8(MIXTRAL, "float", "tensor", static=True), False), (w8a8(MIXTRAL, "float", "tensor", static=True), True),
], ids=["int8-channel-tp2", "fp8-channel-ep2", "autofp8-tp2", "autofp8-ep2", "autofp8-static-ep2",
        "fp8-tensor-static-tp2", "fp8-tensor-static-ep2"])
def test_8bit_experts_are_stacked_and_come_back_bit_for_bit(make_checkpoint, tmp_path, case, expert_parallel):
    """FusedMoE's 8-bit stacks: w13_weight [E, 2 x I, hidden] with channel scales [E, 2 x I, 1] (float32) and
    w2's [E, hidden, 1] whole; per tensor w13_weight_scale [E, 2] (w1's and w3's) and w2's [E]; static
    activations one input scale per expert, w13_input_scale (w1's and w3's, equal) and w2_input_scale [E]."""
    from ferry_worker.shard.experts import MoeTarget

    source, _ = make_checkpoint(case)
    manifest = ShardJob.prepare(source, tmp_path / "cut", tp=2, moe=MoeTarget(expert_parallel=expert_parallel)).run()
    unshard(tmp_path / "cut", tmp_path / "back")
    original = read_checkpoint(source)
    assert read_checkpoint(tmp_path / "back") == {k: v for k, v in original.items() if "rotary" not in k}
    rank = read_safetensors(tmp_path / "cut" / "model-rank-1-part-0.safetensors")
    stack = "model.layers.2.block_sparse_moe.experts.routed_experts."
    experts, rows = (2, 256) if expert_parallel else (4, 128)  # Mixtral here: intermediate 256, hidden 128
    channel = case.config["quantization_config"].get("config_groups", {}).get("group_0", {}).get(
        "weights", {}).get("strategy") == "channel"
    assert rank[stack + "w13_weight_scale"][:2] == ("F32", [experts, 2 * rows, 1] if channel else [experts, 2])
    assert rank[stack + "w2_weight_scale"][:2] == ("F32", [experts, 128, 1] if channel else [experts])
    static = manifest.extra["quantization"]["activations"] == "static"
    assert (stack + "w13_input_scale" in rank, stack + "w2_input_scale" in rank) == (static, static)
    if static:  # rank 1 under EP holds experts 2 and 3: each one's value, widened to float32
        held = range(2, 4) if expert_parallel else range(4)
        for stacked, part in (("w13_input_scale", "w3"), ("w2_input_scale", "w2")):
            dtype, shape, raw = rank[stack + stacked]
            want = [original[f"model.layers.2.block_sparse_moe.experts.{e}.{part}.input_scale"] for e in held]
            assert (dtype, shape) == ("F32", [len(held)]), (stacked, dtype, shape)
            assert raw == b"".join(w[2] if w[0] == "F32" else b"\0\0" + w[2] for w in want), stacked


@pytest.mark.parametrize("case, name, words", [
    (w8a8(LLAMA3, static=True), "model.layers.0.self_attn.k_proj.input_scale",
     r"model.layers.0.self_attn.q_proj.input_scale, .*k_proj.input_scale, .*v_proj.input_scale differ.*"
     r"fused model.layers.0.self_attn.qkv_proj"),
    (fp8_tensor(MIXTRAL, "static"), "model.layers.1.block_sparse_moe.experts.3.w3.input_scale",
     r"experts.3.w1.input_scale, .*experts.3.w3.input_scale differ.*fused model.layers.1.block_sparse_moe.experts.3.w13"),
    (w8a8(MIXTRAL, "float", "tensor", static=True), "model.layers.1.block_sparse_moe.experts.3.w3.input_scale",
     r"experts.3.w1.input_scale, .*experts.3.w3.input_scale differ.*fused model.layers.1.block_sparse_moe.experts.3.w13"),
], ids=["int8-fused-module", "autofp8-expert", "compressed-tensors-fp8-expert"])
def test_parts_with_different_input_scales_are_refused(make_checkpoint, tmp_path, case, name, words):
    """One input scale where vLLM keeps one: an INT8 fused module's (vLLM would quantize q's and k's inputs
    with v's scale without a word), an FP8 expert's w1 and w3 (compressed-tensors' loader refuses them,
    Fp8MoEMethod keeps the last); unshard could not rebuild the others. Refused before a byte is written,
    naming the parts."""
    source, weights = make_checkpoint(case)
    dtype, shape, raw = weights[name]
    weights[name] = (dtype, shape, bytes([raw[0] ^ 1]) + raw[1:])
    for path in source.glob("*.safetensors"):
        path.unlink()
    write_weights(source, weights, 2)
    with pytest.raises(ShardError, match=words):
        ShardJob.prepare(source, tmp_path / "out", tp=2).run()
    assert not (tmp_path / "out").exists()


def test_an_unwidenable_scale_dtype_is_refused(make_checkpoint, tmp_path):
    source, weights = make_checkpoint(w8a8(LLAMA3))
    name = "model.layers.0.self_attn.q_proj.weight_scale"
    dtype, shape, raw = weights[name]
    weights[name] = ("I32", shape, bytes(4 * shape[0]))
    for path in source.glob("*.safetensors"):
        path.unlink()
    write_weights(source, weights, 2)
    with pytest.raises(ShardError, match=f"{name} is I32, expected one of F32, BF16, F16"):
        ShardJob.prepare(source, tmp_path / "out", tp=2)


@pytest.mark.parametrize("where,value", [
    (("format",), [1]), (("format",), {"a": 1}), (("weights",), "channel"), (("weights", "strategy"), ["x"]),
    (("input_activations",), None), (("input_activations", "dynamic"), "yes"), (("weights", "num_bits"), 8.0),
])
def test_odd_config_values_are_refused_by_name_not_crashed_on(where, value):
    """config.json is the tenant's: every odd value ends in a ShardError (found by a sweep of odd values over
    each key: an unhashable format once raised TypeError)."""
    from ferry_worker.shard.plan import quantization

    config = w8a8(LLAMA3).config
    node = config["quantization_config"]["config_groups"]["group_0"]
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = value
    with pytest.raises(ShardError, match="config.json"):
        quantization(config)



@pytest.mark.parametrize("case,tp", [(fp8_tensor(LLAMA3, "static"), 4), (fp8_tensor(QWEN2, "dynamic"), 2)],
                         ids=["static-tp4", "dynamic"])
def test_per_tensor_fp8_scales_sit_one_per_part_and_come_back_0d(make_checkpoint, tmp_path, case, tp):
    """AutoFP8 stores each module's scale 0-d; vLLM's PerTensorScaleParameter holds one per logical part of
    a fused module ([3] for qkv_proj), on every rank, with the KV-cache scales Fp8Config adds to Attention."""
    source, _ = make_checkpoint(case)
    ShardJob.prepare(source, tmp_path / "cut", tp=tp).run()
    unshard(tmp_path / "cut", tmp_path / "back")
    original = read_checkpoint(source)
    assert read_checkpoint(tmp_path / "back") == {k: v for k, v in original.items() if "rotary" not in k}
    rank = read_safetensors(tmp_path / "cut" / f"model-rank-{tp - 1}-part-0.safetensors")
    layer = "model.layers.0."
    assert rank[layer + "self_attn.qkv_proj.weight_scale"][:2] == ("F32", [3])
    assert rank[layer + "mlp.down_proj.weight_scale"][:2] == ("F32", [1])
    assert rank[layer + "self_attn.qkv_proj.weight_scale"][2] == b"".join(
        original[layer + f"self_attn.{p}_proj.weight_scale"][2] for p in "qkv")
    assert (layer + "self_attn.qkv_proj.input_scale" in rank) is (case.config["quantization_config"][
        "activation_scheme"] == "static")
    assert layer + "self_attn.attn.k_scale" in rank


def test_an_8_bit_weight_the_config_leaves_unquantized_is_refused(make_checkpoint, tmp_path):
    """vLLM allocates an ignored module's weight in the model dtype and would cast the 8-bit codes into it."""
    case = w8a8(LLAMA3)
    source, weights = make_checkpoint(case)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"]["ignore"] = ["lm_head", "model.layers.0.mlp.down_proj"]
    (source / "config.json").write_text(json.dumps(config))
    del weights["model.layers.0.mlp.down_proj.weight_scale"]
    for path in source.glob("*.safetensors"):
        path.unlink()
    write_weights(source, weights, 2)
    with pytest.raises(ShardError, match="down_proj.weight is I8, but config.json does not quantize it"):
        ShardJob.prepare(source, tmp_path / "out", tp=2)
