"""The vocabulary of the layout tables: how vLLM builds one parameter of its
per-rank `state_dict` from Hugging Face tensors.

A `Param` is one entry of vLLM's per-rank `state_dict`; its `sources` are the
Hugging Face tensors it is built from, concatenated along dim 0 in order (that
is how `QKVParallelLinear` fuses `[q | k | v]` and `MergedColumnParallelLinear`
fuses `[gate | up]`), each cut for a rank by its `Split`. An expert `Param`
(FusedMoE's `w13_weight`, `w2_weight`) stacks that concatenation once per
expert the rank holds: `[experts on the rank, rows, ...]`.

Shapes are symbolic so one table serves every size: `hidden`, `intermediate`,
`vocab`, `head_dim`, `q` (query heads x head_dim), `kv` (KV heads x head_dim),
and what a family adds (`experts`, `moe_intermediate`, ...; see `SizeKey`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Callable


class Split(Enum):
    """How a Hugging Face tensor is cut for one tensor-parallel rank."""

    REPLICATED = "replicated"  # whole tensor on every rank (norms, RowParallelLinear biases)
    QUERY_HEADS = "query_heads"  # dim 0 by query heads
    KV_HEADS = "kv_heads"  # dim 0 by KV heads; with tp > KV heads each head is replicated
    OUTPUT = "output"  # dim 0 evenly (ColumnParallelLinear: output features)
    INPUT = "input"  # dim 1 evenly (RowParallelLinear: input features)
    VOCAB = "vocab"  # dim 0 padded to a multiple of 64, evenly; zero rows past the vocab


class Placement(Enum):
    """Which pipeline stages hold a non-layer parameter."""

    FIRST_STAGE = "first"
    LAST_STAGE = "last"
    # vLLM builds the input embedding on the last stage too when the LM head is
    # tied to it (LlamaModel/Qwen2Model: `is_first_rank or (tie_word_embeddings
    # and is_last_rank)`).
    FIRST_STAGE_AND_LAST_IF_TIED = "first+tied-last"
    # Gemma 2/3 build their embedding, final norm (and Gemma 3 its LM head)
    # unconditionally, on every stage.
    EVERY_STAGE = "every"


class Mlp(Enum):
    """Which decoder layers hold a layer parameter, in families that mix dense and MoE layers."""

    DENSE = "dense"
    SPARSE = "sparse"


# The block of a tensor holding one value per logical part of a fused module, side by side (vLLM's
# PerTensorScaleParameter: per-tensor FP8 and W8A8 scales), stored [1] or 0-d per part in the checkpoint.
EACH = (-1, -1)
# The block of a tensor a rank holds whole, from one of its parts (the one vLLM loads last): a pack-quantized
# weight_shape, an INT8 static input scale of a fused module, an expert's one static FP8 input scale.
WHOLE = (0, 0)


@dataclass(frozen=True)
class Source:
    hf_name: str  # relative to `model.layers.{i}.` for layer params; `{e}`: the expert index
    shape: tuple[str, ...]  # symbolic, see the module docstring: this source's own rows
    split: Split
    # Part `fused[0]` of a checkpoint tensor that stacks parts of sizes
    # `fused[1]` along dim 0 (Phi-3's `qkv_proj`, `gate_up_proj`): vLLM splits
    # the fused tensor into its parts first, then cuts each part for the rank.
    fused: tuple[int, tuple[str, ...]] | None = None
    # An FP8 weight's block scales (`<weight>_scale_inv`): `(rows, columns)`
    # of the weight each scale covers; the symbolic shape is the weight's,
    # in elements, and the tensor is that shape in whole or partial blocks.
    block: tuple[int, int] | None = None
    # With `block`: the checkpoint name of the weight the blocks cover (its cut decides this tensor's). A
    # packed or quantized weight's own blocks (compressed-tensors' `weight_packed`: 8 int4 values per int32)
    # are blocks of a weight the checkpoint does not hold unpacked. A block of 0 columns spans the whole
    # input: one per-channel scale per row, whole on every rank of a row-parallel cut.
    weight: str | None = None
    # With `block`: the tensor is stored [in, out], the transpose of its weight's blocks (AWQ and GPTQ:
    # `qweight`, `qzeros`, `scales`), so a column-parallel cut is its columns and fused parts sit side by
    # side along dim 1 (plan.py's PlannedTensor.axis).
    transposed: bool = False
    # The dtype vLLM allocates for this tensor when the checkpoint may store it narrower (W8A8 scales: float32
    # from bf16/fp16, which widen exactly); the cut widens it on the way.
    cast: str | None = None

    @property
    def hf_shape(self) -> tuple[str, ...]:
        """The symbolic shape of the checkpoint tensor itself (all parts, when fused)."""
        return self.shape if self.fused is None else ("+".join(self.fused[1]), *self.shape[1:])

    @property
    def one_value(self) -> bool:
        """A single value ([1], or 0-d in the checkpoint): a part's per-tensor scale (EACH), or one the parts
        share (WHOLE)."""
        return self.block == EACH or (self.block == WHOLE and self.shape == ("1",))


@dataclass(frozen=True)
class Flag:
    """A boolean vLLM derives from config.json: true if any of `any_of` is true,
    unless `overridden_by` is present, whose value then decides."""

    any_of: tuple[str, ...] = ()
    overridden_by: str | None = None
    # Instead of the keys: a predicate on config.json (e.g. a key's value).
    test: Callable[[dict], bool] | None = None

    def value(self, config: dict) -> bool:
        if self.test is not None:
            return self.test(config)
        if self.overridden_by is not None and self.overridden_by in config:
            return bool(config[self.overridden_by])
        return any(bool(config.get(key)) for key in self.any_of)


@dataclass(frozen=True)
class Param:
    name: str  # vLLM state_dict key; relative to `model.layers.{i}.` for layer params
    sources: tuple[Source, ...]
    when: str | None = None  # name of the family flag that makes vLLM create it
    placement: Placement | None = None  # non-layer params only
    # The source to read instead when config.json ties the LM head to the
    # input embedding (vLLM then shares one storage and saves it once).
    tied_source: str | None = None
    mlp: Mlp | None = None  # layer params only: None is every layer
    # FusedMoE weights: the sources' `{e}` runs over the experts the rank holds,
    # and the parameter is their stack. Cut by the MoE layer's own parallelism
    # (tensor parallel, or expert parallel: whole experts, split tp 1).
    experts: bool = False
    # A Linear (or FusedMoE) weight that vLLM's FP8 method quantizes unless
    # config.json lists its module as not converted (shard/fp8.py).
    linear: bool = False
    # A linear weight that a packed quantization (shard/wna16.py) replaces with its packed tensors where the
    # module is quantized; kept as it is where the config leaves the module unquantized.
    replaced_when_quantized: bool = False

    @property
    def is_scale(self) -> bool:
        """Blocks of a linear weight (FP8 block scales, packed int4 values and their scales): present only
        where that weight is quantized."""
        return self.sources[0].block is not None


@dataclass(frozen=True)
class SizeKey:
    """A family's own symbolic size, read from the first config.json key present."""

    symbol: str
    keys: tuple[str, ...]
    optional: bool = False  # absent or null: the size is 0 and only the params needing it go


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    # Llama, Mistral and Qwen3 honour config.json `head_dim`; vLLM's Qwen2
    # always uses hidden_size // num_attention_heads.
    head_dim_from_config: bool
    flags: dict[str, Flag]
    # In vLLM's module order: what precedes the decoder layers, the layers
    # (per-layer keys relative to `model.layers.{i}.`), what follows them.
    pre_layer_params: tuple[Param, ...]
    layer_params: tuple[Param, ...]
    post_layer_params: tuple[Param, ...]
    # Checkpoint tensors vLLM's default loader skips (AutoWeightsLoader): matched
    # as name suffixes.
    ignored_suffixes: tuple[str, ...]
    # config.json keys that make vLLM build modules these tables do not describe.
    refused_config_keys: tuple[str, ...] = ()
    attention_module: str = "self_attn.attn"  # where vLLM's Attention layer sits in a layer
    # config.json `tie_word_embeddings` when absent: its transformers config
    # class's default (False for Llama, Qwen, Phi-3, Mixtral; True for Gemma).
    tied_by_default: bool = False
    # Sizes beyond the common ones (experts, moe_intermediate, ...).
    sizes: tuple[SizeKey, ...] = ()
    # Which layers are MoE layers (config, layer index); None: the family has none.
    sparse_layer: Callable[[dict, int], bool] | None = None
    # Sizes computed from the others (all sizes so far -> the new ones).
    derived_sizes: Callable[[dict[str, int]], dict[str, int]] | None = None
    # The MoE block refuses a tensor-parallel size above the expert count
    # (Qwen3MoeSparseMoeBlock raises; Mixtral does not check).
    tp_at_most_experts: bool = False
    # Decoder layers past num_hidden_layers that the checkpoint may hold and
    # vLLM's model skips (DeepSeek's multi-token-prediction layers).
    extra_layers_key: str | None = None
    # A module registered under two paths is saved by sharded_state under the
    # smaller key (the tables' names), but `named_modules()`, which tensorizer's
    # load_into_module resolves names against, knows it only by the path it
    # was registered at first: (infix in the tables' key, infix there).
    module_aliases: tuple[tuple[str, str], ...] = ()
    # Serving targets whose layout the tables do not describe, and why.
    refused_targets: dict[str, str] = field(default_factory=dict)
    # Under an FP8 config, vLLM's Attention layers (not MLA's) gain four 0-d
    # parameters q/k/v/prob_scale (Fp8KVCacheMethod) that the file must hold.
    fp8_attention_scales: bool = True

    def registered_path(self, name: str) -> str:
        """The path under which `named_modules()` (and vLLM's quantization
        config, which sees each module's construction prefix) reaches the
        tensor saved as `name` (see `module_aliases`)."""
        for saved, registered in self.module_aliases:
            if saved in name:
                return name.replace(saved, registered, 1)
        return name

    @property
    def is_moe(self) -> bool:
        return self.sparse_layer is not None

    def layer_mlp(self, config: dict, layer: int) -> Mlp:
        if self.sparse_layer is None:
            return Mlp.DENSE
        return Mlp.SPARSE if self.sparse_layer(config, layer) else Mlp.DENSE
