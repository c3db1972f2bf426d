"""Mixture-of-experts families, read from vLLM 0.32's model code (models/mixtral.py,
qwen3_moe.py, layers/fused_moe/: layer.py, routed_experts.py,
unquantized_fused_moe_method.py, expert_map_manager.py) and checked against
the state_dict vLLM itself builds in each worker (tests/worker/shard).

FusedMoE holds a layer's experts as two stacked parameters: `w13_weight`
`[experts on the rank, 2 x I_rank, hidden]` (each expert's gate rows, then its
up rows) and `w2_weight` `[experts on the rank, hidden, I_rank]`. Under tensor
parallelism every rank holds every expert, each cut like a dense MLP; under
expert parallelism a rank holds whole experts (see plan.expert_ranks).
"""
from __future__ import annotations

from .base import Family, Flag, Mlp, Param, SizeKey, Source, Split
from .dense import (DOWN_PROJ, EMBEDDING, LAYER_NORMS, NORM_AND_LM_HEAD, O_PROJ, QWEN3_ATTENTION, ROTARY_BUFFERS,
                    gate_up, qkv)


def experts(block: str, key: str, gate: str, up: str, down: str) -> tuple[Param, ...]:
    """FusedMoE's stacked weights under `block.key`, from per-expert checkpoint
    tensors `block.experts.{e}.{gate|up|down}.weight`."""
    per_expert = f"{block}.experts.{{e}}"
    return (
        Param(f"{block}.{key}.w13_weight",
              (Source(f"{per_expert}.{gate}.weight", ("moe_intermediate", "hidden"), Split.OUTPUT),
               Source(f"{per_expert}.{up}.weight", ("moe_intermediate", "hidden"), Split.OUTPUT)),
              mlp=Mlp.SPARSE, experts=True, linear=True),
        Param(f"{block}.{key}.w2_weight",
              (Source(f"{per_expert}.{down}.weight", ("hidden", "moe_intermediate"), Split.INPUT),),
              mlp=Mlp.SPARSE, experts=True, linear=True),
    )


def router(block: str, key: str, quantized: bool = False) -> Param:
    """The router (GateLinear `[experts, hidden]`), replicated on every rank.
    `key` is where vLLM's filtered state_dict keeps it: a module registered
    twice keeps its smallest name. `quantized`: the model hands the gate its
    quant_config (Qwen3-MoE; Mixtral's and DeepSeek's always run in bf16)."""
    return Param(f"{block}.{key}.weight", (Source(f"{block}.gate.weight", ("experts", "hidden"), Split.REPLICATED),),
                 mlp=Mlp.SPARSE, linear=quantized)


# The routed experts live in FusedMoE's RoutedExperts submodule.
ROUTED = "experts.routed_experts"

MIXTRAL = Family(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    head_dim_from_config=True,
    flags={},
    pre_layer_params=EMBEDDING,
    layer_params=(
        Param("self_attn.qkv_proj.weight", qkv(bias=False), linear=True),
        O_PROJ,
        router("block_sparse_moe", "gate"),
        *experts("block_sparse_moe", ROUTED, "w1", "w3", "w2"),
        *LAYER_NORMS,
    ),
    post_layer_params=NORM_AND_LM_HEAD,
    ignored_suffixes=ROTARY_BUFFERS,
    # Mixtral's expert intermediate size is config.json `intermediate_size`.
    sizes=(SizeKey("experts", ("num_local_experts",)), SizeKey("moe_intermediate", ("intermediate_size",))),
    sparse_layer=lambda config, layer: True,
)


def _qwen3_moe_sparse(config: dict, layer: int) -> bool:
    """Qwen3MoeDecoderLayer: a MoE block unless the layer is in
    `mlp_only_layers`, and only every `decoder_sparse_step`-th layer."""
    step = config.get("decoder_sparse_step") or 1
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    return layer not in (config.get("mlp_only_layers") or []) and experts > 0 and (layer + 1) % step == 0


