"""AWQ and GPTQ checkpoints without vLLM: what ferry shard refuses before a byte
is written, what its manifest and the artifact's config.json record, and
`unshard` rebuilding every tensor bit for bit from rank files whose fused
parts sit side by side along dim 1, and Mixtral's AWQ and GPTQ expert stacks
(expert_cuts.py). The layout itself is proven against vLLM
0.32 in test_shard_vllm_quantized.py; these checkpoints hold random packed words
(checkpoints.int_packed). Shares nothing heavier than a generated checkpoint
per test."""
from __future__ import annotations

import copy
import json

import pytest

from checkpoints import LLAMA3, MIXTRAL, PHI3, QWEN2, ModelCase, read_checkpoint, write_weights
from expert_cuts import MIXTRAL_STACK, cut_and_rebuilt
from ferry_worker.manifest import IntegrityError, read_manifest
from ferry_worker.shard.job import ShardJob
from ferry_worker.shard.model import ShardError
from ferry_worker.shard.unshard import unshard

AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm",
       "modules_to_not_convert": None}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True, "lm_head": False,
        "checkpoint_format": "gptq", "damp_percent": 0.01}


def quantized(case: ModelCase, base: dict, **settings) -> ModelCase:
    config = copy.deepcopy(case.config)
    config["quantization_config"] = {**base, **settings}
    return ModelCase(f"{case.name}-{base['quant_method']}", config, case.dtype, files=2)


@pytest.mark.parametrize("case,tp", [
    (quantized(LLAMA3, AWQ), 4), (quantized(QWEN2, AWQ), 2), (quantized(LLAMA3, GPTQ), 4),
    (quantized(QWEN2, GPTQ, group_size=-1, desc_act=True), 2), (quantized(LLAMA3, GPTQ, bits=8, group_size=64), 2),
], ids=["awq-llama3-tp4", "awq-qwen2", "gptq-llama3-tp4", "gptq-channel-actorder", "gptq-int8"])
def test_every_tensor_comes_back_bit_for_bit(make_checkpoint, tmp_path, case, tp):
    """At TP 4 Llama 3's two KV heads are each replicated on two ranks: unshard also proves the replicas
    equal. g_idx is the one tensor vLLM drops, so the artifact does not hold it."""
    source, _ = make_checkpoint(case)
    ShardJob.prepare(source, tmp_path / "cut", tp=tp).run()
    unshard(tmp_path / "cut", tmp_path / "back")
    original, back = read_checkpoint(source), read_checkpoint(tmp_path / "back")
    assert back == {k: v for k, v in original.items() if "rotary" not in k and not k.endswith(".g_idx")}
    manifest = read_manifest(tmp_path / "cut").extra
    qc = case.config["quantization_config"]
    assert manifest["quantization"]["method"] == qc["quant_method"]
    assert manifest["quantization"]["bits"] == qc["bits"]
    assert manifest["quantization"].get("groupSize", -1) == qc["group_size"]
    dropped = {k for k in original if k.endswith(".g_idx")}
    assert set(manifest["skippedTensors"]) >= dropped and bool(dropped) is (qc["quant_method"] == "gptq")


def test_a_gptq_artifact_names_its_quantized_modules(make_checkpoint, tmp_path):
    """vLLM's GPTQ config, given none, derives the quantized modules from the directory it serves: from an
    artifact, the fused qkv_proj/gate_up_proj, which match no unfused module, so every fused layer would be
    built unquantized. The artifact's config.json names the checkpoint's own modules instead."""
    source, _ = make_checkpoint(quantized(LLAMA3, GPTQ))
    ShardJob.prepare(source, tmp_path / "cut", tp=2).run()
    listed = json.loads((tmp_path / "cut" / "config.json").read_text())["quantization_config"][
        "modules_in_block_to_quantize"]
    layers = LLAMA3.config["num_hidden_layers"]
    assert len(listed) == 7 * layers and "model.layers.0.self_attn.q_proj" in listed
    assert not any("qkv_proj" in m or "gate_up_proj" in m for m in listed)
    awq_source, _ = make_checkpoint(quantized(QWEN2, AWQ))
    ShardJob.prepare(awq_source, tmp_path / "awq", tp=2).run()
    assert (tmp_path / "awq" / "config.json").read_bytes() == (awq_source / "config.json").read_bytes()


