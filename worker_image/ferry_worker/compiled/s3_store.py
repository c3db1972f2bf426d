"""Compiled state kept in S3, beside an artifact Ferry published there (`<storage.s3.uri>/<ns>/<name>/<uid>/
compiled`), with the same integrity rules as the claim's store (state.py):

    <store>/<key>/<entry>/state-<sha16>.tar   the cache root as one tar, named by its digest
    <store>/<key>/<entry>/compiled.json       the manifest, written last: it names the tar (`state`) and
                                              records the ETag the store gave it (`etag`)

S3 has no rename, so the manifest is the commit: it is written only once its tar is stored and confirmed
(ETag against the parts' MD5s, else read back), and it always names the bytes it describes. A restore reads
only the tar the manifest names, pinned to its ETag (If-Match), and streams it once through the same checked
extraction as the claim's (state.extract_verified): hashed as it streams, every member checked, nothing kept
unless all of it matches. An entry whose tar is not the object the manifest recorded, or that lacks a vLLM
cache key vLLM compiled under, is replaced by the next harvest, and the tar it named is deleted.

Everything read back is untrusted, as on the claim: the manifest is bounded and checked, the tar's name must be
the one its digest gives.
"""
from __future__ import annotations

import json
import logging
import re
import tempfile
from datetime import datetime, timedelta, timezone
from pathlib import Path

from ..tensorize.errors import StoreError
from ..tensorize.location import S3Location, parse_location
from ..tensorize.s3_client import S3Options, is_not_found
from ..tensorize.s3_store import S3Store
from .state import (FORMAT, MANIFEST, MAX_MANIFEST, CompiledStateError, Limits, Outcome, checked_name,
                    extract_verified, harvest, lacking, manifest_of, restore, vllm_keys, write_tar)

log = logging.getLogger("ferry")

STORE_SUFFIX = "/compiled"  # the only prefixes `ferry compiled-delete` deletes
# A tar no manifest names, older than this, is one a harvest that lost a race left: swept by the next publish.
ORPHAN_AGE = timedelta(hours=1)
_STATE_NAME = re.compile(r"^state-[0-9a-f]{16}\.tar$")
_ETAG = re.compile(r"^[0-9A-Za-z-]{1,128}$")  # an S3 ETag as the store gives it, quotes stripped
# What Ferry writes under a store prefix, and so all that `ferry compiled-delete` deletes.
_OURS = re.compile(r"^[0-9a-z][0-9a-z-]{0,79}/[0-9a-z][0-9a-z-]{0,79}/(compiled\.json|state-[0-9a-f]{16}\.tar)$")


def is_s3(store: str | Path) -> bool:
    return str(store).startswith("s3://")


def _entry_store(store: str, key: str, entry: str) -> S3Store:
    checked_name(key, "key"), checked_name(entry, "device")
    location = parse_location(f"{store.rstrip('/')}/{key}/{entry}")
    assert isinstance(location, S3Location)
    return S3Store(location, S3Options())


def _read_manifest(s3: S3Store, key: str, entry: str, limits: Limits) -> dict | None:
    """The entry's manifest, checked (CompiledStateError if it is not one), None if there is none; a store
    that cannot be read raises StoreError (which is not a damaged entry: nothing is replaced for it)."""
    raw = s3.read_at_most(MANIFEST, MAX_MANIFEST)
    if raw is None:
        return None
    if len(raw) > MAX_MANIFEST:
        raise CompiledStateError(f"{MANIFEST} is longer than {MAX_MANIFEST} bytes")
    m = manifest_of(raw, key, entry, limits)
    state, etag = m.get("state"), m.get("etag")
    if not isinstance(state, str) or not _STATE_NAME.match(state) or state[6:22] != m["sha256"][7:23]:
        raise CompiledStateError(f"{MANIFEST}: state {str(state)[:80]!r} is not the tar its sha256 names")
    if not isinstance(etag, str) or not _ETAG.match(etag):
        raise CompiledStateError(f"{MANIFEST}: etag {str(etag)[:80]!r} is not an ETag")
    return m


