"""Compiled state kept in S3 beside an artifact Ferry published there (compiled/s3_store.py), against the real
S3 server process (gofakes3 on loopback): byte for byte, every damaged or foreign entry refused, a stale
entry replaced and its tar deleted, the object's prefix deleted and nothing else. Shares the session's S3
server (tests/worker/conftest.py); each test makes its own bucket and small cache in tmp_path.
"""
from __future__ import annotations

import json

import pytest

from ferry_worker.cli import main
from ferry_worker.compiled.s3_store import delete_all, harvest_into, restore_from
from ferry_worker.compiled.state import MANIFEST, Limits
from test_compiled_state import DEVICE, KEY, cache, tree


def store_of(bucket: str) -> str:
    return f"s3://{bucket}/models/ml/llama/0b7e/compiled"


def keys(client, bucket: str, prefix: str = "") -> list[str]:
    return sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents") or [])


@pytest.fixture
def published(tmp_path, s3_env, s3_server, bucket):
    src = cache(tmp_path / "cold")
    outcome = harvest_into(src, store_of(bucket), KEY, DEVICE)
    assert outcome.state == "published" and outcome.files == 4, outcome
    return src, store_of(bucket), s3_server.client(), bucket


def entry(bucket: str) -> str:
    return f"models/ml/llama/0b7e/compiled/{KEY}/{DEVICE}"


def test_a_harvest_into_s3_restores_byte_for_byte_and_only_once(tmp_path, published):
    src, store, client, bucket = published
    (tar,) = [k for k in keys(client, bucket) if k.endswith(".tar")]
    assert keys(client, bucket) == sorted([tar, f"{entry(bucket)}/{MANIFEST}"])
    manifest = json.loads(client.get_object(Bucket=bucket, Key=f"{entry(bucket)}/{MANIFEST}")["Body"].read())
    assert tar.endswith(manifest["state"]) and manifest["state"] == f"state-{manifest['sha256'][7:23]}.tar"
    assert harvest_into(src, store, KEY, DEVICE).state == "present"  # the first harvest wins
    dest = tmp_path / "dest"
    dest.mkdir()
    outcome = restore_from(store, KEY, DEVICE, dest)
    assert outcome.state == "restored" and tree(dest) == tree(src), outcome
    assert restore_from(store, KEY, "cpu-ffffffffffffffff", tmp_path).state == "absent"


