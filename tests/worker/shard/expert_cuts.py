"""The generated Mixtral's experts cut at TP 2 or EP 2 and rebuilt by unshard: shared by the quantized-expert
unit tests (test_shard_wna16, test_shard_intpack)."""
from __future__ import annotations

from pathlib import Path

from checkpoints import read_checkpoint, read_safetensors
from ferry_worker.shard.experts import MoeTarget
from ferry_worker.shard.job import ShardJob
from ferry_worker.shard.unshard import unshard

# Layer 0's FusedMoE stack in a rank file.
MIXTRAL_STACK = "model.layers.0.block_sparse_moe.experts.routed_experts."


def cut_and_rebuilt(source: Path, tmp_path: Path, expert_parallel: bool, dropped: str = "\0"):
    """Cut `source` for TP 2 (EP 2 with `expert_parallel`), unshard it, and assert every tensor came back bit
    for bit (but the rotary buffers and names ending in `dropped`, which vLLM never loads). Returns the original
    tensors, rank 1's, and (experts, expert intermediate rows) on a rank: Mixtral here has intermediate 256,
    hidden 128 and 4 experts."""
    ShardJob.prepare(source, tmp_path / "cut", tp=2, moe=MoeTarget(expert_parallel=expert_parallel)).run()
    unshard(tmp_path / "cut", tmp_path / "back")
    original, back = read_checkpoint(source), read_checkpoint(tmp_path / "back")
    assert back == {k: v for k, v in original.items() if "rotary" not in k and not k.endswith(dropped)}
    rank = read_safetensors(tmp_path / "cut" / "model-rank-1-part-0.safetensors")
    return original, rank, ((2, 256) if expert_parallel else (4, 128))
