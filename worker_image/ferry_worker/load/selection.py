"""Which files of an artifact a serving pod reads.

A `sharded_state` artifact holds one set of files per rank (the manifest's
`extra.rankFiles`, keyed `pp<P>-tp<T>`); a pod serving ranks R reads only
theirs, plus every file that belongs to no rank (config, tokenizer). Every
other format is read whole by every rank (vLLM's default loader iterates all
safetensors files on each rank and narrows each tensor to its slice).

Ranks are vLLM's global ranks: pp_rank * tensor_parallel_size + tp_rank.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..manifest import FileEntry, Manifest


class SelectionError(Exception):
    """The ranks asked for do not exist in this artifact."""


@dataclass(frozen=True)
class Selection:
    entries: list[FileEntry]
    ranks: list[int] | None  # None: the format has no per-rank files, every file is needed

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries)

    def describe(self) -> str:
        if self.ranks is None:
            return "all files"
        return "rank " + ",".join(map(str, self.ranks)) if len(self.ranks) < 8 else f"{len(self.ranks)} ranks"


def world_size(manifest: Manifest) -> int:
    extra = manifest.extra or {}
    return int(extra.get("tensorParallelSize", 1)) * int(extra.get("pipelineParallelSize", 1))


def select(manifest: Manifest, ranks: list[int] | None) -> Selection:
    """The entries ranks `ranks` need (None: every rank of the artifact, the
    whole TP x PP group a single-node pod serves)."""
    rank_files: dict[str, list[str]] = (manifest.extra or {}).get("rankFiles") or {}
    entries = sorted(manifest.files, key=lambda e: e.path)
    if manifest.format != "sharded_state" or not rank_files:
        return Selection(entries, None)
    tp = int(manifest.extra.get("tensorParallelSize", 1))
    size = world_size(manifest)
    wanted = sorted(set(range(size) if ranks is None else ranks))
    bad = [r for r in wanted if not 0 <= r < size]
    if bad:
        raise SelectionError(f"rank {bad[0]} is not in this artifact (tensor x pipeline parallel size {size}: "
                             f"ranks 0..{size - 1})")
    keys = {f"pp{r // tp}-tp{r % tp}" for r in wanted}
    owned = {name for files in rank_files.values() for name in files}
    mine = {name for key in keys for name in rank_files.get(key, [])}
    return Selection([e for e in entries if e.path in mine or e.path not in owned], wanted)
