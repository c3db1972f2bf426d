"""What changes in vLLM's `sharded_state` contract from one release to the next.

Each rule is a release from which vLLM behaves differently. A version outside
the range Ferry has read the sources of is refused: an artifact for it could be
wrong in ways no table here describes.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

Version = tuple[int, int, int]

OLDEST_KNOWN: Version = (0, 8, 5)
NEWEST_KNOWN_MINOR = (0, 33)  # every 0.33.x patch release
DEFAULT_VLLM_VERSION = "0.32.0"  # what the compatibility tests load artifacts with
DEFAULT_MAX_PART_SIZE = 5 << 30  # vLLM's ShardedStateLoader.save_model default

# From 0.14 every Attention layer registers persistent 0-d float32 buffers
# (layers/attention/attention.py `set_default_quant_scales(register_buffer=True)`),
# so they are part of the state_dict the loader checks; older releases reject them.
ATTENTION_SCALE_BUFFERS_SINCE: Version = (0, 14, 0)
ATTENTION_SCALE_BUFFERS: tuple[str, ...] = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")
ATTENTION_SCALE_VALUE = 1.0

# From 0.32 the loader names files by pipeline stage too when PP > 1
# (ShardedStateLoader.PP_AND_TP_PATTERN). Before, files were named by TP rank
# only, so the stages of one TP rank would need the same file name.
PP_FILE_NAMES_SINCE: Version = (0, 32, 0)
TP_ONLY_PATTERN = "model-rank-{rank}-part-{part}.safetensors"
PP_AND_TP_PATTERN = "model-pp-{pp_rank}-tp-{tp_rank}-part-{part}.safetensors"

# FP8 block-scaled layouts (shard/fp8.py) are read from 0.32's source and
# checked against what 0.32 builds in each worker; older releases differ
# (attention's prob_scale, the scale buffers, MoE scale names).
FP8_BLOCK_LAYOUT_SINCE: Version = (0, 32, 0)


@dataclass(frozen=True)
class VllmTarget:
    """The vLLM release an artifact is cut for, and what that implies."""

    version: Version

    @property
    def attention_scale_buffers(self) -> tuple[str, ...]:
        return ATTENTION_SCALE_BUFFERS if self.version >= ATTENTION_SCALE_BUFFERS_SINCE else ()

    @property
    def fp8_block_layout_known(self) -> bool:
        return self.version >= FP8_BLOCK_LAYOUT_SINCE

    @property
    def supports_pipeline_parallel(self) -> bool:
        return self.version >= PP_FILE_NAMES_SINCE

    def file_name(self, pp_size: int, pp_rank: int, tp_rank: int, part: int) -> str:
        if pp_size > 1:
            return PP_AND_TP_PATTERN.format(pp_rank=pp_rank, tp_rank=tp_rank, part=part)
        return TP_ONLY_PATTERN.format(rank=tp_rank, part=part)

    def __str__(self) -> str:
        return ".".join(map(str, self.version))


def parse_vllm_version(text: str) -> VllmTarget:
    """`0.32`, `0.32.1` or `v0.32.1` -> VllmTarget; an unknown release is a ValueError."""
    match = re.fullmatch(r"v?(\d+)\.(\d+)(?:\.(\d+))?", text.strip())
    if not match:
        raise ValueError(f"vLLM version {text!r} is not of the form X.Y or X.Y.Z")
    version = (int(match[1]), int(match[2]), int(match[3] or 0))
    if version < OLDEST_KNOWN or version[:2] > NEWEST_KNOWN_MINOR:
        newest = ".".join(map(str, NEWEST_KNOWN_MINOR))
        raise ValueError(f"vLLM {text} is outside the releases ferry shard knows "
                         f"({'.'.join(map(str, OLDEST_KNOWN))} to {newest}.x); "
                         f"its sharded_state layout is unverified, so no artifact is written")
    return VllmTarget(version)
