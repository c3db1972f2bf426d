"""FP8 block-scaled checkpoints (DeepSeek-V3/R1, Kimi-K2, Qwen3-*-FP8) as vLLM
0.32 loads them: quantization/fp8.py, utils/fp8_utils.py, utils/quant_utils.py
(`is_layer_skipped`), layers/linear.py, parameter.py and
fused_moe/routed_experts.py; notes with line numbers in
docs/research/fp8-block-scaled.md.

A quantized Linear `X` holds `X.weight` (float8_e4m3fn, its usual per-rank
shape) and `X.weight_scale_inv` (float32, one dequantization factor per
`bn x bk` block of the weight: `[ceil(out/bn), ceil(in/bk)]`), which vLLM
cuts with its weight in block units; FusedMoE stacks the experts' scales as
`w13_weight_scale_inv` / `w2_weight_scale_inv`. Which modules are quantized
is config.json's `ignored_layers` (or `modules_to_not_convert`), matched as
vLLM matches them; the checkpoint must agree, tensor by tensor.

A cut is planned only where every rank's slice of a weight starts and ends on
a block boundary (the last part of a fused weight may end on a partial
block). vLLM allocates `ceil(part/bn)` scale rows per fused part and skips its
own block-shape check for fused layers, so another cut either fails at load
or, for some sizes, loads misplaced scales on the middle ranks without a
word. For MoE experts whose per-rank intermediate size is not whole blocks,
vLLM's default MoE backend refines the scale grid (`refine_fp8_moe_block_shape`:
a square block g = gcd(bn, bk, per-rank intermediate, hidden) >= 32, each
checkpoint scale repeated (bn/g) x (bk/g) times before the rank's cut), and
so does Ferry (`moe_refinement`, plan.py's `Refined` pieces).
"""
from __future__ import annotations

import dataclasses
import math
import struct
from dataclasses import dataclass
from typing import Callable, Mapping

from .experts import MoeTarget
from .layouts import EACH, WHOLE, Family, Param, Source, Split
from .model import ModelDims, ShardError

WEIGHT_DTYPE = "F8_E4M3"  # torch.float8_e4m3fn, what vLLM's Fp8LinearMethod allocates
SCALE_DTYPE = "F32"  # Fp8Config never sets is_scale_e8m0 in 0.32: scales are float32
FP8_DTYPES = ("F8_E4M3", "F8_E5M2", "F8_E8M0")
SCALE_SUFFIX = "_scale_inv"  # `X.weight` -> `X.weight_scale_inv`, `w13_weight` -> `w13_weight_scale_inv`
# The fused modules of vLLM's models (their packed_modules_mapping) and the
# checkpoint modules they stand for: vLLM asks about each part when the
# fused name itself is not listed.
PACKED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
}
# Attention's KV-cache quantization parameters under an FP8 config
# (quantization/kv_cache.py BaseKVCacheMethod.create_weights), in
# registration order: 0-d, the model dtype, -1.0 ("not set by the checkpoint").
ATTENTION_SCALE_PARAMS = ("q_scale", "k_scale", "v_scale", "prob_scale")
ATTENTION_SCALE_UNSET = -1.0
MAX_IGNORED = 100_000  # config.json entries; a real list names each layer's few modules at most


@dataclass(frozen=True)
class BlockFp8:
    """config.json's `quantization_config` for block-scaled FP8."""

    block: tuple[int, int]  # weight_block_size: [rows (bn), columns (bk)]
    ignored: frozenset[str] = frozenset()

    def skips(self, module: str) -> bool:
        """Whether vLLM leaves the module built at `module` (its full prefix)
        unquantized: `is_layer_skipped(prefix, ignored, packed, "exact")`."""
        return skipped_module(module, self.ignored)

    def facts(self) -> dict:
        """For the manifest: what the scales were cut for."""
        return {"method": "fp8", "weightBlockSize": list(self.block), "scaleDtype": SCALE_DTYPE,
                # Where MoE scales are not whole blocks per rank, vLLM's default backend refines the grid
                # (plan.ShardPlan.quant_facts says which); padding (an explicit --moe-backend) is not written.
                "moeScaleGrid": "checkpoint blocks"}


