"""The one small interface every checkpoint source implements.

A source lists its files (path, size, a version token, and whatever content
digests it advertises) and delivers their bytes, in one of two ways:

- `RangedSource.read_range`: any byte range, so the transfer engine can fetch
  parts in parallel, resume a partial file where it stopped, and hash while
  it writes (local/PVC directories, S3);
- `DownloadSource.download`: the whole file to a path, for sources whose own
  client does the transfer better than Ferry could (the Hub: hf_xet).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping


@dataclass(frozen=True)
class RemoteFile:
    path: str  # relative POSIX path, checked by paths.safe_relative_path
    size: int
    # Changes whenever the content may have changed (S3 ETag, Hub blob id, local
    # size+mtime): a partial or completed file is only reused for the same version.
    version: str
    sha256: str | None = None
    # Other digests of the whole content the source advertises, by algorithm
    # ("md5", "crc32", "git-sha1"); verified after the transfer.
    digests: Mapping[str, str] = field(default_factory=dict)


class SourceError(Exception):
    """The source failed or contradicted itself (changed object, short read, ...)."""


class BadSourceError(SourceError):
    """The source as given cannot work (a malformed URI, nothing there): retrying the same fetch cannot help."""


class Source(ABC):
    uri: str
    # What the manifest records as the revision: a Hub commit, or None.
    revision: str | None = None
    # Exceptions worth retrying a range or download for (connection resets, timeouts).
    transient_errors: tuple[type[BaseException], ...] = ()

    @abstractmethod
    def list_files(self) -> list[RemoteFile]:
        """Every file of the checkpoint, with paths already checked."""

    def describe(self, file: RemoteFile) -> RemoteFile:
        """`file` as listed plus what the source can say about its content beyond
        the listing (digests to verify it against), asked for just before `file`
        is transferred: a listing costs one call per page, never one per object,
        however many objects a prefix holds. By default the listing says it all."""
        return file


class RangedSource(Source):
    @abstractmethod
    def read_range(self, file: RemoteFile, start: int, end: int, buffer: memoryview) -> Iterator[memoryview]:
        """Yield bytes [start, end) of `file` in order, as views into `buffer` (each valid until the next)."""


class DownloadSource(Source):
    @abstractmethod
    def download(self, file: RemoteFile, dest: Path, on_bytes: Callable[[int], None]) -> None:
        """Write the whole of `file` to `dest`, calling on_bytes(n) as bytes arrive (n may be negative on a retry)."""
