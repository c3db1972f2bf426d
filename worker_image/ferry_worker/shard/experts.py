"""How vLLM 0.32 spreads a MoE layer's experts over ranks, and which serving
targets change the per-rank shapes it allocates.

- Tensor parallel (default): every rank holds every expert, each expert's MLP
  cut like a dense one (`I / tp` rows of gate and up, columns of down).
- Expert parallel (`--enable-expert-parallel`; config.py: MoE tp 1, ep = tp):
  a rank holds whole experts; `E // ep` each and one more for the first
  `E % ep` ranks (expert_map_manager.determine_expert_map), contiguous
  (`linear`) or strided (`round_robin`, which vLLM honours only for models
  with expert groups and falls back to linear otherwise).
- Some GPU backends allocate a padded per-rank intermediate size
  (oracle/unquantized.py): FlashInfer TRT-LLM (Blackwell) rounds it up to
  128, AITER (ROCm) to 64 or 128. A file cut without that padding loads with
  only a warning and misplaced rows, so Ferry refuses those combinations
  instead of guessing which backend vLLM will pick.
"""
from __future__ import annotations

from dataclasses import dataclass

from .model import ModelDims, ShardError

PLACEMENTS = ("linear", "round_robin")
# The GPU family of the serving pods, as far as the MoE layout depends on it.
TARGETS = ("hopper", "ampere", "ada", "blackwell", "rocm")
DEFAULT_TARGET = "hopper"


@dataclass(frozen=True)
class MoeTarget:
    expert_parallel: bool = False
    placement: str = "linear"
    gpu: str = DEFAULT_TARGET

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ShardError(f"expert placement {self.placement!r} is not one of {', '.join(PLACEMENTS)}")
        if self.gpu not in TARGETS:
            raise ShardError(f"target {self.gpu!r} is not one of {', '.join(TARGETS)}")
        if self.placement != "linear" and not self.expert_parallel:
            raise ShardError(f"expert placement {self.placement} needs expert parallelism")


def expert_ranks(experts: int, ep: int, rank: int, placement: str) -> list[int]:
    """The global expert ids rank `rank` of `ep` holds, in local order."""
    if ep == 1:
        return list(range(experts))
    if placement == "round_robin":
        return list(range(rank, experts, ep))
    base, extra = divmod(experts, ep)
    start = rank * base + min(rank, extra)
    return list(range(start, start + base + (rank < extra)))


def check_moe(dims: ModelDims, tp: int, moe: MoeTarget, *, tp_at_most_experts: bool, expert_groups: int) -> None:
    """Refuse what vLLM would reject, or lay out in a way Ferry cannot know."""
    experts, inter = dims.experts, dims.size("moe_intermediate")
    if moe.expert_parallel:
        if tp == 1:
            raise ShardError("expert parallelism needs a tensor-parallel size above 1 (vLLM's expert-parallel "
                             "size is the tensor-parallel size here)")
        if experts < tp:
            raise ShardError(f"expert parallel size {tp} is larger than the {experts} experts per layer: "
                             f"some ranks would hold no expert")
        if moe.placement == "round_robin" and expert_groups <= 1:
            raise ShardError("vLLM honours round_robin expert placement only for models with expert groups "
                             "(n_group > 1) and would place these experts linearly; ask for linear")
        return _check_padding(inter, moe.gpu)
    if tp_at_most_experts and tp > experts:
        raise ShardError(f"tensor parallel size {tp} is larger than the {experts} experts per layer, which "
                         f"vLLM refuses for this model")
    if inter % tp:
        raise ShardError(f"tensor parallel size {tp} does not divide the expert intermediate size {inter}")
    _check_padding(inter // tp, moe.gpu)


def _check_padding(per_rank: int, gpu: str) -> None:
    alignment = {"blackwell": 128, "rocm": 64 if per_rank <= 192 else 128}.get(gpu)
    if alignment and per_rank % alignment:
        raise ShardError(f"on {gpu} GPUs vLLM may pick a MoE backend that pads the per-rank expert intermediate "
                         f"size {per_rank} to a multiple of {alignment}; ferry shard does not write padded "
                         f"layouts, so it refuses rather than guess (serve on hopper/ampere/ada, or choose a "
                         f"tensor-parallel size that leaves a multiple of {alignment})")