@dataclass(frozen=True)
class TensorFp8:
    """config.json's `quantization_config` for per-tensor FP8 (quant_method "fp8" without weight_block_size,
    as AutoFP8 and vLLM's own fp8 export write it): Fp8LinearMethod registers, after each F8_E4M3 weight,
    `weight_scale` float32 [parts] (PerTensorScaleParameter: one per logical part of a fused module) and, for
    static activations, `input_scale` float32 [parts]. The checkpoint holds one float32 scale per module, 0-d
    or [1]."""

    static_input: bool
    ignored: frozenset[str] = frozenset()

    def skips(self, module: str) -> bool:
        return skipped_module(module, self.ignored)

    def facts(self) -> dict:
        return {"method": "fp8", "strategy": "tensor", "activations": "static" if self.static_input else "dynamic",
                "scaleDtype": SCALE_DTYPE}


def skipped_module(module: str, ignored: frozenset[str]) -> bool:
    """Whether `module` (its full prefix) is one the config leaves unquantized, as vLLM matches names: a fused
    module by its own name or by all of its parts (some parts only: refused, as vLLM refuses it)."""
    proj = module.rsplit(".", 1)[-1]
    if proj in PACKED:
        if module in ignored:
            return True
        parts = {part: module.replace(proj, part) in ignored for part in PACKED[proj]}
        if len(set(parts.values())) > 1:
            raise ShardError(f"config.json quantization_config lists only some parts of {module} as not "
                             f"converted ({', '.join(p for p, skipped in parts.items() if skipped)}); vLLM "
                             f"refuses a fused layer of mixed precision")
        return next(iter(parts.values()))
    if "experts" in module:  # vLLM: any listed name with "experts" in it that contains the prefix
        return any(module in entry for entry in ignored if "experts" in entry)
    return module in ignored


