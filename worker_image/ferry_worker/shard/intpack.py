"""AWQ and GPTQ checkpoints (AutoAWQ's GEMM layout; AutoGPTQ's and GPTQModel's)
as vLLM 0.32 loads them. For a linear module `X` with `I` inputs and `O`
outputs on the rank, group size `g` and `pack` = 32 / bits values per int32:

- AWQ (quantization/auto_awq.py, AutoAWQMarlinLinearMethod.create_weights,
  registration order): `X.qweight` int32 [I, O / 8] (eight int4 outputs per
  word, in AWQ's interleaved order), `X.qzeros` int32 [I / g, O / 8],
  `X.scales` [I / g, O] in the model dtype;
- GPTQ (quantization/auto_gptq.py, AutoGPTQLinearMethod.create_weights):
  `X.qweight` int32 [I / pack, O] (packed along the input), `X.scales`
  [I / g, O], `X.qzeros` int32 [I / g, O / pack]. Channelwise (group_size -1)
  on a row-parallel rank: [1, O] and [1, O / pack], whole on every rank
  (`marlin_repeat_scales_on_all_ranks`). `X.g_idx` is never loaded: vLLM's
  checkpoint weight mapper drops every `.g_idx`.

Both store [in, out], the transpose of the weight's orientation, so each is a
`transposed` block tensor of the (absent) unpacked weight: a column-parallel
rank holds columns, and a fused module's parts sit side by side along dim 1.
Unlike CompressedTensorsWNA16, neither method checks that a rank's inputs
are whole groups (`num_groups = I // g`): vLLM would load a floor-sized,
misplaced slice without a word, so plan.py refuses such cuts by name.

Which modules are quantized is vLLM's rule for each method: AWQ's
`modules_to_not_convert` matched as substrings; GPTQ's
`modules_in_block_to_quantize`, or, when config.json has none, every module
with an integer tensor in the checkpoint (AutoGPTQConfig.maybe_update_config).
That fallback would read the *artifact's* fused names, which match no
unfused module, so the artifact's config.json names the list outright
(`artifact_config`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Mapping

from .fp8 import MAX_IGNORED, PACKED, follow_linears, refuse_experts_and_fused, weight_source
from .layouts import Family
from .model import ShardError

AWQ, GPTQ = "awq", "gptq"
MARLIN_HIDDEN_MULTIPLE, MARLIN_MOE_GROUPS = 128, (0, 32, 64, 128)  # check_moe_marlin_supports_config
PACKED_DTYPE = "I32"
FLOAT_DTYPES = ("F16", "BF16", "F32")  # what maybe_update_config counts as unquantized
GPTQ_GROUPS = (-1, 32, 64, 128)  # MARLIN_SUPPORTED_GROUP_SIZES: verify_marlin_supported refuses others
DROPPED_SUFFIX = ".g_idx"


@dataclass(frozen=True)
class IntPacked:
    """config.json's AWQ or GPTQ quantization_config."""

    method: str
    bits: int
    group: int  # inputs per scale; 0: one per output channel (group_size -1)
    zero_point: bool  # AWQ's zero_point (GPTQ here is symmetric)
    act_order: bool = False  # GPTQ desc_act as written (a no-op with one group per channel)
    modules: frozenset[str] = frozenset()  # AWQ: not converted; GPTQ: quantized (empty: all)
    listed: bool = True  # GPTQ: config.json names modules_in_block_to_quantize

    @property
    def pack(self) -> int:
        return 32 // self.bits

    @property
    def quantizes_every_expert(self) -> bool:
        """GPTQ: vLLM builds every FusedMoE quantized (get_moe_quant_method reads no module list)."""
        return self.method == GPTQ

    def skips(self, module: str) -> bool:
        """Whether vLLM leaves the module built at `module` (its full prefix) unquantized."""
        if self.method == AWQ:  # is_layer_skipped(..., match_mode="substring"), the fused name first
            if module.rsplit(".", 1)[-1] in PACKED and _listed_in(module, self.modules):
                return True
            return _per_part(module, lambda m: _listed_in(m, self.modules), "not converted")
        if not self.modules:  # is_layer_gptq_quantized: an empty list quantizes everything
            return False
        return not _per_part(module, lambda m: _listed_in(m, self.modules), "quantized")

    def facts(self) -> dict:
        return {"method": self.method, "bits": self.bits, "strategy": "group" if self.group else "channel",
                **({"groupSize": self.group} if self.group else {}), "zeroPoint": self.zero_point,
                "actOrder": self.act_order, **({"version": "gemm"} if self.method == AWQ else {})}

    def role(self, name: str) -> str | None:
        """Which packed tensor `name` is ("packed", "zero", "scale"), None for another."""
        return {"qweight": "packed", "qzeros": "zero", "scales": "scale"}.get(name.rsplit(".", 1)[-1])

    def check_dtypes(self, tensors: Mapping[str, str], roles: Mapping[str, str], model_dtype: str) -> None:
        """Packed values and zero points int32, scales the model dtype (vLLM allocates them so)."""
        wanted = {"packed": PACKED_DTYPE, "zero": PACKED_DTYPE, "scale": model_dtype}
        problems = [f"{name} is {tensors[name]}, expected {wanted[role]}" for name, role in sorted(roles.items())
                    if name in tensors and tensors[name] != wanted[role]]
        if problems:
            shown = "; ".join(problems[:10]) + (f" (and {len(problems) - 10} more)" if len(problems) > 10 else "")
            raise ShardError(f"checkpoint dtypes do not match its {self.method.upper()} quantization: {shown}")

    def with_checkpoint_modules(self, dtypes: Mapping[str, str]) -> "IntPacked":
        """GPTQ without modules_in_block_to_quantize: the modules vLLM derives from the checkpoint's integer
        tensors, each of which must be a module with a qweight (so the list the artifact's config.json names is
        one Ferry reads back)."""
        if self.method != GPTQ or self.listed:
            return self
        integer = {name for name, dtype in dtypes.items() if dtype not in FLOAT_DTYPES}
        stray = sorted(n for n in integer if n.rpartition(".")[0] + ".qweight" not in dtypes)
        if stray:
            raise ShardError(f"integer tensor(s) outside a quantized module (no qweight beside them): "
                             f"{', '.join(stray[:10])}; vLLM would count their modules as quantized")
        modules = {name.rpartition(".")[0] for name in integer}
        return dataclasses.replace(self, modules=_names("checkpoint", "the quantized modules", sorted(modules)))

    def artifact_config(self, config: dict) -> dict | None:
        """config.json for the artifact when it must differ from the checkpoint's (see the module docstring)."""
        if self.method != GPTQ or self.listed:
            return None
        listed = {**config["quantization_config"], "modules_in_block_to_quantize": sorted(self.modules)}
        return {**config, "quantization_config": listed}


