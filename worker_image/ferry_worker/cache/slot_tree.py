"""Walking a tree a tenant wrote (a cache fill slot) as root: never recursively, never through a link.

A fill pod can put anything in its slot (symlinks, fifos, device nodes, hard links, trees thousands of
directories deep, sparse files) and may still hold an fd into it while the agent works there. So every
directory is opened relative to its parent's fd with O_DIRECTORY|O_NOFOLLOW, every file relative to its
directory's fd with O_NOFOLLOW|O_NONBLOCK|O_NOCTTY and checked with fstat before anything is changed
through the fd, and anything else is unlinked by name relative to its directory (a link itself, never
its target). A taking-over walk makes each directory root's and 0755 *before* it lists it, so the pod's
uid can no longer add, remove or rename entries there: what was listed is what is acted on.

Walks are iterative with one open fd per level, and bounded (MAX_DEPTH levels, MAX_ENTRIES entries):
`take_over` and `open_to` refuse a tree past a bound (TreeRefused), `used_bytes` counts what it can up to
it and never raises. `remove_tree` removes any tree, however deep, keeping at most FLAT_DEPTH fds open
(a directory deeper than that is first renamed up to the root).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from ..manifest import MAX_ENTRIES as MANIFEST_MAX_ENTRIES
from ..paths import MAX_DEPTH as PATH_MAX_DEPTH

MAX_DEPTH = 2 * PATH_MAX_DEPTH  # 64 levels: a manifest's paths are at most 32 segments deep
MAX_ENTRIES = 2 * MANIFEST_MAX_ENTRIES  # 200 000: a manifest's files, and as many directories
FLAT_DEPTH = 32  # remove_tree's open directory fds at most
CLEAR_BATCH = 10_000  # remove_tree's entries held in memory at once, per directory
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC

OnDir = Callable[[int, str], None]  # (the directory's fd, its path under the root: "" or "a/b/")
OnEntry = Callable[[int, str, os.stat_result, str], None]  # (its directory's fd, name, lstat, path)


class TreeRefused(Exception):
    """A tree past the walk's bounds: refused, never walked further. The message says which bound."""


@dataclass
class Totals:
    size: int = 0  # the regular files' st_size: what they claim to hold
    blocks: int = 0  # bytes the regular files occupy on disk (st_blocks * 512): a sparse file's are few
    complete: bool = True  # False: a lenient walk stopped at a bound, so more may be there than counted


class _Stop(Exception):
    """A lenient walk reached a bound: it ends with what it counted."""


def walk(path: Path, on_entry: OnEntry, on_dir: OnDir = lambda fd, rel: None, *, strict: bool = True,
         max_depth: int = MAX_DEPTH, max_entries: int = MAX_ENTRIES) -> bool:
    """Depth first under `path` (the caller's own directory): `on_dir` gets each directory's fd before it is
    listed, `on_entry` each entry that is not a directory. Strict: past a bound TreeRefused, other errors
    raised. Lenient: stops at a bound, skips what cannot be opened or vanished (the tree is being written).
    Returns False when a lenient walk left something unwalked at a bound."""
    root = os.open(path, DIR_FLAGS)
    stack: list[tuple[int, str, Iterator[str]]] = [(root, "", iter(()))]  # every open fd, the root's first
    budget = [max_entries, max_entries]  # (left, the bound)
    complete = True
    try:
        device = os.fstat(root).st_dev
        stack[0] = (root, "", iter(_step(root, "", on_dir, on_entry, budget, strict)))
        while stack:
            fd, rel, subdirs = stack[-1]
            name = next(subdirs, None)
            if name is None:
                os.close(stack.pop()[0])
                continue
            if len(stack) > max_depth:
                if strict:
                    raise TreeRefused(f"a directory more than {max_depth} levels deep ({_shown(rel + name)})")
                complete = False
                continue
            child = _open_dir(fd, name, rel, on_entry, strict)
            if child is not None:
                stack.append(_descend(child, f"{rel}{name}/", device, on_dir, on_entry, budget, strict))
    except _Stop:
        complete = False
    finally:
        for fd, _, _ in stack:
            os.close(fd)
    return complete


