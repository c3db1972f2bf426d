"""The manifest's two digest forms: a file entry records its whole sha256
(fetched and copied files) or the digest of each block (`ferry shard`'s rank
files, each byte hashed once: BLAKE3 now, sha256 as earlier releases wrote
them). Every reader — `ferry verify`, `ferry load`, `ferry unshard`, `ferry
publish` — accepts either, and both together (what an earlier release wrote
for rank files); an entry with neither is refused, naming the file.

Shares one TP 2 cut of the tiny Llama checkpoint (module fixture); each test
that damages it works on its own copy."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import blake3
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


def sha256_blocks(data: bytes) -> list[str]:
    return [hashlib.sha256(data[i:i + m.BLOCK_SIZE]).hexdigest() for i in range(0, max(len(data), 1), m.BLOCK_SIZE)]


def as_earlier_release(directory: Path, whole: bool = False) -> None:
    """Rank files with sha256 blocks in a version 1 manifest, as releases before BLAKE3 wrote them (`whole`: with
    each file's sha256 too, as the release before those did)."""
    def sha256_forms(body: dict) -> None:
        body["manifestVersion"] = 1
        for f in body["files"]:
            if f.pop("blockHash", None):
                f["blocks"] = sha256_blocks((directory / f["path"]).read_bytes())
            if whole:
                f.setdefault("sha256", sha256_file(directory / f["path"]))
    rewrite(directory, sha256_forms)


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def test_rank_files_record_block_digests_only_and_companions_their_sha256(sharded: Path):
    body = json.loads((sharded / MANIFEST_NAME).read_text())
    ranks = set(rank_files(sharded))
    assert body["blockSize"] == m.BLOCK_SIZE
    assert body["manifestVersion"] == 2  # what a release that checks only sha256 blocks refuses by name
    for f in body["files"]:
        data = (sharded / f["path"]).read_bytes()
        if f["path"] in ranks:
            assert "sha256" not in f and f["blockHash"] == "blake3", f["path"]
            assert f["blocks"] == [blake3.blake3(data[i:i + m.BLOCK_SIZE]).hexdigest()
                                   for i in range(0, len(data), m.BLOCK_SIZE)]
        else:
            assert f["sha256"] == hashlib.sha256(data).hexdigest() and "blocks" not in f, f["path"]
            assert "blockHash" not in f, f["path"]
    verify(sharded)
    load(LoadRequest(str(sharded)), Quiet())


@pytest.mark.parametrize("whole", [False, True], ids=["sha256 blocks", "sha256 blocks and whole"])
def test_an_earlier_releases_manifest_still_verifies_and_catches_damage(artifact: Path, tmp_path: Path,
                                                                       whole: bool):
    as_earlier_release(artifact, whole)
    assert read_manifest(artifact).version == 1
    verify(artifact)
    load(LoadRequest(str(artifact)), Quiet())
    load(LoadRequest(str(artifact), copy_to=tmp_path / "copy"), Quiet())
    unshard(artifact, tmp_path / "rebuilt")
    victim = artifact / rank_files(artifact)[0]
    flip_last_byte(victim)
    for check in (lambda: verify(artifact), lambda: load(LoadRequest(str(artifact)), Quiet()),
                  lambda: load(LoadRequest(str(artifact), copy_to=tmp_path / "copy2"), Quiet())):
        with pytest.raises(IntegrityError, match=f"{victim.name}: block [0-9]+ .* has sha256 "):
            check()


def test_a_damaged_blake3_block_is_named_by_every_reader(artifact: Path, tmp_path: Path):
    victim = artifact / rank_files(artifact)[0]
    flip_last_byte(victim)
    for check in (lambda: verify(artifact), lambda: load(LoadRequest(str(artifact)), Quiet()),
                  lambda: load(LoadRequest(str(artifact), copy_to=tmp_path / "copy"), Quiet()),
                  lambda: unshard(artifact, tmp_path / "rebuilt")):
        with pytest.raises(IntegrityError, match=f"{victim.name}: block [0-9]+ .* has blake3 [0-9a-f]{{64}}, "):
            check()
    assert not (tmp_path / "copy" / victim.name).exists()


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
    def parse(files: list[dict], block_size: object = m.BLOCK_SIZE, version: int = m.MANIFEST_VERSION) -> Manifest:
        body = {"manifestVersion": version, "files": files, "blockSize": block_size}
        return Manifest.from_json(json.dumps(body).encode())

    digest = hashlib.sha256(b"x").hexdigest()
    size = m.BLOCK_SIZE + 1  # two blocks
    with pytest.raises(IntegrityError, match=f"f: 1 block digests in the manifest for {size} bytes"):
        parse([{"path": "f", "size": size, "blocks": [digest]}])
    with pytest.raises(IntegrityError, match="f: 'zz' in the manifest is not a digest"):
        parse([{"path": "f", "size": 1, "blocks": ["zz"]}])
    # A block hash this release does not know is refused, with blocks or without (a whole-file sha256 beside it).
    for name in ("md5", "BLAKE3", "", None, 3, True, [], {}, ["blake3"]):
        for entry in ({"blocks": [digest]}, {"sha256": digest}, {"sha256": digest, "blocks": [digest]}):
            with pytest.raises(IntegrityError, match=r"entry 'f': blockHash .* is none this release checks "
                                                     r"\(sha256, blake3\)"):
                parse([{"path": "f", "size": 1, **entry, "blockHash": name}], version=2)
    blake3_entry = {"path": "f", "size": 1, "blocks": [digest], "blockHash": "blake3"}
    assert parse([blake3_entry], version=2).files == [FileEntry("f", 1, blocks=(digest,), block_hash="blake3")]
    with pytest.raises(IntegrityError, match="manifestVersion 1 with blake3 block digests, which only version 2"):
        parse([blake3_entry], version=1)
    # BLAKE3 blocks of another size next to a whole-file sha256: the sha256 checks the file, as for sha256 blocks.
    assert parse([{**blake3_entry, "sha256": digest}], 4096, version=2).files == [FileEntry("f", 1, digest)]
    with pytest.raises(IntegrityError, match="f: only block digests in the manifest, of blockSize 4096"):
        parse([{"path": "f", "size": 1, "blocks": [digest]}], block_size=4096)
    # Blocks of another size next to a whole-file sha256: the sha256 checks the file.
    assert parse([{"path": "f", "size": 1, "sha256": digest, "blocks": [digest]}], 4096).files == [
        FileEntry("f", 1, digest)]
    with pytest.raises(IntegrityError, match="entry None: not a string"):
        parse([{"size": 1, "sha256": digest}])


@pytest.mark.parametrize("algorithm", ["sha256", "blake3"])
def test_an_empty_file_has_one_block(tmp_path: Path, algorithm: str):
    (tmp_path / "empty").write_bytes(b"")
    hasher = m.BlockHasher(algorithm)
    hasher.update(b"")
    entry = FileEntry("empty", 0, blocks=hasher.result(), block_hash=algorithm)
    assert entry.blocks == (m.BLOCK_HASHES[algorithm](b"").hexdigest(),)
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


def test_the_manifest_version_is_the_lowest_whose_readers_check_every_entry():
    digest = hashlib.sha256(b"x").hexdigest()
    whole, sha_blocks = FileEntry("a", 1, digest), FileEntry("b", 1, blocks=(digest,))
    assert Manifest(files=[whole, sha_blocks]).version == 1
    with_blake3 = Manifest(files=[whole, FileEntry("c", 1, blocks=(digest,), block_hash="blake3")])
    assert json.loads(Manifest(files=[whole, sha_blocks]).to_json())["manifestVersion"] == 1
    assert with_blake3.version == 2 and json.loads(with_blake3.to_json())["manifestVersion"] == 2
    assert Manifest.from_json(with_blake3.to_json()).files == with_blake3.files
    for version in (3, 0, True, "2", None, 2.0, 1.0):
        body = {"manifestVersion": version, "files": [whole.to_dict()]}
        with pytest.raises(IntegrityError, match=f"unsupported manifest version {version!r}: this release reads "
                                                 "versions 1 and 2; run the worker image that prepared it"):
            Manifest.from_json(json.dumps(body).encode())
