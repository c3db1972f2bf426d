"""FP8 block-scaled cuts: scales cut with their weights in block units, vLLM's
rule for which modules stay unquantized, and every checkpoint or target that
vLLM would load wrongly, refused by name before a byte is written. (That the
files are the state vLLM builds is test_shard_vllm_fp8's job; that nothing is
lost, the round trip's, below.)

Blocks of 16 here keep the tensors small; the rules do not depend on the size
(the vLLM test uses DeepSeek's 128).
"""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from ferry_worker.shard.experts import MoeTarget
from ferry_worker.shard.job import ShardJob
from ferry_worker.shard.model import ShardError
from ferry_worker.shard.unshard import UNSHARDED_NAME, unshard
from ferry_worker.tensorize.errors import ArtifactError
from ferry_worker.tensorize.layouts import refuse_quantized

from checkpoints import (DEEPSEEK_V2, DEEPSEEK_V3, LLAMA3, LLAMA32_TIED, MIXTRAL, PHI3, QWEN3, QWEN3_MOE, ModelCase,
                         fp8_block_config, fp8_block_scaled, random_weights, read_safetensors, write_checkpoint)

BLOCK = [16, 16]


def fp8(case: ModelCase, block=BLOCK, not_converted: tuple[str, ...] = (), **edits) -> ModelCase:
    config = fp8_block_config({**case.config, **edits}, block, not_converted)
    return ModelCase(case.name + "-fp8", config, case.dtype, case.files, case.extra_tensors)


QWEN3_MOE_GATES = tuple(f"model.layers.{i}.mlp.gate" for i in range(QWEN3_MOE.config["num_hidden_layers"]))
FP8_CASES = (fp8(LLAMA3), fp8(LLAMA32_TIED), fp8(QWEN3), fp8(PHI3), fp8(MIXTRAL),
             fp8(QWEN3_MOE, not_converted=QWEN3_MOE_GATES), fp8(DEEPSEEK_V2), fp8(DEEPSEEK_V3))


def _rank(directory, rank: int) -> dict:
    return read_safetensors(directory / f"model-rank-{rank}-part-0.safetensors")


def _array(weights, name: str) -> np.ndarray:
    dtype, shape, raw = weights[name]
    return np.frombuffer(raw, dtype={"F8_E4M3": np.uint8, "F32": np.float32, "BF16": np.uint16}[dtype]).reshape(shape)


# At TP 4 the MoE, MLA and Phi-3 shapes here leave partial blocks (refused, below).
ROUND_TRIPS = [(case, tp) for case in FP8_CASES for tp in (1, 2)] + [(c, 4) for c in FP8_CASES[:3]]


@pytest.mark.parametrize("case, tp", ROUND_TRIPS, ids=[f"{c.name}-tp{tp}" for c, tp in ROUND_TRIPS])
def test_fp8_round_trip_is_bit_exact(make_checkpoint, tmp_path, case, tp):
    source, weights = make_checkpoint(case)
    ShardJob.prepare(source, tmp_path / "sharded", tp=tp).run()
    unshard(tmp_path / "sharded", tmp_path / "rebuilt")
    rebuilt = read_safetensors(tmp_path / "rebuilt" / UNSHARDED_NAME)
    expected = {n: w for n, w in weights.items() if n not in case.extra_tensors}
    assert sorted(rebuilt) == sorted(expected)
    assert all(tuple(rebuilt[n]) == tuple(w) for n, w in expected.items())
    assert any(dtype == "F8_E4M3" for dtype, _, _ in rebuilt.values())


@pytest.mark.parametrize("case", [fp8(MIXTRAL), fp8(QWEN3_MOE, not_converted=QWEN3_MOE_GATES), fp8(DEEPSEEK_V3)],
                         ids=lambda c: c.name)
def test_fp8_expert_parallel_round_trip_is_bit_exact(make_checkpoint, tmp_path, case):
    source, weights = make_checkpoint(case)
    ShardJob.prepare(source, tmp_path / "sharded", tp=2, moe=MoeTarget(expert_parallel=True)).run()
    unshard(tmp_path / "sharded", tmp_path / "rebuilt")
    rebuilt = read_safetensors(tmp_path / "rebuilt" / UNSHARDED_NAME)
    assert all(tuple(rebuilt[n]) == tuple(w) for n, w in weights.items() if n not in case.extra_tensors)


