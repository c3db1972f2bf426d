"""Names that come from a source (S3 keys, Hub paths, index entries) are untrusted.

A checkpoint's file names decide where Ferry writes, so each one must be a
plain relative POSIX path that stays inside the output directory. Anything
else is refused outright, before a byte is written: a listing with one hostile
name is a hostile listing.
"""
from __future__ import annotations

from pathlib import Path, PurePosixPath


class UnsafePathError(ValueError):
    """A source named a file that would land outside the output directory."""


def safe_relative_path(name: str, *, origin: str) -> str:
    """Return `name` unchanged if it is a safe relative path, else raise UnsafePathError.

    Refused: empty names, absolute paths, `.` / `..` / empty segments, backslashes
    (a path separator on some filesystems and in some tools) and control characters.
    `origin` says where the name came from, for the error message.
    """
    problem = _problem(name)
    if problem:
        raise UnsafePathError(f"{origin}: refusing file name {name!r}: {problem}")
    return name


def _problem(name: str) -> str | None:
    if not name:
        return "empty"
    if any(ord(c) < 0x20 or c == "\x7f" for c in name):
        return "control character"
    if "\\" in name:
        return "backslash"
    if name.startswith("/"):
        return "absolute path"
    for segment in name.split("/"):
        if segment in ("", ".", ".."):
            return f"path segment {segment!r}"
    return None


def inside(root: Path, relative: str) -> Path:
    """`root / relative`, checked (again, after symlinks) to stay under `root`."""
    path = root / PurePosixPath(relative)
    resolved_root = root.resolve()
    if not path.resolve().is_relative_to(resolved_root):
        raise UnsafePathError(f"{relative!r} resolves outside {root}")
    return path
