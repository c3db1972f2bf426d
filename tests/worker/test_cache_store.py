"""The node cache's store (issue 17, first step): one verified copy per
manifest digest, never visible half-filled, resumable after a SIGKILL landed
between two files, shared by concurrent fills, LRU eviction between
watermarks that spares mounted and pinned entries, and a corrupt entry
refused and refilled. Artifacts are real `ferry shard` output."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import pytest

from file_damage import flip_byte
from ferry_worker.cache.store import CacheError, CacheFull, CacheStore, CorruptEntry, Watermarks, cache_key
from ferry_worker.manifest import MANIFEST_NAME, IntegrityError, manifest_digest, read_manifest

BIG = Watermarks(high=1 << 40, low=1 << 39)


@pytest.fixture(scope="module")
def artifacts(cache_artifacts) -> dict[str, Path]:
    return cache_artifacts


def digest(artifact: Path) -> str:
    return manifest_digest(artifact)


def counted() -> tuple[list[int], Callable[[int], None]]:
    seen = [0]

    def on_bytes(n: int) -> None:
        seen[0] += n
    return seen, on_bytes


def test_a_fill_is_verified_read_only_and_done_once(tmp_path, artifacts):
    store = CacheStore(tmp_path / "cache", BIG)
    source = artifacts["a0"]
    first, on_bytes = counted()
    entry = store.fill(source, digest(source), on_bytes=on_bytes)
    manifest = read_manifest(source)
    assert first[0] == sum(e.size for e in manifest.files)
    assert manifest_digest(entry) == digest(source)  # `ferry load --expected-digest` works on the entry itself
    assert all((entry / e.path).read_bytes() == (source / e.path).read_bytes() for e in manifest.files)
    assert all(((entry / e.path).stat().st_mode & 0o222) == 0 for e in manifest.files)
    again, on_bytes = counted()
    assert store.fill(source, digest(source), on_bytes=on_bytes) == entry
    assert again[0] == 0  # the source is not read a second time


def test_a_rank_subset_holds_only_its_rank_files(tmp_path, artifacts):
    store = CacheStore(tmp_path / "cache", BIG)
    source = artifacts["a0"]
    entry = store.fill(source, digest(source), ranks=[1])
    names = {p.name for p in entry.iterdir()}
    assert "model-rank-1-part-0.safetensors" in names and "model-rank-0-part-0.safetensors" not in names
    assert "config.json" in names and MANIFEST_NAME in names
    store.check(cache_key(digest(source), [1]))  # the subset verifies as a subset


def test_concurrent_fills_of_one_artifact_read_the_source_once(tmp_path, artifacts):
    store = CacheStore(tmp_path / "cache", BIG)
    source = artifacts["a1"]
    total, on_bytes = counted()
    lock = threading.Lock()

    def locked(n: int) -> None:
        with lock:
            on_bytes(n)
    results = []
    threads = [threading.Thread(target=lambda: results.append(store.fill(source, digest(source), on_bytes=locked)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1
    assert total[0] == sum(e.size for e in read_manifest(source).files)


KILLED_FILL = """
import os, sys, time
from pathlib import Path
sys.path.insert(0, {worker!r})
from ferry_worker.cache.store import CacheStore, Watermarks
store = CacheStore(Path({root!r}), Watermarks(1 << 40, 1 << 39))
def after_file(name):
    Path({marker!r}).write_text(name)
    time.sleep(600)  # held here, one file verified in place, until the test kills us
