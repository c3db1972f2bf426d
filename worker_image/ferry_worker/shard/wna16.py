"""compressed-tensors `pack-quantized` checkpoints (llm-compressor's W4A16 and
W8A16: integer weights packed into int32, one scale per group of inputs or per
output channel) as vLLM 0.32 loads them: quantization/compressed_tensors/
compressed_tensors.py picks CompressedTensorsWNA16 (schemes/
compressed_tensors_wNa16.py), whose create_weights registers, for a linear
module `X` with `out` rows and `in` columns on the rank:

- `X.weight_packed`  int32 [out, in / pack]: `pack` = 32 / bits values of one
  row per int32 (packed along the input);
- `X.weight_scale`   the model dtype, [out, in / group] (group strategy), or
  [out, 1] (channel strategy: whole on every rank of a row-parallel cut,
  `marlin_repeat_scales_on_all_ranks`);
- `X.weight_shape`   int64 [2]: loaded whole from each part of a fused module,
  so the part vLLM loads last is what the rank holds;
- `X.weight_zero_point` int32 [out / pack, in / group] (asymmetric only: packed
  along the output).

Each is a block tensor of the unpacked weight (plan.py cuts it with the
weight's cut, in whole blocks), and Attention gains the KV-cache method's six
one-element parameters (`attention_params`).

Experts (compressed_tensors_moe_wna16.py, CompressedTensorsWNA16MoEMethod):
FusedMoE stacks the same tensors N-first, `w13_weight_packed` [E, 2 x I_rank,
hidden / pack], `w2_weight_packed` [E, hidden, I_rank / pack], their
`weight_scale` and `weight_zero_point` cut like a dense gate_up / down, and
`w13_weight_shape` / `w2_weight_shape` [E, 2] in the model dtype (allocated by
torch's default dtype, each expert's checkpoint int64 [2] copied in: for w13
the part loaded last). vLLM picks a kernel for them when the layer is built
(CPU: AMX only); the state before post-load processing is the kernel's
input whatever it is. A cut that splits a group or an
int32 is refused before anything is written, naming the tensor and the block.
"""
from __future__ import annotations

import dataclasses
import re
import struct
from dataclasses import dataclass
from typing import Mapping

from .fp8 import MAX_IGNORED, follow_linears, skipped_module
from .layouts import WHOLE, Family, Param, Source, Split
from .model import ShardError
from .tensors import itemsize

PACKED_DTYPE, SHAPE_DTYPE = "I32", "I64"
MODEL_DTYPE = "model"  # Source.cast: the checkpoint's model dtype, resolved by plan.py (experts' weight_shape)
METHOD = "compressed-tensors"
FORMAT = "pack-quantized"
# The keys of quantization_config this module reads, or must see empty: a sparsity or transform config makes
# vLLM build other modules (CompressedTensorsLinearTransformMethod, 2:4 sparse schemes).
KNOWN_CONFIG_KEYS = {"quant_method", "format", "quantization_status", "config_groups", "ignore", "kv_cache_scheme",
                     "global_compression_ratio", "version", "sparsity_config", "transform_config"}
# The keys of a weights' quantization args this module reads or must see at their default.
KNOWN_WEIGHT_KEYS = {"num_bits", "type", "symmetric", "strategy", "group_size", "dynamic", "actorder", "observer",
                     "observer_kwargs", "block_structure", "zp_dtype", "scale_dtype"}


@dataclass(frozen=True)
class PackQuantized:
    """config.json's compressed-tensors `pack-quantized` weight quantization."""

    bits: int
    group: int  # inputs per scale; 0: one per output channel (strategy "channel")
    symmetric: bool
    ignored: frozenset[str] = frozenset()

    @property
    def pack(self) -> int:
        return 32 // self.bits

    def skips(self, module: str) -> bool:
        return skipped_module(module, self.ignored)

    def facts(self) -> dict:
        return {"method": METHOD, "format": FORMAT, "bits": self.bits,
                "strategy": "group" if self.group else "channel", **({"groupSize": self.group} if self.group else {}),
                "zeroPoint": not self.symmetric, "actOrder": False}

    def role(self, name: str) -> str | None:
        return role(name)

    def check_dtypes(self, tensors: Mapping[str, str], roles: Mapping[str, str], model_dtype: str) -> None:
        """Packed values and zero points int32, weight_shape int64, scales the model dtype (vLLM allocates
        them so and would only warn and cast), nothing of a quantized module left unpacked."""
        wanted = {"packed": PACKED_DTYPE, "zero": PACKED_DTYPE, "shape": SHAPE_DTYPE, "scale": model_dtype}
        problems = [f"{name} is {tensors[name]}, expected {wanted[role]}" for name, role in sorted(roles.items())
                    if name in tensors and tensors[name] != wanted[role]]
        if problems:
            shown = "; ".join(problems[:10]) + (f" (and {len(problems) - 10} more)" if len(problems) > 10 else "")
            raise ShardError(f"checkpoint dtypes do not match its compressed-tensors quantization: {shown}")


