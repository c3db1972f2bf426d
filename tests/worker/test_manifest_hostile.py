"""A manifest is hostile input wherever it is read (issue 29): a tenant can
write `ferry-manifest.json` on her own claim, in a cache slot or under her S3
prefix. Every consumer — verify, load, unshard, publish, delete-artifact, the
cache's fill (agent and fill pod), its adoption of a slot, and the S3 readers
(keys built from entry paths) — refuses an absolute path, a `..` path, a path
through a symlinked directory and an oversized manifest, naming the entry (or
the manifest) and why, and a canary file outside the artifact survives: it is
not removed, and its size never shows in the error (nothing stat'ed it).

Shared here: `canary` (a file outside every artifact, 7777 bytes: an error
that stat'ed it would say so; mode 0600, owned by uid 1234, beside a fifo),
`intact` (the canary's bytes, mode, owner and inode, and its directory's
entries, as the fixture made them), `scenario` (a small artifact, made by
write_manifest, spoiled one of four ways: the SCENARIOS), `hostile_manifest`
(raw manifest JSON, bypassing FileEntry's checks) and `refused` (runs a
consumer, checks the error's words and the canary). Artifacts are a few bytes
of plain files; no vLLM, no cluster. The agent's own adoption over gRPC is in
test_cache_agent.py (test_a_fill_pods_manifest_cannot_lead_the_agent_out_of_its_slot).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from ferry_worker import manifest as m
from ferry_worker.cache.fill_slot import fill_slot
from ferry_worker.cache.store import CacheError, CacheStore, Watermarks, cache_key, keep_verified
from ferry_worker.load.run import LoadRequest, load
from ferry_worker.manifest import (
    MANIFEST_NAME,
    FileEntry,
    IntegrityError,
    Manifest,
    atomic_file,
    read_manifest,
    verify,
    write_manifest,
)
from ferry_worker.paths import UnsafePathError, open_beneath, unlink_beneath
from ferry_worker.shard.unshard import unshard
from ferry_worker.tensorize.delete import delete_artifact
from ferry_worker.tensorize.errors import ArtifactError, StoreError
from ferry_worker.tensorize.publish import PublishJob

CANARY_BYTES = b"c" * 7777
BIG = Watermarks(high=1 << 40, low=1 << 39)
SCENARIOS = ("absolute", "dotdot", "symlinked-dir", "oversized")


class Quiet:
    def report(self, loaded: bool, reason: str, message: str) -> None:
        pass


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


CANARY_UID = 1234
_made: dict[Path, tuple] = {}  # each canary's state as its fixture made it


def canary_state(canary: Path) -> tuple:
    st = os.lstat(canary)
    return canary.read_bytes(), st.st_mode, st.st_uid, st.st_ino, sorted(os.listdir(canary.parent))


def intact(canary: Path) -> None:
    """The canary's bytes, mode, owner and inode, and its directory's entries (a fifo beside it), unchanged:
    nothing wrote, chmod'ed, chown'ed, replaced or unlinked anything there."""
    assert canary_state(canary) == _made[canary]


@pytest.fixture
def canary(tmp_path: Path) -> Path:
    path = tmp_path / "outside" / "canary"
    path.parent.mkdir()
    path.write_bytes(CANARY_BYTES)
    path.chmod(0o600)
    if os.geteuid() == 0:  # a chown to root, the agent's take-over, would show
        os.chown(path, CANARY_UID, CANARY_UID)
    os.mkfifo(path.parent / "fifo")  # an unlink of what is not a regular file would show
    _made[path] = canary_state(path)
    yield path
    _made.pop(path, None)


def build(directory: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (directory / rel).parent.mkdir(parents=True, exist_ok=True)
        (directory / rel).write_bytes(data)
    write_manifest(directory, Manifest([FileEntry(rel, len(data), sha(data)) for rel, data in files.items()]))
    return directory


def hostile_manifest(entries: list[dict]) -> bytes:
    """A manifest as a tenant would write it: raw JSON, no FileEntry check on the way."""
    return json.dumps({"manifestVersion": m.MANIFEST_VERSION, "files": entries}).encode()


def entry(path: str) -> dict:
    return {"path": path, "size": 5, "sha256": sha(b"other")}


def scenario(kind: str, tmp_path: Path, canary: Path) -> tuple[Path, list[str]]:
    """An artifact spoiled the `kind` way (the canary as its target), and the words its refusal must hold."""
    artifact = build(tmp_path / "artifact", {"config.json": b"{}", "model.safetensors": b"weights"})
    good = [entry for entry in json.loads((artifact / MANIFEST_NAME).read_bytes())["files"]]
    if kind == "absolute":
        (artifact / MANIFEST_NAME).write_bytes(hostile_manifest(good + [entry(str(canary))]))
        return artifact, [repr(str(canary)), "absolute path", m.NOT_FERRYS]
    if kind == "dotdot":
        (artifact / MANIFEST_NAME).write_bytes(hostile_manifest(good + [entry("a/../../outside/canary")]))
        return artifact, ["'a/../../outside/canary'", "path segment '..'", m.NOT_FERRYS]
    if kind == "symlinked-dir":  # a valid path, through a link the tenant planted
        (artifact / "sub").symlink_to(canary.parent, target_is_directory=True)
        (artifact / MANIFEST_NAME).write_bytes(hostile_manifest(good + [entry("sub/canary")]))
        return artifact, ["'sub/canary'", "'sub' is a symbolic link"]
    with open(artifact / MANIFEST_NAME, "r+b") as f:  # sparse: cheap to make, refused before it is read
        f.truncate(m.MAX_MANIFEST_BYTES + 1)
    return artifact, [MANIFEST_NAME, f"more than {m.MAX_MANIFEST_BYTES} bytes"]


def refused(call, canary: Path, words: list[str], errors=(IntegrityError,)) -> str:
    with pytest.raises(errors) as info:
        call()
    message = str(info.value)
    for word in words:
        assert word in message, (word, message)
    assert str(len(CANARY_BYTES)) not in message  # the outside file was never stat'ed
    intact(canary)
    return message


# -- the parser --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path, why", [
    ("/etc/passwd", "absolute path"),
    ("a/../../etc/x", "path segment '..'"),
    ("./a", "path segment '.'"),
    ("a//b", "path segment ''"),
    ("", "empty"),
    ("a\\..\\b", "backslash"),
    ("a\x00b", "control character"),
    ("a\nb", "control character"),
    ("x" * 1025, "1025 bytes long, more than 1024"),
    ("a/" + "y" * 256, "a segment of 256 bytes, more than 255"),
    ("/".join(["d"] * 33), "33 segments deep, more than 32"),
    ("\ud800", "not valid UTF-8"),
    (MANIFEST_NAME, "a name Ferry reserves"),
    (f"dir/.x{m.TMP_MARKER}-1-2", "a name Ferry reserves"),
    (".ferry-pending.json", "a name Ferry reserves"),
    (7, "not a string"),
])
def test_a_bad_entry_path_is_refused_naming_it(path, why):
    with pytest.raises(IntegrityError) as info:
        Manifest.from_json(hostile_manifest([entry("ok"), entry(path)]))
    message = str(info.value)
    assert message.startswith(f"{MANIFEST_NAME} entry ") and why in message and m.NOT_FERRYS in message
    assert repr(path)[:100] in message or isinstance(path, str) and len(path) > 200
    with pytest.raises(IntegrityError, match="entry"):
        FileEntry(path, 5, sha(b"other"))  # the writers' side holds the same rule


@pytest.mark.parametrize("size", [-1, True, 1.5, "5", None, m.MAX_TOTAL_BYTES + 1])
def test_a_size_that_is_not_a_byte_count_is_refused(size):
    with pytest.raises(IntegrityError, match=r"entry 'f': size .* is not a byte count"):
        Manifest.from_json(hostile_manifest([{**entry("f"), "size": size}]))


def test_duplicates_collisions_and_oversized_manifests_are_refused():
    with pytest.raises(IntegrityError, match="entry 'f': listed twice"):
        Manifest.from_json(hostile_manifest([entry("f"), entry("f")]))
    with pytest.raises(IntegrityError, match="entry 'f/g': 'f' is listed as a file too"):
        Manifest.from_json(hostile_manifest([entry("f"), entry("f/g")]))
    with pytest.raises(IntegrityError, match=f"100001 entries, more than {m.MAX_ENTRIES}"):
        Manifest.from_json(hostile_manifest([entry(f"f{i}") for i in range(m.MAX_ENTRIES + 1)]))
    half = {"size": m.MAX_TOTAL_BYTES // 2 + 1, "sha256": sha(b"")}
    with pytest.raises(IntegrityError, match=f"bytes in all, more than {m.MAX_TOTAL_BYTES}"):
        Manifest.from_json(hostile_manifest([{"path": "a", **half}, {"path": "b", **half}]))
    with pytest.raises(IntegrityError, match=f"more than {m.MAX_MANIFEST_BYTES}"):
        Manifest.from_json(b" " * (m.MAX_MANIFEST_BYTES + 1))
    for body in (b"[1]", b"{not json", b"[" * 100_000, json.dumps({"manifestVersion": 1, "files": {}}).encode()):
        with pytest.raises(IntegrityError, match=m.NOT_FERRYS):
            Manifest.from_json(body)


def test_the_manifest_is_never_read_through_a_symlink_or_from_a_fifo(tmp_path, canary):
    artifact = tmp_path / "artifact"
    artifact.mkdir()
    (artifact / MANIFEST_NAME).symlink_to(canary)
    refused(lambda: read_manifest(artifact), canary, [f"'{MANIFEST_NAME}' is a symbolic link"])
    (artifact / MANIFEST_NAME).unlink()
    os.mkfifo(artifact / MANIFEST_NAME)  # opened without blocking, refused
    refused(lambda: read_manifest(artifact), canary, ["is not a regular file"])


# -- the helpers: no component followed ------------------------------------------------------------------

def test_open_unlink_and_write_beneath_follow_no_symlink(tmp_path, canary):
    root = tmp_path / "root"
    root.mkdir()
    (root / "sub").symlink_to(canary.parent, target_is_directory=True)
    (root / "leaf").symlink_to(canary)
    for relative, link in (("sub/canary", "sub"), ("leaf", "leaf")):
        with pytest.raises(UnsafePathError, match=f"'{link}' is a symbolic link"):
            open_beneath(root, relative)
    assert unlink_beneath(root, "sub/canary") is False
    with pytest.raises(UnsafePathError, match=r"path segment '\.\.'"):
        unlink_beneath(root, "../outside/canary")
    with pytest.raises(UnsafePathError, match="'sub' is a symbolic link"):
        with atomic_file(root / "sub" / "canary", beneath=root) as f:
            f.write(b"overwritten")
    assert unlink_beneath(root, "leaf") is True  # the link itself goes, never its target
    intact(canary)  # no temporary file beside it either


# -- each consumer ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", SCENARIOS)
def test_verify_load_unshard_and_publish_refuse_by_name(kind, tmp_path, canary):
    artifact, words = scenario(kind, tmp_path, canary)
    refused(lambda: verify(artifact), canary, words)
    refused(lambda: load(LoadRequest(str(artifact)), Quiet()), canary, words)
    refused(lambda: load(LoadRequest(str(artifact), copy_to=tmp_path / "copy"), Quiet()), canary, words)
    refused(lambda: unshard(artifact, tmp_path / "rebuilt"), canary, words)
    refused(lambda: PublishJob.prepare(artifact, str(tmp_path / "published")), canary, words,
            (IntegrityError, ArtifactError))


@pytest.mark.parametrize("kind", SCENARIOS)
def test_delete_artifact_refuses_or_removes_nothing_outside(kind, tmp_path, canary):
    artifact, words = scenario(kind, tmp_path, canary)
    if kind == "symlinked-dir":  # a valid manifest: the artifact goes, nothing through the link does
        delete_artifact(str(artifact))
        intact(canary)
        assert not (artifact / MANIFEST_NAME).exists()
        return
    refused(lambda: delete_artifact(str(artifact)), canary, words, StoreError)
    assert (artifact / "config.json").exists()  # nothing was deleted on the word of that manifest


def test_delete_artifact_refuses_a_hostile_pending_record(tmp_path, canary):
    out = tmp_path / "out"
    out.mkdir()
    (out / ".ferry-pending.json").write_text(json.dumps({"files": ["../outside/canary"]}))
    refused(lambda: delete_artifact(str(out)), canary, ["'../outside/canary'", "path segment '..'"], StoreError)


@pytest.mark.parametrize("kind", SCENARIOS)
def test_the_cache_fill_refuses_by_name_and_removes_nothing_outside(kind, tmp_path, canary):
    """The agent's `fill` (and `ferry cache fill`) from a claim, twice, and a fill pod's `fill-slot` into a
    slot where an earlier pod planted a link to the canary's directory."""
    artifact, words = scenario(kind, tmp_path, canary)
    digest = "sha256:" + sha((artifact / MANIFEST_NAME).read_bytes())
    store = CacheStore(tmp_path / "cache", BIG)
    for _ in range(2):
        refused(lambda: store.fill(artifact, digest), canary, words)
    slot = tmp_path / "slot"
    slot.mkdir()
    (slot / "sub").symlink_to(canary.parent, target_is_directory=True)
    refused(lambda: fill_slot(slot, artifact, digest, None), canary, words)


