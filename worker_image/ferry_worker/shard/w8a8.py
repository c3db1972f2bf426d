"""compressed-tensors W8A8 checkpoints (llm-compressor's `int-quantized` INT8
and `float-quantized` FP8: 8-bit weights with per-channel or per-tensor
scales, activations quantized per token at run time or with a static
per-tensor scale) as vLLM 0.32 loads them: compressed_tensors.py picks
CompressedTensorsW8A8Int8 or CompressedTensorsW8A8Fp8 (schemes/), whose
create_weights registers, for a linear module `X` with `out` rows on the rank
(fused modules: one logical part per q/k/v or gate/up):

- `X.weight`        int8 / float8_e4m3fn, the weight's usual cut;
- `X.weight_scale`  float32 [out, 1] (channel: cut with the weight's rows,
  whole on every rank of a row-parallel cut), or [parts] (tensor:
  PerTensorScaleParameter, one scale per logical part);
- `X.input_scale`   float32 [parts] (FP8 with static activations:
  PerTensorScaleParameter); float32 [1] for INT8 (a BasevLLMParameter that
  every part of a fused module overwrites: vLLM keeps the part it loads last);
- `X.input_zero_point` int8 [1] (INT8 static asymmetric activations; the same
  rule), registered before `input_scale`.

Scales are allocated float32 whatever the checkpoint stores (llm-compressor
writes them in the model dtype), so the cut widens them on the way (`cast`):
bf16 and fp16 widen to float32 exactly, and `unshard` narrows them back,
checking that nothing was lost. Attention gains the KV-cache method's six
one-element parameters, as for every compressed-tensors scheme.

INT8 static activations are cut only where the parts of each fused module
(q/k/v, gate/up) hold the same input scale and zero point, as calibration
leaves them (the parts read the same input): otherwise vLLM would quantize
every part's input with the last part's scale, and `unshard` could not
rebuild the others. ShardJob checks it before writing; `unshard` rebuilds the
other parts from the one the rank files hold (`fused_parts`).

Experts (CompressedTensorsW8A8Int8MoEMethod, ...W8A8Fp8MoEMethod) stack the
same: `w13_weight` [E, 2 x I_rank, hidden] and `w2_weight`, with channel scales
[E, 2 x I_rank, 1] / [E, hidden, 1] (w2's whole on every rank), and dynamic
per-token activations: the one combination vLLM 0.32 loads for INT8 experts.
FP8 experts with per-tensor weight scales (vLLM pairs them with static
per-tensor activations) hold `w13_weight_scale` [E, 2] (w1's and w3's),
`w2_weight_scale` [E] and one input scale per expert, `w13_input_scale` /
`w2_input_scale` [E]: vLLM 0.32 refuses a checkpoint whose w1 and w3 input
scales differ by more than 1e-5, and ShardJob requires them identical before
writing (`shared_groups`). Proven for Mixtral and Qwen3-MoE; DeepSeek's are
refused until compared (fp8.STATIC_EXPERT_FAMILIES).

Refused by name: asymmetric weights, asymmetric FP8 activations, groups and
blocks (other schemes), KV-cache schemes.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Mapping

from .fp8 import (PACKED, TensorFp8, follow_linears, input_scales, last_part_scale, per_part_scale,
                  refuse_experts_and_fused, refuse_unproven_static_experts, skipped_module)
from .fp8 import WEIGHT_DTYPE as FP8_DTYPE
from .layouts import Family, Param
from .model import ShardError
from .wna16 import KNOWN_CONFIG_KEYS, KNOWN_WEIGHT_KEYS, _ignored

FORMATS = {"int-quantized": "int", "float-quantized": "float"}
SCALE_DTYPE = "F32"
CASTABLE = ("F32", "BF16", "F16")  # what a scale may be stored as: each widens to float32 exactly
KNOWN_INPUT_KEYS = KNOWN_WEIGHT_KEYS


@dataclass(frozen=True)
class W8A8:
    """config.json's compressed-tensors W8A8 quantization."""

    kind: str  # "int" (INT8) or "float" (FP8 E4M3)
    channel: bool  # weight scales per output channel (else one per tensor)
    static_input: bool  # a checkpoint input scale per module
    ignored: frozenset[str] = frozenset()
    input_zero_point: bool = False  # INT8 static asymmetric activations

    @property
    def shared_input(self) -> bool:
        """One input scale (and zero point) per module, whichever part vLLM loads last (INT8 static)."""
        return self.static_input and self.kind == "int"

    @property
    def experts_loadable(self) -> bool:
        """What vLLM 0.32 loads for experts: channel scales with dynamic per-token activations (INT8, FP8), or
        FP8 per-tensor scales with static per-tensor activations."""
        if self.channel:
            return not self.static_input
        return self.kind == "float" and self.static_input

    @property
    def weight_dtype(self) -> str:
        return "I8" if self.kind == "int" else FP8_DTYPE

    def skips(self, module: str) -> bool:
        return skipped_module(module, self.ignored)

    def facts(self) -> dict:
        return {"method": "compressed-tensors", "format": next(f for f, k in FORMATS.items() if k == self.kind),
                "bits": 8, "type": self.kind, "strategy": "channel" if self.channel else "tensor",
                "activations": "static" if self.static_input else "dynamic", "zeroPoint": False,
                "inputZeroPoint": self.input_zero_point, "actOrder": False, "scaleDtype": SCALE_DTYPE}

    def role(self, name: str) -> str | None:
        return {"weight_scale": "scale", "input_scale": "scale", "input_zero_point": "zero"}.get(
            name.rsplit(".", 1)[-1])

    def check_dtypes(self, tensors: Mapping[str, str], roles: Mapping[str, str], model_dtype: str,
                     quantized: set[str] = frozenset()) -> None:
        """Quantized weights 8-bit of the scheme's type, scales a float dtype that widens to float32."""
        problems = [f"{name} is {tensors[name]}, expected {self.weight_dtype}" for name in sorted(quantized)
                    if name in tensors and tensors[name] != self.weight_dtype]
        # An 8-bit tensor the config leaves unquantized: vLLM would allocate the model dtype and cast the codes.
        problems += [f"{name} is {dtype}, but config.json does not quantize it (ignore)" for name, dtype
                     in sorted(tensors.items()) if dtype in ("I8", FP8_DTYPE) and name not in quantized
                     and roles.get(name) != "zero"]
        problems += [f"{name} is {tensors[name]}, expected one of {', '.join(CASTABLE)}"
                     for name, role in sorted(roles.items()) if role == "scale" and name in tensors
                     and tensors[name] not in CASTABLE]
        problems += [f"{name} is {tensors[name]}, expected I8 (vLLM allocates the activation zero point int8)"
                     for name, role in sorted(roles.items()) if role == "zero" and name in tensors
                     and tensors[name] != "I8"]
        if problems:
            shown = "; ".join(problems[:10]) + (f" (and {len(problems) - 10} more)" if len(problems) > 10 else "")
            raise ShardError(f"checkpoint dtypes do not match its compressed-tensors W8A8 quantization: {shown}")


