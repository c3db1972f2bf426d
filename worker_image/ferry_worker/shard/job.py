"""`ferry shard`: cut a Hugging Face safetensors checkpoint into vLLM
`sharded_state` rank files, on any CPU node.

    job = ShardJob.prepare(source, output, tp=4)   # validates; writes nothing
    manifest = job.run(on_bytes=progress.advance)  # rank files, companions, manifest last

`prepare` refuses everything that config.json and the safetensors headers can
tell; `run` first proves a tied LM head's separate copy identical (that needs
the bytes), then writes each file under a temporary name and renames it; the
manifest is written last, so an interrupted run leaves no manifest and a rerun
overwrites what it left.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..manifest import MANIFEST_NAME, TMP_MARKER, FileEntry, Manifest, atomic_file, sha256_file, write_manifest
from .experts import MoeTarget
from .model import ShardError
from .plan import Rows, ShardPlan, plan_shards
from .source import Checkpoint, companion_files, open_checkpoint
from .spans import BlockBuffers, Span, piece_span, read_span
from .versions import DEFAULT_MAX_PART_SIZE, DEFAULT_VLLM_VERSION, parse_vllm_version
from . import intpack, wna16
from .write import SourceFiles, header_for, write_rank_files

# vLLM's save_sharded_state example splits parts at 5 GiB by default.
FORMAT = "sharded_state"


@dataclass(frozen=True)
class ShardJob:
    checkpoint: Checkpoint
    output: Path
    plan: ShardPlan
    max_part_size: int | None
    companions: tuple[Path, ...]

    @classmethod
    def prepare(cls, source: Path, output: Path, *, tp: int, pp: int = 1, vllm_version: str = DEFAULT_VLLM_VERSION,
                max_part_size: int | None = DEFAULT_MAX_PART_SIZE,
                pp_layer_partition: list[int] | None = None, moe: MoeTarget = MoeTarget()) -> "ShardJob":
        """Validate the checkpoint and the target and plan every file; raise ShardError otherwise."""
        source, output = source.resolve(), output.resolve()
        if output == source:
            raise ShardError("the output directory must differ from the checkpoint directory")
        try:
            vllm = parse_vllm_version(vllm_version)
        except ValueError as e:
            raise ShardError(str(e)) from None
        if max_part_size is not None and max_part_size <= 0:
            raise ShardError(f"max part size must be positive, got {max_part_size}")
        checkpoint = open_checkpoint(source)
        plan = plan_shards(checkpoint.config, checkpoint.specs, tp=tp, pp=pp, vllm=vllm,
                           max_part_size=max_part_size, pp_layer_partition=pp_layer_partition, moe=moe)
        companions = tuple(companion_files(source))
        job = cls(checkpoint, output, plan, max_part_size, companions)
        job._check_output()
        return job

    @property
    def total_bytes(self) -> int:
        """Bytes `run` writes: what `on_bytes` adds up to."""
        return (sum(len(header_for(f)) + f.data_bytes for f in self.plan.files)
                + sum(len(self._rewritten(p) or b"") or p.stat().st_size for p in self.companions))

    def run(self, *, jobs: int | None = None, on_bytes: Callable[[int], None] | None = None) -> Manifest:
        """Write the rank files and companions, then the manifest. `jobs`: files
        written at once (default: two per core, at least four: a thread waits on
        the disk as often as it hashes)."""
        jobs = jobs or max(4, 2 * (os.cpu_count() or 1))
        self._check_tied_copies()
        self._check_weight_shapes()
        self._check_shared_inputs()
        self.output.mkdir(parents=True, exist_ok=True)
        entries = [self._copy_companion(path, on_bytes) for path in self.companions]
        entries += write_rank_files(self.plan.files, self.output, self.checkpoint.tensors, jobs=jobs,
                                    on_bytes=on_bytes)
        manifest = Manifest(files=entries, source=str(self.checkpoint.directory), format=FORMAT,
                            extra=self._manifest_extra())
        write_manifest(self.output, manifest)
        return manifest

    def _check_output(self) -> None:
        """Refuse to mix with another artifact: vLLM globs `model-rank-{r}-part-*`,
        so a stray rank file from an earlier cut would be loaded too."""
        if not self.output.exists():
            return
        if not self.output.is_dir():
            raise ShardError(f"{self.output}: exists and is not a directory")
        if (self.output / MANIFEST_NAME).exists():
            raise ShardError(f"{self.output} already holds a complete artifact ({MANIFEST_NAME}); "
                             f"remove it to cut again")
        ours = {f.name for f in self.plan.files} | {p.name for p in self.companions}
        stray = sorted(p.name for p in self.output.iterdir() if p.name not in ours and TMP_MARKER not in p.name)
        if stray:
            raise ShardError(f"{self.output} holds files this cut would not write: {', '.join(stray[:10])}; "
                             f"use an empty directory")

    def _check_tied_copies(self) -> None:
        """A tied config with a separate lm_head in the checkpoint: vLLM 0.32's
        default loader serves that lm_head while sharded_state serves the
        embedding; write the artifact only if they are the same bytes."""
        buffers_a, buffers_b = BlockBuffers(), BlockBuffers()
        with SourceFiles(self.checkpoint.tensors) as sources:
            for copy, canonical in self.plan.tied_copies.items():
                a, b = self.checkpoint.tensors[copy], self.checkpoint.tensors[canonical]
                if a.dtype != b.dtype:
                    raise ShardError(f"config.json ties {copy} to {canonical}, but their dtypes differ")
                whole = Rows(copy, 0, a.shape[0])
                chunks_a = read_span(sources.fd(copy), piece_span(whole, a.offset, a.dtype, a.shape), buffers_a)
                chunks_b = read_span(sources.fd(canonical), piece_span(whole, b.offset, b.dtype, b.shape), buffers_b)
                if any(x != y for x, y in zip(chunks_a, chunks_b)):
                    raise ShardError(f"config.json ties {copy} to {canonical}, but the checkpoint's {copy} differs; "
                                     f"vLLM releases disagree on which one to serve, so no artifact is written")

    def _check_weight_shapes(self) -> None:
        """A pack-quantized checkpoint's weight_shape tensors must say what their packed weights hold: a
        rank keeps only the one vLLM loads last of a fused module's parts, so unshard rebuilds the others
        from this rule (wna16.unpacked_shape)."""
        if not isinstance(self.plan.quant, wna16.PackQuantized):
            return
        buffers, specs = BlockBuffers(), self.checkpoint.specs
        with SourceFiles(self.checkpoint.tensors) as sources:
            for name, loc in self.checkpoint.tensors.items():
                if wna16.role(name) != "shape":
                    continue
                data = b"".join(read_span(sources.fd(name), piece_span(Rows(name, 0, loc.shape[0]), loc.offset,
                                                                       loc.dtype, loc.shape), buffers))
                wanted = wna16.unpacked_shape(specs, name, self.plan.quant)
                if loc.shape != (2,) or data != wna16.shape_bytes(wanted):
                    raise ShardError(f"{name} does not hold the shape of its packed weight {list(wanted)} "
                                     f"(weight_packed x {self.plan.quant.pack}); the checkpoint is inconsistent")

    def _check_shared_inputs(self) -> None:
        """Static activations where vLLM keeps one input scale (and zero point) for several checkpoint
        tensors (w8a8.shared_groups: an INT8 fused module's parts, an FP8 expert's w1 and w3): they must be
        stored alike, as vLLM keeps (or, for compressed-tensors experts, demands) one, and unshard rebuilds
        the others from it."""
        buffers, tensors = BlockBuffers(), self.checkpoint.tensors
        with SourceFiles(tensors) as sources:
            for fused, parts in self._shared_groups.items():
                values = {}
                for name in parts:  # a few bytes each ([1], or 0-d)
                    loc = tensors[name]
                    data = b"".join(read_span(sources.fd(name), Span(loc.offset, loc.nbytes), buffers))
                    values[name] = (loc.dtype, loc.shape, data)
                if len(set(values.values())) > 1:
                    raise ShardError(f"{', '.join(parts)} differ (dtype, shape or value); vLLM 0.32 loads one "
                                     f"{fused.rsplit('.', 1)[1]} for the fused {fused.rsplit('.', 1)[0]} and keeps "
                                     f"the part it reads last (or refuses the checkpoint), so it would quantize "
                                     f"every part's input with that one: calibrate the parts together (they read "
                                     f"the same input, and llm-compressor gives them one value) or serve with "
                                     f"format.type safetensors")

    def _rewritten(self, path: Path) -> bytes | None:
        """The artifact's own config.json where it must say more than the checkpoint's (a GPTQ checkpoint's
        quantized modules: intpack.IntPacked.artifact_config); None: the file is copied as it is."""
        if path.name != "config.json" or not isinstance(self.plan.quant, intpack.IntPacked):
            return None
        config = self.plan.quant.artifact_config(self.checkpoint.config)
        return None if config is None else json.dumps(config, indent=2).encode() + b"\n"

    def _copy_companion(self, path: Path, on_bytes: Callable[[int], None] | None) -> FileEntry:
        rewritten = self._rewritten(path)
        with open(path, "rb") as src, atomic_file(self.output / path.name) as dst:
            if rewritten is None:
                shutil.copyfileobj(src, dst, 1 << 20)
            else:
                dst.write(rewritten)
        final = self.output / path.name
        if on_bytes:
            on_bytes(final.stat().st_size)
        return FileEntry(path.name, final.stat().st_size, sha256_file(final))

    def _manifest_extra(self) -> dict:
        plan = self.plan
        return {
            "tensorParallelSize": plan.tp,
            "pipelineParallelSize": plan.pp,
            "vllmVersion": str(plan.vllm),
            "architecture": self.checkpoint.config["architectures"][0],
            "layout": plan.family,
            "maxPartSize": self.max_part_size,
            "ppLayerPartition": [end - start for start, end in plan.layer_ranges],
            "rankFiles": _rank_files(plan),
            "sourceTensors": {name: {"dtype": spec.dtype, "shape": list(spec.shape),
                                     **({"file": spec.file} if self._read_in_order(name) else {})}
                              for name, spec in sorted(self.checkpoint.specs.items())},
            "skippedTensors": dict(plan.skipped) | {c: f"tied copy of {t}" for c, t in plan.tied_copies.items()},
            **plan.moe_facts(),
            **plan.quant_facts(),
        }


    @functools.cached_property
    def _shared_groups(self) -> dict[str, list[str]]:
        return self.plan.shared_groups(self.checkpoint.tensors)

    @functools.cached_property
    def _shared_names(self) -> frozenset[str]:
        return frozenset(n for parts in self._shared_groups.values() for n in parts)

    def _read_in_order(self, name: str) -> bool:
        """Whether the cut of `name` depends on the order vLLM reads the files in (one of a fused module's
        parts kept: pack-quantized weight_shape, INT8 static input scales)."""
        return wna16.role(name) == "shape" or name in self._shared_names


def _rank_files(plan: ShardPlan) -> dict[str, list[str]]:
    files: dict[str, list[str]] = {}
    for f in plan.files:
        files.setdefault(f"pp{f.pp_rank}-tp{f.tp_rank}", []).append(f.name)
    return files
