"""Ferry's rank files against an independent numpy rendering of vLLM's weight
loaders, for every family, TP in {1, 2, 4, 8} and PP in {1, 2}; and the rules
that differ by vLLM release or refuse a target."""
from __future__ import annotations

import json

import pytest

from ferry_worker.shard.job import ShardJob
from ferry_worker.shard.model import ShardError, pp_layer_ranges

from checkpoints import ALL_CASES, LLAMA3, LLAMA32_TIED, QWEN2, ModelCase, read_safetensors
from vllm_reference import as_arrays, rank_state_dict


def _artifact_ranks(output, plan) -> dict[tuple[int, int], dict]:
    ranks: dict[tuple[int, int], dict] = {}
    for f in plan.files:
        ranks.setdefault((f.pp_rank, f.tp_rank), {}).update(read_safetensors(output / f.name))
    return ranks


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.name)
def test_rank_files_match_vllm_weight_loaders(make_checkpoint, tmp_path, case: ModelCase, tp: int, pp: int):
    source, weights = make_checkpoint(case)
    job = ShardJob.prepare(source, tmp_path / "out", tp=tp, pp=pp, vllm_version="0.32")
    job.run()
    ranks = _artifact_ranks(tmp_path / "out", job.plan)
    assert sorted(ranks) == [(p, t) for p in range(pp) for t in range(tp)]
    tensors = as_arrays(weights)
    for (pp_rank, tp_rank), actual in ranks.items():
        expected = rank_state_dict(case.config, tensors, tp=tp, tp_rank=tp_rank, pp=pp, pp_rank=pp_rank,
                                   scale_buffers=True)
        assert sorted(actual) == sorted(expected), f"keys of pp {pp_rank} tp {tp_rank}"
        for name, (dtype, array) in expected.items():
            assert actual[name][:2] == (dtype, list(array.shape)), name
            assert actual[name][2] == array.tobytes(), f"{name} bytes (pp {pp_rank}, tp {tp_rank})"


@pytest.mark.parametrize("version, scales", [("0.8.5", False), ("0.13.0", False), ("0.14", True), ("0.33.2", True)])
def test_attention_scale_buffers_follow_the_vllm_release(make_checkpoint, tmp_path, version, scales):
    source, _ = make_checkpoint(LLAMA3)
    job = ShardJob.prepare(source, tmp_path / "out", tp=2, vllm_version=version)
    keys = {t.name for f in job.plan.files for t in f.tensors}
    assert ("model.layers.0.self_attn.attn._k_scale" in keys) is scales
    assert {k for k in keys if k.endswith("_scale")} == (
        {f"model.layers.{i}.self_attn.attn._{x}_scale" for i in range(3) for x in ("k", "v", "q", "prob")}
        if scales else set())


def test_file_names_follow_the_vllm_release(make_checkpoint, tmp_path):
    source, _ = make_checkpoint(LLAMA3)
    tp_only = ShardJob.prepare(source, tmp_path / "a", tp=2, pp=1, vllm_version="0.32.0")
    assert [f.name for f in tp_only.plan.files] == ["model-rank-0-part-0.safetensors",
                                                    "model-rank-1-part-0.safetensors"]
    staged = ShardJob.prepare(source, tmp_path / "b", tp=2, pp=2, vllm_version="0.32.0")
    assert [f.name for f in staged.plan.files] == [f"model-pp-{p}-tp-{t}-part-0.safetensors"
                                                   for p in range(2) for t in range(2)]
    with pytest.raises(ShardError, match="pipeline parallelism needs vLLM >= 0.32"):
        ShardJob.prepare(source, tmp_path / "c", tp=2, pp=2, vllm_version="0.31.1")


