"""Content digests computed in one pass: sha256 (the manifest's) plus what a source advertises.

The CRCs are the checksums S3 stores: CRC64NVME is what AWS computes for new
objects by default, CRC32 what boto3 sends by default. CRC32C and CRC64NVME
come from awscrt (the AWS SDKs' native runtime, SIMD: ~10 GB/s here); CRC32
from zlib, which is faster than awscrt's for that one.
"""
from __future__ import annotations

import hashlib
import zlib
from typing import Callable, Iterable, Mapping

from ..manifest import IntegrityError


class _Crc:
    def __init__(self, update: Callable[[memoryview, int], int], width_bits: int) -> None:
        self._update = update
        self._hex_digits = width_bits // 4
        self._value = 0

    def update(self, data: memoryview) -> None:
        self._value = self._update(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:0{self._hex_digits}x}"


def _crc32() -> _Crc:
    return _Crc(zlib.crc32, 32)


def _crc32c() -> _Crc:
    from awscrt import checksums

    return _Crc(checksums.crc32c, 32)


def _crc64nvme() -> _Crc:
    from awscrt import checksums

    return _Crc(checksums.crc64nvme, 64)


def _git_blob_sha1(size: int) -> "hashlib._Hash":
    h = hashlib.sha1()
    h.update(b"blob %d\0" % size)  # git hashes a header, then the content
    return h


class ContentHasher:
    """sha256 always; md5, crc32, crc32c, crc64nvme and git-sha1 on request."""

    def __init__(self, size: int, extra: Iterable[str] = ()) -> None:
        factories = {"md5": hashlib.md5, "crc32": _crc32, "crc32c": _crc32c, "crc64nvme": _crc64nvme,
                     "git-sha1": lambda: _git_blob_sha1(size)}
        self._hashes = {"sha256": hashlib.sha256()}
        for name in extra:
            if name not in factories:
                raise ValueError(f"unsupported digest {name!r}")
            self._hashes[name] = factories[name]()

    def update(self, data: memoryview) -> None:
        for h in self._hashes.values():
            h.update(data)  # hashlib releases the GIL on large buffers

    def hexdigests(self) -> dict[str, str]:
        return {name: h.hexdigest() for name, h in self._hashes.items()}


def check_advertised(path: str, computed: Mapping[str, str], sha256: str | None, digests: Mapping[str, str],
                     origin: str) -> None:
    """Raise IntegrityError if the content disagrees with a digest the source advertised."""
    expected = dict(digests)
    if sha256 is not None:
        expected["sha256"] = sha256
    for name, value in sorted(expected.items()):
        if computed[name] != value.lower():
            raise IntegrityError(f"{path}: {name} {computed[name]} != {value} advertised by {origin}")
