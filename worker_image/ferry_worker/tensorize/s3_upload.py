"""One object uploaded to S3: a single PUT, or a multipart upload whose parts
may arrive in any order (the first part last, for tensorizer files).

Each body goes with Content-MD5, so the store rejects a part damaged on the
way; the ETag it answers is compared with our MD5. At most `concurrency`
parts are in flight: `submit` blocks beyond that, which is what bounds memory.
A failure aborts the multipart upload (best effort: the store may be down),
so no object appears; the error names the object and the part.
"""
from __future__ import annotations

import base64
import hashlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .errors import StoreError

MIN_PART_SIZE = 5 << 20  # S3: every part but the last
MAX_PARTS = 10_000


@dataclass(frozen=True)
class SentPart:
    number: int
    size: int
    md5: bytes
    etag: str


def content_md5(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


def multipart_etag(md5s: list[bytes]) -> str:
    """The ETag S3 gives a multipart object: MD5 of the parts' MD5s, dash, count."""
    return f"{hashlib.md5(b''.join(md5s)).hexdigest()}-{len(md5s)}"


def part_size_for(size_hint: int, part_size: int) -> int:
    """`part_size`, or larger (whole MiB) when the object would need more than 10,000 parts."""
    needed = -(-size_hint // (MAX_PARTS - 100))
    return max(part_size, MIN_PART_SIZE, -(-needed // (1 << 20)) * (1 << 20))


def strip_etag(etag: str | None) -> str:
    return (etag or "").strip('"')


class ObjectUpload:
    def __init__(self, client: Any, bucket: str, key: str, concurrency: int, uri: str) -> None:
        self._client, self._bucket, self._key, self.uri = client, bucket, key, uri
        self._slots = threading.BoundedSemaphore(concurrency)
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="ferry-upload")
        self._lock = threading.Lock()
        self._upload_id: str | None = None
        self._futures: list[Future] = []
        self.parts: dict[int, SentPart] = {}
        self.uploaded_bytes = 0

    # -- multipart ---------------------------------------------------------------------------------
    def submit(self, number: int, data: bytearray | bytes) -> None:
        """Upload part `number` (1-based) in the background; blocks while `concurrency` are in flight."""
        self._raise_first_failure()
        if self._upload_id is None:
            self._upload_id = self._call("starting the multipart upload", self._client.create_multipart_upload,
                                         Bucket=self._bucket, Key=self._key,
                                         ContentType="application/octet-stream")["UploadId"]
        self._slots.acquire()
        try:
            future = self._pool.submit(self._put_part, number, data)
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(lambda _: self._slots.release())
        self._futures.append(future)

    def _put_part(self, number: int, data: bytearray | bytes) -> None:
        md5 = hashlib.md5(data).digest()
        response = self._call(f"uploading part {number}", self._client.upload_part, Bucket=self._bucket,
                              Key=self._key, UploadId=self._upload_id, PartNumber=number, Body=data, ContentMD5=content_md5(md5))
        etag = strip_etag(response.get("ETag"))
        if len(etag) == 32 and etag != md5.hex():
            raise StoreError(f"{self.uri}: part {number}: the store's ETag {etag} is not the MD5 {md5.hex()} "
                             f"of what was sent")
        with self._lock:
            self.parts[number] = SentPart(number, len(data), md5, response.get("ETag", ""))
            self.uploaded_bytes += len(data)

    def complete(self) -> str:
        """Wait for every part, then assemble them in order; returns the store's ETag."""
        for future in self._futures:
            future.exception()
        self._raise_first_failure()
        parts = [self.parts[n] for n in sorted(self.parts)]
        numbers = [p.number for p in parts]
        if numbers != list(range(1, len(parts) + 1)):
            raise StoreError(f"{self.uri}: parts {numbers} do not cover the object")
        response = self._call("completing the multipart upload", self._client.complete_multipart_upload,
                              Bucket=self._bucket, Key=self._key, UploadId=self._upload_id,
                              MultipartUpload={"Parts": [{"ETag": p.etag, "PartNumber": p.number} for p in parts]})
        self._upload_id = None
        self._pool.shutdown()
        return strip_etag(response.get("ETag"))

    @property
    def started(self) -> bool:
        return self._upload_id is not None

    # -- single PUT --------------------------------------------------------------------------------
    def put(self, data: bytes | bytearray) -> str:
        md5 = hashlib.md5(data).digest()
        response = self._call("uploading", self._client.put_object, Bucket=self._bucket, Key=self._key,
                              Body=data, ContentMD5=content_md5(md5),
                              ContentType="application/octet-stream")
        self.parts[1] = SentPart(1, len(data), md5, response.get("ETag", ""))
        self.uploaded_bytes += len(data)
        self._pool.shutdown()
        return strip_etag(response.get("ETag"))

    def abort(self) -> None:
        """Stop: cancel queued parts, abort the multipart upload if one was started (errors ignored)."""
        for future in self._futures:
            future.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._upload_id is not None:
            try:
                self._client.abort_multipart_upload(Bucket=self._bucket, Key=self._key, UploadId=self._upload_id)
            except Exception:  # noqa: BLE001 - the store may be what failed
                pass
            self._upload_id = None

    def _raise_first_failure(self) -> None:
        for future in self._futures:
            if future.done() and not future.cancelled() and future.exception() is not None:
                raise future.exception()

    def _call(self, what: str, method, **kwargs):
        try:
            return method(**kwargs)
        except StoreError:
            raise
        except Exception as e:  # botocore has already retried what can be retried
            raise StoreError(f"{self.uri}: {what} failed: {e}") from e