@pytest.mark.parametrize("version", ["0.8.4", "0.7", "0.34.0", "1.0", "latest", "0.32-rc1"])
def test_unknown_vllm_release_is_refused(make_checkpoint, tmp_path, version):
    source, _ = make_checkpoint(LLAMA3)
    with pytest.raises(ShardError, match="vLLM"):
        ShardJob.prepare(source, tmp_path / "out", tp=2, vllm_version=version)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("edits, tp, message", [
    ({}, 3, "does not divide: 8 attention heads"),
    ({"num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 16}, 2, "3 KV heads"),
    ({"intermediate_size": 100}, 8, "intermediate size 100"),
])
def test_tensor_parallel_size_that_vllm_would_reject_is_refused(make_checkpoint, tmp_path, edits, tp, message):
    case = ModelCase("edited", {**LLAMA3.config, **edits}, "BF16")
    source, _ = make_checkpoint(case)
    with pytest.raises(ShardError, match=message):
        ShardJob.prepare(source, tmp_path / "out", tp=tp)


@pytest.mark.parametrize("edits, message", [
    ({"architectures": ["GPT2LMHeadModel"]}, "not supported by ferry shard; supported: .*LlamaForCausalLM.*MixtralForCausalLM"),
    ({"architectures": []}, "not supported"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
])
def test_unsupported_model_is_refused(make_checkpoint, tmp_path, edits, message):
    source, _ = make_checkpoint(LLAMA3)
    (source / "config.json").write_text(json.dumps({**LLAMA3.config, **edits}))
    with pytest.raises(ShardError, match=message):
        ShardJob.prepare(source, tmp_path / "out", tp=2)


def test_parts_split_like_vllms_saver(make_checkpoint, tmp_path):
    source, _ = make_checkpoint(LLAMA32_TIED)
    whole = ShardJob.prepare(source, tmp_path / "whole", tp=2)
    limit = 100_000
    job = ShardJob.prepare(source, tmp_path / "out", tp=2, max_part_size=limit)
    job.run()
    for tp_rank in range(2):
        parts = [f for f in job.plan.files if f.tp_rank == tp_rank]
        assert [f.name for f in parts] == [f"model-rank-{tp_rank}-part-{n}.safetensors" for n in range(len(parts))]
        assert len(parts) > 2
        # Order kept, each part under the limit unless one tensor alone exceeds it.
        assert [t.name for f in parts for t in f.tensors] == [
            t.name for f in whole.plan.files if f.tp_rank == tp_rank for t in f.tensors]
        for part, following in zip(parts, parts[1:]):
            assert part.data_bytes <= limit or len(part.tensors) == 1
            assert part.data_bytes + following.tensors[0].nbytes > limit
        merged = {}
        for part in parts:
            merged |= read_safetensors(tmp_path / "out" / part.name)
        assert len(merged) == sum(len(p.tensors) for p in parts)


@pytest.mark.parametrize("layers, pp, ranges", [
    (3, 2, [(0, 2), (2, 3)]),
    (32, 4, [(0, 8), (8, 16), (16, 24), (24, 32)]),
    (10, 4, [(0, 2), (2, 5), (5, 8), (8, 10)]),  # remainder to the stages before the last
    (5, 4, [(0, 1), (1, 2), (2, 4), (4, 5)]),
])
def test_pipeline_layer_ranges_follow_get_pp_indices(layers, pp, ranges):
    assert pp_layer_ranges(layers, pp) == ranges


def test_explicit_layer_partition_is_checked():
    assert pp_layer_ranges(5, 2, [1, 4]) == [(0, 1), (1, 5)]
    with pytest.raises(ShardError, match="summing to 5"):
        pp_layer_ranges(5, 2, [1, 3])
    with pytest.raises(ShardError, match="without layers"):
        pp_layer_ranges(2, 3)


def test_tied_embedding_is_written_once_as_lm_head(make_checkpoint, tmp_path):
    source, _ = make_checkpoint(QWEN2)
    job = ShardJob.prepare(source, tmp_path / "out", tp=2, pp=2)
    keys = {(f.pp_rank, t.name) for f in job.plan.files for t in f.tensors}
    assert (0, "model.embed_tokens.weight") in keys and (0, "lm_head.weight") not in keys
    # The last stage holds the tied pair too (vLLM builds both), saved once.
    assert (1, "lm_head.weight") in keys and (1, "model.embed_tokens.weight") not in keys
