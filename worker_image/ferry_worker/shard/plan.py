"""Plan a tensor/pipeline-parallel cut: which bytes of which Hugging Face tensor
land where in each `sharded_state` rank file.

The plan is pure data, computed from config.json, the checkpoint's tensor
names/dtypes/shapes and the target (TP, PP, vLLM release); no tensor bytes are
read. Each output tensor is a list of pieces concatenated along dim 0:

- `Rows`: rows [start, stop) of a source tensor: one contiguous byte range;
- `Columns`: columns [start, stop) of a 2-D source tensor: one strided range;
- `ZeroRows`: vocabulary padding, and zeroed expert biases (GPTQ);
- `Constant`: a literal (vLLM's default attention scales);
- `Refined`: rows or columns of an FP8 expert scale on vLLM's refined grid
  (each checkpoint scale repeated over the finer blocks it covers).

An FP8 block-scaled checkpoint's scales (`fp8.py`) are cut with their
weights, in block units: the same pieces, of the scale tensor.

The same plan drives the writer (source -> rank files) and `unshard` (rank
files -> source), which is how the round trip proves the cut lossless.
"""
from __future__ import annotations

import dataclasses
import math
import re
import struct
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Union

from . import fp8, intpack, w8a8, wna16
from .experts import MoeTarget, check_moe, expert_ranks
from .layouts import EACH, WHOLE, Family, Mlp, Param, Placement, Source, Split, family_for
from .model import ModelDims, ShardError, pad_vocab, pp_layer_ranges
from .tensors import itemsize
from .versions import ATTENTION_SCALE_VALUE, VllmTarget

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
EXPERT = "{e}"  # the expert index in a MoE source name
MAX_EXTRA_LAYERS = 8  # DeepSeek-V3 ships 1 multi-token-prediction layer


@dataclass(frozen=True)
class TensorSpec:
    dtype: str
    shape: tuple[int, ...]
    file: str = ""  # the checkpoint file holding it (vLLM reads files in natural order, keys sorted)

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


@dataclass(frozen=True)
class Refined:
    """Indices [start, stop) along `axis` (0: rows, 1: columns) of the checkpoint scale `source` upsampled to
    vLLM's refined MoE grid: each value repeated `factor[0]` times down and `factor[1]` times across (the
    `repeat_interleave` of FusedMoE's weight loader), the other axis whole."""

    source: str
    axis: int
    start: int
    stop: int
    factor: tuple[int, int]

    def shape(self, source_shape: tuple[int, ...]) -> tuple[int, int]:
        rows, columns = source_shape[0] * self.factor[0], source_shape[1] * self.factor[1]
        return (self.stop - self.start, columns) if self.axis == 0 else (rows, self.stop - self.start)

    def source_range(self) -> tuple[int, int]:
        """The checkpoint indices along `axis` the piece repeats."""
        f = self.factor[self.axis]
        return self.start // f, -(-self.stop // f)