def test_scales_are_cut_with_their_weights_in_blocks(make_checkpoint, tmp_path):
    """Llama-3 at TP 2 (8 heads x 16, 2 KV heads x 16, intermediate 256) in 16 x 16 blocks."""
    source, weights = make_checkpoint(fp8(LLAMA3))
    manifest = ShardJob.prepare(source, tmp_path / "out", tp=2).run()
    assert manifest.extra["quantization"] == {"method": "fp8", "weightBlockSize": BLOCK, "scaleDtype": "F32",
                                              "moeScaleGrid": "checkpoint blocks"}
    p = "model.layers.1."
    for rank in range(2):
        files = _rank(tmp_path / "out", rank)
        qkv_scale = _array(files, p + "self_attn.qkv_proj.weight_scale_inv")
        q, k, v = (_array(weights, f"{p}self_attn.{x}_proj.weight_scale_inv") for x in "qkv")
        # q: 64 rows per rank = 4 blocks; k, v: one KV head (16 rows) per rank = 1 block each.
        assert np.array_equal(qkv_scale, np.concatenate([q[4 * rank:4 * rank + 4], k[rank:rank + 1], v[rank:rank + 1]]))
        down_scale = _array(files, p + "mlp.down_proj.weight_scale_inv")  # row-parallel: columns in blocks
        assert np.array_equal(down_scale, _array(weights, p + "mlp.down_proj.weight_scale_inv")[:, 8 * rank:8 * rank + 8])
        down = _array(files, p + "mlp.down_proj.weight")
        assert files[p + "mlp.down_proj.weight"][0] == "F8_E4M3"
        assert np.array_equal(down, _array(weights, p + "mlp.down_proj.weight")[:, 128 * rank:128 * rank + 128])
        # Attention's FP8 parameters: 0-d, the model dtype, vLLM's "unset" -1.0; its buffers as before.
        for name in ("q_scale", "k_scale", "v_scale", "prob_scale"):
            assert files[p + "self_attn.attn." + name] == ("BF16", [], struct.pack("<f", -1.0)[2:])
        assert files[p + "self_attn.attn._k_scale"] == ("F32", [], struct.pack("<f", 1.0))
        assert files["model.embed_tokens.weight"][0] == "BF16" and "model.embed_tokens.weight_scale_inv" not in files


def test_mla_has_no_attention_parameters_and_fuses_the_scales_of_q_a_and_kv_a(make_checkpoint, tmp_path):
    source, weights = make_checkpoint(fp8(DEEPSEEK_V3))
    ShardJob.prepare(source, tmp_path / "out", tp=2).run()
    files = _rank(tmp_path / "out", 1)
    assert not [n for n in files if n.endswith(("attn.q_scale", "attn.prob_scale"))]
    p = "model.layers.1.self_attn."
    fused = _array(files, p + "fused_qkv_a_proj.weight_scale_inv")  # replicated: both scales whole
    assert np.array_equal(fused, np.concatenate([_array(weights, p + "q_a_proj.weight_scale_inv"),
                                                 _array(weights, p + "kv_a_proj_with_mqa.weight_scale_inv")]))
    assert files["model.layers.1.mlp.experts.gate.e_score_correction_bias"][0] == "F32"
    assert files["model.layers.1.mlp.experts.gate.weight"][0] == "BF16"


def test_expert_scales_are_stacked_like_their_weights(make_checkpoint, tmp_path):
    source, weights = make_checkpoint(fp8(MIXTRAL))  # 4 experts, intermediate 256, hidden 128
    ShardJob.prepare(source, tmp_path / "out", tp=2).run()
    for rank in range(2):
        w13 = _array(_rank(tmp_path / "out", rank), "model.layers.0.block_sparse_moe.experts.routed_experts."
                                                    "w13_weight_scale_inv")
        assert w13.shape == (4, 2 * 8, 8)
        for e in range(4):
            expert = f"model.layers.0.block_sparse_moe.experts.{e}."
            gate, up = (_array(weights, expert + f"{w}.weight_scale_inv")[8 * rank:8 * rank + 8] for w in ("w1", "w3"))
            assert np.array_equal(w13[e], np.concatenate([gate, up]))