def format_of(qc: dict) -> str | None:
    """The compressed-tensors format of a config with one config group (None for another shape: the
    pack-quantized parser names what is wrong)."""
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1 or not isinstance(next(iter(groups.values())), dict):
        return None
    fmt = next(iter(groups.values())).get("format")
    fmt = qc.get("format") if fmt is None else fmt  # vLLM falls back to the global format only when unset
    return fmt if isinstance(fmt, str) else None


def w8a8(qc: dict, fmt: str) -> W8A8:
    """quantization_config of a compressed-tensors int-quantized / float-quantized checkpoint, or a
    ShardError naming what vLLM or Ferry would not cut this way."""
    unknown = sorted(set(qc) - KNOWN_CONFIG_KEYS)
    if unknown:
        raise ShardError(f"config.json: quantization_config has keys ferry shard does not know "
                         f"({', '.join(unknown[:10])})")
    if qc.get("sparsity_config") or qc.get("transform_config") or qc.get("kv_cache_scheme") is not None:
        raise ShardError("config.json: quantization_config sets a sparsity, transform or KV-cache scheme; ferry "
                         "shard cuts plain W8A8 checkpoints")
    (name, group), = qc["config_groups"].items()
    kind = FORMATS[fmt]
    if group.get("targets") != ["Linear"] or group.get("output_activations") is not None:
        raise ShardError(f"config.json: config_groups.{name} must target [\"Linear\"] with no output "
                         f"activations; ferry shard cuts a single W8A8 scheme")
    weights = _args(f"config.json: config_groups.{name}.weights", group.get("weights"), kind)
    if weights.get("dynamic"):
        raise ShardError(f"config.json: config_groups.{name}.weights.dynamic is set; weights are quantized "
                         f"statically")
    if weights.get("strategy") not in ("channel", "tensor") or weights.get("symmetric", True) is not True:
        raise ShardError(f"config.json: config_groups.{name}.weights: strategy {weights.get('strategy')!r}, "
                         f"symmetric {weights.get('symmetric')!r}; vLLM's W8A8 schemes load symmetric channel or "
                         f"tensor weights (groups and blocks are other schemes)")
    where = f"config.json: config_groups.{name}.input_activations"
    inputs = _args(where, group.get("input_activations"), kind)
    symmetric = inputs.get("symmetric", True)
    if inputs.get("dynamic") is True and inputs.get("strategy") == "token" and symmetric:
        static = False
    elif inputs.get("dynamic") in (False, None) and inputs.get("strategy") == "tensor" \
            and (symmetric or kind == "int"):
        static = True
    else:
        raise ShardError(f"{where}: dynamic {inputs.get('dynamic')!r} with strategy {inputs.get('strategy')!r}, "
                         f"symmetric {symmetric!r}; ferry shard cuts symmetric per-token dynamic activations and "
                         f"static per-tensor ones (asymmetric for INT8 only)")
    return W8A8(kind, weights["strategy"] == "channel", static, _ignored(qc), input_zero_point=not symmetric)


