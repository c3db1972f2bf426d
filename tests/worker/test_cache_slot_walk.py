"""The root agent's walks of a fill slot a tenant wrote (cache/slot_tree.py, used by store.py): taking it
over, counting it, opening it to the next pod, publishing and removing it, never recursively and never
through a link, fifo or device node the pod planted.

Each test races or plants what a fill pod could (made deterministic by wrapping os.open / os.stat), on a
CacheStore under tmp_path, with a tiny hand-made artifact (`artifact`): nothing is shared with other
modules (no session fixture, no S3 server, no cluster). The tests run as root, as the agent does: the
"pod" is simulated by chown'ing what it wrote to POD_UID.
"""
from __future__ import annotations

import hashlib
import os
import resource
import stat
from pathlib import Path

import pytest

from ferry_worker.cache import slot_tree
from ferry_worker.cache.store import (
    DEFAULT_RESERVATION_S,
    CacheError,
    CacheFull,
    CacheStore,
    Fairness,
    Watermarks,
    cache_key,
)
from ferry_worker.manifest import MANIFEST_NAME, FileEntry, Manifest, write_manifest

POD_UID = 1234
BIG = Watermarks(high=1 << 40, low=1 << 39)
FILES = {"config.json": b"{}", "weights/model.safetensors": b"weights"}

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the agent runs as root; these tests chown and mknod")


def artifact(directory: Path, salt: bytes = b"") -> tuple[str, bytes]:
    """A complete artifact at `directory` (FILES, `salt` making its digest differ): (its key, manifest bytes)."""
    files = {**FILES, "salt": salt} if salt else FILES
    for rel, data in files.items():
        (directory / rel).parent.mkdir(parents=True, exist_ok=True)
        (directory / rel).write_bytes(data)
    digest = write_manifest(directory, Manifest([FileEntry(r, len(d), hashlib.sha256(d).hexdigest())
                                                 for r, d in files.items()]))
    return cache_key(digest), (directory / MANIFEST_NAME).read_bytes()


def fill_in(slot: Path, data: bytes) -> None:
    """What a finished fill pod leaves: FILES and the manifest `data`."""
    for rel, body in FILES.items():
        (slot / rel).parent.mkdir(parents=True, exist_ok=True)
        (slot / rel).write_bytes(body)
    (slot / MANIFEST_NAME).write_bytes(data)


def as_pod(tree: Path) -> None:
    """What the fill pod wrote is its uid's, as it would be."""
    for top, dirs, files in os.walk(tree):
        for name in [top, *(os.path.join(top, n) for n in dirs + files)]:
            os.lchown(name, POD_UID, POD_UID)


@pytest.fixture
def host(tmp_path: Path) -> Path:
    """A host directory outside the cache: a 0600 file owned by POD_UID and a fifo, which no walk may touch."""
    path = tmp_path / "host"
    path.mkdir()
    (path / "secret").write_bytes(b"s" * 4321)
    (path / "secret").chmod(0o600)
    os.chown(path / "secret", POD_UID, POD_UID)
    os.mkfifo(path / "fifo")
    return path


def kept(path: Path) -> tuple:
    st = os.lstat(path)
    return path.read_bytes(), st.st_mode, st.st_uid, st.st_ino


def host_state(host: Path) -> tuple:
    st, own = os.lstat(host / "secret"), os.lstat(host)
    return ((host / "secret").read_bytes(), st.st_mode, st.st_uid, st.st_ino, own.st_mode, own.st_uid,
            sorted(os.listdir(host)), stat.S_ISFIFO(os.lstat(host / "fifo").st_mode))


# -- A1: a directory swapped for a link while the agent takes the slot over -------------------------------

