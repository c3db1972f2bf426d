"""An artifact under an S3 prefix.

How each object is known to be stored intact before the manifest names it:

- every body is sent with Content-MD5 (the store refuses damaged parts) and
  the ETag of each part is compared with our MD5;
- after the upload, HEAD must report the size sent, and an ETag that is the
  store's MD5 of what we sent (single PUT: the MD5; multipart: MD5 of the part
  MD5s, or the whole object's MD5, as some stores report) — then the sha256
  computed while sending is the object's;
- otherwise (an opaque ETag: SSE-KMS, some stores), and always for tensorizer
  files, whose first part is final only at the end so the sha256 cannot be
  computed while sending, the object is read back with ranged GETs pinned to
  that ETag: per-part MD5s must equal those sent, and the sha256 is computed
  from the stored bytes.
"""
from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

from ..manifest import MAX_MANIFEST_BYTES, NOT_FERRYS
from .errors import StoreError
from .location import S3Location
from .objects import OnBytes, StoredObject
from .s3_client import S3Options, is_not_found, make_client
from .s3_upload import MIN_PART_SIZE, ObjectUpload, SentPart, multipart_etag, part_size_for, strip_etag
from .spool import SpoolFile

DEFAULT_PART_SIZE = 32 << 20
READ_BACK_RANGE = 8 << 20


class S3TensorObject:
    """A tensorizer file streamed into one multipart upload through a SpoolFile."""

    def __init__(self, store: "S3Store", name: str, part_size: int) -> None:
        self._store, self._name = store, name
        self._upload = ObjectUpload(store.client, store.location.bucket, store.location.key(name),
                                    store.options.concurrency, store.uri(name))
        self.file = SpoolFile(part_size, lambda index, data: self._upload.submit(index + 1, data))

    def seal(self) -> None:
        self.file.seal()

    def finish(self, on_bytes: OnBytes | None = None) -> StoredObject:
        head, rest = self.file.finish()
        size = self.file.size
        if not rest and not self._upload.started:
            etag = self._upload.put(head)
        else:
            for index, data in rest:
                self._upload.submit(index + 1, data)
            self._upload.submit(1, head)
            del head, rest
            etag = self._upload.complete()
        parts = [self._upload.parts[n] for n in sorted(self._upload.parts)]
        return self._store.confirm(self._name, size, parts, etag, sha256=None, on_bytes=on_bytes)

    def abort(self) -> None:
        self._upload.abort()