def _descend(fd: int, rel: str, device: int, on_dir: OnDir, on_entry: OnEntry, budget: list[int],
             strict: bool) -> tuple[int, str, Iterator[str]]:
    """The stack frame of the directory `fd` just opened (closed on an error): nothing on another filesystem
    is walked (strict: refused)."""
    try:
        if os.fstat(fd).st_dev != device:
            if strict:
                raise TreeRefused(f"{_shown(rel)}, on another filesystem")
            return fd, rel, iter(())
        return fd, rel, iter(_step(fd, rel, on_dir, on_entry, budget, strict))
    except BaseException:
        os.close(fd)
        raise


def _step(fd: int, rel: str, on_dir: OnDir, on_entry: OnEntry, budget: list[int], strict: bool) -> list[str]:
    """One directory: `on_dir`, then its listing (counted against the budget), `on_entry` for each entry
    that is not a directory; returns the names of its subdirectories."""
    try:
        on_dir(fd, rel)
        names = []
        with os.scandir(fd) as listing:
            for item in listing:
                budget[0] -= 1
                if budget[0] < 0:
                    if strict:
                        raise TreeRefused(f"more than {budget[1]} files and directories (at {_shown(rel)})")
                    raise _Stop
                names.append(item.name)
        subdirs = []
        for name in names:
            try:
                st = os.lstat(name, dir_fd=fd)
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(st.st_mode):
                subdirs.append(name)
            else:
                on_entry(fd, name, st, rel + name)
        return subdirs
    except OSError:
        if strict:
            raise
        return []


def _open_dir(parent: int, name: str, rel: str, on_entry: OnEntry, strict: bool) -> int | None:
    """The subdirectory `name` of `parent`, never through a link; None when it is gone or is no longer a
    directory (replaced since it was listed: then `on_entry` gets what is there now)."""
    try:
        return os.open(name, DIR_FLAGS, dir_fd=parent)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT) and strict:
            raise
    try:
        st = os.lstat(name, dir_fd=parent)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        on_entry(parent, name, st, rel + name)
    return None


def _shown(rel: str) -> str:
    rel = rel.rstrip("/") or "."
    return repr(rel if len(rel) <= 80 else rel[:38] + "..." + rel[-38:])


def _own(fd: int) -> None:
    if os.geteuid() == 0:  # the agent; an admin's `ferry cache fill` as themselves keeps their own files
        os.fchown(fd, 0, 0)


def take_over(path: Path, dir_mode: int = 0o755) -> Totals:
    """Make the slot at `path` the agent's own: each directory root's and `dir_mode` before it is listed (the
    root first), each regular file root's and 0444 through its own fd; anything else is unlinked unfollowed
    (symlinks, fifos, devices, sockets, a file with other hard links). TreeRefused past a bound."""
    totals = Totals()

    def own_dir(fd: int, rel: str) -> None:
        _own(fd)
        os.fchmod(fd, dir_mode)

    def own_entry(dir_fd: int, name: str, st: os.stat_result, rel: str) -> None:
        if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
            got = _own_file(dir_fd, name, st)
            if got is None:
                return
            if got:
                totals.size += got.st_size
                totals.blocks += got.st_blocks * 512
                return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)

    walk(path, own_entry, own_dir)
    return totals


def _own_file(dir_fd: int, name: str, listed: os.stat_result):
    """Root's and 0444 through an fd of the regular file `name` that was listed; its fstat, or False when what
    is there now is not that file (to be unlinked), or None when it is gone."""
    try:
        fd = os.open(name, FILE_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.ENODEV, errno.EACCES, errno.EPERM, errno.EAGAIN):
            return False  # a link, a device, or a file the pod holds a lease on (O_NONBLOCK: not waited for)
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or (st.st_dev, st.st_ino) != (listed.st_dev,
                                                                                          listed.st_ino):
            return False
        _own(fd)
        os.fchmod(fd, 0o444)
        return st if _no_writer(fd) else False
    finally:
        os.close(fd)