@pytest.mark.parametrize("settings,words", [
    ({"quant_method": "gptq", "desc_act": True}, "desc_act (act-order) with 32-input groups"),
    ({"quant_method": "gptq", "group_size": 256}, "group sizes -1, 32, 64, 128"),
    ({"quant_method": "gptq", "sym": False}, "symmetric weights only"),
    ({"quant_method": "gptq", "dynamic": {"+:.*": {"bits": 8}}}, "per-module overrides"),
    ({"quant_method": "gptq", "lm_head": True}, "unquantized LM head"),
    ({"bits": 8}, "4-bit weights only"),
    ({"version": "gemv"}, "GEMV checkpoint would not load"),
    ({"group_size": -1}, "grouped AWQ only"),
    ({"bits": "4"}, "must be integers"),
    ({"modules_to_not_convert": ["self_attn.q_proj"]}, "lists only some parts of model.layers.0.self_attn.qkv_proj"),
    ({"q_group_size": 64}, "wrong shape(s): model.layers.0.self_attn.q_proj.qzeros"),  # vLLM reads it first
    ({"quant_method": "gptq", "sym": None}, "symmetric weights only"),
], ids=["gptq-actorder-groups", "gptq-group-256", "gptq-asym", "gptq-dynamic", "lm-head", "awq-8bit", "awq-gemv",
        "awq-channel", "string-bits", "awq-half-fused", "awq-keys-vllm-reads-first",
        "gptq-sym-null"])
def test_what_vllm_would_not_load_is_refused_by_name(make_checkpoint, tmp_path, settings, words):
    base = GPTQ if settings.get("quant_method") == "gptq" else AWQ
    source, _ = make_checkpoint(quantized(LLAMA3, base))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"].update(settings)
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(ShardError, match="config.json") as refused:
        ShardJob.prepare(source, tmp_path / "out", tp=2)
    assert words in str(refused.value)
    assert not (tmp_path / "out").exists()


