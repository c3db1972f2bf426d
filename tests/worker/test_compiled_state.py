"""Compiled state (worker side): harvest a cache root, restore it verified, and refuse every stored state
that is not exactly what its manifest says, leaving vLLM's cache root empty. Shares nothing: each test
makes its own small cache in tmp_path (a real node runs both halves in tests/node/test_compiled_on_node.py)."""
from __future__ import annotations

import io
import json
import os
import sys
import tarfile
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from ferry_worker.compiled.state import (MANIFEST, STATE, Limits, checked_name, device_kind, harvest,
                                         restore)

KEY, DEVICE = "0123456789abcdef0123456789abcdef", "cpu-00112233445566aa"


def cache(root: Path) -> Path:
    """A cache root shaped like vLLM's (torch_compile_cache/<hash>/rank_0_0/...)."""
    files = {"torch_compile_cache/8c1e0b9d21/rank_0_0/backbone/computation_graph.py": b"def f(x):\n  return x\n",
             "torch_compile_cache/8c1e0b9d21/rank_0_0/backbone/cache_key_factors.json": b'{"env": "abc"}',
             "torch_compile_cache/8c1e0b9d21/rank_0_0/inductor_cache/fx/ab/abcdef": os.urandom(70_000),
             "modelinfos/llama.json": b"{}"}
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def published(tmp_path):
    src = cache(tmp_path / "cold")
    store = tmp_path / "store"
    outcome = harvest(src, store, KEY, DEVICE)
    assert outcome.state == "published" and outcome.files == 4
    return src, store


def test_a_harvest_restores_byte_for_byte_and_only_once(tmp_path, published):
    src, store = published
    warm = tmp_path / "warm"
    warm.mkdir()
    outcome = restore(store, KEY, DEVICE, warm)
    assert outcome.state == "restored", outcome
    assert tree(warm) == tree(src)
    assert harvest(src, store, KEY, DEVICE).state == "present"  # the first harvest wins
    assert sorted(p.name for p in (store / KEY).iterdir()) == [DEVICE]  # no staging left


def test_another_key_or_device_finds_nothing_and_says_so(tmp_path, published):
    _, store = published
    dest = tmp_path / "dest"
    dest.mkdir()
    absent = restore(store, KEY.replace("0", "f"), DEVICE, dest)
    assert absent.state == "absent" and "vLLM compiles" in absent.reason
    assert restore(store, KEY, "gpu-00112233445566aa", dest).state == "absent"
    assert list(dest.iterdir()) == []


def test_an_empty_cache_root_is_not_published(tmp_path):
    (tmp_path / "empty" / "torch_compile_cache").mkdir(parents=True)
    assert harvest(tmp_path / "empty", tmp_path / "store", KEY, DEVICE).state == "absent"
    assert not (tmp_path / "store" / KEY / DEVICE).exists()


def refused(store: Path, dest: Path) -> str:
    dest.mkdir(exist_ok=True)
    outcome = restore(store, KEY, DEVICE, dest)
    assert outcome.state == "refused", outcome
    assert list(dest.iterdir()) == [], "nothing may be left for vLLM to load"
    return outcome.reason


def test_one_flipped_byte_fails_verification_and_nothing_is_restored(tmp_path, published):
    _, store = published
    state = store / KEY / DEVICE / STATE
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 1  # inside the 70 kB file's content
    state.write_bytes(bytes(data))
    assert "sha256 differs" in refused(store, tmp_path / "dest")


def test_a_truncated_or_extended_state_is_refused(tmp_path, published):
    _, store = published
    state = store / KEY / DEVICE / STATE
    original = state.read_bytes()
    state.write_bytes(original + b"\0" * 512)
    assert "bytes" in refused(store, tmp_path / "a")
    state.write_bytes(original[:-1024])
    assert "bytes" in refused(store, tmp_path / "b")


def test_a_manifest_for_another_configuration_or_not_one_is_refused(tmp_path, published):
    _, store = published
    path = store / KEY / DEVICE / MANIFEST
    good = json.loads(path.read_text())
    for bad in ({**good, "key": "f" * 32}, {**good, "device": "cpu-ffff"}, {**good, "sha256": "md5:00"},
                {**good, "bytes": -1}, {**good, "bytes": True}, {**good, "format": "other/1"}, [1]):
        path.write_text(json.dumps(bad))
        refused(store, tmp_path / "dest")
    path.write_text("[" * 50_000)
    refused(store, tmp_path / "dest")
    path.write_bytes(b"x" * (70 << 10))  # over the manifest's cap
    refused(store, tmp_path / "dest")


