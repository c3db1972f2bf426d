"""`ferry unshard`: rebuild the Hugging Face tensors from a `sharded_state`
artifact Ferry cut, proving the cut lost nothing.

The artifact's manifest records the cut (TP, PP, vLLM release, layer partition)
and the source tensors' dtypes and shapes; re-planning from them gives, for
every piece of every rank file, the region of the source tensor it came from.
Each region is copied back. Beyond the copy, every other invariant of the
layout is checked: KV-head replicas are identical, vocabulary padding is zero,
constants hold their value, and the pieces tile each source tensor exactly.

Every file of the artifact is opened beneath it without following a symlink
(manifest.opened), and each copy written beneath the output the same way.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ..manifest import (
    MANIFEST_NAME,
    FileEntry,
    IntegrityError,
    Manifest,
    atomic_file,
    opened,
    sha256_file,
    verify,
    write_manifest,
)
from ..paths import UnsafePathError, read_beneath
from ..safetensors_header import validate_safetensors
from .job import FORMAT
from .experts import DEFAULT_TARGET, MoeTarget
from .plan import Columns, Constant, PlannedFile, Refined, Rows, ShardPlan, TensorSpec, ZeroRows, plan_shards
from .spans import BlockBuffers, Span, piece_span, read_span, write_span
from .model import ShardError
from .tensors import HeaderEntry, encode_header, itemsize, narrow
from .versions import parse_vllm_version
from . import wna16

UNSHARDED_NAME = "model.safetensors"


def unshard(artifact: Path, output: Path) -> Manifest:
    """Verify `artifact` against its manifest, then write `output/model.safetensors`
    (every tensor the cut read, under its Hugging Face name) and the companion files."""
    manifest = verify(artifact)
    if manifest.format != FORMAT:
        raise IntegrityError(f"{artifact}: a {manifest.format!r} artifact, not {FORMAT}")
    plan = _replan(artifact, manifest)
    rank_files = {f.name for f in plan.files}
    specs = {name: TensorSpec(s["dtype"], tuple(s["shape"]), s.get("file", "")) for name, s in manifest.extra["sourceTensors"].items()}
    rebuilt = sorted({p.source for f in plan.files for t in f.tensors for p in t.pieces
                      if isinstance(p, (Rows, Columns, Refined))})
    derived = _derived(plan, specs, rebuilt)
    shared = _shared(plan, specs, rebuilt)
    order = sorted([*rebuilt, *derived, *shared], key=lambda n: -itemsize(specs[n].dtype))
    header = encode_header(HeaderEntry(n, specs[n].dtype, specs[n].shape) for n in order)
    offsets, position = {}, len(header)
    for name in order:
        offsets[name] = position
        position += specs[name].nbytes

    output.mkdir(parents=True, exist_ok=True)
    coverage = _Coverage()
    with atomic_file(output / UNSHARDED_NAME, "w+b") as out:
        out.write(header)
        out.truncate(position)
        out.flush()
        for planned in plan.files:
            _scatter(artifact, planned, out.fileno(), offsets, specs, coverage)
        coverage.check_complete(specs, rebuilt)
        for name, data in derived.items():
            os.pwrite(out.fileno(), data, offsets[name])
        for name, kept in _shared(plan, specs, rebuilt).items():  # the parts vLLM's one input scale stands for
            os.pwrite(out.fileno(), os.pread(out.fileno(), specs[kept].nbytes, offsets[kept]), offsets[name])
    entries = [FileEntry(UNSHARDED_NAME, position, sha256_file(output / UNSHARDED_NAME))]
    for entry in manifest.files:
        if entry.path not in rank_files:
            with opened(artifact, entry.path) as fd, open(fd, "rb", closefd=False) as src, \
                    atomic_file(output / entry.path, beneath=output) as dst:
                shutil.copyfileobj(src, dst)
            entries.append(entry)  # the same bytes (verified above): the same digest, in whichever form
    result = Manifest(files=entries, source=str(artifact), format="safetensors",
                      extra={"unshardedFrom": manifest.extra})
    write_manifest(output, result)
    return result


def _derived(plan: ShardPlan, specs: dict[str, TensorSpec], rebuilt: list[str]) -> dict[str, bytes]:
    """Tensors no rank file holds but the cut proved derivable: the weight_shape of each part of a fused
    pack-quantized module that vLLM does not load last (ShardJob checked each against its weight_packed)."""
    if not isinstance(plan.quant, wna16.PackQuantized):
        return {}
    return {name: wna16.shape_bytes(wna16.unpacked_shape(specs, name, plan.quant)) for name in specs
            if wna16.role(name) == "shape" and name not in rebuilt}


def _shared(plan: ShardPlan, specs: dict[str, TensorSpec], rebuilt: list[str]) -> dict[str, str]:
    """Input scales and zero points no rank file holds -> the part of the same group (w8a8.shared_groups: a
    fused INT8 module's, an FP8 expert's w1 and w3) that one does: ShardJob wrote the artifact only where all
    parts held the same dtype, shape and bytes."""
    kept = set(rebuilt)
    shared = {}
    for parts in plan.shared_groups(specs).values():
        held = [p for p in parts if p in kept]
        if len(held) != 1:
            raise IntegrityError(f"{', '.join(parts)}: the rank files hold {len(held)} of them, not one")
        shared.update((p, held[0]) for p in parts if p != held[0])
    return shared


def _replan(artifact: Path, manifest: Manifest) -> ShardPlan:
    extra = manifest.extra
    try:
        config = json.loads(read_beneath(artifact, "config.json", 64 << 20) or b"null")
    except UnsafePathError as e:
        raise IntegrityError(f"{artifact}: {e}") from None
    if not isinstance(config, dict):
        raise IntegrityError(f"{artifact}: no config.json (a JSON object) to re-plan the cut from")
    specs = {name: TensorSpec(s["dtype"], tuple(s["shape"]), s.get("file", "")) for name, s in extra["sourceTensors"].items()}
    plan = plan_shards(config, specs, tp=extra["tensorParallelSize"], pp=extra["pipelineParallelSize"],
                       vllm=parse_vllm_version(extra["vllmVersion"]), max_part_size=extra["maxPartSize"],
                       pp_layer_partition=extra["ppLayerPartition"],
                       moe=MoeTarget(extra.get("expertParallel", False), extra.get("expertPlacement", "linear"),
                                     extra.get("target", DEFAULT_TARGET)))
    listed = {e.path for e in manifest.files}
    missing = [f.name for f in plan.files if f.name not in listed]
    if missing:
        raise IntegrityError(f"{artifact}: rank file(s) missing from {MANIFEST_NAME}: {', '.join(missing)}")
    return plan


@dataclass
class _Coverage:
    """Which regions of each source tensor have been rebuilt, and from where."""

    regions: dict[str, dict[tuple[type, int, int], tuple[Path, Span]]] = field(default_factory=dict)
    # Refined-grid scales: the source's values rebuilt so far, by index along the cut axis (several ranks
    # repeat one checkpoint block: each copy must agree).
    refined: dict[str, dict[int, bytes]] = field(default_factory=dict)
    refined_axes: dict[str, tuple[int, int]] = field(default_factory=dict)  # source -> (axis, factor along it)

    def first_copy(self, source: str, piece: Rows | Columns, rank_file: Path, span: Span) -> tuple[Path, Span] | None:
        """Record a region; return where it was already rebuilt from, if it was."""
        key = (type(piece), piece.start, piece.stop)  # Refined: in refined units
        seen = self.regions.setdefault(source, {})
        if key in seen:
            return seen[key]
        seen[key] = (rank_file, span)
        return None

    def check_complete(self, specs: dict[str, TensorSpec], names: list[str]) -> None:
        for name in names:
            kinds = {kind for kind, _, _ in self.regions[name]}
            if len(kinds) != 1:
                raise IntegrityError(f"{name}: rebuilt from both row and column slices")
            kind = kinds.pop()
            extent = (specs[name].shape or (1,))[1 if kind is Columns else 0]  # a 0-d scale is one row
            if kind is Refined:
                axis, factor = self.refined_axes[name]
                extent = specs[name].shape[axis] * factor
            end = 0
            for _, start, stop in sorted(self.regions[name]):
                if start != end:
                    raise IntegrityError(f"{name}: slices leave a gap or overlap at index {end}")
                end = stop
            if end != extent:
                raise IntegrityError(f"{name}: slices cover {end} of {extent}")


def _scatter(artifact: Path, planned: PlannedFile, out_fd: int, offsets: dict[str, int],
             specs: dict[str, TensorSpec], coverage: _Coverage) -> None:
    with opened(artifact, planned.name) as fd:
        _scatter_from(fd, artifact / planned.name, planned, out_fd, offsets, specs, coverage)


def _check_planned(header, planned: PlannedFile, rank_file: Path) -> None:
    """The rank file holds exactly the tensors the plan names, with the plan's dtypes and shapes."""
    expected = {t.name: (t.dtype, t.shape) for t in planned.tensors}
    actual = {t.name: (t.dtype, t.shape) for t in header.tensors}
    if expected != actual:
        changed = sorted(n for n in expected.keys() & actual.keys() if expected[n] != actual[n])
        raise IntegrityError(f"{rank_file.name}: tensors differ from the plan "
                             f"(only in file: {sorted(actual.keys() - expected.keys())}, "
                             f"only in plan: {sorted(expected.keys() - actual.keys())}, shape/dtype: {changed})")