def test_a_flipped_byte_in_the_stored_tar_restores_nothing_and_the_next_harvest_replaces_it(tmp_path, published):
    src, store, client, bucket = published
    manifest = json.loads(client.get_object(Bucket=bucket, Key=f"{entry(bucket)}/{MANIFEST}")["Body"].read())
    tar_key = f"{entry(bucket)}/{manifest['state']}"
    data = bytearray(client.get_object(Bucket=bucket, Key=tar_key)["Body"].read())
    data[len(data) // 2] ^= 0xFF
    client.put_object(Bucket=bucket, Key=tar_key, Body=bytes(data))  # a new ETag: not the recorded object
    dest = tmp_path / "dest"
    dest.mkdir()
    outcome = restore_from(store, KEY, DEVICE, dest)
    assert outcome.state == "refused" and not list(dest.iterdir()), outcome
    again = harvest_into(src, store, KEY, DEVICE)
    assert again.state == "published" and "replaced the entry there" in again.reason, again
    assert restore_from(store, KEY, DEVICE, dest).state == "restored"


def test_the_same_bytes_under_the_recorded_etag_but_another_sha256_are_refused(tmp_path, published):
    """A manifest that records the tar's real ETag but a digest the bytes do not have: the hash decides."""
    src, store, client, bucket = published
    key = f"{entry(bucket)}/{MANIFEST}"
    manifest = json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    manifest["sha256"] = "sha256:" + manifest["sha256"][7:23] + "0" * 48
    client.put_object(Bucket=bucket, Key=key, Body=json.dumps(manifest).encode())
    dest = tmp_path / "dest"
    dest.mkdir()
    outcome = restore_from(store, KEY, DEVICE, dest)
    assert outcome.state == "refused" and "sha256" in outcome.reason and not list(dest.iterdir()), outcome


@pytest.mark.parametrize("change", [
    {"state": "../../other/state-0000000000000000.tar"},
    {"state": "state-0000000000000000.tar"},  # not the tar its sha256 names
    {"etag": ""},
    {"key": "f" * 32},
    {"format": "something-else"},
])
def test_a_foreign_or_malformed_manifest_is_refused(tmp_path, published, change):
    src, store, client, bucket = published
    key = f"{entry(bucket)}/{MANIFEST}"
    manifest = json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    client.put_object(Bucket=bucket, Key=key, Body=json.dumps({**manifest, **change}).encode())
    dest = tmp_path / "dest"
    dest.mkdir()
    outcome = restore_from(store, KEY, DEVICE, dest)
    assert outcome.state == "refused" and not list(dest.iterdir()), outcome


def test_a_missing_tar_is_refused_and_replaced(tmp_path, published):
    src, store, client, bucket = published
    (tar,) = [k for k in keys(client, bucket) if k.endswith(".tar")]
    client.delete_object(Bucket=bucket, Key=tar)
    dest = tmp_path / "dest"
    dest.mkdir()
    assert restore_from(store, KEY, DEVICE, dest).state == "refused"
    assert harvest_into(src, store, KEY, DEVICE).state == "published"


def test_a_stale_entry_is_replaced_and_its_tar_deleted(tmp_path, published):
    """vLLM compiled under a cache key the entry lacks: the entry is replaced, and the tar it named goes."""
    src, store, client, bucket = published
    (old,) = [k for k in keys(client, bucket) if k.endswith(".tar")]
    (src / "torch_compile_cache" / "f00dfeed11").mkdir()
    (src / "torch_compile_cache" / "f00dfeed11" / "graph.py").write_text("g")
    outcome = harvest_into(src, store, KEY, DEVICE)
    assert outcome.state == "published" and "f00dfeed11" in outcome.reason, outcome
    tars = [k for k in keys(client, bucket) if k.endswith(".tar")]
    assert len(tars) == 1 and tars != [old]
    assert harvest_into(src, store, KEY, DEVICE).state == "present"


def test_the_limits_fail_closed(tmp_path, s3_env, bucket):
    with pytest.raises(Exception, match="more than 2 entries"):
        harvest_into(cache(tmp_path / "big"), store_of(bucket), KEY, DEVICE, Limits(files=2))


def test_deleting_an_objects_compiled_state_deletes_what_harvests_wrote_and_nothing_else(tmp_path, published, caplog):
    src, store, client, bucket = published
    client.put_object(Bucket=bucket, Key="models/ml/llama/0b7e/abc123/model.safetensors", Body=b"weights")
    client.put_object(Bucket=bucket, Key="models/ml/llama/0b7e/compiled-other/x", Body=b"x")
    client.put_object(Bucket=bucket, Key="models/ml/llama/0b7e/compiled/notes.txt", Body=b"a user's")
    upload = client.create_multipart_upload(Bucket=bucket, Key=f"{entry(bucket)}/state-0123456789abcdef.tar")
    assert main(["compiled-delete", "--store", store]) == 0
    assert keys(client, bucket) == ["models/ml/llama/0b7e/abc123/model.safetensors",
                                    "models/ml/llama/0b7e/compiled-other/x",
                                    "models/ml/llama/0b7e/compiled/notes.txt"]  # not a harvest's: left
    uploads = client.list_multipart_uploads(Bucket=bucket).get("Uploads") or []
    assert upload["UploadId"] not in [u["UploadId"] for u in uploads]
    for refused in ("s3://" + bucket + "/models/ml/llama/0b7e", "s3://" + bucket + "/compiled-x",
                    str(tmp_path / "compiled")):
        with pytest.raises(ValueError, match="ending in /compiled"):
            delete_all(refused)


def test_a_manifest_past_its_size_or_with_odd_vllm_keys_is_damage_and_replaced(tmp_path, published):
    """Read bounded (64 KiB, as on the claim), and anything but a list of strings for vllmKeys is an entry to
    replace, never a harvest that fails for good."""
    src, store, client, bucket = published
    key = f"{entry(bucket)}/{MANIFEST}"
    manifest = json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    for body in (json.dumps({**manifest, "pad": "x" * (70 << 10)}), json.dumps({**manifest, "vllmKeys": [["x"]]})):
        client.put_object(Bucket=bucket, Key=key, Body=body.encode())
        outcome = harvest_into(src, store, KEY, DEVICE)
        assert outcome.state == "published" and "replaced" in outcome.reason, outcome


def test_a_store_that_cannot_be_read_replaces_nothing(tmp_path, published, monkeypatch):
    """A failed read of the manifest (the store unreachable) is not a damaged entry: the harvest ends without
    writing, and the entry stays."""
    from ferry_worker.tensorize.errors import StoreError

    src, store, client, bucket = published
    before = keys(client, bucket)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(StoreError):
        harvest_into(src, store, KEY, DEVICE)
    monkeypatch.undo()
    assert keys(client, bucket) == before


def test_a_publish_sweeps_the_tars_no_manifest_names_once_they_are_old(tmp_path, published, monkeypatch):
    """Two pods harvesting one entry at once: the loser's tar is named by no manifest. The next publish deletes
    such tars once older than ORPHAN_AGE (a younger one may be an upload in flight); the entry's own stays."""
    from datetime import timedelta

    from ferry_worker.compiled import s3_store

    src, store, client, bucket = published
    orphan = f"{entry(bucket)}/state-00000000000000ff.tar"
    client.put_object(Bucket=bucket, Key=orphan, Body=b"a lost race")
    (src / "torch_compile_cache" / "f00dfeed11").mkdir()  # a stale entry: the next harvest publishes
    (src / "torch_compile_cache" / "f00dfeed11" / "graph.py").write_text("g")
    monkeypatch.setattr(s3_store, "ORPHAN_AGE", timedelta(hours=1))
    assert harvest_into(src, store, KEY, DEVICE).state == "published"
    assert orphan in keys(client, bucket)  # young: left
    (src / "torch_compile_cache" / "f00dfeed12").mkdir()
    (src / "torch_compile_cache" / "f00dfeed12" / "graph.py").write_text("g")
    monkeypatch.setattr(s3_store, "ORPHAN_AGE", timedelta(seconds=-5))
    assert harvest_into(src, store, KEY, DEVICE).state == "published"
    tars = [k for k in keys(client, bucket) if k.endswith(".tar")]
    assert orphan not in tars and len(tars) == 1
    dest = tmp_path / "dest"
    dest.mkdir()
    assert restore_from(store, KEY, DEVICE, dest).state == "restored"
