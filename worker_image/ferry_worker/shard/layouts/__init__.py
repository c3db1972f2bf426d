"""How vLLM lays out each supported architecture family across tensor-parallel
(and expert-parallel) ranks: one table per family (`dense`, `moe`), in the
vocabulary of `base`."""
from __future__ import annotations

from .base import EACH, WHOLE, Family, Flag, Mlp, Param, Placement, SizeKey, Source, Split
from .dense import GEMMA2, GEMMA3, LLAMA, PHI3, QWEN2, QWEN3
from .moe import DEEPSEEK, MIXTRAL, QWEN3_MOE

FAMILIES: tuple[Family, ...] = (LLAMA, QWEN2, QWEN3, PHI3, GEMMA2, GEMMA3, MIXTRAL, QWEN3_MOE, DEEPSEEK)

__all__ = ["EACH", "WHOLE", "FAMILIES", "Family", "Flag", "Mlp", "Param", "Placement", "SizeKey", "Source", "Split", "family_for",
           "supported_architectures"]


def supported_architectures() -> list[str]:
    return sorted(a for f in FAMILIES for a in f.architectures)


def family_for(architectures: list[str]) -> Family:
    """The family vLLM would build for config.json `architectures` (its first
    entry, as vLLM resolves it), or a ValueError naming what is supported."""
    for family in FAMILIES:
        if architectures and architectures[0] in family.architectures:
            return family
    raise ValueError(f"architecture {architectures!r} is not supported by ferry shard; "
                     f"supported: {', '.join(supported_architectures())}")