def _listed_in(module: str, modules: frozenset[str]) -> bool:
    return any(m in module for m in modules)


def _per_part(module: str, test: Callable[[str], bool], what: str) -> bool:
    """`test` of a module, asked of each part of a fused one (which must agree, as vLLM requires)."""
    proj = module.rsplit(".", 1)[-1]
    if proj not in PACKED:
        return test(module)
    answers = {part: test(module.replace(proj, part)) for part in PACKED[proj]}
    if len(set(answers.values())) > 1:
        raise ShardError(f"config.json quantization_config lists only some parts of {module} as {what} "
                         f"({', '.join(p for p, yes in answers.items() if yes)}); vLLM refuses a fused layer of "
                         f"mixed precision")
    return next(iter(answers.values()))


def int_packed(qc: dict) -> IntPacked:
    """quantization_config of quant_method awq or gptq, or a ShardError naming what vLLM 0.32 or Ferry
    would not load this way."""
    method = qc["quant_method"]
    where = f"config.json: quantization_config ({method})"
    awq = method == AWQ  # vLLM's from_config reads AWQ's own key names first, and requires each setting
    bits = _first(qc, ("w_bit", "bits") if awq else ("bits",), where)
    group = _first(qc, ("q_group_size", "group_size") if awq else ("group_size",), where)
    for key in ("zero_point",) if awq else ("desc_act", "sym"):
        _first(qc, (key,), where)
    if type(bits) is not int or type(group) is not int or (group <= 0 and group != -1):
        raise ShardError(f"{where}: bits and group_size must be integers (group_size -1 or positive), got "
                         f"{bits!r} and {group!r}")
    if qc.get("lm_head"):
        raise ShardError(f"{where}: lm_head is quantized; ferry shard cuts {method.upper()} checkpoints with an "
                         f"unquantized LM head")
    return _awq(qc, where, bits, group) if awq else _gptq(qc, where, bits, group)


def _first(qc: dict, keys: tuple[str, ...], where: str):
    """vLLM's get_from_keys: the first of `keys` present (it raises when none is)."""
    for key in keys:
        if key in qc:
            return qc[key]
    raise ShardError(f"{where}: {' or '.join(keys)} is missing; vLLM 0.32 refuses the config without it")


def _awq(qc: dict, where: str, bits: int, group: int) -> IntPacked:
    if bits != 4:
        raise ShardError(f"{where}: {bits}-bit AWQ; vLLM 0.32's AWQ method loads 4-bit weights only")
    if str(qc.get("version", "gemm")).lower() != "gemm":
        raise ShardError(f"{where}: version {qc.get('version')!r}; vLLM 0.32 allocates the GEMM layout, so a "
                         f"GEMV checkpoint would not load: re-export it as GEMM")
    if group == -1:
        raise ShardError(f"{where}: group_size -1; vLLM 0.32's AWQ method gives a row-parallel rank zero "
                         f"groups then, so ferry shard cuts grouped AWQ only")
    zero_point = qc.get("zero_point", True)
    if not isinstance(zero_point, bool):
        raise ShardError(f"{where}: zero_point must be true or false")
    return IntPacked(AWQ, bits, group, zero_point, modules=_names(where, "modules_to_not_convert",
                                                                  qc.get("modules_to_not_convert")))