def test_a_directory_swapped_for_a_link_mid_take_over_leads_nowhere(tmp_path, host, monkeypatch):
    """The reproduced attack: `slot/a` swapped for a symlink to a host directory between the agent's check
    and its use made root chown/chmod a host file and unlink a host fifo. Now the slot's root is root's and
    0755 before anything in it is looked at (the pod can no longer rename there), and `a` is opened
    O_NOFOLLOW relative to the root's fd: the swapped-in link is unlinked, the host untouched."""
    before = host_state(host)
    store = CacheStore(tmp_path / "cache", BIG)
    key, data = artifact(tmp_path / "artifact")
    slot = store.slot(key, 100)
    fill_in(slot, data)
    (slot / "a" / "b").mkdir(parents=True)
    (slot / "a" / "b" / "f").write_bytes(b"x")
    as_pod(slot)
    real_open, at_swap = os.open, []

    def racing_open(path, flags, *args, dir_fd=None, **kwargs):
        if path == "a" and dir_fd is not None and not at_swap:  # the walker is about to descend into `a`
            st = os.stat(slot)
            at_swap.append((st.st_uid, stat.S_IMODE(st.st_mode)))
            os.rename(slot / "a", tmp_path / "a-moved")  # (only root can now: the test plays a lucky pod)
            os.symlink(host, slot / "a")
        return real_open(path, flags, *args, dir_fd=dir_fd, **kwargs)

    monkeypatch.setattr(os, "open", racing_open)
    entry = store.adopt(key, 100)
    monkeypatch.undo()
    assert at_swap == [(0, 0o755)]  # taken over before its first entry was touched
    assert host_state(host) == before
    assert not os.path.lexists(entry / "a")
    assert all(os.lstat(p).st_uid == 0 for p in [entry, *entry.rglob("*")])


def test_take_over_unlinks_links_hard_links_and_specials_and_owns_the_rest(tmp_path, host):
    slot = tmp_path / "slot"
    (slot / "d").mkdir(parents=True)
    (slot / "d" / "f").write_bytes(b"12345")
    (slot / "link").symlink_to(host / "secret")
    (slot / "dirlink").symlink_to(host, target_is_directory=True)
    outside = tmp_path / "outside"
    outside.write_bytes(b"hard")
    os.link(outside, slot / "hard")  # chown'ing the slot's name would chown the outside file's inode too
    os.mkfifo(slot / "fifo")
    as_pod(slot)
    os.chmod(outside, 0o600)
    before = host_state(host), kept(outside)
    totals = slot_tree.take_over(slot)
    assert sorted(p.relative_to(slot).as_posix() for p in slot.rglob("*")) == ["d", "d/f"]
    assert totals.size == 5 and (host_state(host), kept(outside)) == before
    assert [(os.stat(p).st_uid, stat.S_IMODE(os.stat(p).st_mode)) for p in (slot, slot / "d", slot / "d" / "f")] \
        == [(0, 0o755), (0, 0o755), (0, 0o444)]


# -- A2: trees deeper than Python's recursion ---------------------------------------------------------------

@pytest.fixture
def deep_ok(tmp_path: Path):
    """Whatever a test leaves under tmp_path is removed without recursion: pytest's own cleanup (rmtree)
    would die on a deep tree left by a failing test."""
    yield
    for child in tmp_path.iterdir():
        if child.is_dir() and not child.is_symlink():
            slot_tree.remove_tree(child)



def deep_tree(root: Path, depth: int) -> None:
    """`depth` nested directories under `root`, a file at the bottom, the pod's: made through fds (the path is
    long)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.fchown(child, POD_UID, POD_UID)
            os.close(fd)
            fd = child
        os.close(os.open("bottom", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
    finally:
        os.close(fd)


def test_a_1200_deep_slot_breaks_no_walk_and_is_refused_and_removed(tmp_path, deep_ok):
    """rglob, os.walk and rmtree recurse: a slot 1200 directories deep made usage(), namespace_usage(),
    every other tenant's slot() and adopt() raise RecursionError, which the driver does not catch."""
    store = CacheStore(tmp_path / "cache", BIG, fairness=Fairness(namespace_share=1 << 40))
    key, _ = artifact(tmp_path / "artifact")
    other, _ = artifact(tmp_path / "other", salt=b"other")
    slot = store.slot(key, 100, "team-a")
    deep_tree(slot, 1200)
    assert store.usage() == 100  # the reservation; nothing raised
    # Too deep to count whole (bytes could hide past the bound): it counts as team-a's whole share, so team-a
    # fills nothing more while it lives; another namespace's fill is not held up.
    assert store.namespace_usage("team-a") == 1 << 40
    with pytest.raises(CacheFull, match="namespace team-a"):
        store.slot(other, 100, "team-a")
    assert store.slot(other, 100, "team-b").is_dir()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, len(os.listdir("/proc/self/fd")) + 100), hard))
    try:  # far fewer fds than levels: the walk holds at most 65, the removal FLAT_DEPTH
        with pytest.raises(CacheError, match=f"the fill of {key} left a directory more than 64 levels deep .*removed"):
            store.adopt(key, 100)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert not (tmp_path / "cache" / "filling" / key).exists() and not (tmp_path / "cache" / "slots" / key).exists()


