"""Which files of an artifact a serving pod reads.

A `sharded_state` artifact holds one set of files per rank (the manifest's
`extra.rankFiles`, keyed `pp<P>-tp<T>`); a pod serving ranks R reads only
theirs, plus every file that belongs to no rank (config, tokenizer). Every
other format is read whole by every rank (vLLM's default loader iterates all
safetensors files on each rank and narrows each tensor to its slice).

Ranks are vLLM's global ranks: pp_rank * tensor_parallel_size + tp_rank.

A multi-node serving group (a LeaderWorkerSet group, a StatefulSet) of G pods
shares one pod template, so a pod names its position (`Group`) instead of its
ranks. vLLM's own multi-node launch (`vllm serve --nnodes G --node-rank I`)
gives node I the contiguous global ranks [I*k, (I+1)*k), k = TP*PP / G
(vllm/engine/arg_utils.py: local_world_size = world_size // nnodes, rank =
node_rank * local_world_size + local_rank); `group_ranks` is that arithmetic.
With PP 2 over a group of 2 pods, pod I serves exactly pipeline stage I.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..manifest import FileEntry, Manifest


class SelectionError(Exception):
    """The ranks (or the group position) asked for do not exist in this artifact."""


@dataclass(frozen=True)
class Group:
    """This pod's place in a multi-node serving group: pod `index` of `size`."""
    size: int = 1
    index: int = 0

    def check(self) -> None:
        if self.size < 1:
            raise SelectionError(f"--group-size {self.size}: a group has 1 or more pods")
        if not 0 <= self.index < self.size:
            raise SelectionError(f"--group-index {self.index} is not a pod of a group of {self.size} "
                                 f"(--group-size {self.size}): the index must be 0..{self.size - 1}")

    def describe(self) -> str:
        return f"group pod {self.index}/{self.size}"


def parse_group_index(text: str) -> int:
    """--group-index as it arrives in a pod: the kubelet's expansion of
    $(FERRY_GROUP_INDEX), a decimal string; left as written when the
    container has no such env var."""
    text = text.strip()
    if text.startswith("$(") and text.endswith(")"):
        name = text[2:-1]
        raise SelectionError(f"--group-index is the unexpanded {text!r}: the env var {name} was not set in this "
                             f"container, so the kubelet could not expand it; set {name} from the pod's group "
                             f"index label (the operator wires it), or pass the index itself")
    if not (text.isascii() and text.isdigit()):
        raise SelectionError(f"--group-index {text!r} is not a pod index (a whole number, 0 or more)")
    return int(text)


def group_ranks(world: int, tp: int, group_size: int, index: int) -> list[int]:
    """The global ranks pod `index` of a group of `group_size` pods serves, as
    `vllm serve --nnodes group_size --node-rank index` assigns them: the
    contiguous [index*k, (index+1)*k), k = world / group_size, where world is
    tensor x pipeline parallel size and tp the tensor-parallel size."""
    Group(group_size, index).check()
    if tp < 1 or world < 1 or world % tp:
        raise SelectionError(f"tensor x pipeline parallel size {world} is not a multiple of the tensor parallel "
                             f"size {tp}: the artifact's manifest is inconsistent")
    if world % group_size:
        raise SelectionError(f"tensor x pipeline parallel size {world} cannot be spread over a group of "
                             f"{group_size} pods: {world} must be a multiple of {group_size} (change --group-size, "
                             f"or prepare the artifact for a parallel size the group divides)")
    k = world // group_size
    return list(range(index * k, (index + 1) * k))


def _span(numbers: list[int]) -> str:
    return f"{numbers[0]}-{numbers[-1]}" if len(numbers) > 1 else str(numbers[0])


