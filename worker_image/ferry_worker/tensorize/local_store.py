"""An artifact in a local directory: each file written under a temporary name,
fsynced, hashed, then renamed into place (manifest.atomic_file's rules)."""
from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from ..manifest import MAX_MANIFEST_BYTES, TMP_MARKER, atomic_file, fsync_dir, sha256_file, tmp_name
from ..paths import UnsafePathError, inside, open_beneath, read_beneath, unlink_beneath
from .errors import StoreError
from .location import LocalLocation
from .objects import OnBytes, StoredObject

COPY_BLOCK = 8 << 20


class LocalTensorObject:
    def __init__(self, final: Path, name: str) -> None:
        self._final, self._name = final, name
        final.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = tmp_name(final)
        self.file = open(self._tmp, "wb+")  # TensorSerializer closes it

    def seal(self) -> None:
        pass

    def finish(self, on_bytes: OnBytes | None = None) -> StoredObject:
        self.file.close()
        fd = os.open(self._tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        digest = sha256_file(self._tmp)
        size = self._tmp.stat().st_size
        os.replace(self._tmp, self._final)
        fsync_dir(self._final.parent)
        return StoredObject(self._name, size, digest)

    def abort(self) -> None:
        self.file.close()
        self._tmp.unlink(missing_ok=True)


class LocalStore:
    def __init__(self, location: LocalLocation) -> None:
        self.location = location
        self.root = location.path

    def uri(self, name: str | None = None) -> str:
        return self.location.uri(name)

    def _path(self, name: str) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        return inside(self.root, name)

    def read(self, name: str) -> bytes | None:
        """Ferry's own records (the manifest, the pending record), never through a symlink nor past
        MAX_MANIFEST_BYTES."""
        try:
            return read_beneath(self.root, name, MAX_MANIFEST_BYTES)
        except UnsafePathError as e:
            raise StoreError(f"{self.uri(name)}: {e}") from None

    def head(self, name: str) -> tuple[int, str | None] | None:
        try:
            fd = open_beneath(self.root, name, os.O_RDONLY | os.O_NONBLOCK)
        except (OSError, UnsafePathError):
            return None
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        return (st.st_size, None) if stat.S_ISREG(st.st_mode) else None

    def put_bytes(self, name: str, data: bytes) -> StoredObject:
        with atomic_file(self._path(name)) as f:
            f.write(data)
        return StoredObject(name, len(data), hashlib.sha256(data).hexdigest())

    def put_file(self, name: str, path, on_bytes: OnBytes | None = None,
                 expected_sha256: str | None = None) -> StoredObject:
        digest, size = hashlib.sha256(), 0
        with open(path, "rb", closefd=not isinstance(path, int)) as src, atomic_file(self._path(name)) as dst:
            while block := src.read(COPY_BLOCK):
                digest.update(block)
                dst.write(block)
                size += len(block)
                if on_bytes:
                    on_bytes(len(block))
            if expected_sha256 is not None and digest.hexdigest() != expected_sha256:
                raise StoreError(f"{name}: sha256 {digest.hexdigest()} != {expected_sha256} in the source's "
                                 f"manifest: the source changed or is damaged")
        # What is on disk now, not what passed through: re-hash (page cache) to catch a bad write.
        stored = sha256_file(self.root / name)
        if stored != digest.hexdigest():
            raise StoreError(f"{self.uri(name)}: written bytes hash to {stored}, sent {digest.hexdigest()}")
        return StoredObject(name, size, stored)

    def tensor_object(self, name: str, size_hint: int) -> LocalTensorObject:
        return LocalTensorObject(self._path(name), name)

    def delete(self, names: list[str]) -> list[str]:
        deleted = []
        for name in names:  # a name through a symlink names nothing under the root: nothing is removed
            if self.root.is_dir() and unlink_beneath(self.root, name):
                deleted.append(name)
        if deleted:
            fsync_dir(self.root)
        return deleted

    def abort_unfinished(self, names: list[str]) -> None:
        if not self.root.is_dir():
            return
        wanted = {f".{Path(n).name}{TMP_MARKER}" for n in names}
        for path in self.root.iterdir():
            if any(path.name.startswith(w) for w in wanted):
                path.unlink(missing_ok=True)
