"""`ferry load` outside a pod: verify and prefetch what a serving pod's ranks need.

A real `ferry shard` artifact (TP 2) of a generated checkpoint; the loader must
name a missing, truncated or corrupt file of the ranks it loads (exit 2), leave
the other ranks' files alone, refuse a manifest other than the one the pod was
wired for, and copy exactly the verified bytes.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from checkpoints import LLAMA3, write_checkpoint
from ferry_worker.cli import main
from ferry_worker.load.reader import ReadOptions, read_files
from ferry_worker.load.run import LoadRequest, load
from ferry_worker.load.selection import SelectionError, select
from ferry_worker.manifest import MANIFEST_NAME, FileEntry, IntegrityError, read_manifest


class Recorder:
    def __init__(self) -> None:
        self.reports: list[tuple[bool, str, str]] = []

    def report(self, loaded: bool, reason: str, message: str) -> None:
        self.reports.append((loaded, reason, message))


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("load")
    write_checkpoint(root / "checkpoint", LLAMA3)
    assert main(["shard", "--source", str(root / "checkpoint"), "--output", str(root / "artifact"),
                 "--tensor-parallel-size", "2"]) == 0
    return root / "artifact"


def rank_file(directory: Path, rank: int) -> Path:
    manifest = read_manifest(directory)
    return directory / manifest.extra["rankFiles"][f"pp0-tp{rank}"][0]


def digest(directory: Path) -> str:
    return "sha256:" + hashlib.sha256((directory / MANIFEST_NAME).read_bytes()).hexdigest()


def test_a_rank_reads_its_own_files_and_the_shared_ones(artifact: Path):
    manifest = read_manifest(artifact)
    rank0 = {e.path for e in select(manifest, [0]).entries}
    both = {e.path for e in select(manifest, None).entries}
    assert rank_file(artifact, 0).name in rank0 and rank_file(artifact, 1).name not in rank0
    assert {"config.json", "tokenizer.json"} <= rank0
    assert both == {e.path for e in manifest.files}
    with pytest.raises(SelectionError, match="rank 2 is not in this artifact"):
        select(manifest, [2])


def test_load_verifies_reports_and_describes(artifact: Path):
    recorder = Recorder()
    result = load(LoadRequest(str(artifact), ranks=[1], expected_digest=digest(artifact)), recorder)
    assert result.manifest_digest == digest(artifact)
    assert [(r[0], r[1]) for r in recorder.reports] == [(False, "Loading"), (True, "Loaded")]
    assert "rank 1" in recorder.reports[-1][2] and digest(artifact) in recorder.reports[-1][2]
    assert result.selection.total_bytes == sum(e.size for e in select(read_manifest(artifact), [1]).entries)


def test_a_flipped_byte_in_my_rank_fails_naming_the_file(copy_of: Path, caplog):
    bad = rank_file(copy_of, 1)
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0x01
    bad.write_bytes(bytes(data))
    recorder = Recorder()
    with pytest.raises(IntegrityError, match=bad.name):
        load(LoadRequest(str(copy_of), ranks=[1]), recorder)
    assert recorder.reports[-1][:2] == (False, "VerificationFailed") and bad.name in recorder.reports[-1][2]
    # Rank 0 does not read rank 1's file, so it loads.
    load(LoadRequest(str(copy_of), ranks=[0]), Recorder())
    # The command: exit 2 (a retry fails the same way), the file named.
    assert main(["load", "--artifact", str(copy_of), "--no-report"]) == 2
    # Rank files carry block digests: the block is named too.
    assert f"load failed: {bad.name}: block 0 (bytes 0-" in caplog.text
    # --verify size reads the bytes but does not hash them: a same-size corruption passes.
    assert main(["load", "--artifact", str(copy_of), "--no-report", "--verify", "size"]) == 0


def test_missing_and_truncated_files_are_named_before_reading(copy_of: Path):
    victim = rank_file(copy_of, 0)
    victim.write_bytes(victim.read_bytes()[:-1])
    with pytest.raises(IntegrityError, match=f"{victim.name}: size"):
        load(LoadRequest(str(copy_of), verify="size"), Recorder())
    victim.unlink()
    with pytest.raises(IntegrityError, match=f"{victim.name}: missing"):
        load(LoadRequest(str(copy_of)), Recorder())


def test_a_manifest_other_than_the_wired_one_is_refused(copy_of: Path):
    wired = digest(copy_of)
    body = json.loads((copy_of / MANIFEST_NAME).read_text())
    body["source"] = "somewhere else"
    (copy_of / MANIFEST_NAME).write_text(json.dumps(body))
    with pytest.raises(IntegrityError, match="wired for " + wired):
        load(LoadRequest(str(copy_of), expected_digest=wired), Recorder())
    (copy_of / MANIFEST_NAME).unlink()
    with pytest.raises(IntegrityError, match="no ferry-manifest.json"):
        load(LoadRequest(str(copy_of)), Recorder())


def test_copy_to_writes_the_verified_bytes_and_the_manifest_last(artifact: Path, tmp_path: Path):
    local = tmp_path / "local"
    load(LoadRequest(str(artifact), ranks=[0], copy_to=local), Recorder())
    wanted = {e.path for e in select(read_manifest(artifact), [0]).entries}
    assert {p.name for p in local.iterdir()} == wanted | {MANIFEST_NAME}
    for name in wanted:
        assert (local / name).read_bytes() == (artifact / name).read_bytes()
    assert digest(local) == digest(artifact)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def small_blocks(monkeypatch):
    """4 KiB blocks and segments, so that small files have several."""
    from ferry_worker import manifest
    from ferry_worker.load import reader

    monkeypatch.setattr(manifest, "BLOCK_SIZE", 4096)
    monkeypatch.setattr(reader, "BLOCK_SIZE", 4096)
    monkeypatch.setattr(reader, "MIN_SEGMENT", 4096)


def blocks_of(data: bytes, size: int = 4096, algorithm: str = "sha256") -> tuple[str, ...]:
    from ferry_worker.manifest import BLOCK_HASHES

    digest = lambda chunk: BLOCK_HASHES[algorithm](chunk).hexdigest()  # noqa: E731
    return tuple(digest(data[i:i + size]) for i in range(0, len(data), size)) or (digest(b""),)


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 3 * 4096 + 5])
def test_reader_reads_every_byte_in_order(tmp_path: Path, size: int):
    data = bytes((i * 7 + 3) % 251 for i in range(size))
    (tmp_path / "f").write_bytes(data)
    seen: list[int] = []
    read_files(tmp_path, [FileEntry("f", size, sha(data))], ReadOptions(readers=3, chunk_size=4096),
               seen.append, copy_to=tmp_path / "copy")
    assert sum(seen) == size and (tmp_path / "copy" / "f").read_bytes() == data
    with pytest.raises(IntegrityError, match=f"f: sha256 {sha(data)} != {sha(b'other')} in manifest"):
        read_files(tmp_path, [FileEntry("f", size, sha(b"other"))], ReadOptions(readers=3, chunk_size=4096))


def test_reader_fails_on_a_file_shorter_than_the_manifest_says(tmp_path: Path):
    (tmp_path / "f").write_bytes(b"x" * 5000)
    with pytest.raises(IntegrityError, match="f: ended at byte 5000"):
        read_files(tmp_path, [FileEntry("f", 9000, sha(b"x" * 9000))], ReadOptions(readers=2, chunk_size=4096))


@pytest.mark.parametrize("hashed", [True, False])
def test_segments_cover_every_byte_once_in_order(tmp_path: Path, monkeypatch, hashed: bool):
    from ferry_worker.load import reader

    monkeypatch.setattr(reader, "MIN_SEGMENT", 4096)
    size = 5 * 4096 + 123
    data = bytes((i * 13 + 1) % 256 for i in range(size))
    (tmp_path / "f").write_bytes(data)
    options = ReadOptions(readers=8, chunk_size=1000, segments=4, files_at_once=1, hash=hashed)
    assert [e - s for s, e in options.cut(size, 1)] == [5151, 5151, 5151, 5150]
    seen: list[int] = []
    read_files(tmp_path, [FileEntry("f", size, sha(data))], options, seen.append)
    # Progress counts each byte once: the consumer's bytes when hashing, the segments' otherwise.
    assert sum(seen) == size
    with pytest.raises(IntegrityError, match="f: ended at byte"):
        read_files(tmp_path, [FileEntry("f", size + 9000, sha(data))], options)


@pytest.mark.parametrize("algorithm", ["sha256", "blake3"])
def test_block_digests_verify_a_file_in_parallel_and_name_the_block(tmp_path: Path, small_blocks, algorithm: str):
    from ferry_worker import manifest

    data = bytes((i * 7) % 256 for i in range(4 * 4096 + 10))
    h = manifest.BlockHasher(algorithm)
    for i in range(0, len(data), 1000):  # fed in uneven pieces
        h.update(data[i:i + 1000])
    blocks = h.result()
    assert blocks == blocks_of(data, algorithm=algorithm) and len(blocks) == 5
    (tmp_path / "f").write_bytes(data)
    options = ReadOptions(readers=8, chunk_size=1500, segments=3, files_at_once=1)
    assert all(start % 4096 == 0 for start, _ in options.cut(len(data), 1, align=4096))
    seen: list[int] = []
    entry = FileEntry("f", len(data), blocks=blocks, block_hash=algorithm)  # blocks only, as in rank files
    read_files(tmp_path, [entry], options, seen.append)
    assert sum(seen) == len(data)
    bad = bytearray(data)
    bad[3 * 4096 + 5] ^= 1
    (tmp_path / "f").write_bytes(bytes(bad))
    with pytest.raises(IntegrityError, match=rf"f: block 3 \(bytes 12288-16383\) has {algorithm} "):
        read_files(tmp_path, [entry], options)


@pytest.mark.parametrize("size", [0, 10, 4096, 3 * 4096 + 5])
def test_a_copy_is_checked_against_block_digests_before_it_is_published(tmp_path: Path, small_blocks, size: int):
    """--copy-to: the segment readers write the copy at their offsets as they check the blocks; the copy is
    published only once every block verified."""
    data = bytes((i * 5 + 1) % 256 for i in range(size))
    (tmp_path / "f").write_bytes(data)
    entry = FileEntry("f", size, blocks=blocks_of(data))
    options = ReadOptions(readers=4, chunk_size=1000)
    read_files(tmp_path, [entry], options, copy_to=tmp_path / "copy")
    assert (tmp_path / "copy" / "f").read_bytes() == data
    read_files(tmp_path, [entry], options)  # and without a copy, by the segment readers
    if not size:
        return
    (tmp_path / "f").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    last = len(entry.blocks) - 1
    with pytest.raises(IntegrityError, match=f"f: block {last} "):
        read_files(tmp_path, [entry], options, copy_to=tmp_path / "bad")
    assert not (tmp_path / "bad" / "f").exists() and not list((tmp_path / "bad").iterdir())


def test_the_loader_restores_compiled_state_after_the_weights_and_says_how_it_went(artifact: Path, tmp_path: Path):
    """`ferry load --compiled-store`: the outcome joins the Loaded message; a refused state never fails the
    load (the pod then compiles, as without Ferry)."""
    from ferry_worker.compiled.state import device_kind, harvest

    cache = tmp_path / "cache" / "torch_compile_cache" / "k" / "rank_0_0"
    cache.mkdir(parents=True)
    (cache / "graph.py").write_text("def f(): pass\n")
    store, key = tmp_path / "store", "0" * 32
    assert harvest(tmp_path / "cache", store, key, device_kind()).state == "published"
    for expected in ("restored", "refused"):
        dest = tmp_path / f"dest-{expected}"
        dest.mkdir()
        recorder = Recorder()
        load(LoadRequest(str(artifact), ranks=[0], compiled=(store, key, dest)), recorder)
        loaded, reason, message = recorder.reports[-1]
        assert loaded and reason == "Loaded" and f"compiled state {expected}" in message, message
        assert (dest / "torch_compile_cache/k/rank_0_0/graph.py").exists() == (expected == "restored")
        (next(store.glob(f"{key}/*")) / "state.tar").write_bytes(b"not a tar")
    with pytest.raises(SystemExit) as exit_:  # the three go together
        main(["load", "--artifact", str(artifact), "--no-report", "--compiled-key", key])
    assert exit_.value.code == 2


def test_a_group_pod_restores_its_own_entry_and_not_another_pods(artifact: Path, tmp_path: Path):
    """A pod of a multi-node group compiled only its own ranks: it restores <device>-node<I>, never the entry
    of another pod of the group (nor a single-pod entry)."""
    from ferry_worker.compiled.state import device_kind, entry_name, harvest
    from ferry_worker.load.selection import Group

    store, key = tmp_path / "store", "1" * 32
    for name in (device_kind(), entry_name(device_kind(), 0)):  # a single pod's and the leader's
        cache = tmp_path / name / "torch_compile_cache" / "k" / "rank_0_0"
        cache.mkdir(parents=True)
        (cache / "graph.py").write_text(name)
        assert harvest(tmp_path / name, store, key, name).state == "published"
    dest = tmp_path / "dest"
    dest.mkdir()
    recorder = Recorder()
    load(LoadRequest(str(artifact), group=Group(2, 1), compiled=(store, key, dest)), recorder)
    assert "compiled state absent" in recorder.reports[-1][2] and not list(dest.iterdir()), recorder.reports[-1]
    recorder = Recorder()
    load(LoadRequest(str(artifact), group=Group(2, 0), compiled=(store, key, dest)), recorder)
    assert "compiled state restored" in recorder.reports[-1][2], recorder.reports[-1]
    assert (dest / "torch_compile_cache/k/rank_0_0/graph.py").read_text() == entry_name(device_kind(), 0)