def describe_stages(ranks: list[int], tp: int) -> str:
    """Which pipeline stages (and, of a stage only partly served, which tensor
    ranks) `ranks` are, e.g. "pipeline stage 1", "pipeline stages 0-1",
    "pipeline stage 0, tensor ranks 4-7"."""
    stages: dict[int, list[int]] = {}
    for r in sorted(set(ranks)):
        stages.setdefault(r // tp, []).append(r % tp)
    numbers = list(stages)
    whole = all(tps == list(range(tp)) for tps in stages.values())
    if whole and numbers == list(range(numbers[0], numbers[-1] + 1)):
        return f"pipeline stage {numbers[0]}" if len(numbers) == 1 else f"pipeline stages {_span(numbers)}"
    parts = []
    for stage, tps in stages.items():
        if tps == list(range(tp)):
            parts.append(f"pipeline stage {stage}")
        elif tps == list(range(tps[0], tps[-1] + 1)):
            parts.append(f"pipeline stage {stage}, tensor rank{'s' if len(tps) > 1 else ''} {_span(tps)}")
        else:
            parts.append(f"pipeline stage {stage}, tensor ranks {','.join(map(str, tps))}")
    return "; ".join(parts)


@dataclass(frozen=True)
class Selection:
    entries: list[FileEntry]
    ranks: list[int] | None  # None: the format has no per-rank files, every file is needed
    group: Group | None = None  # set when the pod is one of a multi-node group (size > 1)
    tp: int = 1  # the artifact's tensor-parallel size, to name stages
    # Why every file (ranks None), said of a group's pods.
    whole: str = "this format has no per-rank files: every pod of the group reads them all"

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries)

    def describe_ranks(self) -> str:
        if self.ranks is None:
            return "all files"
        if len(self.ranks) < 8:
            return "rank " + ",".join(map(str, self.ranks))
        if self.ranks == list(range(self.ranks[0], self.ranks[-1] + 1)):
            return f"{len(self.ranks)} ranks ({self.ranks[0]}-{self.ranks[-1]})"
        return f"{len(self.ranks)} ranks"

    def describe(self) -> str:
        if self.group is None or self.group.size == 1:
            return self.describe_ranks()
        if self.ranks is None:
            return f"{self.group.describe()}: all files ({self.whole})"
        return f"{self.group.describe()}: {self.describe_ranks()} ({describe_stages(self.ranks, self.tp)})"


def world_size(manifest: Manifest) -> int:
    extra = manifest.extra or {}
    return int(extra.get("tensorParallelSize", 1)) * int(extra.get("pipelineParallelSize", 1))


def select(manifest: Manifest, ranks: list[int] | None, group: Group | None = None) -> Selection:
    """The entries ranks `ranks` need (None: every rank of the artifact, the
    whole TP x PP group a single-node pod serves), or, given `group`, the
    ranks that pod of the group serves (`group_ranks`)."""
    if group is not None and ranks is not None:
        raise SelectionError("ranks and a group position are exclusive: give one")
    if group is not None:
        group.check()
    rank_files: dict[str, list[str]] = (manifest.extra or {}).get("rankFiles") or {}
    entries = sorted(manifest.files, key=lambda e: e.path)
    if manifest.format != "sharded_state" or not rank_files:
        # No per-rank files: every rank, so every pod of a group, reads every file.
        return Selection(entries, None, group)
    tp = int(manifest.extra.get("tensorParallelSize", 1))
    size = world_size(manifest)
    if group is not None:
        ranks = group_ranks(size, tp, group.size, group.index)
    wanted = sorted(set(range(size) if ranks is None else ranks))
    bad = [r for r in wanted if not 0 <= r < size]
    if bad:
        raise SelectionError(f"rank {bad[0]} is not in this artifact (tensor x pipeline parallel size {size}: "
                             f"ranks 0..{size - 1})")
    keys = {f"pp{r // tp}-tp{r % tp}" for r in wanted}
    owned = {name for files in rank_files.values() for name in files}
    mine = {name for key in keys for name in rank_files.get(key, [])}
    return Selection([e for e in entries if e.path in mine or e.path not in owned], wanted, group, tp)