def test_a_deep_tree_left_in_a_slot_is_replaced_by_an_empty_one(tmp_path, deep_ok):
    store = CacheStore(tmp_path / "cache", BIG)
    key, _ = artifact(tmp_path / "artifact")
    (store.root / "filling" / key).mkdir()  # left by a fill whose adoption never ran
    deep_tree(store.root / "filling" / key, 1200)
    slot = store.slot(key, 100)
    assert list(slot.iterdir()) == [] and stat.S_IMODE(slot.stat().st_mode) == 0o777


def test_remove_tree_removes_any_depth_through_no_link(tmp_path, host, deep_ok):
    tree = tmp_path / "tree"
    tree.mkdir()
    deep_tree(tree, 300)
    (tree / "link").symlink_to(host, target_is_directory=True)
    before = host_state(host)
    slot_tree.remove_tree(tree)
    assert not tree.exists() and host_state(host) == before and not list(tmp_path.glob(".ferry-flat-*"))


# -- A3: counting a live slot follows nothing -----------------------------------------------------------------

def test_usage_never_stats_what_a_link_in_a_live_slot_names(tmp_path, host, monkeypatch):
    """A link's target was stat'ed (is_file follows): /etc/shadow's size learned, or the agent hung on a link
    into a stuck FUSE mount while it held a key's lock."""
    store = CacheStore(tmp_path / "cache", BIG, fairness=Fairness(namespace_share=1 << 40))
    key, _ = artifact(tmp_path / "artifact")
    slot = store.slot(key, 100, "team-a")
    (slot / "link").symlink_to(host / "secret")
    (slot / "dirlink").symlink_to(host, target_is_directory=True)
    (slot / "w").write_bytes(b"w" * 10000)
    reached = watch_host(monkeypatch, host)
    used = (store.usage(), store.namespace_usage("team-a"))
    monkeypatch.undo()
    assert reached == [] and used[0] == used[1] >= 10000


def watch_host(monkeypatch, host: Path) -> list[str]:
    """Every os.stat/lstat/open/scandir that reaches into `host` (after links, where the call follows them)."""
    real = {name: getattr(os, name) for name in ("stat", "lstat", "open", "scandir", "readlink")}
    reached, busy = [], []

    def where(path, dir_fd, follow: bool) -> str:
        if isinstance(path, int):
            return real["readlink"](f"/proc/self/fd/{path}")
        path = os.fsdecode(path)
        if dir_fd is not None and not os.path.isabs(path):
            path = os.path.join(real["readlink"](f"/proc/self/fd/{dir_fd}"), path)
        if follow:
            return os.path.realpath(path)
        return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))

    def watched(name: str, follows):
        def call(path, *args, **kwargs):
            if not busy:
                busy.append(1)
                try:
                    place = where(path, kwargs.get("dir_fd"), follows(args, kwargs))
                    if place == str(host) or place.startswith(f"{host}/"):
                        reached.append(f"{name} {place}")
                except OSError:
                    pass
                finally:
                    busy.pop()
            return real[name](path, *args, **kwargs)
        return call

    monkeypatch.setattr(os, "stat", watched("stat", lambda a, k: k.get("follow_symlinks", True)))
    monkeypatch.setattr(os, "lstat", watched("lstat", lambda a, k: False))
    monkeypatch.setattr(os, "open", watched("open", lambda a, k: not (a or [k.get("flags", 0)])[0] & os.O_NOFOLLOW))
    monkeypatch.setattr(os, "scandir", watched("scandir", lambda a, k: True))
    return reached


# -- A4: a sparse file counts what it occupies, and is still refused on its size -----------------------------

