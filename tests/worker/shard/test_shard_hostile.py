"""Checkpoints that do not match their config, and outputs that are not ours:
refused with a message naming the problem, and never a manifest."""
from __future__ import annotations

import json
import os
import tracemalloc

import numpy as np
import pytest

from ferry_worker.manifest import MANIFEST_NAME
from ferry_worker.shard.job import ShardJob
from ferry_worker.shard.model import ShardError

from checkpoints import LLAMA3, LLAMA32_TIED, QWEN2, QWEN3, random_weights, to_dtype_bytes


def _no_artifact(output) -> bool:
    return not (output / MANIFEST_NAME).exists()


def _weights(case, edit):
    weights = random_weights(case.config, case.dtype)
    edit(weights)
    return weights


def test_missing_tensor_is_named(make_checkpoint, tmp_path):
    source, _ = make_checkpoint(QWEN2, weights=_weights(QWEN2, lambda w: w.pop("model.layers.1.self_attn.k_proj.bias")))
    with pytest.raises(ShardError, match=r"missing tensor\(s\): model\.layers\.1\.self_attn\.k_proj\.bias"):
        ShardJob.prepare(source, tmp_path / "out", tp=2)
    assert not (tmp_path / "out").exists()


def test_wrong_shape_is_named_with_both_shapes(make_checkpoint, tmp_path):
    def transpose_down(w):
        dtype, shape, raw = w["model.layers.2.mlp.down_proj.weight"]
        w["model.layers.2.mlp.down_proj.weight"] = (dtype, shape[::-1], raw)
    source, _ = make_checkpoint(LLAMA3, weights=_weights(LLAMA3, transpose_down))
    with pytest.raises(ShardError, match=r"model\.layers\.2\.mlp\.down_proj\.weight has shape \[256, 128\], "
                                         r"expected \[128, 256\]"):
        ShardJob.prepare(source, tmp_path / "out", tp=2)
    assert _no_artifact(tmp_path / "out")


def test_unexpected_tensor_is_named(make_checkpoint, tmp_path):
    def add_extra(w):
        w["model.layers.0.mlp.experts.0.weight"] = ("BF16", [4], to_dtype_bytes(np.ones(4), "BF16"))
    source, _ = make_checkpoint(LLAMA3, weights=_weights(LLAMA3, add_extra))
    with pytest.raises(ShardError, match=r"unexpected tensor\(s\).*model\.layers\.0\.mlp\.experts\.0\.weight"):
        ShardJob.prepare(source, tmp_path / "out", tp=2)
    assert _no_artifact(tmp_path / "out")


def test_more_layers_than_config_is_unexpected(make_checkpoint, tmp_path):
    def add_layer(w):
        w["model.layers.3.input_layernorm.weight"] = w["model.layers.2.input_layernorm.weight"]
    source, _ = make_checkpoint(LLAMA3, weights=_weights(LLAMA3, add_layer))
    with pytest.raises(ShardError, match=r"model\.layers\.3\.input_layernorm\.weight"):
        ShardJob.prepare(source, tmp_path / "out", tp=2)


def test_fused_tensors_with_different_dtypes_are_refused(make_checkpoint, tmp_path):
    def fp16_k(w):
        _, shape, _ = w["model.layers.0.self_attn.k_proj.weight"]
        w["model.layers.0.self_attn.k_proj.weight"] = ("F16", shape, to_dtype_bytes(np.zeros(shape), "F16"))
    source, _ = make_checkpoint(LLAMA3, weights=_weights(LLAMA3, fp16_k))
    with pytest.raises(ShardError, match="qkv_proj.weight fuses .* whose dtypes differ"):
        ShardJob.prepare(source, tmp_path / "out", tp=2)


