"""`ferry fetch` / `ferry verify` from local directories shaped like real Hub repositories."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from checkpoint_files import (
    finetune_bin_like,
    layer_shard,
    llama3_like,
    mistral_v01_like,
    mistral_v03_like,
    raw_safetensors,
    write_tree,
)
from fetch_support import run_ferry
from ferry_worker.fetch.journal import JOURNAL_NAME
from ferry_worker.fetch.run import FetchRequest, fetch, fetch_listed
from ferry_worker.fetch.transfer import TransferOptions
from ferry_worker.manifest import MANIFEST_NAME, IntegrityError, read_manifest, verify
from ferry_worker.paths import UnsafePathError
from ferry_worker.safetensors_header import UnsafeSafetensorsError
from ferry_worker.sources import SourceError
from ferry_worker.sources.local import LocalSource

METADATA = {"config.json", "generation_config.json", "special_tokens_map.json", "tokenizer.json",
            "tokenizer_config.json", "model.safetensors.index.json"}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fetched(output: Path) -> set[str]:
    """Files in `output` other than Ferry's own bookkeeping."""
    return {p.relative_to(output).as_posix() for p in output.rglob("*")
            if p.is_file() and p.name not in (MANIFEST_NAME, JOURNAL_NAME)}


def manifest_files(output: Path) -> dict[str, tuple[int, str]]:
    manifest = read_manifest(output)
    assert manifest is not None, "no manifest"
    return {f.path: (f.size, f.sha256) for f in manifest.files}


def local_fetch(src: Path, out: Path, **kwargs) -> None:
    fetch(FetchRequest(source=f"file://{src}", output=out, **kwargs))


