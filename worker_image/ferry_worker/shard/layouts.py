"""How vLLM lays out each supported architecture family across tensor-parallel ranks.

One table per family, read from vLLM's model code (0.32: models/llama.py,
mistral.py, qwen2.py, qwen3.py, layers/linear.py, vocab_parallel_embedding.py).
A `Param` is one entry of vLLM's per-rank `state_dict`; its `sources` are the
Hugging Face tensors it is built from, concatenated along dim 0 in order (that
is how `QKVParallelLinear` fuses `[q | k | v]` and `MergedColumnParallelLinear`
fuses `[gate | up]`), each cut for a rank by its `Split`.

Shapes are symbolic so one table serves every size: `hidden`, `intermediate`,
`vocab`, `head_dim`, `q` (query heads x head_dim) and `kv` (KV heads x head_dim).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


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


@dataclass(frozen=True)
class Source:
    hf_name: str  # relative to `model.layers.{i}.` for layer params
    shape: tuple[str, ...]  # symbolic, see the module docstring
    split: Split


@dataclass(frozen=True)
class Flag:
    """A boolean vLLM derives from config.json: true if any of `any_of` is true,
    unless `overridden_by` is present, whose value then decides."""

    any_of: tuple[str, ...]
    overridden_by: str | None = None

    def value(self, config: dict) -> bool:
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
    refused_config_keys: tuple[str, ...]
    attention_module: str = "self_attn.attn"  # where vLLM's Attention layer sits in a layer


def _qkv(bias: bool) -> tuple[Source, ...]:
    kind = "bias" if bias else "weight"
    trailing = () if bias else ("hidden",)
    return (
        Source(f"self_attn.q_proj.{kind}", ("q", *trailing), Split.QUERY_HEADS),
        Source(f"self_attn.k_proj.{kind}", ("kv", *trailing), Split.KV_HEADS),
        Source(f"self_attn.v_proj.{kind}", ("kv", *trailing), Split.KV_HEADS),
    )


def _gate_up(bias: bool) -> tuple[Source, ...]:
    kind = "bias" if bias else "weight"
    trailing = () if bias else ("hidden",)
    return (
        Source(f"mlp.gate_proj.{kind}", ("intermediate", *trailing), Split.OUTPUT),
        Source(f"mlp.up_proj.{kind}", ("intermediate", *trailing), Split.OUTPUT),
    )


def _replicated(name: str, *shape: str, when: str | None = None) -> Param:
    return Param(name, (Source(name, shape, Split.REPLICATED),), when=when)


def _qk_norms(when: str | None) -> tuple[Param, ...]:
    """Per-head RMSNorms on queries and keys (Qwen3; Qwen2 with `qk_norm`)."""
    return tuple(_replicated(f"self_attn.{x}_norm.weight", "head_dim", when=when) for x in "qk")


_O_PROJ = Param("self_attn.o_proj.weight", (Source("self_attn.o_proj.weight", ("hidden", "q"), Split.INPUT),))
_DOWN_PROJ = Param("mlp.down_proj.weight", (Source("mlp.down_proj.weight", ("hidden", "intermediate"), Split.INPUT),))
_LAYER_NORMS = (
    _replicated("input_layernorm.weight", "hidden"),
    _replicated("post_attention_layernorm.weight", "hidden"),
)

# Embedding, final norm and LM head, shared by every decoder family here.
_EMBEDDING = (
    Param("model.embed_tokens.weight",
          (Source("model.embed_tokens.weight", ("vocab", "hidden"), Split.VOCAB),),
          placement=Placement.FIRST_STAGE_AND_LAST_IF_TIED),
)
_NORM_AND_LM_HEAD = (
    Param("model.norm.weight", (Source("model.norm.weight", ("hidden",), Split.REPLICATED),),
          placement=Placement.LAST_STAGE),
    Param("lm_head.weight", (Source("lm_head.weight", ("vocab", "hidden"), Split.VOCAB),),
          placement=Placement.LAST_STAGE, tied_source="model.embed_tokens.weight"),
)

_ROTARY_BUFFERS = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached",
                   "rotary_pos_emb.inv_freq")
_QUANTIZED = ("quantization_config",)

LLAMA = Family(
    name="llama",
    # vLLM 0.32 serves MistralForCausalLM with mistral.py, a LlamaForCausalLM
    # subclass with the same parameters (unless `ada_rms_norm_t_cond`).
    architectures=("LlamaForCausalLM", "MistralForCausalLM"),
    head_dim_from_config=True,
    flags={
        # LlamaDecoderLayer: attention_bias = config.attention_bias or config.bias;
        # o_proj takes that, qkv_proj takes config.qkv_bias when present.
        "qkv_bias": Flag(("attention_bias", "bias"), overridden_by="qkv_bias"),
        "o_proj_bias": Flag(("attention_bias", "bias")),
        "mlp_bias": Flag(("mlp_bias",)),
    },
    pre_layer_params=_EMBEDDING,
    layer_params=(
        Param("self_attn.qkv_proj.weight", _qkv(bias=False)),
        Param("self_attn.qkv_proj.bias", _qkv(bias=True), when="qkv_bias"),
        _O_PROJ,
        Param("self_attn.o_proj.bias", (Source("self_attn.o_proj.bias", ("hidden",), Split.REPLICATED),),
              when="o_proj_bias"),
        Param("mlp.gate_up_proj.weight", _gate_up(bias=False)),
        Param("mlp.gate_up_proj.bias", _gate_up(bias=True), when="mlp_bias"),
        _DOWN_PROJ,
        Param("mlp.down_proj.bias", (Source("mlp.down_proj.bias", ("hidden",), Split.REPLICATED),),
              when="mlp_bias"),
        *_LAYER_NORMS,
    ),
    post_layer_params=_NORM_AND_LM_HEAD,
    ignored_suffixes=_ROTARY_BUFFERS,
    refused_config_keys=(*_QUANTIZED, "ada_rms_norm_t_cond"),
)

QWEN2 = Family(
    name="qwen2",
    architectures=("Qwen2ForCausalLM",),
    head_dim_from_config=False,
    flags={"qk_norm": Flag(("qk_norm",))},
    pre_layer_params=_EMBEDDING,
    layer_params=(
        Param("self_attn.qkv_proj.weight", _qkv(bias=False)),
        Param("self_attn.qkv_proj.bias", _qkv(bias=True)),  # Qwen2Attention: bias=True always
        _O_PROJ,
        *_qk_norms(when="qk_norm"),
        Param("mlp.gate_up_proj.weight", _gate_up(bias=False)),
        _DOWN_PROJ,
        *_LAYER_NORMS,
    ),
    post_layer_params=_NORM_AND_LM_HEAD,
    ignored_suffixes=_ROTARY_BUFFERS,
    refused_config_keys=_QUANTIZED,
)

QWEN3 = Family(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    head_dim_from_config=True,
    flags={"qkv_bias": Flag(("attention_bias",))},
    pre_layer_params=_EMBEDDING,
    layer_params=(
        Param("self_attn.qkv_proj.weight", _qkv(bias=False)),
        Param("self_attn.qkv_proj.bias", _qkv(bias=True), when="qkv_bias"),
        _O_PROJ,
        *_qk_norms(when=None),
        Param("mlp.gate_up_proj.weight", _gate_up(bias=False)),
        _DOWN_PROJ,
        *_LAYER_NORMS,
    ),
    post_layer_params=_NORM_AND_LM_HEAD,
    ignored_suffixes=_ROTARY_BUFFERS,
    refused_config_keys=_QUANTIZED,
)

FAMILIES: tuple[Family, ...] = (LLAMA, QWEN2, QWEN3)


def family_for(architectures: list[str]) -> Family:
    """The family vLLM would build for config.json `architectures` (its first
    entry, as vLLM resolves it), or a ValueError naming what is supported."""
    for family in FAMILIES:
        if architectures and architectures[0] in family.architectures:
            return family
    supported = sorted(a for f in FAMILIES for a in f.architectures)
    raise ValueError(f"architecture {architectures!r} is not supported by ferry shard; "
                     f"supported: {', '.join(supported)}")