def test_tied_config_with_a_different_lm_head_is_refused_before_writing(make_checkpoint, tmp_path):
    def untied_copy(w):
        dtype, shape, raw = w["model.embed_tokens.weight"]
        w["lm_head.weight"] = (dtype, shape, bytes(reversed(raw)))
    source, _ = make_checkpoint(LLAMA32_TIED, weights=_weights(LLAMA32_TIED, untied_copy))
    job = ShardJob.prepare(source, tmp_path / "out", tp=2)
    with pytest.raises(ShardError, match="ties lm_head.weight to model.embed_tokens.weight, but the checkpoint's "
                                         "lm_head.weight differs"):
        job.run()
    assert not (tmp_path / "out").exists()


def test_tied_config_with_an_identical_lm_head_copy_is_accepted(make_checkpoint, tmp_path):
    def same_copy(w):
        w["lm_head.weight"] = w["model.embed_tokens.weight"]
    source, _ = make_checkpoint(LLAMA32_TIED, weights=_weights(LLAMA32_TIED, same_copy))
    manifest = ShardJob.prepare(source, tmp_path / "out", tp=2).run()
    assert manifest.extra["skippedTensors"] == {"lm_head.weight": "tied copy of model.embed_tokens.weight"}


def test_checkpoint_changed_during_the_cut_leaves_no_manifest(make_checkpoint, tmp_path):
    source, _ = make_checkpoint(LLAMA3)
    job = ShardJob.prepare(source, tmp_path / "out", tp=2)
    for weights in source.glob("*.safetensors"):
        os.truncate(weights, weights.stat().st_size // 2)
    with pytest.raises(ShardError, match="unexpected end of file"):
        job.run()
    assert _no_artifact(tmp_path / "out")


def test_pickled_weights_are_never_read(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x02pickle")
    with pytest.raises(ShardError, match=r"no \*.safetensors weights \(found pytorch_model.bin: ferry never unpickles"):
        ShardJob.prepare(tmp_path, tmp_path / "out", tp=1)


def test_malformed_safetensors_header_is_refused(make_checkpoint, tmp_path):
    source, _ = make_checkpoint(LLAMA32_TIED)
    (source / "model.safetensors").write_bytes((2**40).to_bytes(8, "little") + b"{}")
    with pytest.raises(ShardError, match="header length"):
        ShardJob.prepare(source, tmp_path / "out", tp=1)


def test_index_naming_a_missing_file_is_refused(make_checkpoint, tmp_path):
    source, _ = make_checkpoint(LLAMA3)
    (source / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ShardError, match="names file\\(s\\) that are missing: model-00002-of-00002.safetensors"):
        ShardJob.prepare(source, tmp_path / "out", tp=1)


@pytest.mark.parametrize("outside", ["../other/model.safetensors", "/etc/ferry.safetensors", ".."])
def test_an_index_naming_a_file_outside_the_checkpoint_is_refused(make_checkpoint, tmp_path, outside):
    """weight_map values are file names in the checkpoint's directory: one that leads out of it (another
    object's files on a shared claim) is refused before anything is read."""
    source, _ = make_checkpoint(LLAMA3)
    index = json.loads((source / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = outside
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ShardError, match="weight_map names file\\(s\\) outside the checkpoint's directory"):
        ShardJob.prepare(source, tmp_path / "out", tp=1)


def test_output_holding_another_artifact_is_refused(make_checkpoint, tmp_path):
    source, _ = make_checkpoint(LLAMA3)
    ShardJob.prepare(source, tmp_path / "out", tp=2, max_part_size=200_000).run()
    with pytest.raises(ShardError, match="already holds a complete artifact"):
        ShardJob.prepare(source, tmp_path / "out", tp=2)
    (tmp_path / "out" / MANIFEST_NAME).unlink()
    # One part per rank this time: the old part-1 files would still match
    # vLLM's `model-rank-{r}-part-*` glob and load over the new weights.
    with pytest.raises(ShardError, match="holds files this cut would not write: model-rank-0-part-1"):
        ShardJob.prepare(source, tmp_path / "out", tp=2)


def test_output_equal_to_the_source_is_refused(make_checkpoint, tmp_path):
    source, _ = make_checkpoint(LLAMA3)
    with pytest.raises(ShardError, match="must differ"):
        ShardJob.prepare(source, source, tp=2)


def _edit_config(source, **edits) -> None:
    """The checkpoint as written, its config.json claiming other sizes."""
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, **edits}))


