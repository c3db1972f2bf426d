"""shard -> unshard gives back every tensor vLLM reads, bit for bit, for every
family, TP in {1, 2, 4, 8} and PP in {1, 2}; the artifact carries its
companions and a manifest that verifies."""
from __future__ import annotations

import json

import pytest

from ferry_worker.manifest import MANIFEST_NAME, IntegrityError, read_manifest, verify
from ferry_worker.shard.job import ShardJob
from ferry_worker.shard.unshard import UNSHARDED_NAME, unshard

from ferry_worker.shard.experts import MoeTarget

from checkpoints import (ALL_CASES, BREADTH_CASES, DEEPSEEK_V2, DEEPSEEK_V3, LLAMA3, LLAMA32_TIED, MIXTRAL, QWEN3_MOE,
                         ModelCase, read_safetensors)

COMPANIONS = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json"}


def _cuttable(case: ModelCase, tp: int) -> bool:
    """More ranks than experts or heads is refused (test_shard_moe, test_shard_layout), not cut."""
    config = case.config
    experts = config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts") or tp
    return experts >= tp and config["num_attention_heads"] % tp == 0


ROUND_TRIPS = [(case, tp, pp) for case in ALL_CASES + BREADTH_CASES for tp in (1, 2, 4, 8) for pp in (1, 2)
               if _cuttable(case, tp)]


@pytest.mark.parametrize("case, tp, pp", ROUND_TRIPS, ids=[f"{c.name}-tp{tp}-pp{pp}" for c, tp, pp in ROUND_TRIPS])
def test_round_trip_is_bit_exact(make_checkpoint, tmp_path, case: ModelCase, tp: int, pp: int):
    _assert_round_trip(make_checkpoint, tmp_path, case, tp=tp, pp=pp)


# 6 experts over 4 ranks: 2, 2, 1, 1.
MIXTRAL_6 = ModelCase("mixtral-6-experts", {**MIXTRAL.config, "num_local_experts": 6}, "BF16")


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("case", [MIXTRAL, MIXTRAL_6, QWEN3_MOE, DEEPSEEK_V2, DEEPSEEK_V3], ids=lambda c: c.name)
def test_expert_parallel_round_trip_is_bit_exact(make_checkpoint, tmp_path, case: ModelCase, tp: int):
    _assert_round_trip(make_checkpoint, tmp_path, case, tp=tp, pp=1, moe=MoeTarget(expert_parallel=True))


def _assert_round_trip(make_checkpoint, tmp_path, case: ModelCase, **target) -> None:
    source, weights = make_checkpoint(case)
    ShardJob.prepare(source, tmp_path / "sharded", **target).run()
    unshard(tmp_path / "sharded", tmp_path / "rebuilt")
    rebuilt = read_safetensors(tmp_path / "rebuilt" / UNSHARDED_NAME)
    read_by_vllm = {n: w for n, w in weights.items() if n not in case.extra_tensors}
    assert sorted(rebuilt) == sorted(read_by_vllm)
    for name, (dtype, shape, raw) in read_by_vllm.items():
        assert rebuilt[name] == (dtype, shape, raw), name
    verify(tmp_path / "rebuilt")


def test_artifact_has_companions_and_a_manifest_that_verifies(make_checkpoint, tmp_path):
    source, _ = make_checkpoint(LLAMA3)  # two weight files and an index
    manifest = ShardJob.prepare(source, tmp_path / "out", tp=4, pp=2, vllm_version="0.32.1").run()
    names = {e.path for e in manifest.files}
    assert COMPANIONS <= names
    assert "model.safetensors.index.json" not in names  # it names files the artifact lacks
    assert {p.name for p in (tmp_path / "out").iterdir()} == names | {MANIFEST_NAME}
    assert verify(tmp_path / "out").extra == read_manifest(tmp_path / "out").extra
    extra = manifest.extra
    assert (extra["tensorParallelSize"], extra["pipelineParallelSize"], extra["vllmVersion"]) == (4, 2, "0.32.1")
    assert extra["ppLayerPartition"] == [2, 1]
    assert extra["rankFiles"]["pp1-tp3"] == ["model-pp-1-tp-3-part-0.safetensors"]
    assert extra["skippedTensors"] == {"model.layers.0.self_attn.rotary_emb.inv_freq":
                                       "non-persistent buffer that vLLM does not load"}
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()


def test_progress_adds_up_to_the_bytes_written(make_checkpoint, tmp_path):
    source, _ = make_checkpoint(LLAMA32_TIED)
    job = ShardJob.prepare(source, tmp_path / "out", tp=8)
    seen: list[int] = []
    manifest = job.run(jobs=3, on_bytes=seen.append)
    assert sum(seen) == job.total_bytes == manifest.total_bytes


def test_rerun_after_an_interrupted_cut_overwrites_it(make_checkpoint, tmp_path):
    source, _ = make_checkpoint(LLAMA3)
    ShardJob.prepare(source, tmp_path / "out", tp=2).run()
    (tmp_path / "out" / MANIFEST_NAME).unlink()  # as if killed before the manifest
    (tmp_path / "out" / "model-rank-1-part-0.safetensors").write_bytes(b"half")
    ShardJob.prepare(source, tmp_path / "out", tp=2).run()
    verify(tmp_path / "out")


def test_unshard_refuses_a_tampered_artifact(make_checkpoint, tmp_path):
    source, _ = make_checkpoint(LLAMA3)
    ShardJob.prepare(source, tmp_path / "out", tp=2).run()
    rank_file = tmp_path / "out" / "model-rank-0-part-0.safetensors"
    data = bytearray(rank_file.read_bytes())
    data[-1] ^= 0xFF
    rank_file.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="model-rank-0-part-0.safetensors: block 0"):
        unshard(tmp_path / "out", tmp_path / "rebuilt")


def test_unshard_checks_replicas_padding_and_constants(make_checkpoint, tmp_path):
    """Change bytes the manifest still vouches for (re-signed), so only the
    layout checks of unshard can catch them."""
    from ferry_worker.manifest import sha256_file, write_manifest

    source, _ = make_checkpoint(LLAMA3)  # TP 8 > 2 KV heads: each KV head on 4 ranks
    for target, expected in [("model.layers.0.self_attn.qkv_proj.weight", "replicated slice differs"),
                             ("model.embed_tokens.weight", "padding is not zero"),
                             ("model.layers.0.self_attn.attn._q_scale", "not vLLM's default value")]:
        out = tmp_path / target
        ShardJob.prepare(source, out, tp=8).run()
        rank_file = out / "model-rank-7-part-0.safetensors"
        header_len = int.from_bytes(rank_file.read_bytes()[:8], "little")
        entry = json.loads(rank_file.read_bytes()[8:8 + header_len])[target]
        data = bytearray(rank_file.read_bytes())
        data[8 + header_len + entry["data_offsets"][1] - 1] ^= 0x01  # last byte: a K/V row, padding, the float
        rank_file.write_bytes(bytes(data))
        manifest = read_manifest(out)
        manifest.files = [f if f.path != rank_file.name else type(f)(f.path, f.size, sha256_file(rank_file))
                          for f in manifest.files]
        write_manifest(out, manifest)
        with pytest.raises(IntegrityError, match=expected):
            unshard(out, tmp_path / f"rebuilt-{target}")
