"""Page-cache state for the benchmarks: cold (dropped) or warm (read through once)."""
from __future__ import annotations

import subprocess
from pathlib import Path

CHUNK = 16 << 20


def try_drop_page_cache() -> bool:
    """sync, then drop the page cache; False when not allowed (not root)."""
    subprocess.run(["sync"], check=True)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def drop_page_cache(otherwise: str) -> None:
    """Drop the page cache or stop, saying what to do instead (`otherwise`)."""
    if not try_drop_page_cache():
        raise SystemExit(f"cannot drop the page cache: run as root, or {otherwise}")


def read_through(files: list[Path]) -> None:
    """One untimed read of every byte: the files are then in the page cache."""
    buf = bytearray(CHUNK)
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
