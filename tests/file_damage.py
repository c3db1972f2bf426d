"""A file damaged as bit rot damages it: one byte changed in place, the size kept."""
from __future__ import annotations

import os
from pathlib import Path


def flip_byte(path: Path, offset: int = -1) -> Path:
    """Flip the low bit of the byte at `offset` (negative: from the end) of `path`, made writable first (a
    published cache file is read-only); returns `path`."""
    path.chmod(0o644)
    with open(path, "r+b") as f:
        f.seek(offset, os.SEEK_END if offset < 0 else os.SEEK_SET)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    return path