def test_a_sparse_file_in_a_live_slot_fills_no_books_but_is_refused_on_adoption(tmp_path):
    """A 1 TiB sparse file made usage() say 1 TiB: every other namespace's fill got CacheFull."""
    store = CacheStore(tmp_path / "cache", Watermarks(high=1 << 30, low=1 << 29),
                       fairness=Fairness(namespace_share=1 << 30))
    key, data = artifact(tmp_path / "artifact")
    other, _ = artifact(tmp_path / "other", salt=b"other")
    slot = store.slot(key, 100, "team-a")
    (slot / MANIFEST_NAME).write_bytes(data)
    with open(slot / "huge", "wb") as f:
        f.truncate(1 << 40)
    assert store.usage() < 1 << 20 and store.namespace_usage("team-a") < 1 << 20
    assert store.slot(other, 1 << 20, "team-b").is_dir()  # room for another namespace's fill
    with pytest.raises(CacheError, match=f"the fill of {key} left {(1 << 40) + len(data)} bytes, more than"):
        store.adopt(key, 100)
    assert not (tmp_path / "cache" / "filling" / key).exists()


# -- A1/B1: fifos and device nodes are unlinked, never opened -------------------------------------------------

def test_fifos_and_device_nodes_are_removed_by_adopt_without_being_opened(tmp_path, monkeypatch):
    store = CacheStore(tmp_path / "cache", BIG)
    key, data = artifact(tmp_path / "artifact")
    slot = store.slot(key, 100)
    fill_in(slot, data)
    os.mkfifo(slot / "fifo")
    os.mknod(slot / "weights" / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    as_pod(slot)
    real_open, opened = os.open, []

    def recording_open(path, flags, *args, **kwargs):
        opened.append(os.path.basename(os.fsdecode(path)))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", recording_open)
    entry = store.adopt(key, 100)
    monkeypatch.undo()
    assert "fifo" not in opened and "null" not in opened
    assert sorted(p.relative_to(entry).as_posix() for p in entry.rglob("*")) == sorted(
        [MANIFEST_NAME, *FILES, "weights"])


# -- fill() and a slot a fill pod still holds -------------------------------------------------------------------

def test_fill_refuses_a_key_whose_slot_a_fill_pod_has_reserved(tmp_path):
    now = [1000.0]
    store = CacheStore(tmp_path / "cache", BIG, clock=lambda: now[0])
    key, _ = artifact(tmp_path / "artifact")
    slot = store.slot(key, 100, "team-a")
    (slot / "half-written").write_bytes(b"...")
    digest = "sha256:" + key
    with pytest.raises(CacheError, match=f"{key} has a live fill slot reservation"):
        store.fill(tmp_path / "artifact", digest)
    assert (slot / "half-written").exists() and stat.S_IMODE(slot.stat().st_mode) == 0o777  # not taken over
    now[0] += DEFAULT_RESERVATION_S + 1  # the pod's time is up: the admin's fill takes the slot over
    assert store.fill(tmp_path / "artifact", digest) == store.entry(key)


def test_a_file_still_open_for_writing_is_not_adopted(tmp_path):
    """The chmod stops new writers, not an fd the pod (or a process it handed one) still holds, which could
    change the bytes after they are verified and poison the entry for every tenant: such a file is unlinked
    (no read lease while a writer or a writable mapping exists), and the fill stays unfinished."""
    store = CacheStore(tmp_path / "cache", BIG)
    key, data = artifact(tmp_path / "artifact")
    slot = store.slot(key, 100, "team-a")
    fill_in(slot, data)
    as_pod(slot)
    held = os.open(slot / "config.json", os.O_WRONLY)  # a writer that outlives the pod
    try:
        with pytest.raises(CacheError, match="unfinished"):
            store.adopt(key, 100)
        os.write(held, b"EVIL")  # lands in the unlinked inode, in no entry
    finally:
        os.close(held)
    assert store.entry(key) is None and not (slot / "config.json").exists()
    store.slot(key, 100, "team-a")  # the next fill pod: the rest was kept
    fill_in(slot, data)
    assert store.adopt(key, 100) == store.entry(key)
    assert (store.entry(key) / "config.json").read_bytes() == FILES["config.json"]


def test_remove_tree_clears_a_wide_directory_in_batches(tmp_path, monkeypatch):
    """Millions of entries in one directory must not be held in memory at once (the agent's limit is 512 Mi):
    files go batch by batch, empty subdirectories as they are met."""
    monkeypatch.setattr(slot_tree, "CLEAR_BATCH", 7)
    tree = tmp_path / "wide"
    tree.mkdir()
    for i in range(50):
        (tree / f"f{i}").write_bytes(b"x")
    for i in range(20):
        (tree / f"d{i}").mkdir()
    (tree / "d0" / "inner").write_bytes(b"y")
    slot_tree.remove_tree(tree)
    assert not tree.exists()
