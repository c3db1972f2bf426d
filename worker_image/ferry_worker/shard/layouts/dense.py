"""Dense decoder families, read from vLLM 0.32's model code (models/llama.py,
mistral.py, qwen2.py, qwen3.py, gemma2.py, gemma3.py, phi3.py, layers/linear.py,
vocab_parallel_embedding.py)."""
from __future__ import annotations

from .base import Family, Flag, Param, Placement, Source, Split


def qkv(bias: bool, fused: str | None = None) -> tuple[Source, ...]:
    """q | k | v of QKVParallelLinear: from three checkpoint tensors, or parts
    of one fused `fused` tensor (Phi-3)."""
    kind = "bias" if bias else "weight"
    trailing = () if bias else ("hidden",)
    names = [f"self_attn.{x}_proj.{kind}" for x in "qkv"]
    if fused is None:
        return tuple(Source(n, (rows, *trailing), split)
                     for n, rows, split in zip(names, ("q", "kv", "kv"),
                                               (Split.QUERY_HEADS, Split.KV_HEADS, Split.KV_HEADS)))
    parts = ("q", "kv", "kv")
    return tuple(Source(f"{fused}.{kind}", (rows, *trailing), split, fused=(i, parts))
                 for i, (rows, split) in enumerate(zip(parts, (Split.QUERY_HEADS, Split.KV_HEADS, Split.KV_HEADS))))


def gate_up(bias: bool, prefix: str = "mlp", rows: str = "intermediate", fused: str | None = None) -> tuple[Source, ...]:
    """gate | up of MergedColumnParallelLinear."""
    kind = "bias" if bias else "weight"
    trailing = () if bias else ("hidden",)
    if fused is None:
        return (Source(f"{prefix}.gate_proj.{kind}", (rows, *trailing), Split.OUTPUT),
                Source(f"{prefix}.up_proj.{kind}", (rows, *trailing), Split.OUTPUT))
    return tuple(Source(f"{fused}.{kind}", (rows, *trailing), Split.OUTPUT, fused=(i, (rows, rows))) for i in range(2))


def replicated(name: str, *shape: str, when: str | None = None, **kw) -> Param:
    return Param(name, (Source(name, shape, Split.REPLICATED),), when=when, **kw)


def qk_norms(when: str | None) -> tuple[Param, ...]:
    """Per-head RMSNorms on queries and keys (Qwen3, Gemma 3; Qwen2 with `qk_norm`)."""
    return tuple(replicated(f"self_attn.{x}_norm.weight", "head_dim", when=when) for x in "qk")


O_PROJ = Param("self_attn.o_proj.weight", (Source("self_attn.o_proj.weight", ("hidden", "q"), Split.INPUT),),
               linear=True)
DOWN_PROJ = Param("mlp.down_proj.weight", (Source("mlp.down_proj.weight", ("hidden", "intermediate"), Split.INPUT),),
                  linear=True)
LAYER_NORMS = (
    replicated("input_layernorm.weight", "hidden"),
    replicated("post_attention_layernorm.weight", "hidden"),
)

# Embedding, final norm and LM head, shared by the Llama-like families.
EMBEDDING = (
    Param("model.embed_tokens.weight",
          (Source("model.embed_tokens.weight", ("vocab", "hidden"), Split.VOCAB),),
          placement=Placement.FIRST_STAGE_AND_LAST_IF_TIED),
)
NORM_AND_LM_HEAD = (
    Param("model.norm.weight", (Source("model.norm.weight", ("hidden",), Split.REPLICATED),),
          placement=Placement.LAST_STAGE),
    Param("lm_head.weight", (Source("lm_head.weight", ("vocab", "hidden"), Split.VOCAB),),
          placement=Placement.LAST_STAGE, tied_source="model.embed_tokens.weight"),
)

ROTARY_BUFFERS = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached",
                  "rotary_pos_emb.inv_freq")