def _problem(s3: S3Store, m: dict, keys: list[str]) -> str:
    """Why an entry should be replaced ("" if it holds): its tar is not what the manifest recorded, or it lacks
    a vLLM cache key vLLM compiled under."""
    try:
        head = s3.head(m["state"])
    except StoreError as e:
        return str(e)
    if head != (m["bytes"], m["etag"]):
        return f"{m['state']} is not the object its manifest recorded"
    return lacking(m, keys)


def harvest_s3(cache_root: Path, store: str, key: str, entry: str, limits: Limits = Limits()) -> Outcome:
    """Publish `cache_root` as <store>/<key>/<entry> unless an intact entry holds every vLLM key it has. The tar
    is packed in TMPDIR (the pod's scratch emptyDir) and uploaded before the manifest that names it."""
    s3 = _entry_store(store, key, entry)
    replaced, old = "", None
    try:  # a StoreError (the store unreachable) ends the harvest: nothing is replaced on a failed read
        old = _read_manifest(s3, key, entry, limits)
        problem = _problem(s3, old, vllm_keys(cache_root)) if old else ""
    except CompiledStateError as e:
        problem = str(e)
    if old is not None and not problem:
        return Outcome("present", f"{key}/{entry} was published before")
    if problem:
        replaced = f"; replaced the entry there ({problem})"
    with tempfile.TemporaryDirectory(prefix="ferry-compiled-") as scratch:
        tar = Path(scratch) / "state.tar"
        digest, size, files, content = write_tar(cache_root, tar, limits)
        if not files:
            return Outcome("absent", f"{cache_root} holds no file: vLLM compiled nothing to keep")
        name = f"state-{digest[7:23]}.tar"
        stored = s3.put_file(name, tar, expected_sha256=digest[7:])
    manifest = {"format": FORMAT, "key": key, "device": entry, "sha256": digest, "bytes": size,
                "files": files, "contentBytes": content, "vllmKeys": vllm_keys(cache_root), "state": name,
                "etag": stored.etag}
    s3.put_bytes(MANIFEST, json.dumps(manifest, sort_keys=True).encode())
    if old is not None and isinstance(old.get("state"), str) and old["state"] != name \
            and _STATE_NAME.match(old["state"]):
        s3.delete([old["state"]])
    try:
        now = _read_manifest(s3, key, entry, limits)
    except (CompiledStateError, StoreError):
        now = None  # not known: ours may be the entry, so it stays
    if now is not None and now.get("state") != name:  # another pod's manifest landed after ours: its tar is
        s3.delete([name])                              # the entry, ours would only cost storage
        return Outcome("present", f"{key}/{entry} was published by another pod")
    _sweep(s3, name)
    return Outcome("published", f"{files} files, {size} bytes as {s3.uri()}{replaced}", files, size)


def _sweep(s3: S3Store, keep: str) -> None:
    """Delete the entry's tars that no manifest names and that are older than ORPHAN_AGE (a harvest that lost
    a race to another pod's left it; a younger one may be an upload in flight). Best effort."""
    cutoff = datetime.now(timezone.utc) - ORPHAN_AGE
    try:
        listed = s3.client.list_objects_v2(Bucket=s3.location.bucket, Prefix=s3.location.prefix + "/")
        names = [o["Key"].rsplit("/", 1)[-1] for o in listed.get("Contents") or []
                 if o.get("LastModified") and o["LastModified"] < cutoff]
        s3.delete([n for n in names if _STATE_NAME.match(n) and n != keep])
    except Exception as e:  # noqa: BLE001 - an orphan costs storage, not correctness
        log.warning("could not sweep %s: %s", s3.uri(), e)