class S3Store:
    def __init__(self, location: S3Location, options: S3Options, part_size: int = DEFAULT_PART_SIZE) -> None:
        if part_size < MIN_PART_SIZE:
            raise ValueError(f"part size must be at least {MIN_PART_SIZE} bytes (S3's minimum)")
        self.location, self.options, self.part_size = location, options, part_size
        self.client = make_client(options)

    def uri(self, name: str | None = None) -> str:
        return self.location.uri(name)

    def _key(self, name: str) -> str:
        return self.location.key(name)

    # -- reads -------------------------------------------------------------------------------------
    def read_at_most(self, name: str, limit: int) -> bytes | None:
        """The object's first `limit` + 1 bytes (more than `limit`: the caller refuses it), None if absent."""
        try:
            body = self.client.get_object(Bucket=self.location.bucket, Key=self._key(name))["Body"]
            try:
                return body.read(limit + 1)
            finally:
                body.close()
        except Exception as e:
            if is_not_found(e):
                return None
            raise StoreError(f"{self.uri(name)}: read failed: {e}") from e

    def read(self, name: str) -> bytes | None:
        """Ferry's own records (the manifest, the pending record): refused past MAX_MANIFEST_BYTES."""
        data = self.read_at_most(name, MAX_MANIFEST_BYTES)
        if data is None:
            return None
        if len(data) > MAX_MANIFEST_BYTES:
            raise StoreError(f"{self.uri(name)}: more than {MAX_MANIFEST_BYTES} bytes; {NOT_FERRYS}")
        return data

    def head(self, name: str) -> tuple[int, str | None] | None:
        try:
            response = self.client.head_object(Bucket=self.location.bucket, Key=self._key(name))
        except Exception as e:
            if is_not_found(e):
                return None
            raise StoreError(f"{self.uri(name)}: HEAD failed: {e}") from e
        return response["ContentLength"], strip_etag(response.get("ETag"))

    # -- writes ------------------------------------------------------------------------------------
    def put_bytes(self, name: str, data: bytes) -> StoredObject:
        upload = ObjectUpload(self.client, self.location.bucket, self._key(name), 1, self.uri(name))
        etag = upload.put(data)
        return self.confirm(name, len(data), [upload.parts[1]], etag, sha256=hashlib.sha256(data).hexdigest(),
                            whole_md5=upload.parts[1].md5.hex())

    def put_file(self, name: str, path: Path | int, on_bytes: OnBytes | None = None,
                 expected_sha256: str | None = None) -> StoredObject:
        size = os.fstat(path).st_size if isinstance(path, int) else Path(path).stat().st_size
        part_size = part_size_for(size, self.part_size)
        upload = ObjectUpload(self.client, self.location.bucket, self._key(name), self.options.concurrency,
                              self.uri(name))
        sha256, md5 = hashlib.sha256(), hashlib.md5()
        try:
            with open(path, "rb", buffering=0, closefd=not isinstance(path, int)) as f:
                if size <= part_size:
                    data = f.read()
                    sha256.update(data)
                    md5.update(data)
                    self._check_source(name, sha256, expected_sha256)
                    etag = upload.put(data)
                else:
                    number = 0
                    while True:
                        data = bytearray(part_size)
                        n = f.readinto(data)
                        if n == 0:
                            break
                        del data[n:]
                        sha256.update(data)
                        md5.update(data)
                        number += 1
                        upload.submit(number, data)
                        if on_bytes:
                            on_bytes(n)
                    self._check_source(name, sha256, expected_sha256)
                    etag = upload.complete()
        except BaseException:
            upload.abort()
            raise
        if size <= part_size and on_bytes:
            on_bytes(size)
        parts = [upload.parts[n] for n in sorted(upload.parts)]
        return self.confirm(name, size, parts, etag, sha256=sha256.hexdigest(), whole_md5=md5.hexdigest())

    @staticmethod
    def _check_source(name: str, sha256: "hashlib._Hash", expected: str | None) -> None:
        if expected is not None and sha256.hexdigest() != expected:
            raise StoreError(f"{name}: sha256 {sha256.hexdigest()} != {expected} in the source's manifest: the "
                             f"source changed or is damaged; nothing was published")

    def tensor_object(self, name: str, size_hint: int) -> S3TensorObject:
        return S3TensorObject(self, name, part_size_for(size_hint, self.part_size))

    def delete(self, names: list[str]) -> list[str]:
        existing = [n for n in names if self.head(n) is not None]
        for start in range(0, len(existing), 1000):
            batch = existing[start:start + 1000]
            try:
                response = self.client.delete_objects(
                    Bucket=self.location.bucket,
                    Delete={"Objects": [{"Key": self._key(n)} for n in batch], "Quiet": True})
            except Exception as e:
                raise StoreError(f"{self.uri()}: delete failed: {e}") from e
            errors = response.get("Errors") or []
            if errors:
                raise StoreError(f"{self.uri()}: could not delete {errors[0].get('Key')}: "
                                 f"{errors[0].get('Code')} {errors[0].get('Message', '')}")
        return existing

    def abort_unfinished(self, names: list[str]) -> None:
        """Abort multipart uploads an interrupted run left for these keys (they cost storage)."""
        keys = {self._key(n) for n in names}
        try:
            paginator = self.client.get_paginator("list_multipart_uploads")
            for page in paginator.paginate(Bucket=self.location.bucket, Prefix=self.location.prefix + "/"):
                for upload in page.get("Uploads") or []:
                    if upload["Key"] in keys:
                        self.client.abort_multipart_upload(Bucket=self.location.bucket, Key=upload["Key"],
                                                           UploadId=upload["UploadId"])
        except Exception as e:
            if is_not_found(e):  # gofakes3 answers NoSuchUpload for a bucket that never had one
                return
            raise StoreError(f"{self.uri()}: listing or aborting unfinished uploads failed: {e}") from e

    # -- checks ------------------------------------------------------------------------------------
    def confirm(self, name: str, size: int, parts: list[SentPart], completed_etag: str, *, sha256: str | None,
                whole_md5: str | None = None, on_bytes: OnBytes | None = None) -> StoredObject:
        """Prove the object holds what was sent (see the module docstring); return its sha256 and ETag."""
        uri = self.uri(name)
        head = self.head(name)
        if head is None:
            raise StoreError(f"{uri}: missing right after its upload completed")
        stored_size, etag = head
        if stored_size != size:
            raise StoreError(f"{uri}: the store holds {stored_size} bytes, {size} were sent")
        if sum(p.size for p in parts) != size:
            raise StoreError(f"{uri}: parts of {sum(p.size for p in parts)} bytes for an object of {size}")
        ours = {multipart_etag([p.md5 for p in parts]) if len(parts) > 1 else parts[0].md5.hex()}
        if whole_md5:
            ours.add(whole_md5)
        if sha256 is not None and etag in ours:
            return StoredObject(name, size, sha256, etag)
        stored_sha256 = self._read_back(name, parts, etag, on_bytes)
        if sha256 is not None and stored_sha256 != sha256:
            raise StoreError(f"{uri}: stored bytes hash to {stored_sha256}, sent {sha256}")
        return StoredObject(name, size, stored_sha256, etag)

    def _read_back(self, name: str, parts: list[SentPart], etag: str, on_bytes: OnBytes | None) -> str:
        """Ranged GETs pinned to `etag`, hashed in order; per-part MD5s compared with those sent."""
        uri, sha256, md5 = self.uri(name), hashlib.sha256(), hashlib.md5()
        for part, start, end, data in self._stream(name, parts, etag):
            sha256.update(data)
            md5.update(data)
            if on_bytes:
                on_bytes(len(data))
            if end == part.offset + part.sent.size:
                if part.sent.md5 and md5.digest() != part.sent.md5:
                    raise StoreError(f"{uri}: part {part.sent.number} as stored (MD5 {md5.hexdigest()}) is not "
                                     f"what was sent (MD5 {part.sent.md5.hex()})")
                md5 = hashlib.md5()
        return sha256.hexdigest()

    def sha256_of(self, name: str, size: int, etag: str, on_bytes: OnBytes | None = None) -> str:
        """The sha256 of an object as stored (`ferry verify s3://...`)."""
        return self._read_back(name, [SentPart(1, size, b"", etag)], etag, on_bytes)

    def _stream(self, name: str, parts: list[SentPart], etag: str) -> Iterator[tuple["_PartAt", int, int, bytes]]:
        """The object's bytes in order, `concurrency` ranges fetched ahead of the consumer."""
        ranges = list(_ranges(parts))
        ahead = max(1, self.options.concurrency)
        with ThreadPoolExecutor(ahead, thread_name_prefix="ferry-readback") as pool:
            window = [pool.submit(self._get_range, name, start, end, etag) for _, start, end in ranges[:ahead]]
            for i, (part, start, end) in enumerate(ranges):
                data = window[i].result()
                window[i] = None
                if i + ahead < len(ranges):
                    _, s, e = ranges[i + ahead]
                    window.append(pool.submit(self._get_range, name, s, e, etag))
                yield part, start, end, data

    def _get_range(self, name: str, start: int, end: int, etag: str) -> bytes:
        if end == start:
            return b""
        try:
            response = self.client.get_object(Bucket=self.location.bucket, Key=self._key(name),
                                              Range=f"bytes={start}-{end - 1}", IfMatch=f'"{etag}"')
            data = response["Body"].read()
        except Exception as e:
            raise StoreError(f"{self.uri(name)}: reading back bytes {start}-{end - 1} failed: {e}") from e
        if strip_etag(response.get("ETag")) != etag:
            raise StoreError(f"{self.uri(name)}: changed while being read back (ETag {response.get('ETag')})")
        if len(data) != end - start:
            raise StoreError(f"{self.uri(name)}: read back {len(data)} bytes at {start}, asked for {end - start}")
        return data


class _PartAt:
    def __init__(self, sent: SentPart, offset: int) -> None:
        self.sent, self.offset = sent, offset


def _ranges(parts: list[SentPart]) -> Iterator[tuple[_PartAt, int, int]]:
    offset = 0
    for sent in parts:
        at = _PartAt(sent, offset)
        for start in range(offset, offset + sent.size, READ_BACK_RANGE):
            yield at, start, min(start + READ_BACK_RANGE, offset + sent.size)
        if sent.size == 0:
            yield at, offset, offset
        offset += sent.size