def _gptq(qc: dict, where: str, bits: int, group: int) -> IntPacked:
    if bits not in (4, 8):
        raise ShardError(f"{where}: {bits}-bit GPTQ; vLLM 0.32 loads 4- and 8-bit GPTQ")
    if qc.get("sym", True) is not True:
        raise ShardError(f"{where}: sym is {qc.get('sym')!r}; vLLM 0.32's GPTQ method serves symmetric "
                         f"weights only")
    if group not in GPTQ_GROUPS:
        raise ShardError(f"{where}: group_size {group}; vLLM 0.32 serves GPTQ with group sizes "
                         f"{', '.join(map(str, GPTQ_GROUPS))} only")
    act_order = qc.get("desc_act") or False
    if act_order is not False and (act_order is not True or group != -1):
        raise ShardError(f"{where}: desc_act (act-order) with {group}-input groups; vLLM 0.32 refuses to load "
                         f"such a checkpoint at all (\"GPTQ group activation ordering is no longer supported\"): "
                         f"quantize without act-order, or with one group per channel (group_size -1)")
    if qc.get("dynamic"):
        raise ShardError(f"{where}: dynamic sets per-module overrides; ferry shard cuts one scheme for "
                         f"every module")
    if qc.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
        raise ShardError(f"{where}: pack_dtype {qc.get('pack_dtype')!r}; vLLM 0.32 loads int32 packing")
    listed = qc.get("modules_in_block_to_quantize")
    flat = [m for item in listed for m in (item if isinstance(item, list) else [item])] if isinstance(
        listed, list) else listed
    return IntPacked(GPTQ, bits, 0 if group == -1 else group, False, act_order,
                     _names(where, "modules_in_block_to_quantize", flat), listed=bool(listed))


def _names(where: str, key: str, names) -> frozenset[str]:
    names = names or []
    if not isinstance(names, list) or not all(isinstance(m, str) and m for m in names):
        raise ShardError(f"{where}: {key} must be a list of module names")
    if len(names) > MAX_IGNORED:
        raise ShardError(f"{where}: {key} lists {len(names)} modules, more than the {MAX_IGNORED} ferry "
                         f"shard reads")
    return frozenset(names)


def check_marlin_experts(quant: IntPacked, hidden: int) -> None:
    """AWQ and GPTQ experts are built as the Marlin MoE methods' [E, in, out] stacks only where vLLM 0.32's
    check_moe_marlin_supports_layer holds (hidden_size a multiple of 128, a Marlin group size; whole groups
    per rank are checked with every cut); elsewhere vLLM falls back to MoeWNA16, another layout."""
    if hidden % MARLIN_HIDDEN_MULTIPLE or quant.group not in MARLIN_MOE_GROUPS:
        group = quant.group or -1
        raise ShardError(f"config.json: {quant.method.upper()} experts with hidden_size {hidden} and group_size "
                         f"{group}: vLLM 0.32 loads them through MoeWNA16 (its Marlin MoE method needs hidden_size "
                         f"a multiple of {MARLIN_HIDDEN_MULTIPLE} and group_size -1, 32, 64 or 128), a layout "
                         f"ferry shard does not write; serve this checkpoint with format.type safetensors")


def zeroed_biases(family: Family, quant) -> list[tuple[str, tuple]]:
    """GPTQ experts: the w13_bias/w2_bias AutoGPTQMoEMethod registers zeroed (for checkpoints that carry
    expert biases; the families cut here do not), as (state_dict name, the weights whose outputs each spans).
    ShardedStateLoader requires every key, and copying zeros leaves vLLM's bias unset as the default loader
    does."""
    if not (isinstance(quant, IntPacked) and quant.quantizes_every_expert and family.is_moe):
        return []
    return [(param.name.removesuffix("qweight") + "bias", tuple(weight_source(s) for s in param.sources))
            for param in family.layer_params if param.experts and param.name.endswith("_qweight")]


def with_packed(family: Family, quant: IntPacked) -> Family:
    """The family's layer tables with each linear weight followed by its packed tensors, in vLLM's
    registration order (held where the module is quantized; the weight itself only where it is not)."""
    refuse_experts_and_fused(family, quant.method.upper(), experts=True)
    group = quant.group
    if quant.method == AWQ:
        blocks = (("qweight", (8, 1)), ("qzeros", (8, group)), ("scales", (1, group)))
    else:
        blocks = (("qweight", (1, quant.pack)), ("scales", (1, group)), ("qzeros", (quant.pack, group)))
    return follow_linears(family, lambda param: [dataclasses.replace(
        param, name=param.name.removesuffix("weight") + suffix, sources=tuple(
            dataclasses.replace(s, hf_name=s.hf_name.removesuffix("weight") + suffix, block=block,
                                weight=s.hf_name, transposed=True) for s in param.sources))
        for suffix, block in blocks], replaced=True)
