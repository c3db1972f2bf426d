"""`ferry tensorize --layout vllm` of a MoE checkpoint: the expert cut is the
one `ferry shard` makes, it is part of what makes the artifact what it is, and
the operator learns it from the step result (to refuse data parallelism and
EPLB on the serving Deployment).

The expert cut is proven equal to `ferry shard`'s here, tensor for tensor, at
TP 2 and EP 2 (no vLLM: `ferry shard`'s EP cut is proven against vLLM's own
workers in test_shard_vllm_breadth.py, and vLLM's tensorizer loader on the
TP 2 cut of each MoE family in test_tensorize_vllm_breadth.py). Nothing is
shared beyond a small generated Mixtral per test."""
from __future__ import annotations

from pathlib import Path

import pytest

from checkpoints import DEEPSEEK_V3, LLAMA3, MIXTRAL, write_checkpoint
from ferry_worker.shard.experts import MoeTarget
from ferry_worker.shard.job import ShardJob
from ferry_worker.tensorize.errors import ArtifactError
from ferry_worker.tensorize.tensorize import TensorizeJob


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_moe_facts_reach_the_request_the_manifest_and_the_step_result(tmp_path: Path, expert_parallel: bool):
    source = tmp_path / "ckpt"
    write_checkpoint(source, MIXTRAL)
    job = TensorizeJob.prepare(source, str(tmp_path / "out"), layout="vllm", tp=2,
                               moe=MoeTarget(expert_parallel=expert_parallel))
    experts_per_rank = {e.name: e.shape[0] for f in job.files for e in f.entries if e.name.endswith("w13_weight")}
    assert set(experts_per_rank.values()) == {2 if expert_parallel else 4}
    published = job.run()
    assert published.step_result()["experts"] == 4
    assert published.step_result()["expertParallel"] is expert_parallel
    assert published.manifest.extra["request"]["expertParallel"] is expert_parallel
    # A rerun asking for the other cut is another artifact, not a reuse of this one.
    other = TensorizeJob.prepare(source, str(tmp_path / "out"), layout="vllm", tp=2,
                                 moe=MoeTarget(expert_parallel=not expert_parallel))
    assert other.request() != job.request()


@pytest.mark.tensorize
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_expert_rank_files_are_ferry_shards_tensor_for_tensor(tmp_path: Path, expert_parallel: bool):
    from tensorize_support import deserialize, sharded_rank

    source = tmp_path / "ckpt"
    write_checkpoint(source, MIXTRAL)
    moe = MoeTarget(expert_parallel=expert_parallel)
    TensorizeJob.prepare(source, str(tmp_path / "out"), layout="vllm", tp=2, moe=moe).run()
    ShardJob.prepare(source, tmp_path / "sharded", tp=2, vllm_version="0.32.0", moe=moe).run()
    for rank in (0, 1):
        stored = deserialize(str(tmp_path / "out" / f"model-rank-{rank:03d}.tensors"))
        assert stored.pop(".vllm_tensorized_marker") == ("I64", [1], bytes(8))
        reference = sharded_rank(tmp_path / "sharded", rank)
        assert sorted(stored) == sorted(reference), rank
        for key, value in reference.items():
            assert stored[key] == value, f"rank {rank}: {key}"
        experts = {v[1][0] for k, v in stored.items() if k.endswith(("w13_weight", "w2_weight"))}
        assert experts == {2 if expert_parallel else 4}, (rank, experts)


def test_dense_requests_are_unchanged_by_the_moe_fields(tmp_path: Path):
    source = tmp_path / "ckpt"
    write_checkpoint(source, LLAMA3)
    request = TensorizeJob.prepare(source, str(tmp_path / "out"), layout="vllm", tp=2).request()
    assert not {"experts", "expertParallel", "target"} & set(request)


def test_expert_flags_are_refused_for_the_hf_layout(tmp_path: Path):
    source = tmp_path / "ckpt"
    write_checkpoint(source, MIXTRAL)
    with pytest.raises(ArtifactError, match="shape the vllm layout only"):
        TensorizeJob.prepare(source, str(tmp_path / "out"), layout="hf", moe=MoeTarget(expert_parallel=True))


def test_a_float32_parameter_the_loader_would_round_is_refused(tmp_path: Path):
    """Measured with vLLM 0.32 (test_tensorize_vllm_breadth): its tensorizer loader hands DeepSeek-V3's
    float32 e_score_correction_bias back in bf16."""
    source = tmp_path / "ckpt"
    write_checkpoint(source, DEEPSEEK_V3)
    with pytest.raises(ArtifactError, match=r"casts every tensor to the model dtype BF16, so "
                                            r"model\.layers\.1\.mlp\.experts\.gate\.e_score_correction_bias \(F32\)"):
        TensorizeJob.prepare(source, str(tmp_path / "out"), layout="vllm", tp=2)
