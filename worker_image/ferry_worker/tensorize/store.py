"""The two places an artifact can go, behind one interface (`open_store`).

    store.put_file(name, path)      # a companion file, a published weight file
    obj = store.tensor_object(name) # obj.file for TensorSerializer; obj.seal() per tensor; obj.finish()
    store.put_bytes(name, data)     # the pending record, the manifest
    store.read(name), store.delete(names)

Each write returns a `StoredObject` (size, sha256 of the bytes stored, the
store's ETag) only once the bytes are known to be in place: for a local
directory, written to a temporary name, fsynced, hashed and renamed; for S3,
see s3_store.py.
"""
from __future__ import annotations

from typing import Protocol

from .location import LocalLocation, Location, S3Location
from .objects import OnBytes, StoredObject
from .s3_client import S3Options

__all__ = ["OnBytes", "Store", "StoredObject", "TensorObject", "open_store"]


class TensorObject(Protocol):
    file: object  # the seekable file TensorSerializer writes

    def seal(self) -> None:
        """Called after each tensor: everything written so far is final but the prologue."""

    def finish(self, on_bytes: OnBytes | None = None) -> StoredObject:
        """After TensorSerializer.close(): make the object whole and check it."""

    def abort(self) -> None:
        """On failure: nothing of this object may remain half-written."""


class Store(Protocol):
    location: Location

    def uri(self, name: str | None = None) -> str: ...

    def read(self, name: str) -> bytes | None: ...

    def put_bytes(self, name: str, data: bytes) -> StoredObject: ...

    def put_file(self, name: str, path, on_bytes: OnBytes | None = None,
                 expected_sha256: str | None = None) -> StoredObject: ...

    def tensor_object(self, name: str, size_hint: int) -> TensorObject: ...

    def head(self, name: str) -> tuple[int, str | None] | None:
        """(size, etag) of an object, or None when it is absent."""

    def delete(self, names: list[str]) -> list[str]:
        """Delete these objects (absent ones are fine); returns those that existed."""

    def abort_unfinished(self, names: list[str]) -> None:
        """Forget half-written copies of these objects from an earlier run."""


def open_store(location: Location, options: S3Options | None = None, part_size: int | None = None) -> Store:
    if isinstance(location, S3Location):
        from .s3_store import DEFAULT_PART_SIZE, S3Store

        return S3Store(location, options or S3Options(), part_size=part_size or DEFAULT_PART_SIZE)
    if isinstance(location, LocalLocation):
        from .local_store import LocalStore

        return LocalStore(location)
    raise TypeError(location)
