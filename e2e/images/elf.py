"""Is an ELF executable static? (It names no program interpreter: PT_INTERP.)"""
from __future__ import annotations

import struct
from pathlib import Path

PT_INTERP = 3


def is_static(path: Path) -> bool:
    data = path.read_bytes()
    if data[:4] != b"\x7fELF":
        raise ValueError(f"{path} is not an ELF file")
    wide, little = data[4] == 2, data[5] == 1
    order = "<" if little else ">"
    if wide:
        phoff, = struct.unpack_from(order + "Q", data, 0x20)
        phentsize, phnum = struct.unpack_from(order + "HH", data, 0x36)
    else:
        phoff, = struct.unpack_from(order + "I", data, 0x1C)
        phentsize, phnum = struct.unpack_from(order + "HH", data, 0x2A)
    types = [struct.unpack_from(order + "I", data, phoff + i * phentsize)[0] for i in range(phnum)]
    return PT_INTERP not in types
