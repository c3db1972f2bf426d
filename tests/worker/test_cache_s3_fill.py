"""A node cache fill from S3: `ferry cache fill-slot --source s3://...` into a
store's slot, against the real S3-compatible server process (gofakes3 on
loopback). The artifact is real `ferry shard` output published by `ferry
publish`, as the operator's steps publish one. The agent's side (adopt:
verify every byte, publish) is the store's own. On the real node, through
the operator: tests/node/test_node_cache_on_node.py."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from ferry_worker.cache import s3_source
from ferry_worker.cache.fill_slot import fill_slot
from ferry_worker.cache.store import CacheError, CacheStore, Watermarks, cache_key
from ferry_worker.cli import main
from ferry_worker.manifest import MANIFEST_NAME, IntegrityError, Manifest

BIG = Watermarks(high=1 << 40, low=1 << 39)


def published(s3_server, bucket: str, artifact: Path, prefix: str) -> tuple[str, str, Manifest]:
    """(its URI, its digest, its manifest) once `ferry publish` has put `artifact` under `prefix`."""
    uri = f"s3://{bucket}/{prefix}"
    assert main(["publish", "--source", str(artifact), "--output", uri]) == 0
    data = s3_server.client().get_object(Bucket=bucket, Key=f"{prefix}/{MANIFEST_NAME}")["Body"].read()
    return uri, "sha256:" + hashlib.sha256(data).hexdigest(), Manifest.from_json(data)


def test_a_slot_filled_from_s3_is_adopted_byte_for_byte(s3_server, s3_env, bucket, cache_artifacts, tmp_path):
    artifact = cache_artifacts["a0"]
    uri, digest, manifest = published(s3_server, bucket, artifact, "sharded/a0")
    assert manifest.extra.get("etags")  # each object pinned to what was published
    store = CacheStore(tmp_path / "cache", BIG)
    key = cache_key(digest)
    slot = store.slot(key, manifest.total_bytes)
    said = fill_slot(slot, uri, digest, None)
    assert f"filled {len(manifest.files)} files, {manifest.total_bytes} bytes" in said
    entry = store.adopt(key, manifest.total_bytes)  # the agent verifies every byte again
    assert entry == store.entry(key)
    for f in manifest.files:
        assert (entry / f.path).read_bytes() == (artifact / f.path).read_bytes(), f.path


def test_only_the_ranks_asked_for_and_a_killed_fill_resumes(s3_server, s3_env, bucket, cache_artifacts, tmp_path):
    uri, digest, manifest = published(s3_server, bucket, cache_artifacts["a1"], "sharded/a1")
    slot = tmp_path / "slot"
    slot.mkdir()
    fill_slot(slot, uri, digest, [1])
    files = {p.relative_to(slot).as_posix() for p in slot.rglob("*") if p.is_file()}
    assert "model-rank-1-part-0.safetensors" in files and "model-rank-0-part-0.safetensors" not in files
    # A fill killed after its first files: what is whole and verified stays; the rest is fetched.
    (slot / "model-rank-1-part-0.safetensors").unlink()
    (slot / MANIFEST_NAME).unlink()
    assert "filled 1 files" in fill_slot(slot, uri, digest, [1])


def test_a_changed_object_or_manifest_fails_the_fill_naming_it(s3_server, s3_env, bucket, cache_artifacts, tmp_path,
                                                               monkeypatch):
    uri, digest, manifest = published(s3_server, bucket, cache_artifacts["a2"], "sharded/a2")
    victim = "model-rank-0-part-0.safetensors"
    original = (cache_artifacts["a2"] / victim).read_bytes()
    flipped = original[:-1] + bytes([original[-1] ^ 0x01])  # the same size: only the content tells
    s3_server.client().put_object(Bucket=bucket, Key=f"sharded/a2/{victim}", Body=flipped)
    slot = tmp_path / "slot"
    slot.mkdir()
    with pytest.raises(IntegrityError, match=f"{victim}: .* changed since it was published"):
        fill_slot(slot, uri, digest, None)
    assert not (slot / victim).exists() and not (slot / MANIFEST_NAME).exists()  # nothing of it kept
    # Replaced between its HEAD and its GET (the HEAD passes here): the bytes themselves are refused.
    monkeypatch.setattr(s3_source, "_check_head", lambda *a: None)
    with pytest.raises(IntegrityError, match=f"{victim}: sha256 [0-9a-f]+ != "):
        fill_slot(slot, uri, digest, None)
    assert not (slot / victim).exists() and not (slot / MANIFEST_NAME).exists()
    assert not [p.name for p in slot.iterdir() if victim in p.name]  # nor its temporary file
    with pytest.raises(CacheError, match="changed under its record"):
        fill_slot(slot, uri, "sha256:" + "0" * 64, None)
    with pytest.raises(CacheError, match="no ferry-manifest.json"):
        fill_slot(slot, f"s3://{bucket}/nothing-here", digest, None)