def restore_s3(store: str, key: str, entry: str, dest: Path, limits: Limits = Limits()) -> Outcome:
    """Restore <store>/<key>/<entry> into `dest` once verified in full; on any mismatch nothing is kept."""
    where = f"{key}/{entry}"
    s3 = _entry_store(store, key, entry)
    try:
        m = _read_manifest(s3, key, entry, limits)
    except (CompiledStateError, StoreError) as e:
        return Outcome("refused", f"{where} failed verification and is not used ({e}): vLLM compiles afresh")
    if m is None:
        return Outcome("absent", f"none for this configuration and device ({where}) yet: vLLM compiles, and the "
                                 f"first pod to turn Ready keeps what it compiled")
    held = list(dest.iterdir()) if dest.is_dir() else None
    if held is None or held:
        return Outcome("refused", f"{dest} is not an empty directory; nothing restored over it")
    try:
        response = s3.client.get_object(Bucket=s3.location.bucket, Key=s3.location.key(m["state"]),
                                        IfMatch=f'"{m["etag"]}"')
        if response.get("ContentLength") != m["bytes"]:
            raise CompiledStateError(f"{m['state']} holds {response.get('ContentLength')} bytes, its manifest "
                                     f"says {m['bytes']}")
        body = response["Body"]
        try:
            files, size = extract_verified(body, dest, m, limits)
        finally:
            body.close()
    except Exception as e:  # noqa: BLE001 - a store error, a changed object, a bad tar: the pod compiles
        what = "is gone" if is_not_found(e) else f"failed verification and is not used ({e})"
        return Outcome("refused", f"{where} {what}: vLLM compiles afresh")
    return Outcome("restored", f"{files} files, {size} bytes from {s3.uri()}, verified", files, size)


def delete_all(store: str) -> int:
    """Delete what harvests wrote under the store prefix (an object's whole compiled state: <key>/<entry>/
    compiled.json and state-<sha16>.tar, nothing else) and abort their unfinished uploads; only a prefix ending
    in /compiled is accepted. The number of objects deleted."""
    location = parse_location(store)
    if not isinstance(location, S3Location) or not ("/" + location.prefix).endswith(STORE_SUFFIX):
        raise ValueError(f"--store {store!r}: only an s3:// prefix ending in {STORE_SUFFIX} (an object's "
                         f"compiled state) is deleted")
    s3 = S3Store(location, S3Options())
    names = []
    for page in s3.client.get_paginator("list_objects_v2").paginate(Bucket=location.bucket,
                                                                     Prefix=location.prefix + "/"):
        names += [o["Key"][len(location.prefix) + 1:] for o in page.get("Contents") or []]
    deleted = s3.delete([n for n in names if _OURS.match(n)])  # only what a harvest writes
    try:
        uploads = s3.client.get_paginator("list_multipart_uploads")
        for page in uploads.paginate(Bucket=location.bucket, Prefix=location.prefix + "/"):
            for upload in page.get("Uploads") or []:
                if _OURS.match(upload["Key"][len(location.prefix) + 1:]):
                    s3.client.abort_multipart_upload(Bucket=location.bucket, Key=upload["Key"],
                                                     UploadId=upload["UploadId"])
    except Exception as e:  # noqa: BLE001 - an unfinished upload costs storage (a lifecycle rule ends it)
        if not is_not_found(e):  # gofakes3 answers NoSuchUpload for a bucket that never had one
            log.warning("%s: unfinished uploads not aborted: %s", store, e)
    return len(deleted)


def harvest_into(cache_root: Path, store: str, key: str, entry: str, limits: Limits = Limits()) -> Outcome:
    """A harvest into either store: an s3:// prefix, else a directory of the claim."""
    if is_s3(store):
        return harvest_s3(cache_root, store, key, entry, limits)
    return harvest(cache_root, Path(store), key, entry, limits)


def restore_from(store: str, key: str, entry: str, dest: Path, limits: Limits = Limits()) -> Outcome:
    """A restore from either store: an s3:// prefix, else a directory of the claim."""
    if is_s3(store):
        return restore_s3(store, key, entry, dest, limits)
    return restore(Path(store), key, entry, dest, limits)