def pack_quantized(qc: dict) -> PackQuantized:
    """`quantization_config` of quant_method compressed-tensors, or a ShardError naming what vLLM or Ferry
    would not cut this way."""
    unknown = sorted(set(qc) - KNOWN_CONFIG_KEYS)
    if unknown:
        raise ShardError(f"config.json: quantization_config has keys ferry shard does not know "
                         f"({', '.join(unknown[:10])})")
    for key in ("sparsity_config", "transform_config"):
        if qc.get(key):
            raise ShardError(f"config.json: quantization_config.{key} is set; vLLM then builds other modules "
                             f"than the pack-quantized scheme's, which ferry shard does not cut")
    fmt = qc.get("format")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise ShardError("config.json: quantization_config.config_groups must hold exactly one group (one scheme "
                         "for every Linear); ferry shard cuts a single pack-quantized scheme")
    (name, group), = groups.items()
    if not isinstance(group, dict):
        raise ShardError(f"config.json: quantization_config.config_groups.{name} must be an object")
    fmt = group.get("format") or fmt
    if fmt != FORMAT:
        raise ShardError(f"config.json: compressed-tensors format {fmt!r}; ferry shard cuts {FORMAT!r} (W4A16, "
                         f"W8A16), \"int-quantized\" and \"float-quantized\" (W8A8), and writes no layout it has "
                         f"not checked against vLLM")
    if group.get("targets") != ["Linear"]:
        raise ShardError(f"config.json: config_groups.{name}.targets is {group.get('targets')!r}; ferry shard "
                         f"cuts a scheme that targets [\"Linear\"]")
    for key in ("input_activations", "output_activations"):
        if group.get(key) is not None:
            raise ShardError(f"config.json: config_groups.{name}.{key} is set; pack-quantized with quantized "
                             f"activations is another vLLM scheme, which ferry shard does not cut")
    if qc.get("kv_cache_scheme") is not None:
        raise ShardError("config.json: quantization_config.kv_cache_scheme is set; ferry shard cuts "
                         "pack-quantized checkpoints without KV-cache scales")
    return PackQuantized(*_weight_args(name, group.get("weights")), ignored=_ignored(qc))


def _weight_args(name: str, weights) -> tuple[int, int, bool]:
    where = f"config.json: config_groups.{name}.weights"
    if not isinstance(weights, dict):
        raise ShardError(f"{where} must be an object")
    unknown = sorted(set(weights) - KNOWN_WEIGHT_KEYS)
    if unknown:
        raise ShardError(f"{where} has keys ferry shard does not know ({', '.join(unknown)})")
    bits, strategy, group_size = weights.get("num_bits"), weights.get("strategy"), weights.get("group_size")
    if weights.get("type", "int") != "int" or type(bits) is not int or bits not in (4, 8):
        raise ShardError(f"{where}: {weights.get('type')!r} with {bits!r} bits; pack-quantized is int4 or int8")
    if weights.get("dynamic"):
        raise ShardError(f"{where}.dynamic is set; weights are quantized statically")
    if weights.get("actorder") not in (None, False):
        raise ShardError(f"{where}.actorder is {weights['actorder']!r}: act-order (g_idx) checkpoints are not "
                         f"cut by ferry shard yet; serve them with format.type safetensors")
    if strategy == "group":
        if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0:
            raise ShardError(f"{where}.group_size must be a positive integer for strategy \"group\"")
        return bits, group_size, bool(weights.get("symmetric", True))
    if strategy == "channel":
        return bits, 0, bool(weights.get("symmetric", True))
    raise ShardError(f"{where}.strategy is {strategy!r}; ferry shard cuts \"group\" and \"channel\"")