store.fill(Path({source!r}), {digest!r}, after_file=after_file)
"""


def test_sigkill_mid_fill_leaves_nothing_mountable_and_the_next_fill_resumes(tmp_path, artifacts):
    source, root, marker = artifacts["a2"], tmp_path / "cache", tmp_path / "first-file-done"
    worker = str(Path(__file__).resolve().parents[2] / "worker_image")
    script = KILLED_FILL.format(worker=worker, root=str(root), marker=str(marker), source=str(source),
                                digest=digest(source))
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        for _ in range(600):
            if marker.exists() or proc.poll() is not None:
                break
            threading.Event().wait(0.1)
        assert marker.exists(), f"the fill never reached its first file (exit {proc.poll()})"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL  # the fault landed where we held it
    store = CacheStore(root, BIG)
    key = cache_key(digest(source))
    assert store.entry(key) is None  # half-filled: not an entry
    sizes = {e.path: e.size for e in read_manifest(source).files}
    # Files are copied side by side: the one that reached the hook, and any other that finished by then.
    kept = {p.name for p in (root / "filling" / key).iterdir() if p.name in sizes}
    assert marker.read_text() in kept and len(kept) < len(sizes)
    resumed, on_bytes = counted()
    entry = store.fill(source, digest(source), on_bytes=on_bytes)
    assert resumed[0] == sum(sizes.values()) - sum(sizes[k] for k in kept)  # verified files are not fetched again
    store.check(key)
    assert manifest_digest(entry) == digest(source)


def test_a_corrupt_source_never_becomes_an_entry(tmp_path, artifacts):
    source = tmp_path / "bad"
    shutil.copytree(artifacts["a0"], source)
    victim = source / "model-rank-1-part-0.safetensors"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    store = CacheStore(tmp_path / "cache", BIG)
    with pytest.raises(IntegrityError, match="model-rank-1-part-0.safetensors"):
        store.fill(source, digest(source))
    assert store.entry(cache_key(digest(source))) is None
    with pytest.raises(CacheError, match="not .*the artifact changed"):
        store.fill(source, "sha256:" + "0" * 64)


def test_a_corrupt_entry_is_refused_removed_and_refilled(tmp_path, artifacts):
    store = CacheStore(tmp_path / "cache", BIG)
    source = artifacts["a0"]
    key = cache_key(digest(source))
    entry = store.fill(source, digest(source))
    victim = entry / "model-rank-0-part-0.safetensors"
    victim.chmod(0o644)
    data = bytearray(victim.read_bytes())
    data[-10] ^= 0x01
    victim.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="model-rank-0-part-0.safetensors"):
        store.check(key)
    assert store.entry(key) is None
    refilled, on_bytes = counted()
    store.fill(source, digest(source), on_bytes=on_bytes)
    store.check(key)
    assert refilled[0] > 0


def test_a_mount_verifies_every_byte_unless_recently_verified_and_unchanged(tmp_path, artifacts, monkeypatch):
    """Within reverify_after of the last verification (the fill's, or a mount's) with the files unchanged, a
    mount reads nothing. A change to a file, the window passing, or a file changed too recently for its
    times to show the next change (SETTLE_NS) brings the full check back."""
    import ferry_worker.cache.store as store_module

    reads = []
    real_read = store_module.read_files
    monkeypatch.setattr(store_module, "read_files", lambda *a, **kw: reads.append(1) or real_read(*a, **kw))
    clock = [1000.0]
    store = CacheStore(tmp_path / "cache", BIG, clock=lambda: clock[0], reverify_after=600)
    source = artifacts["a0"]
    key = cache_key(digest(source))
    store.fill(source, digest(source))  # verified on its way in
    reads.clear()
    assert store.mount_entry(key, "pod-a") == (store.entry(key), False) and reads == []

    victim = store.entry(key) / "model-rank-1-part-0.safetensors"
    victim.chmod(0o644)  # a change: the next mount verifies
    with open(victim, "r+b") as writer:  # opened now, written later: the write alone must show
        assert store.mount_entry(key, "pod-b")[1] is True and len(reads) == 1
        # Changed less than SETTLE_NS ago: verified, but not trusted to stay unchanged unseen.
        assert store.mount_entry(key, "pod-c")[1] is True and len(reads) == 2
        time.sleep(store_module.SETTLE_NS / 1e9 + 0.1)
        assert store.mount_entry(key, "pod-d")[1] is True and len(reads) == 3
        assert store.mount_entry(key, "pod-e")[1] is False and len(reads) == 3
        clock[0] += 601
        assert store.mount_entry(key, "pod-f")[1] is True and len(reads) == 4  # the window passed
        assert store.mount_entry(key, "pod-g")[1] is False

        # A byte flipped by a write (nothing else): the next mount verifies and refuses.
        writer.seek(victim.stat().st_size // 2)
        byte = writer.read(1)
        writer.seek(-1, os.SEEK_CUR)
        writer.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(IntegrityError, match="model-rank-1-part-0.safetensors"):
        store.mount_entry(key, "pod-h")
    assert "pod-h" not in store.holders(key)

    # reverify_after 0: every mount verifies.
    store2 = CacheStore(tmp_path / "cache2", BIG)
    store2.fill(source, digest(source))
    assert store2.mount_entry(key, "pod-a")[1] is True and store2.mount_entry(key, "pod-b")[1] is True


def test_a_scrub_rereads_entries_not_verified_lately_and_removes_the_corrupt(tmp_path, artifacts, monkeypatch):
    import ferry_worker.cache.store as store_module

    reads = []
    real_read = store_module.read_files
    monkeypatch.setattr(store_module, "read_files", lambda *a, **kw: reads.append(1) or real_read(*a, **kw))
    monkeypatch.setattr(store_module, "SETTLE_NS", 0)  # files just written count as settled (no 2 s waits)
    clock = [1000.0]
    store = CacheStore(tmp_path / "cache", BIG, clock=lambda: clock[0], reverify_after=3600)
    a0, a1 = artifacts["a0"], artifacts["a1"]
    k0, k1 = cache_key(digest(a0)), cache_key(digest(a1))
    store.fill(a0, digest(a0))
    store.fill(a1, digest(a1))
    flip_byte(store.entry(k0) / "model-rank-0-part-0.safetensors")  # rot after the fill's verification
    reads.clear()
    assert store.scrub(every=7200) == [] and reads == []  # verified within the interval: not read
    clock[0] += 7201
    (problem,) = store.scrub(every=7200)
    assert problem.startswith(k0) and "model-rank-0-part-0.safetensors" in problem and len(reads) == 2
    assert store.entry(k0) is None and store.entry(k1) is not None
    assert store.removals() == {k0: ("corrupt", clock[0])}  # said on the node's labels
    reads.clear()
    assert store.scrub(every=7200) == [] and reads == []  # a1 was stamped by this pass

    # Mounted: it stays for its pod, marked corrupt; a new mount reads it all and refuses it; it goes as
    # its last pod lets go, and a scrub does not read it again meanwhile.
    store.fill(a0, digest(a0))
    assert store.mount_entry(k0, "pod-a")[1] is False
    flip_byte(store.entry(k0) / "model-rank-1-part-0.safetensors")
    clock[0] += 7201
    (problem,) = store.scrub(every=7200)
    assert "model-rank-1-part-0.safetensors" in problem and store.entry(k0) is not None
    assert store.corrupt() == {k0: clock[0]} and store.removals() == {}
    reads.clear()
    with pytest.raises(CorruptEntry, match="found corrupt and is still mounted by 1 pod: "):
        store.mount_entry(k0, "pod-b")  # refused up front: the kubelet's retries read nothing
    assert store.holders(k0) == ["pod-a"] and reads == []
    clock[0] += 7201
    reads.clear()
    assert store.scrub(every=7200) == [] and len(reads) == 1  # a1 only
    store.release(k0, "pod-a")
    assert store.entry(k0) is None and store.corrupt() == {}
    assert store.removals()[k0][0] == "corrupt"


def test_a_scrub_holds_no_lock_while_it_reads_and_treats_a_read_error_as_rot(tmp_path, artifacts, monkeypatch):
    import ferry_worker.cache.store as store_module

    monkeypatch.setattr(store_module, "SETTLE_NS", 0)  # files just written count as settled (stamped)
    store = CacheStore(tmp_path / "cache", BIG)
    a0, a1 = artifacts["a0"], artifacts["a1"]
    k0, k1 = cache_key(digest(a0)), cache_key(digest(a1))
    store.fill(a0, digest(a0))
    store.fill(a1, digest(a1))
    real_read = store_module.read_files
    mounted_meanwhile = []

    def read(root, entries, options, *a, **kw):
        if Path(root).name == k0:  # a mount of the entry being scrubbed, held at this point of the read
            mounter = threading.Thread(target=lambda: mounted_meanwhile.append(store.acquire(k0, "pod-a")))
            mounter.start()
            mounter.join(5)
            raise OSError(5, "Input/output error")  # and the disk fails under the scrub
        return real_read(root, entries, options, *a, **kw)
    monkeypatch.setattr(store_module, "read_files", read)
    problems = store.scrub(every=0)
    assert mounted_meanwhile == [store.entry(k0)]  # the mount was not held up by the scrub
    assert len(problems) == 1 and "Input/output error" in problems[0]
    assert store.corrupt() == {k0: pytest.approx(time.time(), abs=60)}  # mounted: marked, not removed
    assert store.entry(k1) is not None and "verified" in store.listing()["entries"][k1]  # the pass went on


def test_the_agents_scrubber_runs_until_stopped(tmp_path, artifacts):
    from ferry_worker.cache.csi.agent import scrubber

    store = CacheStore(tmp_path / "cache", BIG)
    a0 = artifacts["a0"]
    store.fill(a0, digest(a0))
    flip_byte(store.entry(cache_key(digest(a0))) / "model-rank-0-part-0.safetensors")
    stop = threading.Event()
    worker = threading.Thread(target=scrubber, args=(store, 0.05, stop))
    worker.start()
    try:
        deadline = time.monotonic() + 10
        while store.entry(cache_key(digest(a0))) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.entry(cache_key(digest(a0))) is None
    finally:
        stop.set()
        worker.join(5)
    assert not worker.is_alive()


def test_eviction_is_lru_between_watermarks_and_spares_mounted_and_pinned(tmp_path, artifacts):
    size = sum(e.size for e in read_manifest(artifacts["a0"]).files)
    clock = [1000.0]
    store = CacheStore(tmp_path / "cache", Watermarks(high=int(2.5 * size), low=int(1.2 * size)),
                       clock=lambda: clock[0])
    keys = {}
    for name in ("a0", "a1"):
        clock[0] += 1
        store.fill(artifacts[name], digest(artifacts[name]))
        keys[name] = cache_key(digest(artifacts[name]))
    clock[0] += 1
    store.acquire(keys["a0"], "pod-uid-1")  # a0 is mounted, and now the more recently used
    # a2 does not fit beside a0 and a1: a1 (least recently used of the unmounted) goes, a0 stays.
    store.fill(artifacts["a2"], digest(artifacts["a2"]))
    assert store.entry(keys["a1"]) is None and store.entry(keys["a0"]) is not None
    keys["a2"] = cache_key(digest(artifacts["a2"]))
    assert store.usage() <= int(2.5 * size)
    # With a0 mounted and a2 pinned, nothing can make room for a1: refused, with the reason.
    store.pin(keys["a2"])
    with pytest.raises(CacheFull, match="2 entries that could go are mounted or pinned"):
        store.fill(artifacts["a1"], digest(artifacts["a1"]))
    assert store.entry(keys["a1"]) is None
    # Released and unpinned, a0 is evictable again.
    store.release(keys["a0"], "pod-uid-1")
    store.pin(keys["a2"], False)
    store.fill(artifacts["a1"], digest(artifacts["a1"]))
    assert store.entry(keys["a1"]) is not None and store.entry(keys["a0"]) is None


def test_bad_keys_and_holders_are_refused(tmp_path):
    with pytest.raises(CacheError, match="not a manifest digest"):
        cache_key("sha256:../../etc")
    store = CacheStore(tmp_path / "cache", BIG)
    with pytest.raises(CacheError, match="fill it first"):
        store.acquire(cache_key("sha256:" + "a" * 64), "pod")
    with pytest.raises(ValueError, match="low <= high"):
        Watermarks(high=1, low=2)


def test_the_cache_command_fills_lists_and_checks(tmp_path, artifacts, capsys):
    from ferry_worker.cli import main

    source, root = artifacts["a1"], tmp_path / "cache"
    # No disk floor: what this machine's disk has free is not this test's business (test_the_disk_floor...).
    root_args = ["cache", "--root", str(root), "--eviction-hard", "0", "--margin", "0"]
    assert main([*root_args, "fill", "--source", str(source), "--digest", digest(source),
                 "--ranks", "0"]) == 0
    entry = Path(capsys.readouterr().out.strip())
    assert (entry / "model-rank-0-part-0.safetensors").exists()
    assert main([*root_args, "pin", "--digest", digest(source), "--ranks", "0"]) == 0
    assert main([*root_args, "list"]) == 0
    listing = json.loads(capsys.readouterr().out)
    (meta,) = listing["entries"].values()
    assert meta["pinned"] is True and meta["holders"] == [] and listing["usage"] == meta["bytes"]
    assert main([*root_args, "check", "--digest", digest(source), "--ranks", "0"]) == 0
    # A digest the cache does not hold: one clear line, exit 1.
    assert main([*root_args, "check", "--digest", "sha256:" + "b" * 64]) == 1
    # Evicting one entry by digest: refused while mounted, then gone.
    store = CacheStore(root, BIG)
    key = cache_key(digest(source), [0])
    store.acquire(key, "pod-uid-1")
    assert main([*root_args, "evict", "--digest", digest(source), "--ranks", "0"]) == 1
    store.release(key, "pod-uid-1")
    assert main([*root_args, "evict", "--digest", digest(source), "--ranks", "0"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"evicted": [key]}
    assert store.entry(key) is None


def test_the_cache_command_refuses_a_manifest_naming_files_outside(tmp_path, artifacts, caplog):
    """Issue 29: `ferry cache fill`, run twice on an artifact whose manifest names a file `..` outside the
    cache (or one through a symlinked directory), removed that file on the second run. Now each run refuses the
    manifest, naming the entry, and the file stays (its size in no message: it was never stat'ed)."""
    from ferry_worker.cli import main

    source = tmp_path / "claim"
    shutil.copytree(artifacts["a0"], source)
    outside = tmp_path / "host" / "file"
    outside.parent.mkdir()
    outside.write_bytes(b"h" * 7777)
    root_args = ["cache", "--root", str(tmp_path / "cache"), "--eviction-hard", "0", "--margin", "0"]
    # `..` thrice: out of the agent's staging directory (cache/filling/<key>) to the host file.
    for path, why in (("../../../host/file", "path segment '..'"), ("link/file", "'link' is a symbolic link")):
        body = json.loads((artifacts["a0"] / MANIFEST_NAME).read_bytes())
        body["files"].append({"path": path, "size": 1, "sha256": "0" * 64})
        (source / MANIFEST_NAME).write_text(json.dumps(body))
        (source / "link").unlink(missing_ok=True)
        (source / "link").symlink_to(outside.parent, target_is_directory=True)
        for _ in range(2):
            assert main([*root_args, "fill", "--source", str(source), "--digest", digest(source)]) != 0
            assert outside.read_bytes() == b"h" * 7777
            assert f"entry '{path}': {why}" in caplog.text and "7777" not in caplog.text, caplog.text
            caplog.clear()


def test_the_disk_floor_refuses_a_fill_in_the_kubelets_terms(tmp_path, artifacts):
    """Other writers on the disk count: with the watermarks far away, a fill that would leave less free
    than the kubelet's evictionHard (plus margin) evicts first, and is refused when nothing can go."""
    source = artifacts["a0"]
    size = sum(e.size for e in read_manifest(source).files)
    others = [0]  # bytes other writers put on the disk
    store = CacheStore(tmp_path / "cache", Watermarks(high=1 << 40, low=1 << 39, keep_free=int(7.5 * size)),
                       disk_free=lambda: 10 * size - store.usage() - others[0])
    store.fill(source, digest(source))  # 9 sizes free, of which 7.5 must stay
    others[0] = size  # 8 free: a second artifact would leave 7
    store.acquire(cache_key(digest(source)), "pod-uid-1")
    with pytest.raises(CacheFull, match=r"must keep \d+ \(below that the kubelet reports DiskPressure"):
        store.fill(artifacts["a1"], digest(artifacts["a1"]))
    assert store.entry(cache_key(digest(artifacts["a1"]))) is None
    store.release(cache_key(digest(source)), "pod-uid-1")
    store.fill(artifacts["a1"], digest(artifacts["a1"]))  # the unmounted a0 is evicted to make room
    assert store.entry(cache_key(digest(source))) is None


def test_cache_sizes_take_a_share_of_the_disk_or_bytes():
    from ferry_worker.cache.cli import resolve, size_or_share

    assert resolve(size_or_share("10%"), 1000) == 100
    assert resolve(size_or_share("0"), 1000) == 0
    assert resolve(size_or_share("1Ki"), 1000) == 1024
    for bad in ("110%", "lots", "-5%"):
        with pytest.raises(Exception, match="percentage|not a size"):
            size_or_share(bad)