def test_keep_verified_removes_a_planted_link_never_its_target(tmp_path, canary):
    """What a fill pod runs first in its slot (and the agent after taking the slot over): an entry behind a
    link is not kept, the link goes, the file it led to stays."""
    slot = tmp_path / "slot"
    slot.mkdir()
    (slot / "sub").symlink_to(canary.parent, target_is_directory=True)
    (slot / "deep" / "er").mkdir(parents=True)
    (slot / "deep" / "er" / "link").symlink_to(canary)
    wanted = [FileEntry("sub/canary", 5, sha(b"other")), FileEntry("deep/er/link", 5, sha(b"other"))]
    assert keep_verified(slot, wanted, "sha256:" + "0" * 64) == set()
    assert not (slot / "sub").is_symlink() and not (slot / "deep" / "er" / "link").is_symlink()
    intact(canary)


@pytest.mark.parametrize("kind", SCENARIOS)
def test_the_agent_adopts_no_slot_a_fill_pod_filled_with_a_hostile_manifest(kind, tmp_path, canary):
    """The measured attack: the root agent's adoption of what a tenant's fill pod left in its slot
    unlinked files outside the cache that the slot's manifest named."""
    artifact, words = scenario(kind, tmp_path, canary)
    data = (artifact / MANIFEST_NAME).read_bytes()
    key = cache_key("sha256:" + sha(data))
    store = CacheStore(tmp_path / "cache", BIG)
    slot = store.slot(key, 100)
    (slot / MANIFEST_NAME).write_bytes(data)
    if kind == "symlinked-dir":
        (slot / "sub").symlink_to(canary.parent, target_is_directory=True)
        # A valid manifest: the planted link is removed unfollowed, and the fill is unfinished.
        words = ["unfinished: 3 files missing"]
    elif kind == "oversized":
        words = ["left no manifest whose sha256 is"]  # never read: refused for its size
    else:
        words = [f"the fill of {key} left a manifest Ferry refuses", *words, "removed"]
    refused(lambda: store.adopt(key, 100), canary, words, CacheError)
    assert store.entry(key) is None
    assert kind == "symlinked-dir" or not (tmp_path / "cache" / "filling" / key).exists()


