"""The manifest's two digest forms: a file entry records its whole sha256
(fetched and copied files) or the sha256 of each block (`ferry shard`'s rank
files, each byte hashed once). Every reader — `ferry verify`, `ferry load`,
`ferry unshard`, `ferry publish` — accepts either, and both together (what the
previous release wrote for rank files); an entry with neither is refused,
naming the file."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from checkpoints import LLAMA3, write_checkpoint
from ferry_worker import manifest as m
from ferry_worker.cli import main
from ferry_worker.load.run import LoadRequest, load
from ferry_worker.manifest import MANIFEST_NAME, FileEntry, IntegrityError, Manifest, read_manifest, sha256_file, verify
from ferry_worker.shard.job import ShardJob
from ferry_worker.shard.unshard import unshard
from ferry_worker.tensorize.errors import StoreError
from ferry_worker.tensorize.publish import PublishJob


class Quiet:
    def report(self, loaded: bool, reason: str, message: str) -> None:
        pass


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("manifest")
    write_checkpoint(root / "checkpoint", LLAMA3)
    ShardJob.prepare(root / "checkpoint", root / "artifact", tp=2).run()
    return root / "artifact"


@pytest.fixture
def artifact(sharded: Path, tmp_path: Path) -> Path:
    """A copy of the shard artifact this test may damage."""
    target = tmp_path / "artifact"
    target.mkdir()
    for f in sharded.iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    return target


def rank_files(directory: Path) -> list[str]:
    return sorted(n for files in read_manifest(directory).extra["rankFiles"].values() for n in files)


def rewrite(directory: Path, change) -> None:
    body = json.loads((directory / MANIFEST_NAME).read_text())
    change(body)
    (directory / MANIFEST_NAME).write_text(json.dumps(body))


def as_previous_release(directory: Path) -> None:
    """Rank files with both forms, as the release before this one wrote them."""
    def both(body: dict) -> None:
        for f in body["files"]:
            f.setdefault("sha256", sha256_file(directory / f["path"]))
    rewrite(directory, both)


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def test_rank_files_record_block_digests_only_and_companions_their_sha256(sharded: Path):
    body = json.loads((sharded / MANIFEST_NAME).read_text())
    ranks = set(rank_files(sharded))
    assert body["blockSize"] == m.BLOCK_SIZE
    for f in body["files"]:
        data = (sharded / f["path"]).read_bytes()
        if f["path"] in ranks:
            assert "sha256" not in f, f["path"]
            assert f["blocks"] == [hashlib.sha256(data[i:i + m.BLOCK_SIZE]).hexdigest()
                                   for i in range(0, len(data), m.BLOCK_SIZE)]
        else:
            assert f["sha256"] == hashlib.sha256(data).hexdigest() and "blocks" not in f, f["path"]
    verify(sharded)
    load(LoadRequest(str(sharded)), Quiet())


def test_a_manifest_with_both_forms_still_verifies_and_each_catches_damage(artifact: Path, tmp_path: Path):
    as_previous_release(artifact)
    verify(artifact)
    load(LoadRequest(str(artifact)), Quiet())
    load(LoadRequest(str(artifact), copy_to=tmp_path / "copy"), Quiet())
    unshard(artifact, tmp_path / "rebuilt")
    victim = artifact / rank_files(artifact)[0]
    flip_last_byte(victim)
    for check in (lambda: verify(artifact), lambda: load(LoadRequest(str(artifact)), Quiet()),
                  lambda: load(LoadRequest(str(artifact), copy_to=tmp_path / "copy2"), Quiet())):
        with pytest.raises(IntegrityError, match=f"{victim.name}: block"):
            check()


def test_a_rank_file_recorded_by_sha256_alone_is_checked_by_it(artifact: Path):
    victim = rank_files(artifact)[0]

    def whole_only(body: dict) -> None:
        for f in body["files"]:
            if f["path"] == victim:
                f["sha256"] = sha256_file(artifact / victim)
                del f["blocks"]
    rewrite(artifact, whole_only)
    verify(artifact)
    flip_last_byte(artifact / victim)
    with pytest.raises(IntegrityError, match=f"{victim}: sha256 [0-9a-f]{{64}} != "):
        verify(artifact)
    with pytest.raises(IntegrityError, match=f"{victim}: sha256 [0-9a-f]{{64}} != "):
        load(LoadRequest(str(artifact)), Quiet())


def test_verify_names_the_bad_block(artifact: Path):
    victim = artifact / rank_files(artifact)[0]
    flip_last_byte(victim)
    last = (victim.stat().st_size - 1) // m.BLOCK_SIZE
    with pytest.raises(IntegrityError, match=rf"{victim.name}: block {last} \(bytes {last * m.BLOCK_SIZE}-"):
        verify(artifact)
    assert main(["verify", str(artifact)]) != 0


def test_an_entry_with_neither_digest_is_refused_naming_the_file(artifact: Path):
    victim = rank_files(artifact)[1]

    def strip(body: dict) -> None:
        for f in body["files"]:
            if f["path"] == victim:
                f.pop("blocks"), f.pop("sha256", None)
    rewrite(artifact, strip)
    match = f"{victim}: the manifest records neither a sha256 nor block digests"
    for check in (lambda: verify(artifact), lambda: load(LoadRequest(str(artifact)), Quiet()),
                  lambda: unshard(artifact, artifact.parent / "rebuilt"),
                  lambda: PublishJob.prepare(artifact, str(artifact.parent / "published"))):
        with pytest.raises(IntegrityError, match=match):
            check()
    assert main(["load", "--artifact", str(artifact), "--no-report"]) == 2


def test_malformed_block_lists_are_refused_naming_the_file():
    def parse(files: list[dict], block_size: object = m.BLOCK_SIZE) -> Manifest:
        body = {"manifestVersion": m.MANIFEST_VERSION, "files": files, "blockSize": block_size}
        return Manifest.from_json(json.dumps(body).encode())

    digest = hashlib.sha256(b"x").hexdigest()
    size = m.BLOCK_SIZE + 1  # two blocks
    with pytest.raises(IntegrityError, match=f"f: 1 block digests in the manifest for {size} bytes"):
        parse([{"path": "f", "size": size, "blocks": [digest]}])
    with pytest.raises(IntegrityError, match="f: 'zz' in the manifest is not a sha256"):
        parse([{"path": "f", "size": 1, "blocks": ["zz"]}])
    with pytest.raises(IntegrityError, match="f: only block digests in the manifest, of blockSize 4096"):
        parse([{"path": "f", "size": 1, "blocks": [digest]}], block_size=4096)
    # Blocks of another size next to a whole-file sha256: the sha256 checks the file.
    assert parse([{"path": "f", "size": 1, "sha256": digest, "blocks": [digest]}], 4096).files == [
        FileEntry("f", 1, digest)]
    with pytest.raises(IntegrityError, match="entry None: not a string"):
        parse([{"size": 1, "sha256": digest}])


def test_an_empty_file_has_one_block(tmp_path: Path):
    (tmp_path / "empty").write_bytes(b"")
    hasher = m.BlockHasher()
    hasher.update(b"")
    entry = FileEntry("empty", 0, blocks=hasher.result())
    assert entry.blocks == (hashlib.sha256(b"").hexdigest(),)
    m.write_manifest(tmp_path, Manifest(files=[entry]))
    verify(tmp_path)
    load(LoadRequest(str(tmp_path)), Quiet())
    load(LoadRequest(str(tmp_path), copy_to=tmp_path / "copy"), Quiet())


def test_publish_checks_block_digests_and_records_the_stored_sha256(artifact: Path, tmp_path: Path):
    """A store checks its own read of each file against a whole-file sha256: for a rank file the blocks are
    checked first, in one read that also computes that sha256."""
    published = PublishJob.prepare(artifact, str(tmp_path / "published")).run()
    ranks = set(rank_files(artifact))
    for entry in published.manifest.files:
        assert entry.sha256 == sha256_file(artifact / entry.path), entry.path
    assert ranks <= {e.path for e in published.manifest.files}
    verify(tmp_path / "published")
    # The request tells two sources apart by their block digests: the same bytes are kept, not rewritten.
    assert PublishJob.prepare(artifact, str(tmp_path / "published")).run().reused
    flip_last_byte(artifact / sorted(ranks)[0])
    with pytest.raises(StoreError, match=f"{sorted(ranks)[0]}: block .* the source changed or is damaged"):
        PublishJob.prepare(artifact, str(tmp_path / "again")).run()
    assert not (tmp_path / "again" / MANIFEST_NAME).exists()