def block_fp8(config: dict) -> BlockFp8 | TensorFp8 | None:
    """The checkpoint's FP8 quantization (block-scaled, or per tensor without weight_block_size), None for
    an unquantized one, or a ShardError naming the setting vLLM or Ferry would not accept."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ShardError("config.json: quantization_config must be an object")
    method = qc.get("quant_method")
    if method != "fp8":
        raise ShardError(f"config.json: quantization_config.quant_method is {method!r}; ferry shard cuts "
                         f"unquantized and FP8 block-scaled (quant_method \"fp8\" with weight_block_size) "
                         f"checkpoints only, and writes no layout it has not checked against vLLM")
    block = qc.get("weight_block_size")
    if block is None:
        return _tensor_fp8(qc)
    if (not isinstance(block, list) or len(block) != 2
            or any(not isinstance(b, int) or isinstance(b, bool) or b <= 0 for b in block)):
        raise ShardError(f"config.json: quantization_config.weight_block_size must be two positive integers, "
                         f"got {block!r}")
    if qc.get("activation_scheme") != "dynamic":
        raise ShardError(f"config.json: quantization_config.activation_scheme is "
                         f"{qc.get('activation_scheme')!r}; vLLM loads block-scaled FP8 only with \"dynamic\"")
    if qc.get("fmt") not in (None, "e4m3"):
        raise ShardError(f"config.json: quantization_config.fmt is {qc.get('fmt')!r}; vLLM allocates "
                         f"float8_e4m3fn weights, so only \"e4m3\" is cut")
    if qc.get("store_dtype") is not None:
        raise ShardError(f"config.json: quantization_config.store_dtype {qc.get('store_dtype')!r} selects "
                         f"another expert layout (MXFP4), which ferry shard does not write")
    ignored = qc.get("ignored_layers") or qc.get("modules_to_not_convert") or []
    if not isinstance(ignored, list) or not all(isinstance(m, str) for m in ignored):
        raise ShardError("config.json: quantization_config.ignored_layers / modules_to_not_convert must be a "
                         "list of module names")
    if len(ignored) > MAX_IGNORED:
        raise ShardError(f"config.json: quantization_config lists {len(ignored)} modules not to convert, "
                         f"more than the {MAX_IGNORED} ferry shard reads")
    return BlockFp8((block[0], block[1]), frozenset(ignored))


def _tensor_fp8(qc: dict) -> TensorFp8:
    scheme = qc.get("activation_scheme")
    if scheme not in ("dynamic", "static"):
        raise ShardError(f"config.json: quantization_config.activation_scheme is {scheme!r}; vLLM loads "
                         f"per-tensor FP8 with \"dynamic\" or \"static\"")
    if qc.get("fmt") not in (None, "e4m3") or qc.get("store_dtype") is not None:
        raise ShardError("config.json: quantization_config sets fmt or store_dtype; vLLM allocates "
                         "float8_e4m3fn weights, so only \"e4m3\" is cut")
    ignored = qc.get("ignored_layers") or qc.get("modules_to_not_convert") or []
    if not isinstance(ignored, list) or not all(isinstance(m, str) for m in ignored) or len(ignored) > MAX_IGNORED:
        raise ShardError(f"config.json: quantization_config.ignored_layers / modules_to_not_convert must be a "
                         f"list of at most {MAX_IGNORED} module names")
    return TensorFp8(scheme == "static", frozenset(ignored))


def refuse_experts_and_fused(family: Family, scheme: str, experts: bool = False) -> None:
    """No checkpoint that ships fused modules (vLLM then asks the quantization config about the fused names
    themselves, Phi-3's packed_modules_mapping, which the module rules here do not model), and no experts
    unless `experts` (the scheme's expert layout is cut)."""
    if family.is_moe and not experts:
        raise ShardError(f"{family.name}: {scheme} experts are not cut by ferry shard yet; serve this checkpoint "
                         f"with format.type safetensors")
    if any(s.fused for p in family.layer_params if p.linear for s in p.sources):
        raise ShardError(f"{family.name}: a checkpoint whose modules are already fused is not cut for {scheme} "
                         f"by ferry shard yet; serve it with format.type safetensors")


def per_part_scale(param: Param, suffix: str, cast: str | None = None) -> Param:
    """`<module>.<suffix>`: one value per logical part of the module, side by side (the EACH block)."""
    return dataclasses.replace(param, name=param.name.removesuffix("weight") + suffix, sources=tuple(
        Source(s.hf_name.removesuffix("weight") + suffix, ("1",), Split.REPLICATED, block=EACH, weight=s.hf_name,
               cast=cast) for s in param.sources))


def last_part_scale(param: Param, suffix: str, cast: str | None = None) -> Param:
    """`<module>.<suffix>`: one value for the whole module (an expert's w1 and w3 share one), from the part vLLM
    loads last (WHOLE); ShardJob checks that the parts agree (w8a8.shared_groups)."""
    return dataclasses.replace(param, name=param.name.removesuffix("weight") + suffix, sources=tuple(
        Source(s.hf_name.removesuffix("weight") + suffix, ("1",), Split.REPLICATED, block=WHOLE, weight=s.hf_name,
               cast=cast) for s in param.sources))


# The MoE families whose static-activation FP8 experts are proven against vLLM 0.32's own state (Mixtral,
# Qwen3-MoE: test_shard_vllm_quantized.py). DeepSeek's MLA adds static per-part input scales to fused modules
# no test has compared yet: refused until one does.
STATIC_EXPERT_FAMILIES = ("mixtral", "qwen3_moe")


def refuse_unproven_static_experts(family: Family, scheme: str) -> None:
    if family.is_moe and family.name not in STATIC_EXPERT_FAMILIES:
        raise ShardError(f"{family.name}: {scheme} with static activations is cut for "
                         f"{' and '.join(STATIC_EXPERT_FAMILIES)} experts only (the layouts proven against vLLM "
                         f"0.32); serve this checkpoint with format.type safetensors")


def input_scales(param: Param, cast: str | None = None) -> Param:
    """A static per-tensor input scale: one per logical part of a dense module ([parts]), one per expert for
    FusedMoE's stacks (`w13_input_scale` / `w2_input_scale` [E]: w1 and w3 read the same input, and vLLM keeps
    one value for both)."""
    return last_part_scale(param, "input_scale", cast) if param.experts else per_part_scale(param, "input_scale", cast)


def follow_linears(family: Family, followers: Callable[[Param], list[Param]], *, replaced: bool = False) -> Family:
    """The family's layer tables with each linear weight followed by `followers(weight)` (a quantization's
    scales or packed tensors, present in a layer only where that weight is quantized); with `replaced`, the
    weight itself stays only where the module is not quantized (packed layouts)."""
    params: list[Param] = []
    for param in family.layer_params:
        if not param.linear:
            params.append(param)
            continue
        params.append(dataclasses.replace(param, replaced_when_quantized=True) if replaced else param)
        params += followers(param)
    return dataclasses.replace(family, layer_params=tuple(params))


def with_tensor_scales(family: Family, quant: TensorFp8) -> Family:
    """Each linear weight followed by its per-tensor scales, one per logical part. Experts (Fp8MoEMethod
    without blocks): `w13_weight_scale` [E, 2] (w1's and w3's), `w2_weight_scale` [E], and with static
    activations `w13_input_scale` / `w2_input_scale` [E] (input_scales)."""
    refuse_experts_and_fused(family, "per-tensor FP8", experts=True)
    if quant.static_input:
        refuse_unproven_static_experts(family, "per-tensor FP8")
    return follow_linears(family, lambda param: [per_part_scale(param, "weight_scale")]
                          + ([input_scales(param)] if quant.static_input else []))


def with_scales(family: Family, quant: BlockFp8) -> Family:
    """Each linear weight followed by its block scales."""
    def scales(param: Param) -> list[Param]:
        sources = tuple(dataclasses.replace(s, hf_name=s.hf_name + SCALE_SUFFIX, block=quant.block,
                                            weight=s.hf_name) for s in param.sources)
        return [dataclasses.replace(param, name=param.name + SCALE_SUFFIX, sources=sources)]
    return follow_linears(family, scales)


def module_of(family: Family, full_name: str, param: Param) -> str:
    """The prefix vLLM built the module holding `full_name` with (the one its
    quantization config is asked about): FusedMoE's for expert stacks."""
    registered = family.registered_path(full_name)
    return registered.rsplit(".", 2 if param.experts else 1)[0]


def weight_source(scale: Source) -> Source:
    """The weight whose cut decides the cut of `scale` (a block tensor: scales, packed values)."""
    return dataclasses.replace(scale, hf_name=scale.weight, block=None, weight=None)


def scale_shape(weight_shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The shape of a block tensor covering a weight of `weight_shape`, partial blocks counted (a block of
    0 columns spans them all)."""
    rows, columns = weight_shape
    return -(-rows // block[0]), (-(-columns // block[1]) if block[1] else 1)


MIN_REFINED_BLOCK = 32  # vLLM's refine_fp8_moe_block_shape offers no finer block


def check_moe_blocks(dims: ModelDims, tp: int, moe: MoeTarget, quant: BlockFp8) -> tuple[int, int] | None:
    """The experts' scale grid vLLM 0.32's default MoE backend loads at this cut: None for the checkpoint's
    blocks (each rank's expert intermediate size is whole blocks), or the refinement factors (bn/g, bk/g)
    of `refine_fp8_moe_block_shape`'s square block g. A cut with neither is refused, naming the sizes that
    work."""
    bn, bk = quant.block
    inter, hidden = dims.size("moe_intermediate"), dims.hidden
    moe_tp = 1 if moe.expert_parallel else tp
    if moe.gpu == "rocm":
        raise ShardError("FP8 experts on ROCm: vLLM's AITER path converts and may pad FP8 MoE weights in ways "
                         "ferry shard has not checked; cut for hopper/ampere/ada/blackwell")
    grid = _moe_grid(inter, hidden, moe_tp, quant.block)
    if grid is not False:
        return grid
    per_rank, g = inter // moe_tp, math.gcd(bn, bk, inter // moe_tp, hidden)
    fitting = [str(t) for t in (1, 2, 4, 8, 16) if inter % t == 0 and _moe_grid(inter, hidden, t, quant.block)
               is not False]
    why = (f"the finest block vLLM would refine to, gcd({bn}, {bk}, {per_rank}, {hidden}) = {g}, is below "
           f"{MIN_REFINED_BLOCK}" if g < MIN_REFINED_BLOCK else
           f"moe_intermediate_size {inter} and hidden_size {hidden} are not whole {bn}x{bk} blocks, so vLLM's "
           f"refined scales would not line up with the ranks")
    way_out = (f"choose a tensor-parallel size of {', '.join(fitting)} for the experts" if fitting else
               "no tensor-parallel size up to 16 lines up: serve this checkpoint with format.type safetensors")
    raise ShardError(f"FP8 experts: each rank's expert intermediate size is {per_rank} (moe_intermediate_size "
                     f"{inter} / {moe_tp}), not whole {bn}x{bk} scale blocks, and {why}; vLLM cannot load this "
                     f"cut with its default MoE backend: {way_out}")


def _moe_grid(inter: int, hidden: int, moe_tp: int, block: tuple[int, int]) -> tuple[int, int] | None | bool:
    """None: the checkpoint's blocks; (bn/g, bk/g): vLLM's refined grid; False: neither lines up."""
    bn, bk = block
    per_rank = inter // moe_tp
    if per_rank % bn == 0 and (moe_tp == 1 or per_rank % bk == 0):
        return None
    g = math.gcd(bn, bk, per_rank, hidden)
    if g >= MIN_REFINED_BLOCK and all(size % b == 0 for size in (inter, hidden) for b in block):
        return bn // g, bk // g
    return False


def check_dtypes(tensors: Mapping[str, str], quantized: set[str], scales: set[str],
                 quant: BlockFp8 | None) -> None:
    """Each tensor's dtype must be the one vLLM allocates for it: the
    quantized weights F8_E4M3, their scales F32, nothing else FP8 (vLLM's
    sharded_state loader would only warn and cast a mismatch)."""
    problems = []
    for name, dtype in tensors.items():
        if name in quantized:
            if dtype != WEIGHT_DTYPE:
                problems.append(f"{name} is {dtype}, expected {WEIGHT_DTYPE} (config.json quantizes it; a module "
                                f"kept in {dtype} belongs in quantization_config.modules_to_not_convert)")
        elif name in scales:
            if dtype != SCALE_DTYPE:
                problems.append(f"{name} is {dtype}, expected {SCALE_DTYPE} (vLLM 0.32 keeps block scales in "
                                f"float32; UE8M0 scales are not loaded as such)")
        elif dtype in FP8_DTYPES:
            problems.append(f"{name} is {dtype}, but " + (
                "config.json has no quantization_config" if quant is None
                else "config.json does not quantize it (ignored_layers / modules_to_not_convert)"))
    if problems:
        shown = "; ".join(problems[:10]) + (f" (and {len(problems) - 10} more)" if len(problems) > 10 else "")
        raise ShardError(f"checkpoint dtypes do not match its quantization: {shown}")


def attention_scale_value(dtype: str) -> bytes:
    """-1.0 as one element of `dtype`, the model dtype of the 0-d attention parameters."""
    if dtype == "BF16":
        return struct.pack("<f", ATTENTION_SCALE_UNSET)[2:]  # the high half of the float32
    if dtype == "F16":
        return struct.pack("<e", ATTENTION_SCALE_UNSET)
    if dtype == "F32":
        return struct.pack("<f", ATTENTION_SCALE_UNSET)
    raise ShardError(f"the model dtype {dtype} is not one vLLM serves FP8 checkpoints in (BF16, F16, F32)")