def test_modules_not_converted_stay_unquantized_as_vllm_decides(make_checkpoint, tmp_path):
    """Qwen3-MoE hands its router the quant config: quantized unless listed (Qwen3-*-FP8 list every router)."""
    listed = fp8(QWEN3_MOE, not_converted=QWEN3_MOE_GATES)
    source, _ = make_checkpoint(listed)
    ShardJob.prepare(source, tmp_path / "out", tp=2).run()
    files = _rank(tmp_path / "out", 0)
    assert files["model.layers.1.mlp.experts.gate.weight"][0] == "BF16"
    assert "model.layers.1.mlp.experts.gate.weight_scale_inv" not in files
    # Not listed: vLLM quantizes the router, and a checkpoint that did too is cut with its scale.
    unlisted = fp8(QWEN3_MOE)
    weights = fp8_block_scaled(random_weights(unlisted.config, "BF16"), unlisted.config, routers=True)
    write_checkpoint(tmp_path / "routers", unlisted, weights=weights)
    ShardJob.prepare(tmp_path / "routers", tmp_path / "out2", tp=2).run()
    files = _rank(tmp_path / "out2", 0)
    assert files["model.layers.1.mlp.experts.gate.weight"][0] == "F8_E4M3"
    assert files["model.layers.1.mlp.experts.gate.weight_scale_inv"][1] == [1, 8]
    # A fused module is skipped when its own name is listed, or when all its parts are.
    parts = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj",
             "model.layers.2.mlp.gate_proj", "model.layers.2.mlp.up_proj")
    weights = fp8_block_scaled(random_weights(LLAMA3.config, "BF16"), fp8(LLAMA3, not_converted=parts).config)
    listed = fp8(LLAMA3, not_converted=("model.layers.0.self_attn.qkv_proj", *parts[3:]))
    write_checkpoint(tmp_path / "fused", listed, weights=weights)
    ShardJob.prepare(tmp_path / "fused", tmp_path / "out3", tp=2).run()
    files = _rank(tmp_path / "out3", 1)
    assert files["model.layers.0.self_attn.qkv_proj.weight"][0] == "BF16"
    assert files["model.layers.2.mlp.gate_up_proj.weight"][0] == "BF16"
    assert "model.layers.2.mlp.gate_up_proj.weight_scale_inv" not in files
    assert files["model.layers.2.mlp.down_proj.weight"][0] == "F8_E4M3"
    assert files["model.layers.1.self_attn.qkv_proj.weight"][0] == "F8_E4M3"


def _written(make_checkpoint, case, name="checkpoint", edit=None):
    source, weights = make_checkpoint(case, name=name)
    if edit is not None:
        edit(weights)
        write_checkpoint(source, case, weights=weights)
    return source


def _bf16(weights, name):
    _, shape, _ = weights[name]
    weights[name] = ("BF16", shape, bytes(2 * int(np.prod(shape))))
    weights.pop(name + "_scale_inv", None)


@pytest.mark.parametrize("quantization, message", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method is 'bitsandbytes'"),
    ({"quant_method": "fp8", "activation_scheme": "per-token"}, "per-tensor FP8 with"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e5m2"}, "e4m3"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [16, 16]}, "activation_scheme"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16]}, "two positive integers"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16], "fmt": "e5m2"}, "e4m3"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16], "store_dtype": "mxfp4"},
     "MXFP4"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16],
      "ignored_layers": "lm_head"}, "list of module names"),
    ("fp8", "must be an object"),
])
def test_quantization_configs_vllm_or_ferry_would_not_load_are_refused(make_checkpoint, tmp_path, quantization,
                                                                       message):
    source, _ = make_checkpoint(LLAMA3)
    (source / "config.json").write_text(json.dumps({**LLAMA3.config, "quantization_config": quantization}))
    with pytest.raises(ShardError, match=message):
        ShardJob.prepare(source, tmp_path / "out", tp=2)