def _llama_layers(fused: bool) -> tuple[Param, ...]:
    """LlamaDecoderLayer; Phi-3 checkpoints store qkv_proj and gate_up_proj fused."""
    qkv_name = "self_attn.qkv_proj" if fused else None
    gate_up_name = "mlp.gate_up_proj" if fused else None
    return (
        Param("self_attn.qkv_proj.weight", qkv(bias=False, fused=qkv_name), linear=True),
        Param("self_attn.qkv_proj.bias", qkv(bias=True, fused=qkv_name), when="qkv_bias"),
        O_PROJ,
        Param("self_attn.o_proj.bias", (Source("self_attn.o_proj.bias", ("hidden",), Split.REPLICATED),),
              when="o_proj_bias"),
        Param("mlp.gate_up_proj.weight", gate_up(bias=False, fused=gate_up_name), linear=True),
        Param("mlp.gate_up_proj.bias", gate_up(bias=True, fused=gate_up_name), when="mlp_bias"),
        DOWN_PROJ,
        Param("mlp.down_proj.bias", (Source("mlp.down_proj.bias", ("hidden",), Split.REPLICATED),),
              when="mlp_bias"),
        *LAYER_NORMS,
    )


# LlamaDecoderLayer: attention_bias = config.attention_bias or config.bias;
# o_proj takes that, qkv_proj takes config.qkv_bias when present.
_LLAMA_FLAGS = {
    "qkv_bias": Flag(("attention_bias", "bias"), overridden_by="qkv_bias"),
    "o_proj_bias": Flag(("attention_bias", "bias")),
    "mlp_bias": Flag(("mlp_bias",)),
}

LLAMA = Family(
    name="llama",
    # vLLM 0.32 serves MistralForCausalLM with mistral.py, a LlamaForCausalLM
    # subclass with the same parameters (unless `ada_rms_norm_t_cond`).
    architectures=("LlamaForCausalLM", "MistralForCausalLM"),
    head_dim_from_config=True,
    flags=_LLAMA_FLAGS,
    pre_layer_params=EMBEDDING,
    layer_params=_llama_layers(fused=False),
    post_layer_params=NORM_AND_LM_HEAD,
    ignored_suffixes=ROTARY_BUFFERS,
    refused_config_keys=("ada_rms_norm_t_cond",),
)

# Phi3ForCausalLM is a LlamaForCausalLM whose checkpoint fuses q/k/v and
# gate/up; vLLM's loader splits them (linear.py, weight_loader with
# loaded_shard_id None) before the usual per-rank cut, so the rank files are
# laid out exactly as Llama's. Phi-3-small (Phi3SmallForCausalLM) is another model.
PHI3 = Family(
    name="phi3",
    architectures=("Phi3ForCausalLM",),
    head_dim_from_config=True,
    flags=_LLAMA_FLAGS,
    pre_layer_params=EMBEDDING,
    layer_params=_llama_layers(fused=True),
    post_layer_params=NORM_AND_LM_HEAD,
    ignored_suffixes=ROTARY_BUFFERS,
)

QWEN2 = Family(
    name="qwen2",
    architectures=("Qwen2ForCausalLM",),
    head_dim_from_config=False,
    flags={"qk_norm": Flag(("qk_norm",))},
    pre_layer_params=EMBEDDING,
    layer_params=(
        Param("self_attn.qkv_proj.weight", qkv(bias=False), linear=True),
        Param("self_attn.qkv_proj.bias", qkv(bias=True)),  # Qwen2Attention: bias=True always
        O_PROJ,
        *qk_norms(when="qk_norm"),
        Param("mlp.gate_up_proj.weight", gate_up(bias=False), linear=True),
        DOWN_PROJ,
        *LAYER_NORMS,
    ),
    post_layer_params=NORM_AND_LM_HEAD,
    ignored_suffixes=ROTARY_BUFFERS,
)

QWEN3_ATTENTION = (
    Param("self_attn.qkv_proj.weight", qkv(bias=False), linear=True),
    Param("self_attn.qkv_proj.bias", qkv(bias=True), when="qkv_bias"),
    O_PROJ,
    *qk_norms(when=None),
)

