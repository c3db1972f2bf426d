"""Plan a tensor/pipeline-parallel cut: which bytes of which Hugging Face tensor
land where in each `sharded_state` rank file.

The plan is pure data, computed from config.json, the checkpoint's tensor
names/dtypes/shapes and the target (TP, PP, vLLM release); no tensor bytes are
read. Each output tensor is a list of pieces concatenated along dim 0:

- `Rows`: rows [start, stop) of a source tensor: one contiguous byte range;
- `Columns`: columns [start, stop) of a 2-D source tensor: one strided range;
- `ZeroRows`: vocabulary padding;
- `Constant`: a literal (vLLM's default attention scales).

The same plan drives the writer (source -> rank files) and `unshard` (rank
files -> source), which is how the round trip proves the cut lossless.
"""
from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass, field
from typing import Mapping, Union

from .layouts import Family, Param, Placement, Source, Split, family_for
from .model import ModelDims, ShardError, pad_vocab, pp_layer_ranges
from .tensors import itemsize
from .versions import VllmTarget

LAYER_PREFIX = "model.layers.{i}."
SCALE_DTYPE = "F32"
# How many problem names an error message lists before summarising.
MAX_LISTED = 20
# The layer index of a decoder-layer tensor name; nine digits are past any real model.
LAYER_INDEX = re.compile(r"model\.layers\.(\d{1,9})\.")
# config.json's words for each symbolic dimension of the layout tables.
CONFIG_SIZES = {
    "vocab": "vocab_size", "hidden": "hidden_size", "intermediate": "intermediate_size", "head_dim": "head_dim",
    "q": "num_attention_heads x head_dim", "kv": "num_key_value_heads x head_dim",
}


@dataclass(frozen=True)
class TensorSpec:
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


@dataclass(frozen=True)
class Rows:
    source: str
    start: int
    stop: int


@dataclass(frozen=True)
class Columns:
    source: str
    start: int
    stop: int


@dataclass(frozen=True)
class ZeroRows:
    count: int


@dataclass(frozen=True)
class Constant:
    data: bytes


Piece = Union[Rows, Columns, ZeroRows, Constant]


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


@dataclass(frozen=True)
class PlannedFile:
    name: str
    pp_rank: int
    tp_rank: int
    tensors: tuple[PlannedTensor, ...]

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class ShardPlan:
    family: str
    dims: ModelDims
    tp: int
    pp: int
    vllm: VllmTarget
    layer_ranges: tuple[tuple[int, int], ...]
    files: tuple[PlannedFile, ...]
    # Checkpoint tensors that appear in no rank file, and why (vLLM skips them too).
    skipped: Mapping[str, str] = field(default_factory=dict)
    # Redundant copies of a tied LM head -> the tensor written in their place;
    # the bytes must be proven identical before anything is written.
    tied_copies: Mapping[str, str] = field(default_factory=dict)

    @property
    def data_bytes(self) -> int:
        return sum(f.data_bytes for f in self.files)


def plan_shards(config: dict, tensors: Mapping[str, TensorSpec], *, tp: int, pp: int, vllm: VllmTarget,
                max_part_size: int | None, pp_layer_partition: list[int] | None = None) -> ShardPlan:
    """Plan every rank file, or raise ShardError naming what is wrong."""
    if tp < 1 or pp < 1:
        raise ShardError(f"parallel sizes must be >= 1 (tensor {tp}, pipeline {pp})")
    if pp > 1 and not vllm.supports_pipeline_parallel:
        raise ShardError(f"vLLM {vllm} names sharded_state files by tensor-parallel rank only, so the "
                         f"{pp} pipeline stages of a rank would collide; pipeline parallelism needs vLLM >= 0.32")
    try:
        family = family_for(list(config.get("architectures") or []))
    except ValueError as e:
        raise ShardError(str(e)) from None
    refused = [key for key in family.refused_config_keys if config.get(key)]
    if refused:
        raise ShardError(f"config.json sets {', '.join(refused)}: vLLM builds modules for it that "
                         f"ferry shard has no layout for")
    dims = ModelDims.from_config(family, config)
    flags = {name: flag.value(config) for name, flag in family.flags.items()}
    check_dims_against_checkpoint(family, dims, flags, tensors)
    dims.check_tensor_parallel(tp)
    skipped, tied_copies = _check_sources(family, dims, flags, tensors)
    ranges = pp_layer_ranges(dims.layers, pp, pp_layer_partition)
    cutter = _Cutter(dims, tp, tensors)
    files = []
    for pp_rank, layer_range in enumerate(ranges):
        params = _stage_params(family, dims, flags, vllm, layer_range,
                               first=pp_rank == 0, last=pp_rank == pp - 1)
        for tp_rank in range(tp):
            planned = [cutter.cut(name, sources, tp_rank) for name, sources in params]
            files += _split_parts(planned, vllm, pp, pp_rank, tp_rank, max_part_size)
    return ShardPlan(family.name, dims, tp, pp, vllm, tuple(ranges), tuple(files), skipped, tied_copies)