def test_checkpoint_dtypes_must_agree_with_the_config(make_checkpoint, tmp_path):
    case = fp8(LLAMA3)
    bf16_weight = _written(make_checkpoint, case, "a", lambda w: _bf16(w, "model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(ShardError, match=r"model.layers.1.mlp.down_proj.weight is BF16, expected F8_E4M3"):
        ShardJob.prepare(bf16_weight, tmp_path / "out", tp=2)

    def bf16_scale(w):
        _, shape, raw = w["model.layers.0.self_attn.o_proj.weight_scale_inv"]
        w["model.layers.0.self_attn.o_proj.weight_scale_inv"] = ("BF16", shape, raw[:len(raw) // 2])
    with pytest.raises(ShardError, match=r"o_proj.weight_scale_inv is BF16, expected F32"):
        ShardJob.prepare(_written(make_checkpoint, case, "b", bf16_scale), tmp_path / "out", tp=2)

    # FP8 tensors in a checkpoint whose config.json does not say it is quantized.
    source, weights = make_checkpoint(case, name="c")
    (source / "config.json").write_text(json.dumps(LLAMA3.config))
    with pytest.raises(ShardError, match="F8_E4M3, but config.json has no quantization_config"):
        ShardJob.prepare(source, tmp_path / "out", tp=2)

    # A module the config keeps unquantized, stored in FP8 anyway.
    listed = fp8(LLAMA3, not_converted=("model.layers.1.mlp.down_proj",))
    source, _ = make_checkpoint(fp8(LLAMA3), name="d")
    (source / "config.json").write_text(json.dumps(listed.config))
    with pytest.raises(ShardError, match="down_proj.weight is F8_E4M3, but config.json does not quantize it"):
        ShardJob.prepare(source, tmp_path / "out", tp=2)


def test_a_fused_layer_of_mixed_precision_is_refused(make_checkpoint, tmp_path):
    case = fp8(LLAMA3, not_converted=("model.layers.0.mlp.gate_proj",))
    source, _ = make_checkpoint(fp8(LLAMA3))
    (source / "config.json").write_text(json.dumps(case.config))
    with pytest.raises(ShardError, match="only some parts of model.layers.0.mlp.gate_up_proj.*gate_proj"):
        ShardJob.prepare(source, tmp_path / "out", tp=2)


@pytest.mark.parametrize("case, tp, moe, message", [
    # 8 query heads x 16 / 2 = 64 rows per rank: not whole 128-row blocks.
    (fp8(LLAMA3, block=[128, 128]), 2, MoeTarget(), r"qkv_proj.weight_scale_inv at tensor parallel size 2: rank 0 "
                                                    r"would hold rows \[0, 64\) of model.layers.0.self_attn.q_proj"),
    # TP 4 above the 2 KV heads: each rank holds one 16-row head, and the next part starts mid-block.
    (fp8(LLAMA3, block=[32, 32]), 4, MoeTarget(), r"rows \[0, 16\) of model.layers.0.self_attn.k_proj.weight.*"
                                                  r"not whole 32-wide FP8 scale blocks"),
    # o_proj at TP 4 with 48-column blocks: 32 input columns per rank.
    (fp8(LLAMA3, block=[16, 48]), 4, MoeTarget(), r"o_proj.weight_scale_inv.*columns \[0, 32\)"),
    # 48-wide blocks: expert intermediate 128 per rank is neither whole blocks nor a grid vLLM refines.
    (fp8(MIXTRAL, block=[48, 48]), 2, MoeTarget(), r"expert intermediate size is 128 \(moe_intermediate_size 256 / 2\), "
                                                   r"not whole 48x48.*gcd\(48, 48, 128, 128\) = 16, is below 32.*no tensor-parallel size"),
    (fp8(MIXTRAL), 2, MoeTarget(gpu="rocm"), "FP8 experts on ROCm"),
    (fp8(QWEN3_MOE, not_converted=QWEN3_MOE_GATES, block=[128, 128]), 2, MoeTarget(expert_parallel=True),
     r"intermediate size is 64 \(moe_intermediate_size 64 / 1\)"),
])
def test_cuts_that_leave_partial_blocks_are_refused(make_checkpoint, tmp_path, case, tp, moe, message):
    source, _ = make_checkpoint(case)
    with pytest.raises(ShardError, match=message):
        ShardJob.prepare(source, tmp_path / "out", tp=tp, moe=moe)


# Mixtral here: expert intermediate 256, hidden 128; attention left in bf16 so that only the experts'
# blocks decide the cut.
ATTENTION = tuple(f"model.layers.{i}.self_attn.{m}_proj" for i in range(MIXTRAL.config["num_hidden_layers"]) for m in "qkvo")
REFINED = [(fp8(MIXTRAL, block=[128, 128], not_converted=ATTENTION), 4, (2, 2)),  # 64 per rank: 64x64 blocks
           (fp8(MIXTRAL, block=[128, 128], not_converted=ATTENTION), 8, (4, 4))]  # 32 per rank: 32x32 blocks


@pytest.mark.parametrize("case, tp, factor", REFINED, ids=[f"tp{tp}" for _, tp, _ in REFINED])
def test_expert_scales_on_vllms_refined_grid(make_checkpoint, tmp_path, case, tp, factor):
    """vLLM's default MoE backend refines the experts' 128x128 grid where a rank's intermediate size is not
    whole blocks (refine_fp8_moe_block_shape), upsampling each checkpoint scale before the rank's cut: so
    does the cut, and unshard rebuilds the checkpoint's grid bit for bit."""
    source, weights = make_checkpoint(case)
    manifest = ShardJob.prepare(source, tmp_path / "out", tp=tp).run()
    assert manifest.extra["quantization"]["moeScaleGrid"] == {"refinedBlock": [128 // factor[0]] * 2,
                                                              "factor": list(factor)}
    p = "model.layers.1.block_sparse_moe."
    for rank in range(tp):
        files = _rank(tmp_path / "out", rank)
        w13 = _array(files, p + "experts.routed_experts.w13_weight_scale_inv")
        w2 = _array(files, p + "experts.routed_experts.w2_weight_scale_inv")
        rows = 256 // tp // (128 // factor[0])  # refined rows of each of gate and up on this rank
        for e in range(4):
            def up(name):
                scale = _array(weights, f"{p}experts.{e}.{name}.weight_scale_inv")
                return scale.repeat(factor[0], axis=0).repeat(factor[1], axis=1)
            expected = np.concatenate([up("w1")[rank * rows:(rank + 1) * rows], up("w3")[rank * rows:(rank + 1) * rows]])
            assert np.array_equal(w13[e], expected)
            assert np.array_equal(w2[e], up("w2")[:, rank * rows:(rank + 1) * rows])
    unshard(tmp_path / "out", tmp_path / "rebuilt")
    rebuilt = read_safetensors(tmp_path / "rebuilt" / UNSHARDED_NAME)
    assert all(tuple(rebuilt[n]) == tuple(w) for n, w in weights.items() if n not in case.extra_tensors)


def test_unshard_refuses_refined_scales_that_are_not_the_checkpoints_repeated(make_checkpoint, tmp_path):
    from ferry_worker.manifest import IntegrityError, read_manifest, sha256_file, write_manifest

    case, tp, _ = REFINED[0]
    source, _ = make_checkpoint(case)
    ShardJob.prepare(source, tmp_path / "out", tp=tp).run()
    rank_file = tmp_path / "out" / "model-rank-3-part-0.safetensors"
    header_len = int.from_bytes(rank_file.read_bytes()[:8], "little")
    entry = json.loads(rank_file.read_bytes()[8:8 + header_len])[
        "model.layers.0.block_sparse_moe.experts.routed_experts.w2_weight_scale_inv"]
    data = bytearray(rank_file.read_bytes())
    data[8 + header_len + entry["data_offsets"][1] - 1] ^= 0x01  # one repeat of the last expert's last scale
    rank_file.write_bytes(bytes(data))
    manifest = read_manifest(tmp_path / "out")  # re-signed: only unshard's layout check can catch it
    manifest.files = [f if f.path != rank_file.name else type(f)(f.path, f.size, sha256_file(rank_file))
                      for f in manifest.files]
    write_manifest(tmp_path / "out", manifest)
    with pytest.raises(IntegrityError, match="refined FP8 scale's repeats differ"):
        unshard(tmp_path / "out", tmp_path / "rebuilt")


@pytest.mark.parametrize("inter, hidden, tp, grid", [
    (768, 2048, 1, None), (768, 2048, 2, None),  # Qwen3-30B-A3B-FP8: 384 per rank is whole 128 blocks
    (768, 2048, 4, (2, 2)), (768, 2048, 8, (4, 4)),  # 192 and 96 per rank: 64 and 32 blocks
    (768, 2048, 16, False),  # 48 per rank: gcd 16, below vLLM's 32
    (1408, 2048, 4, (4, 4)),  # DeepSeek-V2-Lite's sizes: 352 per rank, 32 blocks
    (768, 2880, 4, False),  # a hidden size that is not whole 128 blocks: the refined scales would not line up
])
def test_which_grid_vllm_loads_the_experts_scales_on(inter, hidden, tp, grid):
    from ferry_worker.shard import fp8 as fp8_rules

    assert fp8_rules._moe_grid(inter, hidden, tp, (128, 128)) == grid


def test_fp8_needs_a_vllm_release_whose_layout_was_checked(make_checkpoint, tmp_path):
    source, _ = make_checkpoint(fp8(LLAMA3))
    with pytest.raises(ShardError, match="checked against vLLM 0.32 onwards; vLLM 0.14.0 is older"):
        ShardJob.prepare(source, tmp_path / "out", tp=2, vllm_version="0.14.0")


def test_tensorize_refuses_quantized_checkpoints_with_the_way_out():
    with pytest.raises(ArtifactError, match="casts every tensor to the model dtype.*use the sharded_state format"):
        refuse_quantized(fp8(LLAMA3).config)
    refuse_quantized(LLAMA3.config)  # unquantized: nothing to say