def test_a_symlinked_store_entry_is_never_followed(tmp_path, published):
    _, store = published
    elsewhere = tmp_path / "elsewhere"
    (store / KEY / DEVICE).rename(elsewhere)
    (store / KEY / DEVICE).symlink_to(elsewhere)
    assert "symbolic link" in refused(store, tmp_path / "dest")
    (store / KEY / DEVICE).unlink()
    (store / KEY / DEVICE).mkdir()
    (store / KEY / DEVICE / MANIFEST).symlink_to(elsewhere / MANIFEST)
    assert "symbolic link" in refused(store, tmp_path / "dest2")


def forged(store: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> None:
    """A state.tar with these members and a manifest that matches it exactly (as its producer could write)."""
    import hashlib
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    entry = store / KEY / DEVICE
    entry.mkdir(parents=True, exist_ok=True)
    (entry / STATE).write_bytes(buf.getvalue())
    (entry / MANIFEST).write_text(json.dumps({"format": "ferry-compiled/1", "key": KEY, "device": DEVICE,
                                              "sha256": "sha256:" + hashlib.sha256(buf.getvalue()).hexdigest(),
                                              "bytes": len(buf.getvalue()), "files": len(members)}))


def info(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    i = tarfile.TarInfo(name)
    i.type, i.linkname = kind, link
    return i


@pytest.mark.parametrize("members, words", [
    ([(info("../escape"), b"x")], ".."),
    ([(info("/etc/cron.d/x"), b"x")], "absolute"),
    ([(info("a/./b"), b"x")], "segment"),
    ([(info("link", tarfile.SYMTYPE, "/etc/passwd"), None)], "neither a file nor a directory"),
    ([(info("hard", tarfile.LNKTYPE, "a"), None)], "neither a file nor a directory"),
    ([(info("dev", tarfile.CHRTYPE), None)], "neither a file nor a directory"),
    ([(info("fifo", tarfile.FIFOTYPE), None)], "neither a file nor a directory"),
    ([(info("twice"), b"a"), (info("twice"), b"b")], "exists"),
])
def test_a_hostile_archive_that_matches_its_manifest_is_still_refused(tmp_path, members, words):
    store = tmp_path / "store"
    forged(store, members)
    reason = refused(store, tmp_path / "dest")
    assert words in reason.lower() or words in reason, reason
    assert not (tmp_path / "escape").exists()


def test_the_limits_fail_closed(tmp_path, published):
    _, store = published
    dest = tmp_path / "dest"
    dest.mkdir()
    assert restore(store, KEY, DEVICE, dest, Limits(files=2)).state == "refused"
    assert restore(store, KEY, DEVICE, dest, Limits(bytes=1000)).state == "refused"
    assert list(dest.iterdir()) == []
    with pytest.raises(Exception, match="more than"):
        harvest(cache(tmp_path / "big"), tmp_path / "s2", KEY, DEVICE, Limits(files=2))


def test_names_and_the_device_kind():
    assert checked_name(KEY, "key") == KEY
    for bad in ("", "../x", "A" * 3, "a/b", "x" * 81):
        with pytest.raises(ValueError):
            checked_name(bad, "key")
    kind = device_kind()
    assert checked_name(kind, "device") == kind and kind.startswith(("cpu-", "gpu-"))
    assert device_kind() == kind  # stable


def test_a_damaged_entry_is_replaced_by_the_next_harvest(tmp_path, published):
    src, store = published
    state = store / KEY / DEVICE / STATE
    data = bytearray(state.read_bytes())
    data[-3000] ^= 1
    state.write_bytes(bytes(data))
    outcome = harvest(src, store, KEY, DEVICE)
    assert outcome.state == "published" and "replaced the entry there" in outcome.reason
    dest = tmp_path / "dest"
    dest.mkdir()
    assert restore(store, KEY, DEVICE, dest).state == "restored" and tree(dest) == tree(src)
    assert sorted(p.name for p in (store / KEY).iterdir()) == [DEVICE]


# --- review findings ------------------------------------------------------------------------------------------

def test_an_extended_header_larger_than_a_path_is_refused_before_it_is_read():
    """tarfile reads a PAX or GNU long-name header whole into memory: over 64 KiB it is refused."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        store = Path(d) / "store"
        forged(store, [(info("x" * 70_000), b"x")])  # a PAX path record of 70 kB
        reason = refused(store, Path(d) / "dest")
        assert "extended header" in reason, reason


def test_a_sparse_member_is_refused(tmp_path):
    sparse = info("s", tarfile.GNUTYPE_SPARSE)
    forged(tmp_path / "store", [(sparse, b"x" * 10)])
    assert refused(tmp_path / "store", tmp_path / "dest")


@pytest.mark.parametrize("pax", [
    {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": "s", "GNU.sparse.realsize": "10"},
    {"GNU.sparse.map": "0,5,5,5"},
    {"GNU.sparse.size": "10"},
    {"hdrcharset": "BINARY"},
])
def test_pax_records_harvest_never_writes_are_refused_before_tarfile_acts_on_them(tmp_path, pax):
    """PAX headers can declare a member sparse (tarfile would then read a sparse map of any length from the
    stream before the member reaches the checks) or change how names decode: refused at the header."""
    member = info("s")
    member.pax_headers = dict(pax)
    forged(tmp_path / "store", [(member, b"9999999999\n" + b"0\n" * 4000)])
    reason = refused(tmp_path / "store", tmp_path / "dest")
    assert "harvest never writes" in reason and next(iter(pax)) in reason, reason


def raw_tar(store: Path, blocks: list[bytes]) -> None:
    """A state.tar of these raw 512-byte-padded blocks, and a manifest that matches it."""
    import hashlib
    data = b"".join(b + b"\0" * (-len(b) % 512) for b in blocks) + b"\0" * 1024
    entry = store / KEY / DEVICE
    entry.mkdir(parents=True)
    (entry / STATE).write_bytes(data)
    (entry / MANIFEST).write_text(json.dumps({"format": "ferry-compiled/1", "key": KEY, "device": DEVICE,
                                              "sha256": "sha256:" + hashlib.sha256(data).hexdigest(),
                                              "bytes": len(data), "files": 1}))


def header(name: str, kind: bytes, size: int) -> bytes:
    i = tarfile.TarInfo(name)
    i.type, i.size = kind, size
    return i.tobuf(tarfile.USTAR_FORMAT)


@pytest.mark.parametrize("blocks, words", [
    # tarfile keeps a global header's records for every later member, copying them into each
    ([header("g", tarfile.XGLTYPE, 20), b"20 comment=xxxxxxxx\n", header("f", tarfile.REGTYPE, 1), b"x"],
     "global header"),
    # a PAX header for a PAX header: tarfile recurses, each level holding its buffer
    ([header("p1", tarfile.XHDTYPE, 16), b"16 path=aaaaaaa\n", header("p2", tarfile.XHDTYPE, 16),
      b"16 path=bbbbbbb\n", header("f", tarfile.REGTYPE, 1), b"x"], "follows another"),
    ([header("././@LongLink", tarfile.GNUTYPE_LONGNAME, 4), b"abc\0", header("f", tarfile.REGTYPE, 1), b"x"],
     "GNU long name"),
    # a record of digits: tarfile's own hdrcharset search is quadratic in it
    ([header("p", tarfile.XHDTYPE, 2000), b"1" * 2000, header("f", tarfile.REGTYPE, 1), b"x"], "malformed"),
    ([header("p", tarfile.XHDTYPE, 12), b"99 path=abc\n", header("f", tarfile.REGTYPE, 1), b"x"], "malformed"),
])
def test_tar_headers_harvest_never_writes_are_refused(tmp_path, blocks, words):
    raw_tar(tmp_path / "store", blocks)
    dest = tmp_path / "dest"
    dest.mkdir()
    outcome = restore(tmp_path / "store", KEY, DEVICE, dest)
    assert outcome.state == "refused" and words in outcome.reason, outcome.reason
    assert list(dest.iterdir()) == []


def test_member_headers_are_not_kept_while_the_state_streams(tmp_path):
    """tarfile keeps every header it read (PAX records of up to 64 KiB each); the restore keeps none, so its
    memory does not grow with the count of members."""
    import tracemalloc
    deep = "/".join(["d" * 240] * 4)  # a path of about 1 kB: a PAX record for every member
    members = [(info(deep, tarfile.DIRTYPE), None)] + [(info(f"{deep}/f{i}"), b"x") for i in range(4000)]
    forged(tmp_path / "store", members)
    dest = tmp_path / "dest"
    dest.mkdir()
    tracemalloc.start()
    try:
        outcome = restore(tmp_path / "store", KEY, DEVICE, dest)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert outcome.state == "restored", outcome.reason
    assert peak < 3_000_000, f"the restore held {peak} bytes at its peak"  # 1.1 MB; 7.5 MB if headers were kept


def test_directories_count_toward_the_cap(tmp_path):
    forged(tmp_path / "store", [(info(f"d{i}", tarfile.DIRTYPE), None) for i in range(50)])
    dest = tmp_path / "dest"
    dest.mkdir()
    assert restore(tmp_path / "store", KEY, DEVICE, dest, Limits(files=10)).state == "refused"
    assert list(dest.iterdir()) == []


def test_nothing_is_restored_over_a_cache_root_that_holds_something(tmp_path, published):
    _, store = published
    dest = tmp_path / "dest"
    (dest / "torch_compile_cache").mkdir(parents=True)
    outcome = restore(store, KEY, DEVICE, dest)
    assert outcome.state == "refused" and "already holds" in outcome.reason
    assert [p.name for p in dest.iterdir()] == ["torch_compile_cache"]


def test_restored_entries_are_open_to_vllm_whatever_its_uid(tmp_path, published):
    _, store = published
    dest = tmp_path / "dest"
    dest.mkdir()
    assert restore(store, KEY, DEVICE, dest).state == "restored"
    for p in dest.rglob("*"):
        assert p.stat().st_mode & 0o777 == (0o777 if p.is_dir() else 0o666), p


def test_a_harvest_never_follows_a_symlink_out_of_the_cache_root(tmp_path):
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "token").write_text("hunter2")
    root = cache(tmp_path / "cold")
    (root / "torch_compile_cache" / "escape").symlink_to(secret)  # a directory link
    (root / "modelinfos" / "token").symlink_to(secret / "token")  # a file link
    store = tmp_path / "store"
    assert harvest(root, store, KEY, DEVICE).state == "published"
    with tarfile.open(store / KEY / DEVICE / STATE) as tar:
        names = tar.getnames()
    assert not [n for n in names if "escape" in n or n.endswith("token")], names
    assert b"hunter2" not in (store / KEY / DEVICE / STATE).read_bytes()


def test_a_leftover_staging_directory_or_a_racing_harvest_does_not_fail_it(tmp_path):
    root, store = cache(tmp_path / "cold"), tmp_path / "store"
    (store / KEY / f".{DEVICE}.partial-1").mkdir(parents=True)  # another pod's, or a killed one's
    assert harvest(root, store, KEY, DEVICE).state == "published"
    assert harvest(root, store, KEY, DEVICE).state == "present"


def test_what_a_killed_harvest_left_is_swept_once_it_is_old(tmp_path):
    """A SIGKILLed harvest (OOM, a lost node) leaves its partial tar on the claim; the next harvest of that
    entry removes such leftovers older than an hour, and never a running harvest's."""
    import time

    store = tmp_path / "store"
    (store / KEY).mkdir(parents=True)
    old, fresh = (store / KEY / f".{DEVICE}.partial-{n}" for n in ("old", "fresh"))
    aside = store / KEY / f".{DEVICE}.old-x"
    for d in (old, fresh, aside):
        d.mkdir()
        (d / STATE).write_bytes(b"x" * 100)
    for path in (old / STATE, old, aside / STATE, aside, fresh):
        os.utime(path, (time.time() - 7200,) * 2)  # fresh: a long harvest still writing its tar (not aged)
    assert harvest(cache(tmp_path / "src"), store, KEY, DEVICE).state == "published"
    assert sorted(p.name for p in (store / KEY).iterdir()) == sorted([DEVICE, fresh.name])


def test_an_entry_without_the_cache_key_vllm_now_uses_is_replaced(tmp_path, published):
    src, store = published
    (src / "torch_compile_cache" / "f00dfeed11").mkdir()  # vLLM compiled under another key (a new config)
    (src / "torch_compile_cache" / "f00dfeed11" / "graph.py").write_text("g")
    outcome = harvest(src, store, KEY, DEVICE)
    assert outcome.state == "published" and "f00dfeed11" in outcome.reason
    assert harvest(src, store, KEY, DEVICE).state == "present"


class Health(BaseHTTPRequestHandler):
    """vLLM's /health, healthy."""

    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def healthy_url():
    """A stand-in for vLLM's /health on loopback (the harvest waits for its 200)."""
    import threading

    server = HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/health"
    server.shutdown()


def test_the_harvest_reads_a_tls_health_endpoint(tmp_path):
    """vLLM serving TLS (--ssl-keyfile): its certificate names a Service, not 127.0.0.1, and the harvest still
    learns that it serves (and that it does not, once it stops)."""
    import ssl
    import subprocess
    import threading

    from ferry_worker.compiled.cli import _healthy

    key, crt = tmp_path / "key.pem", tmp_path / "crt.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=llama-70b.serving.svc", "-keyout", str(key), "-out", str(crt)], check=True,
                   capture_output=True)
    server = HTTPServer(("127.0.0.1", 0), Health)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(crt, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        assert _healthy(f"https://127.0.0.1:{port}/health")
        assert not _healthy(f"http://127.0.0.1:{port}/health")  # plain HTTP to a TLS server: not yet
    finally:
        server.shutdown()
        server.server_close()
    assert not _healthy(f"https://127.0.0.1:{port}/health")


def test_a_warm_up_harvest_exits_0_only_when_the_state_is_kept(tmp_path, healthy_url, capsys):
    """`--once` (the warm-up Job's one container, executors/warm_up.py): its exit status is the Job's outcome."""
    from ferry_worker.cli import main

    def run(root: Path) -> int:
        return main(["compiled-harvest", "--cache-root", str(root), "--store", str(tmp_path / "store"),
                     "--key", KEY, "--health-url", healthy_url, "--poll-seconds", "0.1", "--once"])

    (tmp_path / "empty" / "torch_compile_cache").mkdir(parents=True)
    assert run(tmp_path / "empty") == 1  # vLLM compiled nothing: nothing to hand the replicas
    assert "compiled state absent" in capsys.readouterr().out
    assert run(cache(tmp_path / "cold")) == 0
    assert "compiled state published" in capsys.readouterr().out
    assert run(tmp_path / "cold") == 0  # already kept (a Job run twice): still a success
    assert "compiled state present" in capsys.readouterr().out


HARVEST = [sys.executable, "-c", "import sys; from ferry_worker.cli import main; sys.exit(main(sys.argv[1:]))",
           "compiled-harvest", "--poll-seconds", "0.1"]


def test_a_waiting_harvest_ends_on_sigterm(tmp_path):
    """The sidecar is PID 1 of its container, where the kernel drops a signal it has no handler for: without
    one every pod with compiled state waits out its grace period (30 s) when it is deleted."""
    import signal
    import subprocess

    proc = subprocess.Popen(HARVEST + ["--cache-root", str(cache(tmp_path / "c")), "--store", str(tmp_path / "s"),
                                       "--key", KEY, "--health-url", "http://127.0.0.1:9/health"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("harvest waits: http://127.0.0.1:9")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0  # without the handler: -15
    finally:
        proc.kill()
    assert not (tmp_path / "s").exists()
    # A warm-up Job's harvest (--once) interrupted fails its pod, so the Job never counts it Complete.
    proc = subprocess.Popen(HARVEST + ["--cache-root", str(tmp_path / "c"), "--store", str(tmp_path / "s"),
                                       "--key", KEY, "--health-url", "http://127.0.0.1:9/health", "--once"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("harvest waits: ")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 143
    finally:
        proc.kill()


def test_a_group_pod_keeps_its_own_entry_once_the_leader_serves_and_its_vllm_compiled(tmp_path, healthy_url,
                                                                                        caplog):
    """A pod that serves no HTTP (an LWS worker) waits on its group leader's /health, then for vLLM's cache
    key directory in its own cache root, and keeps <device>-node<I>; a non-loopback URL needs --group-index."""
    import subprocess

    from ferry_worker.cli import main
    from ferry_worker.compiled.state import entry_name

    leader = healthy_url.replace("127.0.0.1", "localhost")  # as a leader's DNS name would be given
    root, store = tmp_path / "cache", tmp_path / "store"
    root.mkdir()
    proc = subprocess.Popen(HARVEST + ["--cache-root", str(root), "--store", str(store), "--key", KEY,
                                       "--health-url", leader, "--group-index", "1", "--once"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert "holds no vLLM cache key yet" in proc.stdout.readline()  # the leader serves; this pod has nothing
        cache(tmp_path / "cache")
        assert proc.wait(timeout=30) == 0
        assert "compiled state published" in proc.stdout.read()
    finally:
        proc.kill()
    assert [p.name for p in (store / KEY).iterdir()] == [entry_name(device_kind(), 1)]
    assert main(["compiled-harvest", "--cache-root", str(root), "--store", str(store), "--key", KEY,
                 "--health-url", "http://10.0.0.9:8000/health"]) != 0
    assert "a group leader's address goes with --group-index" in caplog.text
