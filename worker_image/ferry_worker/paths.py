"""Names that come from a source (S3 keys, Hub paths, index entries) are untrusted.

A checkpoint's file names decide where Ferry writes, so each one must be a
plain relative POSIX path that stays inside the output directory. Anything
else is refused outright, before a byte is written: a listing with one hostile
name is a hostile listing. The same rule holds for a manifest's entries
(manifest.FileEntry), bounded in length and depth.

A checked name can still lead elsewhere through a symlink a tenant planted in
the directory (a claim, a cache slot), so readers and writers of a directory
Ferry does not own go through `open_beneath` and its kin: each directory
component is opened relative to its parent with O_NOFOLLOW (openat), and so
is the leaf. A symlink anywhere below the root leads nowhere: it is refused,
and its target is never opened or stat'ed.
"""
from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path, PurePosixPath
from typing import Callable

MAX_PATH_BYTES = 1024
MAX_SEGMENT_BYTES = 255  # NAME_MAX
MAX_DEPTH = 32
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafePathError(ValueError):
    """A source named a file that would land outside the output directory."""


def safe_relative_path(name: str, *, origin: str) -> str:
    """Return `name` unchanged if it is a safe relative path, else raise UnsafePathError.

    Refused: empty names, absolute paths, `.` / `..` / empty segments, backslashes
    (a path separator on some filesystems and in some tools) and control characters.
    `origin` says where the name came from, for the error message.
    """
    problem = path_problem(name)
    if problem:
        raise UnsafePathError(f"{origin}: refusing file name {name!r}: {problem}")
    return name


def path_problem(name: object) -> str | None:
    """Why `name` is not a plain relative POSIX path of bounded length and depth, or None."""
    if not isinstance(name, str):
        return f"not a string ({type(name).__name__})"
    if not name:
        return "empty"
    try:
        size = len(name.encode())
    except UnicodeEncodeError:
        return "not valid UTF-8"
    if any(ord(c) < 0x20 or c == "\x7f" for c in name):
        return "control character"
    if "\\" in name:
        return "backslash"
    if name.startswith("/"):
        return "absolute path"
    if size > MAX_PATH_BYTES:
        return f"{size} bytes long, more than {MAX_PATH_BYTES}"
    segments = name.split("/")
    if len(segments) > MAX_DEPTH:
        return f"{len(segments)} segments deep, more than {MAX_DEPTH}"
    for segment in segments:
        if segment in ("", ".", ".."):
            return f"path segment {segment!r}"
        if len(segment.encode()) > MAX_SEGMENT_BYTES:
            return f"a segment of {len(segment.encode())} bytes, more than {MAX_SEGMENT_BYTES}"
    return None


def inside(root: Path, relative: str) -> Path:
    """`root / relative`, checked (again, after symlinks) to stay under `root`."""
    path = root / PurePosixPath(relative)
    resolved_root = root.resolve()
    if not path.resolve().is_relative_to(resolved_root):
        raise UnsafePathError(f"{relative!r} resolves outside {root}")
    return path


def _checked(relative: str) -> str:
    problem = path_problem(relative)
    if problem:
        raise UnsafePathError(f"{repr(relative)[:200]}: {problem}")
    return relative


def _no_symlink(shown: str, call, link: Callable[[], bool] = lambda: False):
    """`call()`, with O_NOFOLLOW meeting a symlink (ELOOP; ENOTDIR with O_DIRECTORY, when `link()`, an lstat
    of the name itself, says so) as UnsafePathError naming the component."""
    try:
        return call()
    except OSError as e:
        if e.errno == errno.ELOOP or (e.errno == errno.ENOTDIR and link()):
            raise UnsafePathError(f"{shown!r} is a symbolic link; Ferry follows none inside an artifact") from None
        raise


def open_dir_beneath(root: Path, relative: str, *, make_dirs: bool = False) -> int:
    """A directory fd of `relative` ("" for `root` itself) under `root` (the caller's own path, followed as
    given), each component opened relative to its parent without following a symlink. `make_dirs` creates
    missing ones (a writer's). Raises UnsafePathError for a symlink (naming it), FileNotFoundError or
    NotADirectoryError as the kernel says."""
    segments = _checked(relative).split("/") if relative else []
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for depth, segment in enumerate(segments, 1):
            if make_dirs:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(segment, 0o777, dir_fd=fd)
            child = _no_symlink("/".join(segments[:depth]), lambda: os.open(segment, _DIR_FLAGS, dir_fd=fd),
                                lambda: stat.S_ISLNK(os.stat(segment, dir_fd=fd, follow_symlinks=False).st_mode))
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_beneath(root: Path, relative: str, flags: int = os.O_RDONLY, mode: int = 0o666, *,
                 make_dirs: bool = False) -> int:
    """An fd of the file `relative` names under `root`, no component (the leaf included) followed through a
    symlink: see open_dir_beneath for the errors. Never the caller's controlling terminal (O_NOCTTY), and a
    read-only open does not block (O_NONBLOCK: a fifo, or a file a lease holder keeps), so a device node or
    fifo planted under the name is opened harmlessly and refused by the caller's fstat check."""
    parent_path, _, leaf = _checked(relative).rpartition("/")
    parent = open_dir_beneath(root, parent_path, make_dirs=make_dirs)
    try:
        flags |= os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY
        if flags & os.O_ACCMODE == os.O_RDONLY and not flags & os.O_CREAT:
            flags |= os.O_NONBLOCK
        return _no_symlink(relative, lambda: os.open(leaf, flags, mode, dir_fd=parent))
    finally:
        os.close(parent)


def read_beneath(root: Path, relative: str, limit: int) -> bytes | None:
    """The bytes of the regular file `relative` under `root` (open_beneath), None when it is absent; refused
    (UnsafePathError) when it is not a regular file or holds more than `limit` bytes."""
    try:
        fd = open_beneath(root, relative, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)  # a fifo must not block
    except (FileNotFoundError, NotADirectoryError):
        return None
    with open(fd, "rb", closefd=True) as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"{relative!r} is not a regular file")
        data = f.read(limit + 1) if st.st_size <= limit else b""
    if st.st_size > limit or len(data) > limit:
        raise UnsafePathError(f"{relative!r} holds more than {limit} bytes")
    return data


def unlink_beneath(root: Path, relative: str) -> bool:
    """Remove the file (or symlink, never followed) `relative` names under `root`. A path through a symlink
    names nothing under `root`: nothing is removed. Returns whether something was."""
    parent_path, _, leaf = _checked(relative).rpartition("/")
    try:
        parent = open_dir_beneath(root, parent_path)
    except (FileNotFoundError, NotADirectoryError, UnsafePathError):
        return False
    try:
        os.unlink(leaf, dir_fd=parent)
        return True
    except (FileNotFoundError, IsADirectoryError):
        return False
    finally:
        os.close(parent)