def expected_sources(family: Family, dims: ModelDims, flags: Mapping[str, bool]) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor vLLM reads for this model, with its shape."""
    expected: dict[str, tuple[int, ...]] = {}
    for param in (*family.pre_layer_params, *family.post_layer_params):
        for source in _model_param_sources(param, dims):
            expected[source.hf_name] = dims.shape(source.shape)
    for i in range(dims.layers):
        for param in family.layer_params:
            if param.when is None or flags[param.when]:
                for source in param.sources:
                    expected[LAYER_PREFIX.format(i=i) + source.hf_name] = dims.shape(source.shape)
    return expected


def check_dims_against_checkpoint(family: Family, dims: ModelDims, flags: Mapping[str, bool],
                                  tensors: Mapping[str, TensorSpec]) -> None:
    """Refuse config.json sizes that the checkpoint's tensors contradict, before
    any table or loop is sized by them (a config may claim a billion layers).

    The layer count may not exceed the layers the checkpoint holds tensors for
    (fewer is refused later, naming the unexpected tensors); each size must be
    the extent of the first tensor that uses it (the embedding's rows are
    vocab_size, layer 0's q_proj rows num_attention_heads x head_dim, ...).
    """
    indices = {int(m.group(1)) for name in tensors if (m := LAYER_INDEX.match(name))}
    if dims.layers > len(indices):
        held = f"{len(indices)} layer(s), numbered 0 to {max(indices)}" if indices else "no model.layers.* tensors"
        raise ShardError(f"config.json: num_hidden_layers is {dims.layers}, but the checkpoint holds {held}")
    for symbol, (name, axis) in _first_use_of_each_size(family, dims, flags, tensors).items():
        extent = tensors[name].shape[axis]
        if extent != dims.size(symbol):
            raise ShardError(f"config.json: {CONFIG_SIZES[symbol]} is {_size_expression(dims, symbol)}, but the "
                             f"checkpoint's {name} has {extent} on dim {axis} (shape {list(tensors[name].shape)})")


def _first_use_of_each_size(family: Family, dims: ModelDims, flags: Mapping[str, bool],
                            tensors: Mapping[str, TensorSpec]) -> dict[str, tuple[str, int]]:
    """symbol -> (tensor name, axis) of the first checkpoint tensor, in table
    order (layer 0 for the layers), whose shape uses it. Tensors absent or of
    another rank are left to the full check that follows."""
    layer0 = LAYER_PREFIX.format(i=0)
    sources = [s for p in family.pre_layer_params for s in _model_param_sources(p, dims)]
    sources += [Source(layer0 + s.hf_name, s.shape, s.split) for p in family.layer_params
                if p.when is None or flags[p.when] for s in p.sources]
    sources += [s for p in family.post_layer_params for s in _model_param_sources(p, dims)]
    found: dict[str, tuple[str, int]] = {}
    for source in sources:
        spec = tensors.get(source.hf_name)
        if spec is None or len(spec.shape) != len(source.shape):
            continue
        for axis, symbol in enumerate(source.shape):
            found.setdefault(symbol, (source.hf_name, axis))
    return found


def _size_expression(dims: ModelDims, symbol: str) -> str:
    if symbol == "q":
        return f"{dims.heads} x {dims.head_dim} = {dims.size(symbol)}"
    if symbol == "kv":
        return f"{dims.kv_heads} x {dims.head_dim} = {dims.size(symbol)}"
    return str(dims.size(symbol))


def _model_param_sources(param: Param, dims: ModelDims) -> tuple[Source, ...]:
    if dims.tie_word_embeddings and param.tied_source:
        return tuple(Source(param.tied_source, s.shape, s.split) for s in param.sources)
    return param.sources


def _check_sources(family: Family, dims: ModelDims, flags: Mapping[str, bool],
                   tensors: Mapping[str, TensorSpec]) -> tuple[dict[str, str], dict[str, str]]:
    """Refuse a checkpoint with missing, misshapen or unexpected tensors.

    Returns the tensors vLLM skips (name -> why) and the redundant copies of a
    tied LM head (name -> the tensor vLLM uses instead), which the caller must
    prove identical: vLLM releases disagree on which one they serve.
    """
    expected = expected_sources(family, dims, flags)
    skipped: dict[str, str] = {}
    tied_copies: dict[str, str] = {}
    for name in tensors:
        if name.endswith(family.ignored_suffixes):
            skipped[name] = "non-persistent buffer that vLLM does not load"
    if dims.tie_word_embeddings:
        for param in (*family.pre_layer_params, *family.post_layer_params):
            if param.tied_source and param.name in tensors:
                tied_copies[param.name] = param.tied_source
                expected[param.name] = expected[param.tied_source]
    problems = []
    missing = [n for n in expected if n not in tensors]
    if missing:
        problems.append(f"missing tensor(s): {_listing(missing)}")
    wrong = [f"{n} has shape {list(tensors[n].shape)}, expected {list(shape)}"
             for n, shape in expected.items() if n in tensors and tensors[n].shape != shape]
    if wrong:
        problems.append(f"wrong shape(s): {_listing(wrong)}")
    extra = [n for n in tensors if n not in expected and n not in skipped]
    if extra:
        problems.append(f"unexpected tensor(s), for which vLLM's {family.name} model has no parameter: "
                        f"{_listing(extra)}")
    if problems:
        raise ShardError("checkpoint does not match config.json: " + "; ".join(problems))
    return skipped, tied_copies


def _listing(items: list[str]) -> str:
    shown = ", ".join(items[:MAX_LISTED])
    return shown + (f" (and {len(items) - MAX_LISTED} more)" if len(items) > MAX_LISTED else "")


def _stage_params(family: Family, dims: ModelDims, flags: Mapping[str, bool], vllm: VllmTarget,
                  layer_range: tuple[int, int], *, first: bool, last: bool) -> list[tuple[str, tuple[Source, ...]]]:
    """The (state_dict key, sources) of one pipeline stage, in vLLM's module order."""
    on_stage = {
        Placement.FIRST_STAGE: first,
        Placement.LAST_STAGE: last,
        Placement.FIRST_STAGE_AND_LAST_IF_TIED: first or (last and dims.tie_word_embeddings),
    }

    def model_params(params: tuple[Param, ...]) -> list[tuple[str, tuple[Source, ...]]]:
        return [(p.name, _model_param_sources(p, dims)) for p in params if on_stage[p.placement]]

    layers = []
    for i in range(*layer_range):
        prefix = LAYER_PREFIX.format(i=i)
        for param in family.layer_params:
            if param.when is None or flags[param.when]:
                layers.append((prefix + param.name,
                               tuple(Source(prefix + s.hf_name, s.shape, s.split) for s in param.sources)))
        for buffer in vllm.attention_scale_buffers:
            layers.append((f"{prefix}{family.attention_module}.{buffer}", ()))
    return _drop_shared_storage(model_params(family.pre_layer_params) + layers
                                + model_params(family.post_layer_params))


def _drop_shared_storage(params: list[tuple[str, tuple[Source, ...]]]) -> list[tuple[str, tuple[Source, ...]]]:
    """vLLM saves and loads `_filter_subtensors(model.state_dict())`: of the
    parameters sharing one storage (the tied LM head and input embedding) it
    keeps the smallest key, at the position where that storage first appears."""
    by_sources: dict[tuple[Source, ...], list[str]] = {}
    for name, sources in params:
        if sources:
            by_sources.setdefault(sources, []).append(name)
    kept, seen = [], set()
    for name, sources in params:
        if not sources:
            kept.append((name, sources))
        elif sources not in seen:
            seen.add(sources)
            kept.append((min(by_sources[sources]), sources))
    return kept


class _Cutter:
    """Cuts one parameter for one tensor-parallel rank."""

    def __init__(self, dims: ModelDims, tp: int, tensors: Mapping[str, TensorSpec]):
        self.dims, self.tp, self.tensors = dims, tp, tensors

    def cut(self, name: str, sources: tuple[Source, ...], rank: int) -> PlannedTensor:
        if not sources:  # an attention scale buffer: a 0-d float32 1.0
            return PlannedTensor(name, SCALE_DTYPE, (), (Constant(struct.pack("<f", 1.0)),))
        dtypes = {self.tensors[s.hf_name].dtype for s in sources}
        if len(dtypes) > 1:
            raise ShardError(f"{name} fuses {', '.join(s.hf_name for s in sources)} whose dtypes differ "
                             f"({', '.join(sorted(dtypes))}); their bytes cannot be concatenated")
        pieces: list[Piece] = []
        for source in sources:
            pieces += self._cut_source(source, rank)
        rows = sum(self._piece_rows(p) for p in pieces)
        trailing = self._trailing_shape(sources[0], pieces[0])
        return PlannedTensor(name, dtypes.pop(), (rows, *trailing), tuple(pieces))

    def _cut_source(self, source: Source, rank: int) -> list[Piece]:
        shape = self.tensors[source.hf_name].shape
        name, tp, dims = source.hf_name, self.tp, self.dims
        if source.split is Split.REPLICATED:
            return [Rows(name, 0, shape[0])]
        if source.split is Split.QUERY_HEADS:
            return [_even_rows(name, shape[0], tp, rank)]
        if source.split is Split.KV_HEADS:
            if tp >= dims.kv_heads:  # QKVParallelLinear: one KV head per rank, replicated
                head = rank // (tp // dims.kv_heads)
                return [Rows(name, head * dims.head_dim, (head + 1) * dims.head_dim)]
            return [_even_rows(name, shape[0], tp, rank)]
        if source.split is Split.OUTPUT:
            return [_even_rows(name, shape[0], tp, rank)]
        if source.split is Split.INPUT:
            width = shape[1] // tp
            return [Columns(name, rank * width, (rank + 1) * width)]
        if source.split is Split.VOCAB:
            per_rank = pad_vocab(dims.vocab) // tp
            start, stop = rank * per_rank, (rank + 1) * per_rank
            real = Rows(name, min(start, dims.vocab), min(stop, dims.vocab))
            padding = per_rank - (real.stop - real.start)
            return [p for p in (real if real.stop > real.start else None,
                                ZeroRows(padding) if padding else None) if p is not None]
        raise AssertionError(source.split)

    def _piece_rows(self, piece: Piece) -> int:
        if isinstance(piece, Rows):
            return piece.stop - piece.start
        if isinstance(piece, Columns):
            return self.tensors[piece.source].shape[0]
        if isinstance(piece, ZeroRows):
            return piece.count
        raise AssertionError(piece)

    def _trailing_shape(self, source: Source, piece: Piece) -> tuple[int, ...]:
        if isinstance(piece, Columns):
            return (piece.stop - piece.start,)
        return self.tensors[source.hf_name].shape[1:]


def _even_rows(name: str, rows: int, tp: int, rank: int) -> Rows:
    per_rank = rows // tp
    return Rows(name, rank * per_rank, (rank + 1) * per_rank)


def _split_parts(tensors: list[PlannedTensor], vllm: VllmTarget, pp: int, pp_rank: int, tp_rank: int,
                 max_part_size: int | None) -> list[PlannedFile]:
    """vLLM's `save_model` rule: start a new part when the next tensor would
    take the current one past `max_part_size` (a tensor larger than that gets a
    part of its own; vLLM would also write an empty part before it)."""
    parts: list[list[PlannedTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if max_part_size is not None and parts[-1] and size + tensor.nbytes > max_part_size:
            parts.append([])
            size = 0
        parts[-1].append(tensor)
        size += tensor.nbytes
    return [PlannedFile(vllm.file_name(pp, pp_rank, tp_rank, n), pp_rank, tp_rank, tuple(part))
            for n, part in enumerate(parts)]