def test_a_cut_that_splits_a_group_is_refused_with_the_sizes_that_fit(make_checkpoint, tmp_path):
    """vLLM's AWQ and GPTQ methods allocate I // group groups per rank and never check the remainder, so a
    row-parallel rank holding half a group would load misplaced scales: refused, naming what fits."""
    source, _ = make_checkpoint(quantized(LLAMA3, GPTQ, group_size=64))  # hidden 128: 32 inputs per rank at TP 4
    with pytest.raises(ShardError) as refused:
        ShardJob.prepare(source, tmp_path / "out", tp=4)
    message = str(refused.value)
    assert "o_proj.scales at tensor parallel size 4" in message and "not whole 64-wide" in message
    assert "(for this tensor: 1, 2)" in message


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_awq_experts_are_stacked_in_first_and_come_back_bit_for_bit(make_checkpoint, tmp_path, expert_parallel):
    """AWQ experts (vLLM's AWQMarlinMoEMethod): each expert's [in, out/8] qweight, qzeros and scales stacked as
    [E, in, out]: gate's and up's column slices side by side in w13 as in a dense gate_up, down's rows cut like
    a dense down_proj; under EP each rank holds whole experts."""
    source, _ = make_checkpoint(quantized(MIXTRAL, AWQ))
    original, rank, (experts, rows) = cut_and_rebuilt(source, tmp_path, expert_parallel)
    stack = MIXTRAL_STACK
    assert rank[stack + "w13_qweight"][:2] == ("I32", [experts, 128, 2 * rows // 8])
    assert rank[stack + "w13_scales"][:2] == ("BF16", [experts, 128 // 32, 2 * rows])
    assert rank[stack + "w2_qweight"][:2] == ("I32", [experts, rows, 128 // 8])
    assert rank[stack + "w2_qzeros"][:2] == ("I32", [experts, rows // 32, 128 // 8])
    # Rank 1's w13 rows begin with its half of expert 0's gate (TP) or expert 2's whole gate (EP).
    expert = 2 if expert_parallel else 0
    gate = original[f"model.layers.0.block_sparse_moe.experts.{expert}.w1.qweight"]
    begin = 0 if expert_parallel else 128 // 8
    assert rank[stack + "w13_qweight"][2][:4 * (rows // 8)] == gate[2][4 * begin:4 * (begin + rows // 8)]


def test_awq_experts_vllm_would_load_through_moe_wna16_are_refused(make_checkpoint, tmp_path):
    """Group 16 is no Marlin MoE group size: vLLM 0.32 would build MoeWNA16's layout, not the one cut here."""
    source, _ = make_checkpoint(quantized(MIXTRAL, AWQ, group_size=16))
    with pytest.raises(ShardError, match="group_size 16: vLLM 0.32 loads them through MoeWNA16"):
        ShardJob.prepare(source, tmp_path / "out", tp=2)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_gptq_experts_are_stacked_with_the_zeroed_biases_vllm_registers(make_checkpoint, tmp_path, expert_parallel):
    """GPTQ experts (AutoGPTQMoEMethod): [E, in / 8, out] qweight, [E, in / group, out] scales, qzeros; plus
    the w13_bias/w2_bias it registers zeroed, which ShardedStateLoader requires and unshard checks are zero.
    Every expert is quantized whatever modules_in_block_to_quantize says (vLLM asks no list for FusedMoE)."""
    source, _ = make_checkpoint(quantized(MIXTRAL, GPTQ, modules_in_block_to_quantize=[["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"]]))
    _, rank, (experts, rows) = cut_and_rebuilt(source, tmp_path, expert_parallel, dropped=".g_idx")
    stack = MIXTRAL_STACK
    assert rank[stack + "w13_qweight"][:2] == ("I32", [experts, 128 // 8, 2 * rows])
    assert rank[stack + "w2_qweight"][:2] == ("I32", [experts, rows // 8, 128])
    assert rank[stack + "w2_scales"][:2] == ("BF16", [experts, rows // 32, 128])
    for bias, width in (("w13_bias", 2 * rows), ("w2_bias", 128)):
        dtype, shape, data = rank[stack + bias]
        assert (dtype, shape) == ("BF16", [experts, width]) and not any(data)
    # A non-zero bias would be a different model: unshard refuses it.
    _poke(tmp_path / "cut" / "model-rank-1-part-0.safetensors", stack + "w2_bias")
    with pytest.raises(IntegrityError, match="w2_bias: padding is not zero"):
        unshard(tmp_path / "cut", tmp_path / "again")


def _poke(path, name: str) -> None:
    """Set the first byte of tensor `name` in a rank file to 1 and re-sign the manifest (so that only unshard's
    layout checks can catch it)."""
    import struct

    from ferry_worker.manifest import sha256_file, write_manifest

    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    begin = json.loads(data[8:8 + length])[name]["data_offsets"][0]
    data[8 + length + begin] = 1
    path.write_bytes(bytes(data))
    manifest = read_manifest(path.parent)
    manifest.files = [f if f.path != path.name else type(f)(f.path, f.size, sha256_file(path)) for f in manifest.files]
    write_manifest(path.parent, manifest)


@pytest.mark.parametrize("missing", ["zero_point", "desc_act"])
def test_a_setting_vllm_requires_is_required(make_checkpoint, tmp_path, missing):
    base = AWQ if missing == "zero_point" else GPTQ
    source, _ = make_checkpoint(quantized(LLAMA3, base))
    config = json.loads((source / "config.json").read_text())
    del config["quantization_config"][missing]
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(ShardError, match=f"{missing} is missing; vLLM 0.32 refuses"):
        ShardJob.prepare(source, tmp_path / "out", tp=2)


def test_an_integer_tensor_outside_a_quantized_module_is_refused(make_checkpoint, tmp_path):
    """Without modules_in_block_to_quantize vLLM counts the module of every integer tensor as quantized; a
    g_idx (which the cut skips) with no qweight beside it would put a module no one can read back into the
    artifact's config.json."""
    source, weights = make_checkpoint(quantized(LLAMA3, GPTQ))
    weights["model.layers.0.self_attn.rotary.g_idx"] = ("I32", [4], bytes(16))
    for path in source.glob("*.safetensors"):
        path.unlink()
    write_weights(source, weights, 2)
    with pytest.raises(ShardError, match="integer tensor.*model.layers.0.self_attn.rotary.g_idx"):
        ShardJob.prepare(source, tmp_path / "out", tp=2)


def test_a_checkpoint_with_fused_modules_is_refused(make_checkpoint, tmp_path):
    """Phi-3 ships qkv_proj and gate_up_proj fused; vLLM then asks the quantization config about the fused
    names themselves, which Ferry's module rules do not model yet."""
    source, _ = make_checkpoint(quantized(PHI3, GPTQ))
    with pytest.raises(ShardError, match="already fused is not cut for GPTQ"):
        ShardJob.prepare(source, tmp_path / "out", tp=2)
