"""`ferry fetch` from a real S3-compatible server process on loopback (gofakes3, see conftest.py)."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
from awscrt import checksums

from checkpoint_files import llama3_like, raw_safetensors, safetensors_blob
from fetch_support import run_ferry, upload_tree
from ferry_worker.fetch.journal import JOURNAL_NAME
from ferry_worker.fetch.run import FetchRequest, fetch, fetch_listed
from ferry_worker.manifest import MANIFEST_NAME, partial_name, read_manifest, verify
from ferry_worker.paths import UnsafePathError
from ferry_worker.sources import SourceError
from ferry_worker.sources.s3 import S3Source, s3_client

MiB = 1 << 20


def test_cli_fetch_with_parallel_ranged_parts(s3_server, s3_env, bucket: str, tmp_path: Path) -> None:
    repo = llama3_like()
    upload_tree(s3_server.client(), bucket, "models/llama-3", repo)
    upload_tree(s3_server.client(), bucket, "models/llama-3-70b", {"config.json": b"{}"})  # a sibling prefix
    out = tmp_path / "out"
    result = run_ferry("fetch", "--source", f"s3://{bucket}/models/llama-3", "--output", str(out),
                       "--part-size", "16Ki", "--concurrency", "4", env=s3_env)
    assert result.returncode == 0, result.stderr
    manifest = read_manifest(out)
    assert {f.path for f in manifest.files} == {
        "config.json", "generation_config.json", "special_tokens_map.json", "tokenizer.json",
        "tokenizer_config.json", "model.safetensors.index.json",
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    for f in manifest.files:
        assert (out / f.path).read_bytes() == repo[f.path]
        assert f.sha256 == hashlib.sha256(repo[f.path]).hexdigest()
    assert manifest.source == f"s3://{bucket}/models/llama-3"
    verify(out)


def test_content_check_uses_what_the_store_advertises(s3_server, s3_env, bucket: str, tmp_path: Path) -> None:
    data = os.urandom(70_000)
    client = s3_server.client()
    client.put_object(Bucket=bucket, Key="m/sha.bin", Body=data, ChecksumAlgorithm="SHA256")
    client.put_object(Bucket=bucket, Key="m/crc.bin", Body=data)  # botocore's default: CRC32
    client.put_object(Bucket=bucket, Key="m/crc64.bin", Body=data, ChecksumAlgorithm="CRC64NVME")
    s3_server.client(request_checksum_calculation="when_required").put_object(Bucket=bucket, Key="m/md5.bin", Body=data)
    source = S3Source.from_uri(f"s3://{bucket}/m", 4)
    files = {f.path: source.describe(f) for f in source.list_files()}
    assert (files["sha.bin"].sha256, files["sha.bin"].digests) == (hashlib.sha256(data).hexdigest(), {})
    assert files["crc.bin"].digests == {"crc32": f"{zlib.crc32(data):08x}"}
    assert files["crc64.bin"].digests == {"crc64nvme": f"{checksums.crc64nvme(data):016x}"}
    assert files["md5.bin"].digests == {"md5": hashlib.md5(data).hexdigest()}
    # and each of them is what the fetch then checks the content against
    out = tmp_path / "out"
    fetch(FetchRequest(source=f"s3://{bucket}/m", output=out, allow_patterns=["*.bin"]))
    assert {f.sha256 for f in read_manifest(out).files} == {hashlib.sha256(data).hexdigest()}


def counted_source(uri: str) -> tuple[S3Source, list[str]]:
    """An S3Source whose client records the name of every S3 operation it sends."""
    client = s3_client(4)
    operations: list[str] = []
    client.meta.events.register("before-call.s3", lambda model, **_: operations.append(model.name))
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    return S3Source(bucket, prefix.rstrip("/") + "/", uri, client), operations


def test_listing_sends_no_head_and_only_fetched_files_are_headed(s3_server, s3_env, bucket: str,
                                                                  tmp_path: Path) -> None:
    repo = llama3_like()
    # Training leftovers the selection drops: a hostile prefix could hold millions.
    leftovers = {f"checkpoint-{i}/optimizer.pt": b"x" for i in range(40)}
    upload_tree(s3_server.client(), bucket, "m", {**repo, **leftovers})
    source, operations = counted_source(f"s3://{bucket}/m")
    listing = source.list_files()
    assert operations == ["ListObjectsV2"]
    assert len(listing) == len(repo) + len(leftovers)
    assert {f.path: (f.size, f.version) for f in listing}["config.json"][0] == len(repo["config.json"])
    assert all(f.sha256 is None and not f.digests for f in listing)  # content checks come with the transfer

    fetch_listed(FetchRequest(source=source.uri, output=tmp_path / "out"), source, listing)
    fetched = read_manifest(tmp_path / "out").files
    assert len(fetched) == 8  # of the repository's 14 files (no original/, no .bin copies)
    assert operations.count("HeadObject") == len(fetched)  # one per file transferred, none for the rest
    assert operations.count("ListObjectsV2") == 1


def test_object_overwritten_after_listing_is_refused(s3_server, s3_env, bucket: str, tmp_path: Path) -> None:
    repo = llama3_like()
    client = s3_server.client()
    upload_tree(client, bucket, "llama", repo)
    source = S3Source.from_uri(f"s3://{bucket}/llama", 4)
    listing = source.list_files()
    flipped = bytearray(repo["model-00001-of-00002.safetensors"])
    flipped[-1] ^= 0x01
    client.put_object(Bucket=bucket, Key="llama/model-00001-of-00002.safetensors", Body=bytes(flipped))
    out = tmp_path / "out"
    with pytest.raises(SourceError, match=r"model-00001-of-00002\.safetensors changed since it was listed"):
        fetch_listed(FetchRequest(source=source.uri, output=out), source, listing)
    assert not (out / MANIFEST_NAME).exists()
    assert not (out / "model-00001-of-00002.safetensors").exists()


@pytest.mark.parametrize("checksum", ["crc32", "md5"])
def test_bitrot_behind_an_unchanged_etag_is_caught(s3_server, s3_env, bucket: str, tmp_path: Path,
                                                   checksum: str) -> None:
    """A byte flipped on the store's disk, size and mtime kept: ETag and checksum still describe the old bytes."""
    repo = llama3_like()
    uploader = s3_server.client() if checksum == "crc32" else s3_server.client(request_checksum_calculation="when_required")
    upload_tree(uploader, bucket, "rot", repo)
    stored = s3_server.root / "data" / "buckets" / bucket / "rot" / "model-00002-of-00002.safetensors"
    stat = stored.stat()
    with open(stored, "r+b") as f:
        f.seek(stat.st_size - 10)
        byte = f.read(1)
        f.seek(stat.st_size - 10)
        f.write(bytes([byte[0] ^ 0x40]))
    os.utime(stored, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    out = tmp_path / "out"
    result = run_ferry("fetch", "--source", f"s3://{bucket}/rot", "--output", str(out), env=s3_env)
    assert result.returncode == 1
    assert f"model-00002-of-00002.safetensors: {checksum} " in result.stderr and "advertised by s3://" in result.stderr
    assert not (out / MANIFEST_NAME).exists() and not (out / "model-00002-of-00002.safetensors").exists()


def test_hostile_header_in_an_object(s3_server, s3_env, bucket: str, tmp_path: Path) -> None:
    overlapping = raw_safetensors({"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},
                                   "b": {"dtype": "U8", "shape": [8], "data_offsets": [4, 12]}}, b"\0" * 12)
    upload_tree(s3_server.client(), bucket, "bad", {"config.json": b"{}", "model.safetensors": overlapping})
    out = tmp_path / "out"
    result = run_ferry("fetch", "--source", f"s3://{bucket}/bad", "--output", str(out), env=s3_env)
    assert result.returncode == 2  # bad input: a prepare Job does not retry it
    assert "model.safetensors: tensor 'b' [4, 12) overlaps" in result.stderr
    assert not (out / MANIFEST_NAME).exists() and not (out / "model.safetensors").exists()


@pytest.mark.parametrize("key, problem", [("models/../../etc/passwd", "'..'"), ("models//etc/passwd", "absolute path")])
def test_keys_escaping_the_output_are_refused(s3_memory_server, monkeypatch, tmp_path: Path,
                                              key: str, problem: str) -> None:
    for name, value in s3_memory_server.env().items():
        monkeypatch.setenv(name, value)
    client = s3_memory_server.client()
    bucket = f"evil-{abs(hash(key)) % 10**8}"
    client.create_bucket(Bucket=bucket)
    upload_tree(client, bucket, "models", {"config.json": b"{}", "model.safetensors": safetensors_blob({"w": ("U8", [4])})})
    client.put_object(Bucket=bucket, Key=key, Body=b"root:x:0:0::/root:/bin/sh\n")
    assert key in [o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]]  # stored as is
    out = tmp_path / "deep" / "out"
    with pytest.raises(UnsafePathError, match=problem):
        fetch(FetchRequest(source=f"s3://{bucket}/models", output=out))
    assert not (out / MANIFEST_NAME).exists()
    assert not (tmp_path / "etc").exists() and not list(out.iterdir())