Piece = Union[Rows, Columns, ZeroRows, Constant, Refined]


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    # The dim the pieces are concatenated along: 1 for the column slices of an [in, out] tensor (AWQ, GPTQ),
    # side by side in each row (an expert stack [E, in, out]: each expert's pieces, experts one after another).
    axis: int = 0

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of the last two dims (the rows axis-1 pieces sit side by side in)."""
        rows = math.prod(self.shape[:-1]) if self.shape else 1
        return self.nbytes // rows if rows else 0

    @property
    def groups(self) -> int:
        """How many side-by-side groups of pieces (axis 1): one per expert of a stack, else one."""
        return self.shape[0] if self.axis == 1 and len(self.shape) == 3 else 1

    def side_by_side(self) -> Iterator[tuple[Piece, ...]]:
        """Axis 1: each group's pieces, which sit side by side in its rows (one group per expert)."""
        per_group = len(self.pieces) // self.groups
        return (self.pieces[first:first + per_group] for first in range(0, len(self.pieces), per_group))

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
    moe: MoeTarget = MoeTarget()
    experts: int = 0  # routed experts per MoE layer; 0 for a dense model
    quant: Quantization | None = None
    # FP8 experts on vLLM's refined scale grid: the factors each checkpoint scale is repeated by.
    moe_scale_refine: tuple[int, int] | None = None

    @property
    def data_bytes(self) -> int:
        return sum(f.data_bytes for f in self.files)

    def quant_facts(self) -> dict:
        """How the checkpoint is quantized (empty when it is not), for its manifest."""
        if not self.quant:
            return {}
        facts = self.quant.facts()
        if self.moe_scale_refine:
            facts["moeScaleGrid"] = {"refinedBlock": [b // f for b, f in zip(self.quant.block, self.moe_scale_refine)],
                                     "factor": list(self.moe_scale_refine)}
        return {"quantization": facts}

    def shared_groups(self, names) -> dict[str, list[str]]:
        """w8a8.shared_groups over the tensors among `names` that vLLM reads (a skipped layer's, e.g. an MTP
        layer past num_hidden_layers, is in no group: its shape was never checked, and no rank file holds it)."""
        return w8a8.shared_groups(self.quant, [n for n in names if n not in self.skipped])

    def moe_facts(self) -> dict:
        """What a MoE artifact was cut for (empty for a dense model), for its
        manifest: the operator records it and refuses serving flags the files
        cannot honour (data parallelism, EPLB)."""
        if not self.experts:
            return {}
        return {"experts": self.experts, "expertParallel": self.moe.expert_parallel,
                "expertPlacement": self.moe.placement, "target": self.moe.gpu}


def plan_shards(config: dict, tensors: Mapping[str, TensorSpec], *, tp: int, pp: int, vllm: VllmTarget,
                max_part_size: int | None, pp_layer_partition: list[int] | None = None,
                moe: MoeTarget = MoeTarget()) -> ShardPlan:
    """Plan every rank file, or raise ShardError naming what is wrong."""
    if tp < 1 or pp < 1:
        raise ShardError(f"parallel sizes must be >= 1 (tensor {tp}, pipeline {pp})")
    if pp > 1 and not vllm.supports_pipeline_parallel:
        raise ShardError(f"vLLM {vllm} names sharded_state files by tensor-parallel rank only, so the "
                         f"{pp} pipeline stages of a rank would collide; pipeline parallelism needs vLLM >= 0.32")
    family, quant = _family_and_quantization(config, tensors, vllm)
    dims = ModelDims.from_config(family, config)
    layers = _Layers(family, config, dims, quant)
    flags = {name: flag.value(config) for name, flag in family.flags.items()}
    check_dims_against_checkpoint(family, dims, flags, tensors, layers)
    dims.check_tensor_parallel(tp, dense_mlp=layers.any(Mlp.DENSE))
    if moe.gpu in family.refused_targets:
        raise ShardError(f"{family.name}: {family.refused_targets[moe.gpu]}")
    refine = _check_experts(family, config, dims, layers, flags, tp, moe, quant)
    skipped = _skipped_tensors(family, dims, tensors, layers)
    _check_quantized_dtypes(family, dims, flags, tensors, layers, skipped)
    tied_copies = _check_sources(family, dims, flags, tensors, layers, skipped)
    ranges = pp_layer_ranges(dims.layers, pp, pp_layer_partition)
    model_dtype = _model_dtype(family, dims, tensors)
    _check_exact_shapes(family, dims, layers, model_dtype)
    cutter = _Cutter(dims, tp, tensors, moe, refine, model_dtype)
    files = []
    for pp_rank, layer_range in enumerate(ranges):
        params = _stage_params(family, dims, flags, vllm, layers, layer_range, model_dtype,
                               first=pp_rank == 0, last=pp_rank == pp - 1)
        for tp_rank in range(tp):
            planned = [cutter.cut(entry, tp_rank) for entry in params]
            files += _split_parts(planned, vllm, pp, pp_rank, tp_rank, max_part_size)
    return ShardPlan(family.name, dims, tp, pp, vllm, tuple(ranges), tuple(files), skipped, tied_copies,
                     moe if family.is_moe else MoeTarget(), dims.experts, quant, refine)


Quantization = Union[fp8.BlockFp8, fp8.TensorFp8, wna16.PackQuantized, intpack.IntPacked, w8a8.W8A8]


def _family_and_quantization(config: dict, tensors: Mapping[str, TensorSpec],
                             vllm: VllmTarget) -> tuple[Family, Quantization | None]:
    """The model family config.json names (with its quantized parameters) and its quantization, or
    ShardError for one ferry shard has no layout for."""
    try:
        family = family_for(list(config.get("architectures") or []))
    except ValueError as e:
        raise ShardError(str(e)) from None
    refused = [key for key in family.refused_config_keys if config.get(key)]
    if refused:
        raise ShardError(f"config.json sets {', '.join(refused)}: vLLM builds modules for it that "
                         f"ferry shard has no layout for")
    quant = quantization(config)
    if quant is not None:
        if not vllm.fp8_block_layout_known:
            raise ShardError(f"quantized layouts are checked against vLLM 0.32 onwards; vLLM {vllm} is "
                             f"older, so no artifact is written")
        family = _with_quantized_params(family, quant)
        if isinstance(quant, intpack.IntPacked):
            quant = quant.with_checkpoint_modules({name: spec.dtype for name, spec in tensors.items()})
    return family, quant


def _check_experts(family: Family, config: dict, dims: ModelDims, layers: _Layers, flags: dict, tp: int,
                   moe: MoeTarget, quant: Quantization | None):
    """A MoE model's expert cut checked (its FP8 scale grid refined where vLLM refines it: the refinement,
    else None); expert parallelism refused for a dense one."""
    if not family.is_moe:
        if moe.expert_parallel:
            raise ShardError(f"expert parallelism was asked for, but {family.name} has no experts")
        return None
    check_moe(dims, tp, moe, tp_at_most_experts=family.tp_at_most_experts,
              expert_groups=int(config.get("n_group") or 1))
    quantized_experts = any(layers.quantized(p, i) for p in family.layer_params if p.experts
                            for i in range(dims.layers) if layers.holds(p, i, flags))
    if isinstance(quant, intpack.IntPacked) and quantized_experts:
        intpack.check_marlin_experts(quant, dims.hidden)
    if isinstance(quant, fp8.BlockFp8) and quantized_experts:
        return fp8.check_moe_blocks(dims, tp, moe, quant)
    return None



def quantization(config: dict) -> Quantization | None:
    """The checkpoint's quantization as ferry shard cuts it (None: unquantized), or a ShardError naming the
    setting it does not cut."""
    qc = config.get("quantization_config")
    if isinstance(qc, dict) and qc.get("quant_method") == wna16.METHOD:
        fmt = w8a8.format_of(qc)
        return w8a8.w8a8(qc, fmt) if fmt in w8a8.FORMATS else wna16.pack_quantized(qc)
    if isinstance(qc, dict) and qc.get("quant_method") in (intpack.AWQ, intpack.GPTQ):
        return intpack.int_packed(qc)
    if isinstance(qc, dict) and qc.get("quant_method") not in (None, "fp8"):
        raise ShardError(f"config.json: quantization_config.quant_method is {qc.get('quant_method')!r}; ferry "
                         f"shard cuts unquantized, FP8 block-scaled (\"fp8\" with weight_block_size), AWQ, GPTQ "
                         f"and compressed-tensors pack-quantized checkpoints, and writes no layout it has not "
                         f"checked against vLLM")
    return fp8.block_fp8(config)


def _with_quantized_params(family: Family, quant: Quantization) -> Family:
    if isinstance(quant, fp8.BlockFp8):
        return fp8.with_scales(family, quant)
    if isinstance(quant, fp8.TensorFp8):
        return fp8.with_tensor_scales(family, quant)
    if isinstance(quant, intpack.IntPacked):
        return intpack.with_packed(family, quant)
    if isinstance(quant, w8a8.W8A8):
        return w8a8.with_scales(family, quant)
    return wna16.with_packed(family, quant)


def _check_exact_shapes(family: Family, dims: ModelDims, layers: "_Layers", model_dtype: str) -> None:
    """Pack-quantized experts: vLLM copies each expert's int64 weight_shape into a parameter of the model
    dtype, which must hold the sizes exactly (else vLLM holds a rounded shape the cut could not undo)."""
    if not (isinstance(layers.quant, wna16.PackQuantized) and family.is_moe):
        return
    from .tensors import exactly_representable

    for symbol in ("moe_intermediate", "hidden"):
        if not exactly_representable(dims.size(symbol), model_dtype):
            raise ShardError(f"config.json: {_config_words(family, symbol)} {dims.size(symbol)} is not exactly a "
                             f"{model_dtype} value, and vLLM keeps the experts' weight_shape in {model_dtype}; "
                             f"ferry shard does not write the rounded shape: serve with format.type safetensors")


def _model_dtype(family: Family, dims: ModelDims, tensors: Mapping[str, TensorSpec]) -> str:
    """The dtype of the checkpoint's unquantized weights: the input embedding's."""
    embedding = _model_param_sources(family.pre_layer_params[0], dims)[0].hf_name
    return tensors[embedding].dtype


class _Layers:
    """Which decoder layers are MoE layers, which of their linear weights are
    quantized, and which layer params each holds."""

    def __init__(self, family: Family, config: dict, dims: ModelDims, quant: Quantization | None = None):
        self.family, self.config, self.count, self.quant = family, config, dims.layers, quant
        self._kinds: list[Mlp] | None = None

    def kind(self, layer: int) -> Mlp:
        if self._kinds is None:  # only once the layer count is checked against the checkpoint
            self._kinds = [self.family.layer_mlp(self.config, i) for i in range(self.count)]
        return self._kinds[layer]

    def any(self, kind: Mlp) -> bool:
        return any(self.kind(i) is kind for i in range(self.count))

    def holds(self, param: Param, layer: int, flags: Mapping[str, bool]) -> bool:
        return ((param.when is None or flags[param.when])
                and (param.mlp is None or param.mlp is self.kind(layer))
                and (not param.is_scale or self.quantized(param, layer))
                and not (param.replaced_when_quantized and self.quantized(param, layer)))

    def quantized(self, param: Param, layer: int) -> bool:
        """Whether vLLM quantizes this linear weight (or scale's weight) in this layer."""
        if param.experts and param.linear and isinstance(self.quant, intpack.IntPacked) and \
                self.quant.quantizes_every_expert:
            return True
        return (self.quant is not None and param.linear
                and not self.quant.skips(fp8.module_of(self.family, LAYER_PREFIX.format(i=layer) + param.name,
                                                       param)))

    def first_holding(self, param: Param, flags: Mapping[str, bool]) -> int | None:
        return next((i for i in range(self.count) if self.holds(param, i, flags)), None)


def expected_sources(family: Family, dims: ModelDims, flags: Mapping[str, bool],
                     layers: "_Layers") -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor vLLM reads for this model, with its shape."""
    expected: dict[str, tuple[int, ...]] = {}
    for param in (*family.pre_layer_params, *family.post_layer_params):
        for source in _model_param_sources(param, dims):
            expected[source.hf_name] = dims.shape(source.hf_shape)
    for _, _, source, name in _layer_sources(family, dims, flags, layers):
        if source.block not in (None, WHOLE, EACH) and not name.endswith(fp8.SCALE_SUFFIX):
            _check_whole_blocks(name, source, *dims.shape(fp8.weight_source(source).hf_shape))
        expected[name] = _source_shape(dims, source)
    return expected


def _layer_sources(family: Family, dims: ModelDims, flags: Mapping[str, bool],
                   layers: "_Layers") -> Iterator[tuple[int, Param, Source, str]]:
    """(layer, param, source, checkpoint name) of every decoder-layer tensor vLLM reads, experts expanded."""
    for i in range(dims.layers):
        for param in family.layer_params:
            if layers.holds(param, i, flags):
                for source in param.sources:
                    for e in range(dims.experts if param.experts else 1):
                        yield i, param, source, LAYER_PREFIX.format(i=i) + source.hf_name.replace(EXPERT, str(e))


def _source_shape(dims: ModelDims, source: Source) -> tuple[int, ...]:
    shape = dims.shape(source.hf_shape)
    if source.block in (None, WHOLE, EACH):
        return shape
    blocks = fp8.scale_shape(shape, source.block)
    return blocks[::-1] if source.transposed else blocks


def _check_quantized_dtypes(family: Family, dims: ModelDims, flags: Mapping[str, bool],
                            tensors: Mapping[str, TensorSpec], layers: "_Layers", skipped: Mapping[str, str]) -> None:
    """Quantized weights FP8, their scales float32, nothing else FP8 (fp8.check_dtypes); the packed tensors
    of a pack-quantized checkpoint as vLLM allocates them (wna16)."""
    if isinstance(layers.quant, (wna16.PackQuantized, intpack.IntPacked, w8a8.W8A8)):
        roles, quantized = {}, set()
        for i, param, _, name in _layer_sources(family, dims, flags, layers):
            if param.is_scale:
                roles[name] = layers.quant.role(name)
            elif layers.quantized(param, i):
                quantized.add(name)
        dtypes, model_dtype = {n: t.dtype for n, t in tensors.items()}, _model_dtype(family, dims, tensors)
        if isinstance(layers.quant, w8a8.W8A8):
            layers.quant.check_dtypes(dtypes, roles, model_dtype, quantized)
        else:
            layers.quant.check_dtypes(dtypes, roles, model_dtype)
        return
    quantized, scales = set(), set()
    for i, param, source, name in _layer_sources(family, dims, flags, layers):
        if layers.quantized(param, i):
            (scales if source.block else quantized).add(name)
    fp8.check_dtypes({n: t.dtype for n, t in tensors.items() if n not in skipped}, quantized, scales, layers.quant)


def check_dims_against_checkpoint(family: Family, dims: ModelDims, flags: Mapping[str, bool],
                                  tensors: Mapping[str, TensorSpec], layers: "_Layers") -> None:
    """Refuse config.json sizes that the checkpoint's tensors contradict, before
    any table or loop is sized by them (a config may claim a billion layers or experts).

    The layer count may not exceed the layers the checkpoint holds tensors for
    (fewer is refused later, naming the unexpected tensors); each size must be
    the extent of the first tensor that uses it (the embedding's rows are
    vocab_size, layer 0's q_proj rows num_attention_heads x head_dim, a
    router's rows the expert count, ...).
    """
    indices = {int(m.group(1)) for name in tensors if (m := LAYER_INDEX.match(name))}
    if dims.layers > len(indices):
        held = f"{len(indices)} layer(s), numbered 0 to {max(indices)}" if indices else "no model.layers.* tensors"
        raise ShardError(f"config.json: num_hidden_layers is {dims.layers}, but the checkpoint holds {held}")
    for symbol, (name, axis) in _first_use_of_each_size(family, dims, flags, tensors, layers).items():
        extent = tensors[name].shape[axis]
        if extent != dims.size(symbol):
            raise ShardError(f"config.json: {_config_words(family, symbol)} is {_size_expression(dims, symbol)}, "
                             f"but the checkpoint's {name} has {extent} on dim {axis} "
                             f"(shape {list(tensors[name].shape)})")


def _first_use_of_each_size(family: Family, dims: ModelDims, flags: Mapping[str, bool],
                            tensors: Mapping[str, TensorSpec], layers: "_Layers") -> dict[str, tuple[str, int]]:
    """symbol -> (tensor name, axis) of the first checkpoint tensor, in table
    order (the first layer that holds it, expert 0), whose shape uses it.
    Tensors absent or of another rank are left to the full check that follows."""
    sources = [s for p in family.pre_layer_params for s in _model_param_sources(p, dims)]
    for param in family.layer_params:
        layer = layers.first_holding(param, flags)
        if layer is not None and not param.is_scale:  # a scale's extents are blocks, not sizes
            sources += [Source(LAYER_PREFIX.format(i=layer) + s.hf_name.replace(EXPERT, "0"), s.shape, s.split,
                               s.fused) for s in param.sources]
    sources += [s for p in family.post_layer_params for s in _model_param_sources(p, dims)]
    found: dict[str, tuple[str, int]] = {}
    for source in sources:
        spec = tensors.get(source.hf_name)
        if spec is None or len(spec.shape) != len(source.hf_shape):
            continue
        for axis, symbol in enumerate(source.hf_shape):
            # Sums and sizes derived from others are checked by the full shape check that follows.
            if symbol in CONFIG_SIZES or any(k.symbol == symbol for k in family.sizes):
                found.setdefault(symbol, (source.hf_name, axis))
    return found


def _config_words(family: Family, symbol: str) -> str:
    size_key = next((k for k in family.sizes if k.symbol == symbol), None)
    return " / ".join(size_key.keys) if size_key else CONFIG_SIZES[symbol]


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


def _skipped_tensors(family: Family, dims: ModelDims, tensors: Mapping[str, TensorSpec],
                     layers: "_Layers") -> dict[str, str]:
    """The checkpoint tensors vLLM skips, name -> why."""
    skipped: dict[str, str] = {}
    extra_layers = range(dims.layers, dims.layers + _extra_layers(family, layers.config))
    for name in tensors:
        if name.endswith(family.ignored_suffixes):
            skipped[name] = "non-persistent buffer that vLLM does not load"
        elif (m := LAYER_INDEX.match(name)) and int(m.group(1)) in extra_layers:
            skipped[name] = f"layer past num_hidden_layers ({family.extra_layers_key}), which vLLM's model skips"
        elif isinstance(layers.quant, intpack.IntPacked) and name.endswith(intpack.DROPPED_SUFFIX):
            skipped[name] = "GPTQ act-order index, which vLLM's checkpoint weight mapper drops"
    return skipped


def _check_sources(family: Family, dims: ModelDims, flags: Mapping[str, bool], tensors: Mapping[str, TensorSpec],
                   layers: "_Layers", skipped: Mapping[str, str]) -> dict[str, str]:
    """Refuse a checkpoint with missing, misshapen or unexpected tensors.

    Returns the redundant copies of a tied LM head (name -> the tensor vLLM
    uses instead), which the caller must prove identical: vLLM releases
    disagree on which one they serve.
    """
    expected = expected_sources(family, dims, flags, layers)
    tied_copies: dict[str, str] = {}
    if dims.tie_word_embeddings:
        for param in (*family.pre_layer_params, *family.post_layer_params):
            if param.tied_source and param.name in tensors:
                tied_copies[param.name] = param.tied_source
                expected[param.name] = expected[param.tied_source]
    problems = []
    missing = [n for n in expected if n not in tensors]
    if missing:
        problems.append(f"missing tensor(s): {_listing(missing)}")
    scalars = {name for _, _, source, name in _layer_sources(family, dims, flags, layers) if source.one_value}
    wrong = [f"{n} has shape {list(tensors[n].shape)}, expected {list(shape)}"
             for n, shape in expected.items() if n in tensors and tensors[n].shape != shape
             and not (n in scalars and tensors[n].shape == ())]  # one value (per part, or shared): [1] or 0-d
    if wrong:
        problems.append(f"wrong shape(s): {_listing(wrong)}")
    extra = [n for n in tensors if n not in expected and n not in skipped]
    if extra:
        problems.append(f"unexpected tensor(s), for which vLLM's {family.name} model has no parameter: "
                        f"{_listing(extra)}")
    if problems:
        raise ShardError("checkpoint does not match config.json: " + "; ".join(problems))
    return tied_copies


def _extra_layers(family: Family, config: dict) -> int:
    value = config.get(family.extra_layers_key) if family.extra_layers_key else None
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_EXTRA_LAYERS else 0


def _listing(items: list[str]) -> str:
    shown = ", ".join(items[:MAX_LISTED])
    return shown + (f" (and {len(items) - MAX_LISTED} more)" if len(items) > MAX_LISTED else "")


@dataclass(frozen=True)
class _Entry:
    """One key of a stage's state_dict and what it is built from."""

    name: str
    sources: tuple[Source, ...]  # empty: a constant (an attention scale), 0-d unless `shape`
    experts: bool = False
    constant: tuple[str, bytes] = (SCALE_DTYPE, struct.pack("<f", ATTENTION_SCALE_VALUE))  # dtype, bytes
    shape: tuple[int, ...] = ()
    # A zeroed expert bias the checkpoint lacks (GPTQ's w13_bias/w2_bias): the weights whose outputs it spans.
    zeros: tuple[Source, ...] = ()


def _stage_params(family: Family, dims: ModelDims, flags: Mapping[str, bool], vllm: VllmTarget, layers: _Layers,
                  layer_range: tuple[int, int], model_dtype: str, *, first: bool, last: bool) -> list[_Entry]:
    """The state_dict entries of one pipeline stage, in vLLM's module order."""
    on_stage = {
        Placement.FIRST_STAGE: first,
        Placement.LAST_STAGE: last,
        Placement.FIRST_STAGE_AND_LAST_IF_TIED: first or (last and dims.tie_word_embeddings),
        Placement.EVERY_STAGE: True,
    }

    def model_params(params: tuple[Param, ...]) -> list[_Entry]:
        return [_Entry(p.name, _model_param_sources(p, dims)) for p in params if on_stage[p.placement]]

    entries = []
    for i in range(*layer_range):
        prefix = LAYER_PREFIX.format(i=i)
        for param in family.layer_params:
            if layers.holds(param, i, flags):
                entries.append(_Entry(prefix + param.name, tuple(_prefixed(s, prefix) for s in param.sources),
                                      param.experts))
        entries += [_Entry(prefix + name, (), True, zeros=tuple(_prefixed(w, prefix) for w in weights))
                    for name, weights in intpack.zeroed_biases(family, layers.quant)
                    if any(layers.holds(p, i, flags) for p in family.layer_params if p.experts)]
        if isinstance(layers.quant, (fp8.BlockFp8, fp8.TensorFp8)) and family.fp8_attention_scales:
            unset = (model_dtype, fp8.attention_scale_value(model_dtype))
            entries += [_Entry(f"{prefix}{family.attention_module}.{p}", (), constant=unset)
                        for p in fp8.ATTENTION_SCALE_PARAMS]
        if isinstance(layers.quant, (wna16.PackQuantized, w8a8.W8A8)):  # compressed-tensors' KV-cache method
            entries += [_Entry(f"{prefix}{family.attention_module}.{p}", (), constant=value, shape=(1,))
                        for p, value in wna16.attention_params(model_dtype)]
        for buffer in vllm.attention_scale_buffers:
            entries.append(_Entry(f"{prefix}{family.attention_module}.{buffer}", ()))
    return _drop_shared_storage(model_params(family.pre_layer_params) + entries
                                + model_params(family.post_layer_params))


def _prefixed(source: Source, prefix: str) -> Source:
    return dataclasses.replace(source, hf_name=prefix + source.hf_name, weight=source.weight and prefix + source.weight)


def _drop_shared_storage(entries: list[_Entry]) -> list[_Entry]:
    """vLLM saves and loads `_filter_subtensors(model.state_dict())`: of the
    parameters sharing one storage (the tied LM head and input embedding) it
    keeps the smallest key, at the position where that storage first appears."""
    by_sources: dict[tuple[Source, ...], list[str]] = {}
    for entry in entries:
        if entry.sources:
            by_sources.setdefault(entry.sources, []).append(entry.name)
    kept, seen = [], set()
    for entry in entries:
        if not entry.sources:
            kept.append(entry)
        elif entry.sources not in seen:
            seen.add(entry.sources)
            kept.append(_Entry(min(by_sources[entry.sources]), entry.sources, entry.experts))
    return kept


class _Cutter:
    """Cuts one parameter for one tensor-parallel rank."""

    def __init__(self, dims: ModelDims, tp: int, tensors: Mapping[str, TensorSpec], moe: MoeTarget,
                 refine: tuple[int, int] | None = None, model_dtype: str = ""):
        self.dims, self.tp, self.tensors, self.moe, self.refine = dims, tp, tensors, moe, refine
        self.model_dtype = model_dtype

    def cut(self, entry: _Entry, rank: int) -> PlannedTensor:
        if entry.zeros:
            return self._zeroed_bias(entry, rank)
        if not entry.sources:  # an attention scale: a constant
            dtype, data = entry.constant
            return PlannedTensor(entry.name, dtype, entry.shape, (Constant(data),))
        if entry.experts:
            return self._cut_experts(entry, rank)
        pieces = self._concatenation(entry.name, entry.sources, rank, self.tp)
        dtype = self._dtype(entry.name, entry.sources)
        assert not (entry.sources[0].transposed and entry.sources[0].cast), entry.name  # the writer widens dim 0 only
        if entry.sources[0].transposed and isinstance(pieces[0], Columns):  # [in, out]: parts side by side
            rows = {self._piece_rows(p) for p in pieces}
            assert len(rows) == 1 and all(isinstance(p, Columns) for p in pieces), entry.name
            width = sum(p.stop - p.start for p in pieces)
            return PlannedTensor(entry.name, dtype, (rows.pop(), width), tuple(pieces), axis=1)
        rows = sum(self._piece_rows(p) for p in pieces)
        trailing = self._trailing_shape(entry.sources[0], pieces[0])
        return PlannedTensor(entry.name, dtype, (rows, *trailing), tuple(pieces))

    def _experts_held(self, rank: int) -> tuple[list[int], int, int]:
        """The experts `rank` holds, and the MoE layer's tensor-parallel size and rank (1 and 0 under EP)."""
        if self.moe.expert_parallel:
            return expert_ranks(self.dims.experts, self.tp, rank, self.moe.placement), 1, 0
        return list(range(self.dims.experts)), self.tp, rank

    def _zeroed_bias(self, entry: _Entry, rank: int) -> PlannedTensor:
        """[experts held, the rank's outputs of entry.zeros' weights] of zeros in the model dtype."""
        held, moe_tp, moe_rank = self._experts_held(rank)
        width = 0
        for weight in entry.zeros:
            for piece in self._cut_source(_for_expert(weight, held[0]), moe_rank, moe_tp):
                width += piece.stop - piece.start if isinstance(piece, Rows) else self.dims.size(weight.shape[0])
        return PlannedTensor(entry.name, self.model_dtype, (len(held), width), (ZeroRows(len(held)),))

    def _cut_experts(self, entry: _Entry, rank: int) -> PlannedTensor:
        """FusedMoE's stack: for each expert the rank holds, its sources cut by
        the MoE layer's tensor-parallel size (1 under expert parallelism)."""
        held, moe_tp, moe_rank = self._experts_held(rank)
        per_expert = [[_for_expert(s, e) for s in entry.sources] for e in held]
        pieces = [self._concatenation(entry.name, sources, moe_rank, moe_tp, self.refine) for sources in per_expert]
        rows = sum(self._piece_rows(p) for p in pieces[0])
        trailing = self._trailing_shape(per_expert[0][0], pieces[0][0])
        dtype = self._dtype(entry.name, tuple(s for sources in per_expert for s in sources))
        if entry.sources[0].transposed and isinstance(pieces[0][0], Columns):  # [E, in, out]: parts side by side
            width = sum(p.stop - p.start for p in pieces[0])
            return PlannedTensor(entry.name, dtype, (len(held), rows // len(pieces[0]), width),
                                 tuple(p for ps in pieces for p in ps), axis=1)
        first = entry.sources[0]
        if first.one_value and (first.block == WHOLE or len(entry.sources) == 1):
            # one scale per expert (w2's; an input scale w1 and w3 share): [E]
            return PlannedTensor(entry.name, dtype, (len(held),), tuple(p for ps in pieces for p in ps))
        return PlannedTensor(entry.name, dtype, (len(held), rows, *trailing), tuple(p for ps in pieces for p in ps))

    def _concatenation(self, name: str, sources: tuple[Source, ...] | list[Source], rank: int,
                       tp: int, refine: tuple[int, int] | None = None) -> list[Piece]:
        """The pieces of `sources` for `rank`, concatenated along dim 0: each
        cut for the rank, or for FP8 scales, their weights' cuts in blocks (on
        vLLM's refined grid for FP8 experts with `refine`)."""
        if sources[0].block is None:
            return [p for s in sources for p in self._cut_source(s, rank, tp)]
        if sources[0].block == EACH:  # each part's one value ([1] or 0-d in the checkpoint), side by side
            return [Rows(s.hf_name, 0, 1) for s in sources]
        if sources[0].block == WHOLE:  # whole, from the part vLLM loads last ([n], or a 0-d scale)
            last = max(sources, key=lambda s: (wna16.natural_key(self.tensors[s.hf_name].file), s.hf_name))
            return [Rows(last.hf_name, 0, (self.tensors[last.hf_name].shape or (1,))[0])]
        weights = [(s, p) for s in sources for p in self._cut_source(fp8.weight_source(s), rank, tp)]
        if refine and sources[0].hf_name.endswith(fp8.SCALE_SUFFIX):
            return [_refined(scale, piece, refine) for scale, piece in weights]
        pieces = [self._in_blocks(name, scale, piece, rank, tp, last=i == len(weights) - 1)
                  for i, (scale, piece) in enumerate(weights)]
        return [_transposed(p) for p in pieces] if sources[0].transposed else pieces

    def _in_blocks(self, name: str, scale: Source, piece: Piece, rank: int, tp: int, *, last: bool) -> Piece:
        """The scale piece that covers weight `piece`. vLLM allocates
        ceil(part/bn) scale rows per fused part and cuts the scale at the
        weight's offsets divided by the block: only whole blocks line up (a
        fused weight's last part may end on a partial one, its own tail)."""
        assert isinstance(piece, (Rows, Columns)), piece  # no vocabulary padding in a linear weight
        rows, columns = self.dims.shape(fp8.weight_source(scale).hf_shape)
        block = scale.block[0] if isinstance(piece, Rows) else scale.block[1]
        if block == 0:  # one scale spans the whole input: whole on every rank
            return Columns(scale.hf_name, 0, 1)
        extent, axis = (rows, "rows") if isinstance(piece, Rows) else (columns, "columns")
        fp8_scale = scale.hf_name.endswith(fp8.SCALE_SUFFIX)
        if not fp8_scale:  # packed words and groups: whole on every axis (expected_sources checked), no tail
            last = False
        if piece.start % block or (piece.stop % block and (piece.stop != extent or not last)):
            what = "FP8 scale blocks" if fp8_scale else "quantization blocks (packed words or groups)"
            fitting = [str(t) for t in (1, 2, 4, 8, 16, 32, 64) if extent % (t * block) == 0]
            raise ShardError(f"{name} at tensor parallel size {tp}: rank {rank} would hold {axis} "
                             f"[{piece.start}, {piece.stop}) of {piece.source} (its weight's "
                             f"{'outputs' if axis == 'rows' else 'inputs'}), which is not whole {block}-wide "
                             f"{what} ({piece.stop - piece.start} {axis}); vLLM cannot load that cut, so choose "
                             f"a tensor-parallel size that leaves each rank a multiple of {block}"
                             f" (for this tensor: {', '.join(fitting) or 'none'})")
        start, stop = piece.start // block, -(-piece.stop // block)
        return Rows(scale.hf_name, start, stop) if isinstance(piece, Rows) else Columns(scale.hf_name, start, stop)

    def _dtype(self, name: str, sources: tuple[Source, ...]) -> str:
        if sources[0].cast == wna16.MODEL_DTYPE:  # experts' int64 weight_shape, in the model dtype
            return self.model_dtype
        if sources[0].cast:  # widened on the way (w8a8: the checkpoint's dtypes were checked castable)
            return sources[0].cast
        dtypes = {self.tensors[s.hf_name].dtype for s in sources}
        if len(dtypes) > 1:
            raise ShardError(f"{name} fuses {', '.join(s.hf_name for s in sources)} whose dtypes differ "
                             f"({', '.join(sorted(dtypes))}); their bytes cannot be concatenated")
        return dtypes.pop()

    def _cut_source(self, source: Source, rank: int, tp: int) -> list[Piece]:
        """The pieces of `source` for `rank` of `tp`; a fused source's rows are
        offset by the parts before it."""
        name, dims = source.hf_name, self.dims
        rows = dims.size(source.shape[0])
        offset = 0
        if source.fused is not None:
            index, parts = source.fused
            offset = sum(dims.size(p) for p in parts[:index])
        if source.split is Split.REPLICATED:
            return [Rows(name, offset, offset + rows)]
        if source.split in (Split.QUERY_HEADS, Split.OUTPUT):
            return [_even_rows(name, rows, tp, rank, offset)]
        if source.split is Split.KV_HEADS:
            if tp >= dims.kv_heads:  # QKVParallelLinear: one KV head per rank, replicated
                head = rank // (tp // dims.kv_heads)
                return [Rows(name, offset + head * dims.head_dim, offset + (head + 1) * dims.head_dim)]
            return [_even_rows(name, rows, tp, rank, offset)]
        if source.split is Split.INPUT:
            columns = self.tensors[name].shape[1] if name in self.tensors else dims.size(source.shape[1])
            _check_divides(name, columns, tp, "columns")
            width = columns // tp
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
        if isinstance(piece, Refined):
            return piece.shape(self.tensors[piece.source].shape)[0]
        raise AssertionError(piece)

    def _trailing_shape(self, source: Source, piece: Piece) -> tuple[int, ...]:
        if isinstance(piece, Columns):
            return (piece.stop - piece.start,)
        if isinstance(piece, Refined):
            return piece.shape(self.tensors[piece.source].shape)[1:]
        return self.tensors[source.hf_name].shape[1:]


def _check_whole_blocks(name: str, block_tensor: Source, rows: int, columns: int) -> None:
    """A packed or grouped tensor's weight must be whole blocks on both axes (CompressedTensorsWNA16 asserts
    each rank's inputs are whole groups and allocates in // pack words)."""
    block_rows, block_columns = block_tensor.block
    for extent, size, axis in ((rows, block_rows, "rows"), (columns, block_columns, "columns")):
        if size and extent % size:
            raise ShardError(f"{name}: its weight has {extent} {axis}, not a multiple of the {size}-wide "
                             f"blocks it is packed or grouped in; vLLM cannot load it")


def _refined(scale: Source, piece: Piece, factor: tuple[int, int]) -> Refined:
    """The refined-grid scale piece covering weight `piece` (rows of gate/up, columns of down): its offsets
    in refined blocks, which divide every rank's cut (fp8.check_moe_blocks)."""
    assert isinstance(piece, (Rows, Columns)) and not scale.transposed, piece
    axis = 0 if isinstance(piece, Rows) else 1
    size = scale.block[axis] // factor[axis]
    assert piece.start % size == 0 and piece.stop % size == 0, (piece, size)
    return Refined(scale.hf_name, axis, piece.start // size, piece.stop // size, factor)


def _transposed(piece: Piece) -> Piece:
    """The same slice of an [in, out] tensor: a weight's rows are its columns."""
    if isinstance(piece, Rows):
        return Columns(piece.source, piece.start, piece.stop)
    assert isinstance(piece, Columns), piece
    return Rows(piece.source, piece.start, piece.stop)


def _for_expert(source: Source, expert: int) -> Source:
    return dataclasses.replace(source, hf_name=source.hf_name.replace(EXPERT, str(expert)),
                               weight=source.weight and source.weight.replace(EXPERT, str(expert)))


def _check_divides(name: str, extent: int, tp: int, what: str) -> None:
    """vLLM's `divide` asserts on the same; say which tensor before any byte is written."""
    if extent % tp:
        raise ShardError(f"tensor parallel size {tp} does not divide the {extent} {what} of {name}")


def _even_rows(name: str, rows: int, tp: int, rank: int, offset: int = 0) -> Rows:
    _check_divides(name, rows, tp, "rows")
    per_rank = rows // tp
    return Rows(name, offset + rank * per_rank, offset + (rank + 1) * per_rank)


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
