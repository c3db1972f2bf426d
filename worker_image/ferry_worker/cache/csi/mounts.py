"""Bind mounts through mount(2) and umount2(2) (ctypes: the agent needs no
mount binary in its image)."""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND = 1, 2, 4, 32, 4096
MNT_DETACH = 2

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)


def bind(source: Path, target: Path, read_only: bool) -> None:
    """Bind `source` at `target`, then remount it nosuid,nodev (and read-only): a bind mount takes its
    flags only from the remount."""
    _call(_libc.mount, str(source).encode(), str(target).encode(), None, MS_BIND, None)
    flags = MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV | (MS_RDONLY if read_only else 0)
    try:
        _call(_libc.mount, None, str(target).encode(), None, flags, None)
    except OSError:
        unmount(target)
        raise


def unmount(target: Path) -> None:
    """Detach `target` (lazily: a process still inside it keeps its view until it leaves)."""
    _call(_libc.umount2, str(target).encode(), MNT_DETACH)


def is_mount(target: Path) -> bool:
    """Whether `target` is a mount point in this mount namespace (mountinfo: bind mounts of a directory
    on the same filesystem are invisible to st_dev comparisons)."""
    wanted = os.path.realpath(target)
    with open("/proc/self/mountinfo") as f:
        return any(_unescape(line.split()[4]) == wanted for line in f)


def _unescape(field: str) -> str:
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def _call(fn, *args) -> None:
    if fn(*args) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{fn.__name__}{tuple(a.decode() if isinstance(a, bytes) else a for a in args[:2])}: "
                             f"{os.strerror(errno)}")
