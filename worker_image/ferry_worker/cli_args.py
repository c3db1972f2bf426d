"""argparse types shared by the `ferry` commands (fetch, shard, tensorize...)."""
from __future__ import annotations

import argparse
import re

_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]i?)?B?$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4,
          "KI": 1 << 10, "MI": 1 << 20, "GI": 1 << 30, "TI": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from `123`, `64Mi`, `1.5G`, `100MB` (K/M/G/T: powers of 1000; Ki/Mi/Gi/Ti: of 1024)."""
    match = _SIZE.match(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 64Mi, 100M, 1G)")
    value = float(match.group(1)) * _UNITS[(match.group(2) or "").upper()]
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be at least 1 byte: {text!r}")
    return int(value)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return value