def _scatter_from(fd: int, rank_file: Path, planned: PlannedFile, out_fd: int, offsets: dict[str, int],
                  specs: dict[str, TensorSpec], coverage: _Coverage) -> None:
    header = validate_safetensors(fd, name=str(rank_file))
    _check_planned(header, planned, rank_file)
    stored = {t.name: t for t in header.tensors}
    buffers, other = BlockBuffers(), BlockBuffers()
    for tensor in planned.tensors:
        position = header.data_offset + stored[tensor.name].begin
        row_bytes = tensor.row_bytes if tensor.axis == 1 else (
            tensor.nbytes // tensor.shape[0] if tensor.shape else tensor.nbytes)
        per_group = len(tensor.pieces) // tensor.groups
        for index, piece in enumerate(tensor.pieces):
            if tensor.axis == 1 and index and index % per_group == 0:  # the next expert's rows
                position += (tensor.shape[-2] - 1) * row_bytes
            if isinstance(piece, (Rows, Columns)):
                spec = specs[piece.source]
                dest = piece_span(piece, offsets[piece.source], spec.dtype, spec.shape)
                # Along dim 1 a piece is a run in each of the tensor's rows; `position` is its first byte. A
                # widened scale (w8a8) takes its dtype's bytes per source element, as does an experts'
                # weight_shape held in the model dtype.
                nbytes = dest.nbytes * itemsize(tensor.dtype) // itemsize(spec.dtype)
                here = (Span(position, dest.length, dest.count, row_bytes) if tensor.axis == 1
                        else Span(position, nbytes))
                earlier = coverage.first_copy(piece.source, piece, rank_file, here)
                if earlier is None:
                    written = 0
                    for chunk in read_span(fd, here, buffers):
                        same = tensor.dtype == spec.dtype
                        data = chunk if same else memoryview(_narrowed(chunk, tensor, spec, rank_file))
                        write_span(out_fd, dest, data, written)
                        written += len(data)
                else:
                    _check_replica(fd, here, *earlier, buffers, other, f"{tensor.name} in {rank_file.name}")
                position += dest.length if tensor.axis == 1 else nbytes
            elif isinstance(piece, Refined):
                position += _unrefine(fd, position, piece, specs[piece.source], offsets[piece.source], out_fd,
                                      coverage, f"{tensor.name} in {rank_file.name}")
            elif isinstance(piece, ZeroRows):
                nbytes = piece.count * row_bytes
                if any(any(chunk) for chunk in read_span(fd, Span(position, nbytes), buffers)):
                    raise IntegrityError(f"{rank_file.name}: {tensor.name}: padding is not zero (vLLM holds zeros "
                                         f"there: vocabulary padding, an unset bias)")
                position += nbytes
            elif isinstance(piece, Constant):
                if next(read_span(fd, Span(position, len(piece.data)), buffers)) != piece.data:
                    raise IntegrityError(f"{rank_file.name}: {tensor.name} is not vLLM's default value")
                position += len(piece.data)


def _unrefine(fd: int, position: int, piece: Refined, spec: TensorSpec, offset: int, out_fd: int,
              coverage: _Coverage, label: str) -> int:
    """Rebuild the checkpoint scale values a refined-grid piece repeats: every repeat must equal its value,
    and a value another rank also repeats must agree. Returns the piece's size in bytes."""
    import numpy as np

    size = itemsize(spec.dtype)
    shape = piece.shape(spec.shape)
    nbytes = shape[0] * shape[1] * size
    data = b"".join(bytes(c) for c in read_span(fd, Span(position, nbytes), BlockBuffers()))
    fine = np.frombuffer(data, dtype=np.uint8).reshape(*shape, size)
    lo, hi = piece.source_range()
    index = np.arange(piece.start, piece.stop) // piece.factor[piece.axis]
    across = 1 - piece.axis
    coarse = np.take(fine, np.arange(0, shape[across], piece.factor[across]), axis=across)
    first = np.take(coarse, np.searchsorted(index, np.arange(lo, hi)), axis=piece.axis)
    if not np.array_equal(fine, first.repeat(piece.factor[across], axis=across).take(index - lo, axis=piece.axis)):
        raise IntegrityError(f"{label}: a refined FP8 scale's repeats differ: it is not the checkpoint's grid "
                             f"repeated")
    coverage.first_copy(piece.source, piece, Path(label), Span(position, nbytes))
    coverage.refined_axes[piece.source] = (piece.axis, piece.factor[piece.axis])
    seen = coverage.refined.setdefault(piece.source, {})
    row_bytes = spec.shape[1] * size
    for i in range(lo, hi):
        value = np.take(first, i - lo, axis=piece.axis).tobytes()
        if seen.setdefault(i, value) != value:
            raise IntegrityError(f"{label}: refined FP8 scale {piece.source} index {i} differs from another "
                                 f"rank's copy")
        if piece.axis == 0:
            os.pwrite(out_fd, value, offset + i * row_bytes)
        else:
            for row in range(spec.shape[0]):
                os.pwrite(out_fd, value[row * size:(row + 1) * size], offset + row * row_bytes + i * size)
    return nbytes


def _narrowed(chunk: memoryview, tensor, spec: TensorSpec, rank_file: Path) -> bytes:
    try:
        return narrow(chunk, tensor.dtype, spec.dtype)
    except ShardError as e:
        raise IntegrityError(f"{rank_file.name}: {tensor.name}: {e}") from None


def _check_replica(fd: int, here: Span, first_file: Path, first: Span, buffers: BlockBuffers,
                   other: BlockBuffers, label: str) -> None:
    with opened(first_file.parent, first_file.name) as first_fd:
        if any(a != b for a, b in zip(read_span(fd, here, buffers), read_span(first_fd, first, other))):
            raise IntegrityError(f"{label}: replicated slice differs from its copy in {first_file.name}")