def _args(where: str, args, kind: str) -> dict:
    if not isinstance(args, dict):
        raise ShardError(f"{where} must be an object")
    unknown = sorted(set(args) - KNOWN_INPUT_KEYS)
    if unknown:
        raise ShardError(f"{where} has keys ferry shard does not know ({', '.join(unknown)})")
    if args.get("type") != kind or type(args.get("num_bits")) is not int or args["num_bits"] != 8:
        raise ShardError(f"{where}: {args.get('type')!r} with {args.get('num_bits')!r} bits; the format holds "
                         f"8-bit {kind} values")
    if args.get("actorder") not in (None, False) or args.get("group_size") is not None \
            or args.get("block_structure") is not None:
        raise ShardError(f"{where}: groups, blocks or act-order belong to another scheme, which ferry shard does "
                         f"not cut")
    if not isinstance(args.get("symmetric", True), bool) or not isinstance(args.get("dynamic", False), (bool, str)):
        raise ShardError(f"{where}: symmetric must be true or false, and dynamic a boolean")
    return args


def with_scales(family: Family, quant: W8A8) -> Family:
    """Each linear weight followed by its scales, in vLLM's registration order, widened to the float32 vLLM
    allocates."""
    refuse_experts_and_fused(family, "compressed-tensors W8A8", experts=True)
    if family.is_moe and not quant.experts_loadable:
        raise ShardError(f"{family.name}: compressed-tensors {'INT8' if quant.kind == 'int' else 'FP8'} experts "
                         f"with {'channel' if quant.channel else 'per-tensor'} weight scales and "
                         f"{'static' if quant.static_input else 'dynamic'} activations: vLLM 0.32 loads INT8 "
                         f"experts only with channel scales and dynamic per-token activations, and FP8 experts "
                         f"with those or with per-tensor weight scales and static per-tensor activations; serve "
                         f"this checkpoint with format.type safetensors")
    if quant.static_input:  # FP8 here: INT8 static experts were refused above
        refuse_unproven_static_experts(family, "compressed-tensors FP8")

    def scales(param: Param) -> list[Param]:
        if quant.channel:  # [out, 1]: the weight's rows, whole on every rank of a row-parallel cut
            out = [dataclasses.replace(param, name=param.name.removesuffix("weight") + "weight_scale", sources=tuple(
                dataclasses.replace(s, hf_name=s.hf_name.removesuffix("weight") + "weight_scale", block=(1, 0),
                                    weight=s.hf_name, cast=SCALE_DTYPE) for s in param.sources))]
        else:
            out = [per_part_scale(param, "weight_scale", SCALE_DTYPE)]
        if quant.shared_input:
            return out + [last_part_scale(param, "input_zero_point")] * quant.input_zero_point + [
                last_part_scale(param, "input_scale", SCALE_DTYPE)]
        return out + ([input_scales(param, SCALE_DTYPE)] if quant.static_input else [])
    return follow_linears(family, scales)


SHARED_SUFFIXES = ("input_scale", "input_zero_point")
# Each expert's gate and up parts (Mixtral's w1/w3, Qwen3-MoE's gate_proj/up_proj), fused into w13.
EXPERT_INPUT = re.compile(r"(?P<expert>.+\.experts\.\d+)\.(?P<part>w1|w3|gate_proj|up_proj)\.input_scale")
EXPERT_PART_ORDER = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1}


def shared_groups(quant: object, names) -> dict[str, list[str]]:
    """The checkpoint tensors among `names` of which vLLM keeps one per group, by group (the rank files hold
    the one it loads last; ShardJob checks that they agree, unshard rebuilds the others from it): INT8 static
    activations' input scales and zero points of fused modules, static FP8 input scales of an expert's w1
    and w3."""
    if isinstance(quant, W8A8) and quant.shared_input:
        return fused_parts(names)
    if isinstance(quant, (W8A8, TensorFp8)) and quant.static_input:
        return expert_parts(names)
    return {}


def expert_parts(names) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for name in names:
        if found := EXPERT_INPUT.fullmatch(name):
            groups.setdefault(f"{found['expert']}.w13.input_scale", []).append(name)
    return {group: sorted(parts, key=lambda n: EXPERT_PART_ORDER[n.rsplit(".", 2)[1]])
            for group, parts in groups.items()}


def fused_parts(names) -> dict[str, list[str]]:
    """The INT8 static input scales and zero points of each fused module's parts among `names`, by the
    fused module's name (e.g. `...self_attn.qkv_proj.input_scale` -> the q, k and v ones): the values vLLM
    loads one of, which must agree."""
    groups: dict[str, list[str]] = {}
    for name in names:
        module, _, suffix = name.rpartition(".")
        prefix, _, proj = module.rpartition(".")
        fused = next((f for f, parts in PACKED.items() if proj in parts), None)
        if suffix in SHARED_SUFFIXES and fused:
            groups.setdefault(f"{prefix}.{fused}.{suffix}", []).append(name)
    order = {part: i for parts in PACKED.values() for i, part in enumerate(parts)}
    return {fused: sorted(parts, key=lambda n: order[n.rsplit(".", 2)[1]]) for fused, parts in groups.items()}