QWEN3_MOE = Family(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    head_dim_from_config=True,
    flags={"qkv_bias": Flag(("attention_bias",))},
    pre_layer_params=EMBEDDING,
    layer_params=(
        *QWEN3_ATTENTION,
        # Qwen3MoeSparseMoeBlock hands its gate to FusedMoE, which registers it
        # again as `experts.gate`: the filter keeps that smaller name.
        router("mlp", "experts.gate", quantized=True),
        *experts("mlp", ROUTED, "gate_proj", "up_proj", "down_proj"),
        Param("mlp.gate_up_proj.weight", gate_up(bias=False), mlp=Mlp.DENSE, linear=True),
        Param(DOWN_PROJ.name, DOWN_PROJ.sources, mlp=Mlp.DENSE, linear=True),
        *LAYER_NORMS,
    ),
    post_layer_params=NORM_AND_LM_HEAD,
    ignored_suffixes=ROTARY_BUFFERS,
    # transformers 5 writes `num_local_experts` (its attribute_map aliases the Hub's `num_experts` to it).
    sizes=(SizeKey("experts", ("num_experts", "num_local_experts")),
           SizeKey("moe_intermediate", ("moe_intermediate_size",))),
    sparse_layer=_qwen3_moe_sparse,
    tp_at_most_experts=True,
    module_aliases=((".mlp.experts.gate.", ".mlp.gate."),),
)


def _deepseek_sparse(config: dict, layer: int) -> bool:
    """DeepseekV2DecoderLayer: MoE from `first_k_dense_replace` on, every `moe_layer_freq`-th layer."""
    return (config.get("n_routed_experts") is not None and layer >= (config.get("first_k_dense_replace") or 0)
            and layer % (config.get("moe_layer_freq") or 1) == 0)


def _mla_sizes(sizes: dict[str, int]) -> dict[str, int]:
    """DeepseekV2MLAAttention's per-head sizes times the heads."""
    heads = sizes["heads"]
    return {"mla_q": heads * (sizes["nope"] + sizes["rope"]), "mla_kv_b": heads * (sizes["nope"] + sizes["v_head"]),
            "mla_o": heads * sizes["v_head"], "shared_intermediate": sizes["moe_intermediate"] * sizes["shared"]}


# Multi-head latent attention (vLLM 0.32 builds it whenever the model has
# q/k head dims, as DeepSeek-V2/V3 do). The MLA wrapper registers the query,
# q-norm and output projections again under `self_attn.mla_attn`, and the
# filter keeps those smaller names; the latent KV projection, its norm and
# kv_b_proj keep their own. With a q LoRA (V3), q_a_proj and
# kv_a_proj_with_mqa are fused into one replicated `fused_qkv_a_proj`.
_MLA = (
    Param("self_attn.fused_qkv_a_proj.weight",
          (Source("self_attn.q_a_proj.weight", ("q_lora", "hidden"), Split.REPLICATED),
           Source("self_attn.kv_a_proj_with_mqa.weight", ("kv_lora+rope", "hidden"), Split.REPLICATED)),
          when="q_lora", linear=True),
    Param("self_attn.kv_a_proj_with_mqa.weight",
          (Source("self_attn.kv_a_proj_with_mqa.weight", ("kv_lora+rope", "hidden"), Split.REPLICATED),),
          when="no_q_lora", linear=True),
    Param("self_attn.mla_attn.q_a_layernorm.weight",
          (Source("self_attn.q_a_layernorm.weight", ("q_lora",), Split.REPLICATED),), when="q_lora"),
    Param("self_attn.mla_attn.q_b_proj.weight",
          (Source("self_attn.q_b_proj.weight", ("mla_q", "q_lora"), Split.OUTPUT),), when="q_lora",
          linear=True),
    Param("self_attn.mla_attn.q_proj.weight",
          (Source("self_attn.q_proj.weight", ("mla_q", "hidden"), Split.OUTPUT),), when="no_q_lora",
          linear=True),
    Param("self_attn.kv_a_layernorm.weight",
          (Source("self_attn.kv_a_layernorm.weight", ("kv_lora",), Split.REPLICATED),)),
    Param("self_attn.kv_b_proj.weight", (Source("self_attn.kv_b_proj.weight", ("mla_kv_b", "kv_lora"), Split.OUTPUT),),
          linear=True),
    Param("self_attn.mla_attn.o_proj.weight",
          (Source("self_attn.o_proj.weight", ("hidden", "mla_o"), Split.INPUT),), linear=True),
)