QWEN3 = Family(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    head_dim_from_config=True,
    flags={"qkv_bias": Flag(("attention_bias",))},
    pre_layer_params=EMBEDDING,
    layer_params=(
        *QWEN3_ATTENTION,
        Param("mlp.gate_up_proj.weight", gate_up(bias=False), linear=True),
        DOWN_PROJ,
        *LAYER_NORMS,
    ),
    post_layer_params=NORM_AND_LM_HEAD,
    ignored_suffixes=ROTARY_BUFFERS,
)

# Gemma 2/3: four GemmaRMSNorms per layer, stored raw (vLLM adds the 1 in
# forward); Gemma2Model/Gemma3Model build the embedding and the final norm on
# every pipeline stage; the embedding's `normalizer` is a non-persistent buffer.
_GEMMA_LAYER_NORMS = (
    *LAYER_NORMS,
    replicated("pre_feedforward_layernorm.weight", "hidden"),
    replicated("post_feedforward_layernorm.weight", "hidden"),
)
_GEMMA_EMBEDDING = (
    Param("model.embed_tokens.weight", (Source("model.embed_tokens.weight", ("vocab", "hidden"), Split.VOCAB),),
          placement=Placement.EVERY_STAGE),
)
_GEMMA_NORM = Param("model.norm.weight", (Source("model.norm.weight", ("hidden",), Split.REPLICATED),),
                    placement=Placement.EVERY_STAGE)


def _gemma_layers(qk_norm: bool) -> tuple[Param, ...]:
    """Gemma2/3DecoderLayer: qkv_proj and o_proj take config.attention_bias; Gemma 3 adds q/k norms."""
    return (
        Param("self_attn.qkv_proj.weight", qkv(bias=False), linear=True),
        Param("self_attn.qkv_proj.bias", qkv(bias=True), when="qkv_bias"),
        O_PROJ,
        Param("self_attn.o_proj.bias", (Source("self_attn.o_proj.bias", ("hidden",), Split.REPLICATED),),
              when="o_proj_bias"),
        *(qk_norms(when=None) if qk_norm else ()),
        Param("mlp.gate_up_proj.weight", gate_up(bias=False), linear=True),
        DOWN_PROJ,
        *_GEMMA_LAYER_NORMS,
    )


_GEMMA_FLAGS = {"qkv_bias": Flag(("attention_bias",)), "o_proj_bias": Flag(("attention_bias",))}

GEMMA2 = Family(
    name="gemma2",
    architectures=("Gemma2ForCausalLM",),
    head_dim_from_config=True,
    flags=_GEMMA_FLAGS,
    pre_layer_params=_GEMMA_EMBEDDING,
    layer_params=_gemma_layers(qk_norm=False),
    # Gemma2ForCausalLM has no LM head module: logits come from the embedding.
    post_layer_params=(_GEMMA_NORM,),
    ignored_suffixes=ROTARY_BUFFERS,
    tied_by_default=True,
)

GEMMA3 = Family(
    name="gemma3",
    # Gemma 3 1B is text-only; the larger ones are Gemma3ForConditionalGeneration
    # (a SigLIP tower and language_model.* names), refused as unsupported.
    architectures=("Gemma3ForCausalLM",),
    head_dim_from_config=True,
    flags=_GEMMA_FLAGS,
    pre_layer_params=_GEMMA_EMBEDDING,
    layer_params=_gemma_layers(qk_norm=True),
    # Gemma3ForCausalLM builds a ParallelLMHead on every stage, tied to the
    # embedding when config.json says so (then `lm_head.weight` is the kept key).
    post_layer_params=(
        _GEMMA_NORM,
        Param("lm_head.weight", (Source("lm_head.weight", ("vocab", "hidden"), Split.VOCAB),),
              placement=Placement.EVERY_STAGE, tied_source="model.embed_tokens.weight"),
    ),
    ignored_suffixes=ROTARY_BUFFERS,
    tied_by_default=True,
)