def _no_writer(fd: int) -> bool:
    """Whether nothing holds the file open for writing, or mapped writable: the kernel grants a read lease
    only then. The chmod above stops new writers, not one the pod (or a process it handed an fd) still has,
    which could change the bytes after they are verified. A filesystem without leases proves nothing."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EBUSY, errno.EINVAL):
            return False
        raise
    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    return True


def used_bytes(path: Path) -> Totals:
    """Bytes the regular files under `path` (a slot being written) occupy on disk (`blocks`: st_blocks, so a
    sparse file counts what it holds). Only lstat relative to directory fds (no link followed, no file
    opened); up to the bounds (`complete` False past one: more may be hidden there), skipping what vanishes;
    never raises (nothing when `path` is gone)."""
    totals = Totals()

    def count(dir_fd: int, name: str, st: os.stat_result, rel: str) -> None:
        if stat.S_ISREG(st.st_mode):
            totals.blocks += st.st_blocks * 512

    with contextlib.suppress(OSError):  # gone, or a directory that vanished: what was counted
        totals.complete = walk(path, count, strict=False)
    return totals


def open_to(path: Path, dir_mode: int, file_mode: int | None = None, *, root_too: bool = True) -> None:
    """Chmod every directory under `path` (the root too unless not `root_too`) to `dir_mode` and, given
    `file_mode`, every regular file, each through its own fd (a tree taken over: anything else is left)."""
    def on_dir(fd: int, rel: str) -> None:
        if rel or root_too:
            os.fchmod(fd, dir_mode)

    def on_entry(dir_fd: int, name: str, st: os.stat_result, rel: str) -> None:
        if file_mode is None or not stat.S_ISREG(st.st_mode):
            return
        fd = os.open(name, FILE_FLAGS, dir_fd=dir_fd)
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                os.fchmod(fd, file_mode)
        finally:
            os.close(fd)

    walk(path, on_entry, on_dir)


def remove_tree(path: Path) -> None:
    """Remove `path` (a directory) and everything beneath it, never following a link and never recursing:
    each directory is made the agent's and 0700 before it is listed, its entries unlinked by name, and a
    directory deeper than FLAT_DEPTH renamed up under `path` first (at most FLAT_DEPTH fds open, any depth)."""
    root = os.open(path, DIR_FLAGS)
    stack: list[tuple[int, str, list[str]]] = [(root, "", [])]  # every open fd, the root's first
    flat = f".ferry-flat-{uuid.uuid4().hex[:8]}-"
    moved = 0
    try:
        device = os.fstat(root).st_dev
        stack[0][2].extend(_clear(root))
        while stack:
            fd, _, subdirs = stack[-1]
            if not subdirs:
                _, name, _ = stack.pop()
                os.close(fd)
                if stack:
                    with contextlib.suppress(FileNotFoundError):
                        os.rmdir(name, dir_fd=stack[-1][0])
                continue
            name = subdirs.pop()
            if len(stack) >= FLAT_DEPTH:  # too deep to hold another fd: moved up, removed from there
                os.rename(name, f"{flat}{moved}", src_dir_fd=fd, dst_dir_fd=root)
                stack[0][2].append(f"{flat}{moved}")
                moved += 1
                continue
            child = _open_dir(fd, name, "", _unlink, strict=True)
            if child is not None:
                try:
                    if os.fstat(child).st_dev != device:
                        raise TreeRefused(f"{name!r} is on another filesystem: not removed")
                    stack.append((child, name, _clear(child)))
                except BaseException:
                    os.close(child)
                    raise
    finally:
        for fd, _, _ in stack:
            os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(path)


def _clear(fd: int) -> list[str]:
    """Make the directory `fd` the agent's and 0700 (no one else adds to it now), unlink all but its
    subdirectories, and return the names of those not empty. At most CLEAR_BATCH files are held at once (a
    directory of millions of files is cleared batch by batch), and an empty subdirectory is removed as met."""
    _own(fd)
    os.fchmod(fd, 0o700)
    subdirs: list[str] = []
    seen: set[str] = set()
    while True:
        files = []
        with os.scandir(fd) as listing:
            for item in listing:
                if not item.is_dir(follow_symlinks=False):
                    files.append(item.name)
                    if len(files) >= CLEAR_BATCH:
                        break
                elif item.name not in seen:
                    seen.add(item.name)
                    if not _removed_empty(fd, item.name):
                        subdirs.append(item.name)
        for name in files:
            _unlink(fd, name)
        if len(files) < CLEAR_BATCH:
            return subdirs


def _removed_empty(dir_fd: int, name: str) -> bool:
    try:
        os.rmdir(name, dir_fd=dir_fd)
        return True
    except FileNotFoundError:
        return True
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.EACCES, errno.EPERM):
            return False
        raise


def _unlink(dir_fd: int, name: str, *_) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dir_fd)
