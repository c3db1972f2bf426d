"""A checkpoint in a local directory: file:///path, or pvc://claim/path mounted into the Job.

Symlinked files are followed (a Hub cache snapshot is a tree of symlinks into
its blob store); symlinked directories are not descended into, so a link loop
cannot trap the walk. Ferry's own bookkeeping files are not part of the
checkpoint (fetch drops them from every listing). If the directory was itself
prepared by Ferry, the sha256 values of its manifest are advertised, so the
copy is verified against them.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

from ..manifest import MANIFEST_NAME
from ..paths import safe_relative_path
from .base import BadSourceError, RangedSource, RemoteFile, SourceError


class LocalSource(RangedSource):
    def __init__(self, root: Path, uri: str, revision: str | None = None) -> None:
        self.root = root
        self.uri = uri
        self.revision = revision

    def list_files(self) -> list[RemoteFile]:
        if not self.root.is_dir():
            raise BadSourceError(f"{self.uri}: {self.root} is not a directory")
        advertised = self._manifest_digests()
        files = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames.sort()
            for name in sorted(filenames):
                full = Path(dirpath, name)
                rel = safe_relative_path(full.relative_to(self.root).as_posix(), origin=self.uri)
                if not full.exists():
                    raise SourceError(f"{self.uri}: {rel} is a broken symlink")
                if not full.is_file():
                    continue
                st = full.stat()  # follows a symlinked file to its target
                files.append(
                    RemoteFile(path=rel, size=st.st_size, version=f"{st.st_size}:{st.st_mtime_ns}",
                               sha256=advertised.get(rel))
                )
        return files

    def read_range(self, file: RemoteFile, start: int, end: int, buffer: memoryview) -> Iterator[memoryview]:
        fd = os.open(self.root / file.path, os.O_RDONLY)
        try:
            position = start
            while position < end:
                n = os.preadv(fd, [buffer[: min(len(buffer), end - position)]], position)
                if n == 0:
                    raise SourceError(f"{self.uri}: {file.path} ends at {position}, expected {file.size} bytes")
                position += n
                yield buffer[:n]
        finally:
            os.close(fd)

    def _manifest_digests(self) -> dict[str, str]:
        path = self.root / MANIFEST_NAME
        if not path.is_file():
            return {}
        try:
            return {f["path"]: f["sha256"] for f in json.loads(path.read_bytes())["files"]}
        except (ValueError, KeyError, TypeError) as e:
            raise SourceError(f"{self.uri}: unreadable {MANIFEST_NAME}: {e}") from None