# -- S3: keys built from entry paths ----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["absolute", "dotdot", "oversized"])
def test_s3_readers_build_no_key_from_a_hostile_entry(kind, s3_server, s3_env, bucket, tmp_path, canary):
    """delete-artifact, load, verify and a fill pod's S3 fill refuse a manifest naming an absolute or `..`
    path before any key is built from it (the object such a key names survives), and one too large to be
    Ferry's before it is parsed."""
    from ferry_worker.tensorize.verify import verify_artifact

    client = s3_server.client()
    client.put_object(Bucket=bucket, Key="other/canary", Body=CANARY_BYTES)
    path = {"absolute": "/other/canary", "dotdot": "../other/canary"}.get(kind)
    data = hostile_manifest([entry(path)]) if path else b" " * (m.MAX_MANIFEST_BYTES + 1)
    client.put_object(Bucket=bucket, Key=f"art/{MANIFEST_NAME}", Body=data)
    uri = f"s3://{bucket}/art"
    words = ([repr(path), "absolute path" if kind == "absolute" else "path segment '..'"] if path else
             [f"{uri}/{MANIFEST_NAME}: more than {m.MAX_MANIFEST_BYTES} bytes"])
    refused(lambda: delete_artifact(uri), canary, words, StoreError)
    refused(lambda: load(LoadRequest(uri), Quiet()), canary, words, (IntegrityError, StoreError))
    refused(lambda: verify_artifact(uri), canary, words, StoreError)
    slot = tmp_path / "slot"
    slot.mkdir()
    refused(lambda: fill_slot(slot, uri, "sha256:" + sha(data), None), canary, words, (IntegrityError, StoreError))
    assert client.get_object(Bucket=bucket, Key="other/canary")["Body"].read() == CANARY_BYTES