def test_empty_prefix_is_a_clear_error(s3_env, bucket: str, tmp_path: Path) -> None:
    result = run_ferry("fetch", "--source", f"s3://{bucket}/nothing-here", "--output", str(tmp_path / "o"), env=s3_env)
    assert result.returncode == 2 and f"s3://{bucket}/nothing-here: no objects under this prefix" in result.stderr


def test_killed_mid_file_resumes_from_the_journaled_prefix(s3_server, s3_env, bucket: str, tmp_path: Path) -> None:
    big = safetensors_blob({"w": ("U8", [48 * MiB])}, seed=11)
    upload_tree(s3_server.client(), bucket, "big", {"config.json": b"{}", "model.safetensors": big})
    out = tmp_path / "out"
    argv = ["fetch", "--source", f"s3://{bucket}/big", "--output", str(out), "--part-size", "2Mi"]
    # Throttled to 16 MiB/s the transfer takes ~3 s; the prefix is journaled every 8 parts (16 MiB).
    child = subprocess.Popen([sys.executable, "-m", "ferry_worker.cli", *argv, "--max-bandwidth", "16Mi"],
                             env={**os.environ, **s3_env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        durable = _wait_for_journaled_prefix(out / JOURNAL_NAME, "model.safetensors", timeout_s=30)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert 0 < durable < len(big)
    assert not (out / MANIFEST_NAME).exists() and not (out / "model.safetensors").exists()
    assert partial_name(out / "model.safetensors").exists()

    result = run_ferry(*argv, env=s3_env)
    assert result.returncode == 0, result.stderr
    resumed_at = int(result.stderr.split("resuming model.safetensors at byte ")[1].split()[0])
    assert resumed_at >= durable
    assert (out / "model.safetensors").read_bytes() == big
    assert not partial_name(out / "model.safetensors").exists()
    verify(out)


def _wait_for_journaled_prefix(journal: Path, path: str, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            entry = json.loads(journal.read_bytes())["files"].get(path, {})
        except (FileNotFoundError, ValueError):
            entry = {}
        if entry.get("durable_bytes", 0) > 0 and not entry.get("sha256"):
            return entry["durable_bytes"]
        time.sleep(0.02)
    raise AssertionError(f"no partial checkpoint of {path} in {journal} within {timeout_s}s")


def test_a_sources_own_ferry_files_are_never_fetched(s3_server, s3_env, bucket: str, tmp_path: Path) -> None:
    """An artifact Ferry once prepared, copied to S3, must not bring its manifest or journal along mid-fetch."""
    repo = {**llama3_like(), MANIFEST_NAME: b'{"manifestVersion": 1, "files": []}',
            JOURNAL_NAME: b"{}", ".ferry-staging/x.json": b"{}"}
    upload_tree(s3_server.client(), bucket, "prepared", repo)
    out = tmp_path / "out"
    fetch(FetchRequest(source=f"s3://{bucket}/prepared", output=out))
    manifest = read_manifest(out)
    assert manifest.source == f"s3://{bucket}/prepared" and len(manifest.files) == 8
    assert not (out / ".ferry-staging").exists()
    verify(out)