def _ignored(qc: dict) -> frozenset[str]:
    ignored = qc.get("ignore") or []
    if not isinstance(ignored, list) or not all(isinstance(m, str) for m in ignored):
        raise ShardError("config.json: quantization_config.ignore must be a list of module names")
    if len(ignored) > MAX_IGNORED:
        raise ShardError(f"config.json: quantization_config.ignore lists {len(ignored)} modules, more than the "
                         f"{MAX_IGNORED} ferry shard reads")
    patterns = [m for m in ignored if m.startswith("re:") and m not in ("re:.*lm_head", "re:lm_head")]
    if patterns:
        raise ShardError(f"config.json: quantization_config.ignore holds patterns ({', '.join(patterns[:5])}); "
                         f"ferry shard matches module names only: list each module by name")
    return frozenset(m.removeprefix("re:.*").removeprefix("re:") for m in ignored)


def with_packed(family: Family, quant: PackQuantized) -> Family:
    """The family's layer tables with each linear weight followed by its packed tensors (held where the
    module is quantized; the weight itself only where it is not)."""
    if any(s.fused for p in family.layer_params if p.linear for s in p.sources):
        raise ShardError(f"{family.name}: a checkpoint whose modules are already fused is not cut for "
                         f"compressed-tensors by ferry shard yet; serve it with format.type safetensors")
    return follow_linears(family, lambda param: _packed_params(param, quant), replaced=True)


def _packed_params(param: Param, quant: PackQuantized) -> list[Param]:
    """vLLM's registration order: weight_packed, weight_scale, weight_shape, weight_zero_point."""
    stem = param.name.removesuffix("weight")

    def blocks(suffix: str, block: tuple[int, int]) -> Param:
        sources = tuple(dataclasses.replace(s, hf_name=s.hf_name.removesuffix("weight") + suffix, block=block,
                                            weight=s.hf_name) for s in param.sources)
        return dataclasses.replace(param, name=stem + suffix, sources=sources, replaced_when_quantized=False)

    # Every part's [2] weight_shape, of which a rank holds the one vLLM loads last (plan.py picks it: WHOLE).
    # Experts: one [2] per expert in the model dtype ([E, 2]).
    shape = dataclasses.replace(param, name=stem + "weight_shape", replaced_when_quantized=False, sources=tuple(
        Source(s.hf_name.removesuffix("weight") + "weight_shape", ("2",), Split.REPLICATED, block=WHOLE,
               weight=s.hf_name, cast=MODEL_DTYPE if param.experts else None) for s in param.sources))
    out = [blocks("weight_packed", (1, quant.pack)), blocks("weight_scale", (1, quant.group)), shape]
    if not quant.symmetric:
        out.append(blocks("weight_zero_point", (quant.pack, quant.group)))
    return out


def attention_params(model_dtype: str) -> list[tuple[str, tuple[str, bytes]]]:
    """The parameters CompressedTensorsKVCacheMethod gives each Attention layer with no kv_cache_scheme, in
    registration order, each of one element: k/v/q_scale 1.0 in float32, k/v/q_zero_point 0 in the model
    dtype (torch's default dtype while the model is built)."""
    one = ("F32", struct.pack("<f", 1.0))
    zero = (model_dtype, bytes(itemsize(model_dtype)))
    return [("k_scale", one), ("v_scale", one), ("q_scale", one),
            ("k_zero_point", zero), ("v_zero_point", zero), ("q_zero_point", zero)]


def role(name: str) -> str | None:
    """Which packed tensor `name` is ("packed", "scale", "shape", "zero"), None for another."""
    for suffix, kind in (("weight_packed", "packed"), ("weight_scale", "scale"), ("weight_shape", "shape"),
                         ("weight_zero_point", "zero")):
        if name.endswith("." + suffix):
            return kind
    return None


def unpacked_shape(specs: Mapping, shape_name: str, quant: PackQuantized) -> tuple[int, int]:
    """What `X.weight_shape` must hold: X's weight_packed rows, and its int32 columns x the pack factor."""
    packed = specs.get(shape_name.removesuffix("weight_shape") + "weight_packed")
    if packed is None or len(packed.shape) != 2:
        raise ShardError(f"{shape_name} has no two-dimensional weight_packed beside it")
    return packed.shape[0], packed.shape[1] * quant.pack


def shape_bytes(shape: tuple[int, int]) -> bytes:
    return struct.pack("<2q", *shape)


def natural_key(file: str) -> list:
    """vLLM's `_natural_sort_key`: the order its default loader reads checkpoint files in."""
    return [int(s) if s.isascii() and s.isdigit() else s for s in re.split(r"([0-9]+)", file.rsplit("/", 1)[-1])]
