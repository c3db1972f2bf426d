"""What goes into each tensorizer file, as data: names, kinds, dtypes, shapes
and where each tensor's bytes come from. Nothing is read here but config.json
and the safetensors headers (and, for a tied LM head, the two copies compared).

- `hf_files`: every tensor of the checkpoint under its own name, one file;
- `vllm_files`: per rank, the tensors of vLLM's module tree (see versions.py),
  cut by `ferry shard`'s plan (`shard.plan.plan_shards`): the same rule tables,
  the same per-rank shapes and bytes as a `sharded_state` rank file.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

from ..shard.layouts import family_for
from ..shard.model import ShardError
from ..shard.experts import MoeTarget
from ..shard.plan import Constant, PlannedTensor, Rows, ShardPlan, plan_shards
from ..shard.source import Checkpoint
from ..shard.spans import BlockBuffers, piece_span, read_span
from ..shard.tensors import TensorLocation, itemsize
from ..shard.versions import VllmTarget
from ..shard.write import SourceFiles
from .errors import ArtifactError
from .versions import tensor_file_names

PARAM, BUFFER = "param", "buffer"
MARKER = ".vllm_tensorized_marker"  # vLLM: model.register_parameter("vllm_tensorized_marker", ...) on the root
MARKER_DTYPE, MARKER_SHAPE = "I64", (1,)  # torch.tensor((1,), device="meta")
# safetensors dtypes tensorizer stores (bfloat16 as an "opaque" torch dtype).
SUPPORTED_DTYPES = ("BF16", "F16", "F32", "F64", "I64", "I32", "I16", "I8", "U8", "BOOL")
# Per tensor: tensorizer's entry header (name, dtype, shape, two hashes) and its metadata index line.
HEADER_OVERHEAD = 400
PROLOGUE = 256 * 1024 + 64

Source = Union[PlannedTensor, TensorLocation, None]


@dataclass(frozen=True)
class TensorEntry:
    name: str
    kind: str  # PARAM or BUFFER (tensorizer's TensorType; load_into_module registers accordingly)
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    source: Source  # None: a meta tensor (no data), vLLM's marker
    meta: bool = False

    @property
    def nbytes(self) -> int:
        return 0 if self.meta else math.prod(self.shape) * itemsize(self.dtype)


@dataclass(frozen=True)
class TensorFile:
    name: str
    entries: tuple[TensorEntry, ...]

    @property
    def data_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def size_hint(self) -> int:
        return PROLOGUE + self.data_bytes + HEADER_OVERHEAD * len(self.entries)


def hf_files(checkpoint: Checkpoint) -> list[TensorFile]:
    """One file with every checkpoint tensor (what vLLM's load_weights is given), in file order."""
    locations = sorted(checkpoint.tensors.values(), key=lambda loc: (str(loc.path), loc.offset))
    _check_dtypes([(loc.name, loc.dtype) for loc in locations])
    entries = tuple(TensorEntry(loc.name, PARAM, loc.dtype, loc.shape, loc) for loc in locations)
    return [TensorFile(tensor_file_names("hf", 1)[0], entries)]


def refuse_quantized(config: dict) -> None:
    """vLLM 0.32 deserializes a tensorized model with `dtype=` the model's dtype
    (model_loader/tensorizer.py), so FP8 weights and their float32 scales would
    come back cast, and it warns that tensorizer with quantization is unstable:
    quantized checkpoints go to sharded_state (or runai_streamer) instead."""
    quant = config.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ArtifactError(f"config.json is quantized ({method!r}): vLLM's tensorizer loader casts every tensor "
                            f"to the model dtype, so FP8 weights and scales would not load as stored; use the "
                            f"sharded_state format (ferry shard) or runai_streamer for quantized checkpoints")


def vllm_plan(checkpoint: Checkpoint, tp: int, vllm: VllmTarget, moe: MoeTarget = MoeTarget()) -> ShardPlan:
    """`ferry shard`'s plan of the rank tensors (one part per rank), or ArtifactError."""
    try:
        return plan_shards(checkpoint.config, checkpoint.specs, tp=tp, pp=1, vllm=vllm, max_part_size=None, moe=moe)
    except ShardError as e:
        raise ArtifactError(str(e)) from None


def vllm_files(checkpoint: Checkpoint, plan: ShardPlan) -> list[TensorFile]:
    """Per tensor-parallel rank, the tensors vLLM's `serialize_vllm_model` would write there."""
    tp = plan.tp
    _check_tied_copies(checkpoint, plan.tied_copies)
    family = family_for(checkpoint.config["architectures"])
    tied = {p.name: p.tied_source for p in family.post_layer_params if p.tied_source} \
        if plan.dims.tie_word_embeddings else {}
    names = tensor_file_names("vllm", tp)
    files = []
    for planned_file in sorted(plan.files, key=lambda f: f.tp_rank):
        _check_dtypes([(t.name, t.dtype) for t in planned_file.tensors])
        _check_one_param_dtype(planned_file.tensors)
        entries = [TensorEntry(MARKER, PARAM, MARKER_DTYPE, MARKER_SHAPE, None, meta=True)]
        heads = []
        for tensor in planned_file.tensors:
            kind = BUFFER if all(isinstance(p, Constant) for p in tensor.pieces) else PARAM
            # The plan keeps one key per storage (sharded_state's _filter_subtensors); vLLM's module
            # tree holds a tied LM head twice: the embedding in its place, the head after the norm.
            lm_head = next((head for head, embedding in tied.items() if tensor.name in (head, embedding)), None)
            if lm_head is not None:
                entries.append(TensorEntry(tied[lm_head], kind, tensor.dtype, tensor.shape, tensor))
                heads.append(TensorEntry(lm_head, kind, tensor.dtype, tensor.shape, tensor))
            else:
                entries.append(TensorEntry(family.registered_path(tensor.name), kind, tensor.dtype, tensor.shape, tensor))
        files.append(TensorFile(names[planned_file.tp_rank], tuple(entries + heads)))
    return files


def _check_one_param_dtype(tensors) -> None:
    """vLLM 0.32 deserializes a vLLM-tensorized file with `dtype=` the model's dtype: every tensor is
    cast. For the 1.0 attention scales that is exact; a parameter kept in another dtype on purpose
    (DeepSeek-V3's float32 e_score_correction_bias) would come back rounded and route differently from
    the default loader. Refuse instead of serving that."""
    params = [t for t in tensors if not all(isinstance(p, Constant) for p in t.pieces)]
    counts: dict[str, int] = {}
    for t in params:
        counts[t.dtype] = counts.get(t.dtype, 0) + 1
    model_dtype = max(counts, key=counts.get) if counts else None
    odd = [f"{t.name} ({t.dtype})" for t in params if t.dtype != model_dtype]
    if odd:
        raise ArtifactError(f"vLLM's tensorizer loader casts every tensor to the model dtype {model_dtype}, so "
                            f"{', '.join(odd[:5])} would be served rounded; use sharded_state, or the hf layout")


def _check_dtypes(tensors: list[tuple[str, str]]) -> None:
    odd = sorted({f"{name} ({dtype})" for name, dtype in tensors if dtype not in SUPPORTED_DTYPES})
    if odd:
        raise ArtifactError(f"tensors in dtypes ferry tensorize does not store: {', '.join(odd[:10])}")


def _check_tied_copies(checkpoint: Checkpoint, tied_copies) -> None:
    """A tied config with a separate LM head in the checkpoint: serve it only if it
    is the embedding's bytes (releases disagree on which one they load)."""
    buffers_a, buffers_b = BlockBuffers(), BlockBuffers()
    with SourceFiles(checkpoint.tensors) as sources:
        for copy, canonical in tied_copies.items():
            a, b = checkpoint.tensors[copy], checkpoint.tensors[canonical]
            if a.dtype != b.dtype:
                raise ArtifactError(f"config.json ties {copy} to {canonical}, but their dtypes differ")
            whole = Rows(copy, 0, a.shape[0])
            chunks_a = read_span(sources.fd(copy), piece_span(whole, a.offset, a.dtype, a.shape), buffers_a)
            chunks_b = read_span(sources.fd(canonical), piece_span(whole, b.offset, b.dtype, b.shape), buffers_b)
            if any(x != y for x, y in zip(chunks_a, chunks_b)):
                raise ArtifactError(f"config.json ties {copy} to {canonical}, but the checkpoint's {copy} differs; "
                                    f"vLLM releases disagree on which one to serve, so nothing is written")
