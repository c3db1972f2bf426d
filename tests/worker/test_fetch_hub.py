"""`ferry fetch hf://...` through huggingface_hub, against hub_double.FakeHub.

FakeHub is a test double of an external service (the Hugging Face Hub, not
reachable here): a local HTTP server implementing the endpoints
huggingface_hub 2.4.0 calls, reached the way users reach mirrors, through
HF_ENDPOINT. Everything on Ferry's side (huggingface_hub, the CLI) is real.
"""
from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoint_files import llama3_like
from fetch_support import run_ferry
from ferry_worker.manifest import MANIFEST_NAME, read_manifest, verify
from hub_double import FakeHub, HubRepo

REPO_ID = "meta-llama/Meta-Llama-3-8B-Instruct"
SHARD = "model-00001-of-00002.safetensors"


def hub_env(hub: FakeHub, tmp_path: Path, **extra: str) -> dict[str, str]:
    return {"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_TOKEN": "hf_ferry_test_token", **extra}


def fetch_hf(hub: FakeHub, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_ferry("fetch", "--source", f"hf://{REPO_ID}", "--output", str(tmp_path / "out"), *extra,
                     env=hub_env(hub, tmp_path))


def test_fetch_pins_the_commit_and_verifies_hashes(tmp_path: Path) -> None:
    files = llama3_like()
    repo = HubRepo(files, branches=("main", "v1.0"))
    with FakeHub({REPO_ID: repo}) as hub:
        result = fetch_hf(hub, tmp_path, "--revision", "v1.0")
    assert result.returncode == 0, result.stderr
    out = tmp_path / "out"
    manifest = read_manifest(out)
    assert (manifest.source, manifest.revision) == (f"hf://{REPO_ID}", repo.commit)
    assert {f.path for f in manifest.files} == {
        "config.json", "generation_config.json", "special_tokens_map.json", "tokenizer.json",
        "tokenizer_config.json", "model.safetensors.index.json", SHARD, "model-00002-of-00002.safetensors"}
    for f in manifest.files:
        assert (out / f.path).read_bytes() == files[f.path]
    verify(out)
    resolves = [r for r in hub.requests if "/resolve/" in r.path]
    assert resolves and all(f"/resolve/{repo.commit}/" in r.path for r in resolves)  # never "v1.0" again
    assert not any("original/" in r.path for r in hub.requests)
    assert all(r.authorization == "Bearer hf_ferry_test_token" for r in hub.requests if not r.path.startswith("/cdn/"))
    assert not (out / ".ferry-staging").exists()


def test_unknown_revision_is_a_clear_error(tmp_path: Path) -> None:
    with FakeHub({REPO_ID: HubRepo(llama3_like())}) as hub:
        result = fetch_hf(hub, tmp_path, "--revision", "no-such-branch")
    assert result.returncode == 2  # the Hub's answer, not an accident: not retried
    assert "fetch failed" in result.stderr and "no-such-branch" in result.stderr


@pytest.mark.parametrize("path", [SHARD, "tokenizer.json"], ids=["lfs-sha256", "git-blob-sha1"])
def test_content_differing_from_the_listing_is_refused(tmp_path: Path, path: str) -> None:
    files = llama3_like()
    tampered = bytearray(files[path])
    tampered[-2] ^= 0x01
    with FakeHub({REPO_ID: HubRepo(files, serve_instead={path: bytes(tampered)})}) as hub:
        result = fetch_hf(hub, tmp_path)
    assert result.returncode == 1
    digest = "sha256" if path.endswith(".safetensors") else "git-sha1"
    assert f"{path}: {digest} " in result.stderr and f"advertised by hf://{REPO_ID}" in result.stderr
    assert not (tmp_path / "out" / MANIFEST_NAME).exists() and not (tmp_path / "out" / path).exists()


def test_truncated_download_is_refused(tmp_path: Path) -> None:
    files = llama3_like()
    with FakeHub({REPO_ID: HubRepo(files, serve_instead={SHARD: files[SHARD][:4096]})}) as hub:
        result = fetch_hf(hub, tmp_path)
    assert result.returncode == 1
    assert f"hf://{REPO_ID}: {SHARD}: Consistency check failed: file should be of size 50104" in result.stderr
    assert not (tmp_path / "out" / MANIFEST_NAME).exists() and not (tmp_path / "out" / SHARD).exists()


def test_hostile_name_in_the_listing_is_refused(tmp_path: Path) -> None:
    evil = {"rfilename": "../../../etc/cron.d/ferry", "size": 10, "blobId": "0" * 40}
    with FakeHub({REPO_ID: HubRepo(llama3_like(), extra_siblings=[evil])}) as hub:
        result = fetch_hf(hub, tmp_path)
    assert result.returncode == 2
    assert "refusing file name '../../../etc/cron.d/ferry'" in result.stderr
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()
    assert not any("/resolve/" in r.path for r in hub.requests)  # refused before any download


def test_offline_mode_fetches_from_the_hub_cache(tmp_path: Path) -> None:
    files = llama3_like()
    repo = HubRepo(files)
    with FakeHub({REPO_ID: repo}) as hub:
        env = hub_env(hub, tmp_path)
        warm = subprocess.run([sys.executable, "-c", f"import huggingface_hub as h; h.snapshot_download({REPO_ID!r})"],
                              env={**env, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60)
        assert warm.returncode == 0, warm.stderr
    # The Hub is gone now; HF_HUB_OFFLINE makes Ferry read the cached snapshot.
    result = run_ferry("fetch", "--source", f"hf://{REPO_ID}", "--output", str(tmp_path / "out"),
                       env={**env, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    manifest = read_manifest(tmp_path / "out")
    assert manifest.revision == repo.commit
    assert {f.path: f.sha256 for f in manifest.files}[SHARD] == hashlib.sha256(files[SHARD]).hexdigest()
    assert not any(f.path.startswith("original/") for f in manifest.files)