BILLION = 1_000_000_000


def test_a_billion_layers_is_refused_before_anything_is_sized_by_it(make_checkpoint, tmp_path):
    source, _ = make_checkpoint(LLAMA3)
    _edit_config(source, num_hidden_layers=BILLION)
    tracemalloc.start()
    try:
        with pytest.raises(ShardError) as refused:
            ShardJob.prepare(source, tmp_path / "out", tp=2)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert str(refused.value) == (f"config.json: num_hidden_layers is {BILLION}, but the checkpoint holds "
                                  f"3 layer(s), numbered 0 to 2")
    assert peak < 32 << 20  # a table with an entry per claimed layer would need tens of GiB
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case, edits, message", [
    (LLAMA3, {"vocab_size": BILLION},
     f"vocab_size is {BILLION}, but the checkpoint's model.embed_tokens.weight has 1000 on dim 0 (shape [1000, 128])"),
    (LLAMA3, {"hidden_size": BILLION},
     f"hidden_size is {BILLION}, but the checkpoint's model.embed_tokens.weight has 128 on dim 1 (shape [1000, 128])"),
    (LLAMA3, {"intermediate_size": BILLION},
     f"intermediate_size is {BILLION}, but the checkpoint's model.layers.0.mlp.gate_proj.weight has 256 on dim 0 "
     f"(shape [256, 128])"),
    (LLAMA32_TIED, {"num_attention_heads": BILLION},
     f"num_attention_heads x head_dim is {BILLION} x 16 = {16 * BILLION}, "
     f"but the checkpoint's model.layers.0.self_attn.q_proj.weight has 128 on dim 0 (shape [128, 128])"),
    (LLAMA3, {"num_key_value_heads": BILLION},
     f"num_key_value_heads x head_dim is {BILLION} x 16 = {16 * BILLION}, "
     f"but the checkpoint's model.layers.0.self_attn.k_proj.weight has 32 on dim 0 (shape [32, 128])"),
    (QWEN3, {"head_dim": BILLION},
     f"num_attention_heads x head_dim is 8 x {BILLION} = {8 * BILLION}, "
     f"but the checkpoint's model.layers.0.self_attn.q_proj.weight has 256 on dim 0 (shape [256, 128])"),
    (LLAMA3, {"num_attention_heads": BILLION}, f"hidden_size 128 // num_attention_heads {BILLION} leaves head_dim 0"),
    (LLAMA3, {"num_key_value_heads": "2"}, "num_key_value_heads must be a positive integer, got '2'"),
    (LLAMA32_TIED, {"head_dim": -16}, "head_dim must be a positive integer, got -16"),
], ids=["vocab", "hidden", "intermediate", "heads", "kv-heads", "head-dim", "heads-no-head-dim", "kv-not-int",
        "negative-head-dim"])
def test_config_sizes_the_tensors_contradict_are_named(make_checkpoint, tmp_path, case, edits, message):
    source, _ = make_checkpoint(case)
    _edit_config(source, **edits)
    with pytest.raises(ShardError) as refused:
        ShardJob.prepare(source, tmp_path / "out", tp=1)
    assert str(refused.value) == f"config.json: {message}"


def test_a_pipeline_size_past_the_layers_is_refused_before_it_is_allocated():
    from ferry_worker.shard.model import pp_layer_ranges
    tracemalloc.start()
    try:
        with pytest.raises(ShardError, match=f"pipeline parallel size {BILLION} leaves a stage without layers"):
            pp_layer_ranges(3, BILLION)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # not a list of a billion stage sizes