def test_cli_fetches_what_vllm_loads_and_verify_passes(tmp_path: Path) -> None:
    repo = llama3_like()
    src, out = write_tree(tmp_path / "src", repo), tmp_path / "out"
    result = run_ferry("fetch", "--source", f"file://{src}", "--output", str(out))
    assert result.returncode == 0, result.stderr
    wanted = METADATA | {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    assert fetched(out) == wanted
    assert manifest_files(out) == {p: (len(repo[p]), sha(repo[p])) for p in wanted}
    manifest = json.loads((out / MANIFEST_NAME).read_bytes())
    assert (manifest["source"], manifest["format"]) == (f"file://{src}", "safetensors")
    assert manifest["tool"].startswith("ferry ")
    assert result.stdout.strip() == "sha256:" + sha((out / MANIFEST_NAME).read_bytes())
    assert run_ferry("verify", str(out)).returncode == 0


@pytest.mark.parametrize(
    "repo, weights, absent, fmt",
    [
        (mistral_v03_like(), {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"},
         {"consolidated.safetensors"}, "safetensors"),
        (mistral_v01_like(), {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"},
         {"pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"}, "safetensors"),
        (finetune_bin_like(), {"pytorch_model.bin"},
         {"training_args.bin", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"}, "pt"),
    ],
    ids=["consolidated+sharded", "bin+safetensors", "training-artifacts"],
)
def test_repository_shapes(tmp_path: Path, repo: dict, weights: set, absent: set, fmt: str) -> None:
    src, out = write_tree(tmp_path / "src", repo), tmp_path / "out"
    local_fetch(src, out)
    files = fetched(out)
    assert weights <= files and not absent & files
    assert {"config.json", "tokenizer.json"} <= files
    assert read_manifest(out).format == fmt


def test_rerun_keeps_complete_files_untouched(tmp_path: Path) -> None:
    src, out = write_tree(tmp_path / "src", llama3_like()), tmp_path / "out"
    local_fetch(src, out)
    before = {p: os.stat(out / p).st_ino for p in fetched(out)}
    local_fetch(src, out)
    assert {p: os.stat(out / p).st_ino for p in fetched(out)} == before
    verify(out)


def test_rerun_refetches_a_file_damaged_on_disk(tmp_path: Path) -> None:
    repo = llama3_like()
    src, out = write_tree(tmp_path / "src", repo), tmp_path / "out"
    local_fetch(src, out)
    shard = out / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    local_fetch(src, out)
    assert shard.read_bytes() == repo["model-00002-of-00002.safetensors"]
    verify(out)


def test_files_no_longer_selected_are_removed(tmp_path: Path) -> None:
    src, out = write_tree(tmp_path / "src", llama3_like()), tmp_path / "out"
    local_fetch(src, out)
    local_fetch(src, out, ignore_patterns=["tokenizer.json"])
    assert "tokenizer.json" not in fetched(out) | set(manifest_files(out))


def test_fetching_another_checkpoint_replaces_the_first(tmp_path: Path) -> None:
    out = tmp_path / "out"
    local_fetch(write_tree(tmp_path / "a", finetune_bin_like()), out)
    local_fetch(write_tree(tmp_path / "b", llama3_like()), out)
    assert "pytorch_model.bin" not in fetched(out)
    assert fetched(out) == set(manifest_files(out))


def test_pvc_source_is_read_below_the_mount_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_tree(tmp_path / "mnt" / "model-cache" / "llama", llama3_like())
    monkeypatch.setenv("FERRY_PVC_ROOT", str(tmp_path / "mnt"))
    fetch(FetchRequest(source="pvc://model-cache/llama", output=tmp_path / "out"))
    assert read_manifest(tmp_path / "out").source == "pvc://model-cache/llama"


def test_progress_counts_every_fetched_byte(tmp_path: Path) -> None:
    class Recorder:
        final = None

        def publish(self, snapshot) -> None:
            pass

        def close(self, snapshot) -> None:
            Recorder.final = snapshot

    repo = llama3_like()
    src, out = write_tree(tmp_path / "src", repo), tmp_path / "out"
    fetch(FetchRequest(source=f"file://{src}", output=out), [Recorder()])
    index = len(repo["model.safetensors.index.json"])  # fetched first, before the total is known
    assert Recorder.final.bytes_done == Recorder.final.bytes_total == read_manifest(out).total_bytes - index


# --- verify: the first bad or missing file, named -------------------------------------------------

@pytest.fixture
def prepared(tmp_path: Path) -> Path:
    out = tmp_path / "out"
    local_fetch(write_tree(tmp_path / "src", llama3_like()), out)
    return out


def test_verify_names_a_flipped_byte(prepared: Path) -> None:
    shard = prepared / "model-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    result = run_ferry("verify", str(prepared))
    assert result.returncode == 1
    assert "model-00001-of-00002.safetensors: sha256" in result.stderr


def test_verify_names_a_truncated_file(prepared: Path) -> None:
    with open(prepared / "tokenizer.json", "r+b") as f:
        f.truncate(3)
    with pytest.raises(IntegrityError, match=r"tokenizer\.json: size 3 != "):
        verify(prepared)


def test_verify_names_a_missing_file(prepared: Path) -> None:
    (prepared / "config.json").unlink()
    result = run_ferry("verify", str(prepared))
    assert result.returncode == 1 and "config.json: missing" in result.stderr


def test_verify_without_manifest_fails(tmp_path: Path) -> None:
    result = run_ferry("verify", str(tmp_path))
    assert result.returncode == 1 and "no ferry-manifest.json" in result.stderr


# --- faults while fetching: a clear error and no manifest -----------------------------------------

def test_hostile_safetensors_header_is_refused(tmp_path: Path) -> None:
    repo = llama3_like()
    repo["model-00002-of-00002.safetensors"] = raw_safetensors(
        {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1 << 40]}}, b"\0" * 16)
    src, out = write_tree(tmp_path / "src", repo), tmp_path / "out"
    result = run_ferry("fetch", "--source", f"file://{src}", "--output", str(out))
    assert result.returncode == 2
    assert "model-00002-of-00002.safetensors: tensor 'a': F32 shape [4] needs 16 bytes" in result.stderr
    assert not (out / MANIFEST_NAME).exists()
    assert not (out / "model-00002-of-00002.safetensors").exists()
    assert not list(out.glob(".model-00002*"))  # the partial file is gone too


def test_header_length_bomb_is_refused(tmp_path: Path) -> None:
    repo = {"config.json": b"{}", "model.safetensors": (1 << 60).to_bytes(8, "little") + b"{}"}
    src, out = write_tree(tmp_path / "src", repo), tmp_path / "out"
    with pytest.raises(UnsafeSafetensorsError, match="header length 1152921504606846976 exceeds"):
        local_fetch(src, out)
    assert not (out / MANIFEST_NAME).exists()


def test_source_file_truncated_after_listing(tmp_path: Path) -> None:
    src, out = write_tree(tmp_path / "src", llama3_like()), tmp_path / "out"
    source = LocalSource(src, f"file://{src}")
    listing = source.list_files()
    with open(src / "model-00001-of-00002.safetensors", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(SourceError, match=r"model-00001-of-00002\.safetensors ends at 1000"):
        fetch_listed(FetchRequest(source=source.uri, output=out), source, listing)
    assert not (out / MANIFEST_NAME).exists()


def test_bitrot_in_a_source_prepared_by_ferry_is_caught(tmp_path: Path) -> None:
    """A directory Ferry prepared carries sha256s; copying from it checks them."""
    first, second = tmp_path / "first", tmp_path / "second"
    local_fetch(write_tree(tmp_path / "src", llama3_like()), first)
    shard = first / "model-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x10
    shard.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=r"model-00001-of-00002\.safetensors: sha256 .* advertised by file://"):
        local_fetch(first, second)
    assert not (second / MANIFEST_NAME).exists()


def test_output_symlink_cannot_redirect_writes(tmp_path: Path) -> None:
    repo = {"config.json": b"{}", "sub/model.safetensors": layer_shard(0, 0)}
    src, out, elsewhere = write_tree(tmp_path / "src", repo), tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / "sub").symlink_to(elsewhere)
    with pytest.raises(UnsafePathError, match="sub/model.safetensors"):
        local_fetch(src, out, allow_patterns=["sub/*.safetensors"])
    assert not list(elsewhere.iterdir())


def test_small_parts_reassemble_exactly(tmp_path: Path) -> None:
    repo = llama3_like()
    src, out = write_tree(tmp_path / "src", repo), tmp_path / "out"
    local_fetch(src, out, options=TransferOptions(concurrency=4, part_size=4096))
    for path in fetched(out):
        assert (out / path).read_bytes() == repo[path]


# --- symlinks: a source (a pvc:// claim its user fills) never reaches out of itself ----------------

def test_a_symlink_to_etc_passwd_is_refused(tmp_path: Path) -> None:
    src, out = write_tree(tmp_path / "src", llama3_like()), tmp_path / "out"
    (src / "notes.txt").symlink_to("/etc/passwd")  # *.txt at the top level is fetched
    result = run_ferry("fetch", "--source", f"file://{src}", "--output", str(out))
    assert result.returncode == 2  # bad input: retrying cannot help
    assert (f"file://{src}: notes.txt is a symlink to /etc/passwd (/etc/passwd), outside the source {src}; "
            "Ferry follows no symlink out of a source") in result.stderr
    assert not (out / MANIFEST_NAME).exists() and not (out / "notes.txt").exists()


def test_a_symlink_to_a_sibling_directory_is_refused(tmp_path: Path) -> None:
    src = write_tree(tmp_path / "claim" / "model", llama3_like())
    write_tree(tmp_path / "claim" / "other-team", {"secret.json": b'{"token": "x"}'})
    (src / "extra").symlink_to("../other-team", target_is_directory=True)
    with pytest.raises(SourceError, match=r"extra is a symlink to \.\./other-team \(.*/claim/other-team\), "
                                          r"outside the source .*/claim/model"):
        LocalSource(src, f"file://{src}").list_files()


def test_a_symlink_out_of_a_pvc_source_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    claim = write_tree(tmp_path / "pvcs" / "team-a" / "llama", llama3_like())
    (claim / "tokenizer.model").symlink_to("/etc/passwd")
    monkeypatch.setenv("FERRY_PVC_ROOT", str(tmp_path / "pvcs"))
    with pytest.raises(SourceError, match="pvc://team-a/llama: tokenizer.model is a symlink to /etc/passwd"):
        fetch(FetchRequest(source="pvc://team-a/llama", output=tmp_path / "out"))
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()


def test_symlinks_inside_the_source_are_followed(tmp_path: Path) -> None:
    """A Hub-cache-like tree: names link to blobs kept in the same directory."""
    repo = llama3_like()
    src, out = tmp_path / "src", tmp_path / "out"
    write_tree(src / "blobs", {f"b{i}": data for i, data in enumerate(repo.values())})
    for i, name in enumerate(repo):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).symlink_to(src / "blobs" / f"b{i}")
    local_fetch(src, out, ignore_patterns=["blobs/"])
    assert {p: repo[p] for p in fetched(out)} == {p: d for p, d in repo.items() if p in fetched(out)}
    assert "model-00001-of-00002.safetensors" in fetched(out)


def test_a_source_reached_through_a_symlink_is_refused(tmp_path: Path) -> None:
    real = write_tree(tmp_path / "real", llama3_like())
    (tmp_path / "alias").symlink_to(real, target_is_directory=True)
    with pytest.raises(SourceError, match=f"{tmp_path}/alias resolves to {real} through a symlink"):
        local_fetch(tmp_path / "alias", tmp_path / "out")


def test_a_file_swapped_for_a_symlink_after_listing_is_not_followed(tmp_path: Path) -> None:
    src, out = write_tree(tmp_path / "src", llama3_like()), tmp_path / "out"
    source = LocalSource(src, f"file://{src}")
    listing = source.list_files()
    (src / "tokenizer.json").unlink()
    (src / "tokenizer.json").symlink_to("/etc/passwd")
    with pytest.raises(SourceError, match="tokenizer.json was replaced by a symlink since it was listed"):
        fetch_listed(FetchRequest(source=source.uri, output=out), source, listing)
    assert not (out / MANIFEST_NAME).exists() and not (out / "tokenizer.json").exists()


def test_a_file_replaced_by_another_after_listing_is_not_read(tmp_path: Path) -> None:
    src, out = write_tree(tmp_path / "src", llama3_like()), tmp_path / "out"
    source = LocalSource(src, f"file://{src}")
    listing = source.list_files()
    replacement = tmp_path / "replacement"
    replacement.write_bytes((src / "tokenizer.json").read_bytes())
    replacement.replace(src / "tokenizer.json")  # same name, same size, another inode
    with pytest.raises(SourceError, match="tokenizer.json was replaced since it was listed"):
        fetch_listed(FetchRequest(source=source.uri, output=out), source, listing)


def test_file_uris_with_dot_dot_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="without '..'"):
        local_fetch(tmp_path / "src" / ".." / "etc", tmp_path / "out")
