"""A checkpoint in a local directory: file:///path, or pvc://claim/path mounted into the Job.

A Job reads a pvc:// source as file:///source/<path>, from a claim the
requesting user fills, so a local source follows no symlink out of itself:

- the source directory must be named by its real path (no symlink on the way
  to it: /source/ckpt -> /var/run/secrets would copy the worker's token);
- a symlinked file is followed only if it resolves inside the source
  directory (or, for the worker's own Hub cache, inside the repository's cache
  folder whose blob store huggingface_hub links to); a link out of it is
  refused, naming the link and its target;
- a symlinked directory inside the source is not descended into (a link loop
  cannot trap the walk); one pointing out of it is refused like a file;
- each file is read from the path it resolved to at listing, and only if it is
  still the same inode, so a link swapped after the listing is not followed.

Ferry's own bookkeeping files are not part of the checkpoint (fetch drops
them from every listing). If the directory was itself prepared by Ferry, the
sha256 values of its manifest are advertised, so the copy is verified against them.
"""
from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..manifest import MANIFEST_NAME
from ..paths import safe_relative_path
from .base import BadSourceError, RangedSource, RemoteFile, SourceError


@dataclass(frozen=True)
class _Listed:
    """Where a listed file's bytes are, and which inode they were."""

    path: Path
    device: int
    inode: int


class LocalSource(RangedSource):
    def __init__(self, root: Path, uri: str, revision: str | None = None, *, links_within: Path | None = None) -> None:
        self.root = root
        self.uri = uri
        self.revision = revision
        # Where a symlink may point: the source directory unless told otherwise.
        self._links_within = links_within
        self._listed: dict[str, _Listed] = {}

    def list_files(self) -> list[RemoteFile]:
        root = self._real_root()
        boundary = (self._links_within or root).resolve()
        advertised = self._manifest_digests(root, boundary)
        files = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in dirnames:
                if Path(dirpath, name).is_symlink():  # not descended into; but never one pointing out
                    self._contained(Path(dirpath, name), root, boundary)
            for name in sorted(filenames):
                full = Path(dirpath, name)
                rel = safe_relative_path(full.relative_to(root).as_posix(), origin=self.uri)
                target = self._contained(full, root, boundary)
                if not target.is_file():
                    continue
                st = target.stat()
                self._listed[rel] = _Listed(target, st.st_dev, st.st_ino)
                files.append(
                    RemoteFile(path=rel, size=st.st_size, version=f"{st.st_size}:{st.st_mtime_ns}",
                               sha256=advertised.get(rel))
                )
        return files

    def read_range(self, file: RemoteFile, start: int, end: int, buffer: memoryview) -> Iterator[memoryview]:
        listed = self._listed.get(file.path)
        if listed is None:
            raise SourceError(f"{self.uri}: {file.path} was not in this source's listing")
        try:
            fd = os.open(listed.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise SourceError(f"{self.uri}: {file.path} was replaced by a symlink since it was listed") from None
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (listed.device, listed.inode):
                raise SourceError(f"{self.uri}: {file.path} was replaced since it was listed")
            position = start
            while position < end:
                n = os.preadv(fd, [buffer[: min(len(buffer), end - position)]], position)
                if n == 0:
                    raise SourceError(f"{self.uri}: {file.path} ends at {position}, expected {file.size} bytes")
                position += n
                yield buffer[:n]
        finally:
            os.close(fd)

    def _real_root(self) -> Path:
        if not self.root.is_dir():
            raise BadSourceError(f"{self.uri}: {self.root} is not a directory")
        given = self.root.absolute()
        real = given.resolve()
        if real != given:
            raise BadSourceError(f"{self.uri}: {given} resolves to {real} through a symlink; Ferry follows no "
                                 f"symlink to or out of a source: name the directory itself")
        return real

    def _contained(self, path: Path, root: Path, boundary: Path) -> Path:
        """`path` resolved, refused unless it stays inside `boundary`."""
        rel = path.relative_to(root).as_posix()
        try:
            target = path.resolve(strict=True)
        except FileNotFoundError:
            raise SourceError(f"{self.uri}: {rel} is a broken symlink") from None
        except (RuntimeError, OSError) as e:  # Python < 3.13 raises RuntimeError for a loop, later ELOOP
            if isinstance(e, OSError) and e.errno != errno.ELOOP:
                raise
            raise BadSourceError(f"{self.uri}: {rel} is a symlink loop") from None
        if not target.is_relative_to(boundary):
            link = os.readlink(path) if path.is_symlink() else str(path)
            raise BadSourceError(f"{self.uri}: {rel} is a symlink to {link} ({target}), outside the source "
                                 f"{boundary}; Ferry follows no symlink out of a source")
        return target

    def _manifest_digests(self, root: Path, boundary: Path) -> dict[str, str]:
        path = root / MANIFEST_NAME
        if not path.is_symlink() and not path.is_file():
            return {}
        target = self._contained(path, root, boundary)
        if not target.is_file():
            return {}
        try:
            return {f["path"]: f["sha256"] for f in json.loads(target.read_bytes())["files"]}
        except (ValueError, KeyError, TypeError) as e:
            raise SourceError(f"{self.uri}: unreadable {MANIFEST_NAME}: {e}") from None
