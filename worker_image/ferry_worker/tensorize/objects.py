"""What a store write returns (`StoredObject`), apart from the stores
(store.py, local_store.py, s3_store.py) so that they import it without
importing each other."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..manifest import FileEntry

OnBytes = Callable[[int], None]


@dataclass(frozen=True)
class StoredObject:
    path: str
    size: int
    sha256: str
    etag: str | None = None  # S3 only: what a later HEAD must answer for the object to be unchanged

    def entry(self) -> FileEntry:
        return FileEntry(self.path, self.size, self.sha256)