# DeepseekV2MoE hands its gate and its shared experts to FusedMoE, which
# registers them again (`experts.gate`, `experts._shared_experts._layer`): the
# filter keeps those smaller names. The shared experts are a dense MLP cut by
# TP, also under expert parallelism. V3's `noaux_tc` routing adds a float32
# e_score_correction_bias to the gate.
_DEEPSEEK_MOE = (
    router("mlp", "experts.gate"),
    Param("mlp.experts.gate.e_score_correction_bias",
          (Source("mlp.gate.e_score_correction_bias", ("experts",), Split.REPLICATED),),
          when="noaux_tc", mlp=Mlp.SPARSE),
    Param("mlp.experts._shared_experts._layer.gate_up_proj.weight",
          gate_up(bias=False, prefix="mlp.shared_experts", rows="shared_intermediate"),
          when="shared_experts", mlp=Mlp.SPARSE, linear=True),
    Param("mlp.experts._shared_experts._layer.down_proj.weight",
          (Source("mlp.shared_experts.down_proj.weight", ("hidden", "shared_intermediate"), Split.INPUT),),
          when="shared_experts", mlp=Mlp.SPARSE, linear=True),
    *experts("mlp", ROUTED, "gate_proj", "up_proj", "down_proj"),
)

DEEPSEEK = Family(
    name="deepseek",
    architectures=("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"),
    head_dim_from_config=True,
    flags={
        "q_lora": Flag(test=lambda config: config.get("q_lora_rank") is not None),
        "no_q_lora": Flag(test=lambda config: config.get("q_lora_rank") is None),
        "noaux_tc": Flag(test=lambda config: config.get("topk_method") == "noaux_tc"),
        "shared_experts": Flag(("n_shared_experts",)),
    },
    pre_layer_params=EMBEDDING,
    layer_params=(
        *_MLA,
        *_DEEPSEEK_MOE,
        Param("mlp.gate_up_proj.weight", gate_up(bias=False), mlp=Mlp.DENSE, linear=True),
        Param(DOWN_PROJ.name, DOWN_PROJ.sources, mlp=Mlp.DENSE, linear=True),
        *LAYER_NORMS,
    ),
    post_layer_params=NORM_AND_LM_HEAD,
    ignored_suffixes=ROTARY_BUFFERS,
    refused_config_keys=("index_topk",),  # DeepSeek-V3.2's sparse-attention indexer
    attention_module="self_attn.mla_attn.mla_attn",
    sizes=(SizeKey("experts", ("n_routed_experts",)), SizeKey("moe_intermediate", ("moe_intermediate_size",)),
           SizeKey("q_lora", ("q_lora_rank",), optional=True), SizeKey("kv_lora", ("kv_lora_rank",)),
           SizeKey("rope", ("qk_rope_head_dim",)), SizeKey("nope", ("qk_nope_head_dim",)),
           SizeKey("v_head", ("v_head_dim",)), SizeKey("shared", ("n_shared_experts",), optional=True)),
    derived_sizes=_mla_sizes,
    sparse_layer=_deepseek_sparse,
    extra_layers_key="num_nextn_predict_layers",
    # DeepseekV2MLAAttention and DeepseekV2MoE register these before handing them to their wrappers.
    module_aliases=((".mlp.experts.gate.", ".mlp.gate."), (".mlp.experts._shared_experts._layer.", ".mlp.shared_experts."),
                    (".self_attn.mla_attn.q_a_layernorm.", ".self_attn.q_a_layernorm."),
                    (".self_attn.mla_attn.q_b_proj.", ".self_attn.q_b_proj."),
                    (".self_attn.mla_attn.q_proj.", ".self_attn.q_proj."),
                    (".self_attn.mla_attn.o_proj.", ".self_attn.o_proj.")),
    refused_targets={"rocm": "on ROCm vLLM may fuse the shared experts into the routed ones (AITER), a layout "
                             "ferry shard does not write"},
    # MLAAttention is not an Attention: vLLM's FP8 config gives it no q/k/v/prob_scale.
    fp8_attention_scales=False,
)
