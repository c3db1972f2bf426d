"""Ferry's container images (e2e/images, `make images`), checked as they ship:
from the archives `ctr images import` reads, unpacked by umoci, run by runc
with a read-only root filesystem, and imported into a real containerd.

The tests marked `images` build (or reuse, in about a second) the images:
root, debootstrap, umoci, runc and containerd are needed (docs/images.md).
The cache-key test needs none of that.
"""
from __future__ import annotations

import email.parser
import json
import os
import re
import shutil
import signal
import subprocess
import tarfile
import time
import tomllib
import uuid
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from images import build as images_build
from images import elf, keys, sandbox

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SITE = "opt/ferry/venv/lib/python3.11/site-packages"


# --- cache keys (no build) ---------------------------------------------------

def _project_copy(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for top in keys.PROJECT_FILES:
        src = REPO / top
        if src.is_dir():
            shutil.copytree(src, dest / top, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(src, dest / top)
    return dest


def test_vllm_sources_get_the_whole_second_mtimes_their_byte_code_records(tmp_path):
    """umoci's layer tar rounds an mtime to the nearest second, pip's .pyc records it truncated: the vLLM image's
    sources get whole-second mtimes, in copies, so their byte code stays valid; the host's linked files keep theirs."""
    import importlib.util
    import py_compile

    from images.image_vllm import whole_second_sources

    host, site = tmp_path / "host", tmp_path / "site"
    (host / "pkg").mkdir(parents=True)
    module = host / "pkg" / "m.py"
    module.write_text("x = 1\n")
    late = 1_796_513_554_641_688_402  # .64 s past the second: rounded, it would be the next one
    os.utime(module, ns=(late, late))
    py_compile.compile(str(module))
    pyc = Path(importlib.util.cache_from_source(str(module)))
    recorded = int.from_bytes(pyc.read_bytes()[8:12], "little")
    subprocess.run(["cp", "-al", f"{host}/.", str(site)], check=True)

    assert whole_second_sources(site) == 1
    copy = site / "pkg" / "m.py"
    assert copy.stat().st_mtime_ns == recorded * 1_000_000_000 and copy.read_text() == "x = 1\n"
    assert round(copy.stat().st_mtime) == recorded, "what umoci stores is what the .pyc records"
    assert module.stat().st_mtime_ns == late and module.stat().st_ino != copy.stat().st_ino
    assert (site / pyc.relative_to(host)).stat().st_ino == pyc.stat().st_ino, "byte code stays linked"
    assert whole_second_sources(site) == 0


def test_python_change_moves_only_the_app_key(tmp_path):
    repo = _project_copy(tmp_path)
    before = keys.ferry_keys(repo)

    (repo / "worker_image/ferry_worker/__pycache__").mkdir(exist_ok=True)
    (repo / "worker_image/ferry_worker/__pycache__/cli.cpython-311.pyc").write_bytes(b"byte code")
    assert keys.ferry_keys(repo) == before, "byte code is not an input"

    init = repo / "worker_image/ferry_worker/__init__.py"
    init.write_text(init.read_text() + "\n# a Python-only change\n")
    python_change = keys.ferry_keys(repo)
    assert (python_change.base, python_change.deps) == (before.base, before.deps)
    assert python_change.app != before.app

    pyproject = repo / "pyproject.toml"
    text = pyproject.read_text()
    test_pin = PYPROJECT["project"]["optional-dependencies"]["test"][0]
    pyproject.write_text(text.replace(f'"{test_pin}"', f'"{test_pin}.post1"'))
    test_change = keys.ferry_keys(repo)
    assert (test_change.base, test_change.deps) == (before.base, before.deps), \
        "the test extra is not installed in the image"
    assert test_change.app not in (before.app, python_change.app), "pyproject.toml goes into the wheel"

    pin = next(r for r in PYPROJECT["project"]["optional-dependencies"]["worker"] if r.startswith("tqdm=="))
    pyproject.write_text(text.replace(pin, "tqdm==4.0.0"))
    pin_change = keys.ferry_keys(repo)
    assert pin_change.base == before.base
    assert pin_change.deps != before.deps and pin_change.app != python_change.app


# --- the images, as shipped --------------------------------------------------

@pytest.fixture(scope="session")
def built() -> dict:
    if os.geteuid() != 0:
        pytest.fail("building and running images needs root (debootstrap, mount, chroot, runc)")
    return images_build.build()


def _read_archive(record: dict) -> tuple[dict, dict, dict]:
    """(index.json, manifest, image config) of an image archive."""
    with tarfile.open(record["archive"]) as tar:
        def blob(digest):
            return json.load(tar.extractfile("blobs/sha256/" + digest.split(":", 1)[1]))
        index = json.load(tar.extractfile("index.json"))
        manifest = blob(record["digest"])
        return index, manifest, blob(manifest["config"]["digest"])


def _unpack(record: dict, dest: Path) -> Path:
    """The archive's image as an OCI runtime bundle (umoci unpack), at dest/bundle."""
    layout = dest / "layout"
    with tarfile.open(record["archive"]) as tar:
        tar.extractall(layout, **({"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}))
    bundle = dest / "bundle"
    subprocess.run(["umoci", "unpack", "--image", f"{layout}:{record['ref']}", str(bundle)],
                   check=True, capture_output=True)
    shutil.rmtree(layout)
    return bundle


@pytest.fixture(scope="session")
def ferry_bundle(built, tmp_path_factory) -> Path:
    return _unpack(built["ferry"], tmp_path_factory.mktemp("ferry-image"))


class Runc:
    """Runs a bundle the way kubelet would with readOnlyRootFilesystem: the
    image's user, a read-only root, an emptyDir-like tmpfs on /tmp."""

    def __init__(self, bundle: Path, state: Path):
        self.bundle, self.state = bundle, state
        self.config = json.loads((bundle / "config.json").read_text())

    def _prepare(self, args: list[str] | None) -> str:
        config = json.loads(json.dumps(self.config))
        config["process"]["terminal"] = False
        if args is not None:
            config["process"]["args"] = args
        config["root"]["readonly"] = True
        config["mounts"].append({"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
                                 "options": ["nosuid", "nodev", "mode=1777"]})
        (self.bundle / "config.json").write_text(json.dumps(config))
        return f"ferry-test-{uuid.uuid4().hex[:8]}"

    def run(self, args: list[str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        cid = self._prepare(args)
        return subprocess.run(["runc", "--root", str(self.state), "run", "--bundle", str(self.bundle), cid],
                              capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    def start(self, args: list[str] | None = None) -> tuple[str, subprocess.Popen]:
        cid = self._prepare(args)
        proc = subprocess.Popen(["runc", "--root", str(self.state), "run", "--bundle", str(self.bundle), cid],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
        return cid, proc

    def kill(self, cid: str, sig: str) -> None:
        subprocess.run(["runc", "--root", str(self.state), "kill", cid, sig], check=True)


def _dockerfile_final_stage() -> dict:
    """USER, ENV and ENTRYPOINT of worker_image/Dockerfile's last stage (read here on its own)."""
    text = (REPO / "worker_image/Dockerfile").read_text()
    last = text[text.rindex("\nFROM "):]
    env = {}
    for line in re.findall(r"^ENV (.+)$", last, re.MULTILINE):
        env.update(item.split("=", 1) for item in line.split())
    return {"user": re.search(r"^USER (\S+)$", last, re.MULTILINE).group(1), "env": env,
            "entrypoint": json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", last, re.MULTILINE).group(1))}


@pytest.mark.images
def test_ferry_image_config_matches_the_dockerfile(built):
    record = built["ferry"]
    index, manifest, config = _read_archive(record)
    want = _dockerfile_final_stage()
    assert want["user"] == "65532:65532" and want["entrypoint"] == ["ferry-operator"]
    runtime = config["config"]
    assert runtime["User"] == want["user"]
    assert runtime["Entrypoint"] == want["entrypoint"]
    assert not runtime.get("Cmd")
    env = dict(item.split("=", 1) for item in runtime["Env"])
    assert {k: env.get(k) for k in want["env"]} == want["env"] == {"PYTHONUNBUFFERED": "1", "HOME": "/tmp"}
    assert env["PATH"].split(":")[0] == "/opt/ferry/venv/bin"
    assert config["os"] == "linux" and len(manifest["layers"]) == 3  # base, deps, app

    digest = record["digest"].split(":", 1)[1]
    assert record["refs"] == [f"ferry.local/ferry:{digest[:12]}", "ferry.local/ferry:dev"]
    named = {d["annotations"]["org.opencontainers.image.ref.name"]: d["digest"] for d in index["manifests"]}
    assert named == {ref: record["digest"] for ref in record["refs"]}


def _installed(site: Path) -> dict[str, tuple[str, list[str]]]:
    """canonical name -> (version, Requires-Dist) of every distribution in site-packages."""
    dists = {}
    for info in site.glob("*.dist-info"):
        meta = email.parser.Parser().parsestr((info / "METADATA").read_text())
        dists[canonicalize_name(meta["Name"])] = (meta["Version"], meta.get_all("Requires-Dist") or [])
    return dists


@pytest.mark.images
def test_ferry_venv_holds_the_pinned_dependencies_and_nothing_else(ferry_bundle):
    dists = _installed(ferry_bundle / "rootfs" / SITE)
    project = PYPROJECT["project"]
    pins = project["dependencies"] + project["optional-dependencies"]["operator"] \
        + project["optional-dependencies"]["worker"]
    for pin in pins:
        req = Requirement(pin)
        (spec,) = req.specifier
        assert spec.operator == "==", f"{pin} is not a pin"
        assert dists.get(canonicalize_name(req.name), ("missing",))[0] == spec.version, pin
    assert dists["ferry"][0] == project["version"]

    # Everything installed is ferry[operator,worker]'s requirement closure
    # (plus the venv's own pip/setuptools): no test extra, no strays.
    needed, seen, todo = set(), set(), [("ferry", frozenset({"operator", "worker"}))]
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        needed.add(name)
        for text in dists[name][1]:
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in (extras or {""})):
                todo.append((canonicalize_name(req.name), frozenset(req.extras)))
    assert set(dists) - {"pip", "setuptools"} == needed
    assert "pytest" not in dists


@pytest.mark.images
def test_ferry_clis_run_as_nonroot_on_a_read_only_root(ferry_bundle, tmp_path):
    runc = Runc(ferry_bundle, tmp_path / "runc")
    assert runc.config["process"]["user"] == {"uid": 65532, "gid": 65532}
    assert runc.config["process"]["args"] == ["ferry-operator"]
    for cli in ("ferry", "ferry-operator"):
        result = runc.run([cli, "--help"])
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"usage: {cli} "), result.stdout
    probe = ("import os, errno\n"
             "assert (os.getuid(), os.getgid()) == (65532, 65532)\n"
             "try:\n    open('/opt/ferry/probe', 'w')\nexcept OSError as e:\n    assert e.errno == errno.EROFS, e\n"
             "else:\n    raise SystemExit('the root filesystem is writable')\n"
             "open(os.path.join(os.environ['HOME'], 'probe'), 'w').write('ok')\n"
             "import ferry_worker.fetch.run, ferry_operator.handlers\nprint('ok')\n")
    result = runc.run(["python", "-c", probe])
    assert (result.returncode, result.stdout.strip()) == (0, "ok"), result.stderr


@pytest.mark.images
def test_ferry_byte_code_is_compiled_at_build_time(ferry_bundle, tmp_path):
    """Import every module of the project (and so its dependencies) on a
    writable root, as root, with byte-code writing on: nothing gets written."""
    upper = tmp_path / "upper"
    upper.mkdir()
    env = {k: v for k, v in sandbox.DEFAULT_ENV.items() if k != "PYTHONDONTWRITEBYTECODE"}
    script = ("import importlib, pkgutil, ferry_operator, ferry_worker\n"
              "for pkg in (ferry_operator, ferry_worker):\n"
              "    for mod in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
              "        importlib.import_module(mod.name)\n")
    sandbox.run([ferry_bundle / "rootfs"], [["/opt/ferry/venv/bin/python", "-c", script],
                                            ["/opt/ferry/venv/bin/ferry", "--help"],
                                            ["/opt/ferry/venv/bin/ferry-operator", "--help"]],
                upper=upper, env=env, scratch=tmp_path)
    written = [str(p.relative_to(upper)) for p in upper.rglob("*.pyc")]
    assert written == [], f"{len(written)} .pyc written at run time, e.g. {written[:5]}"


@pytest.mark.images
def test_pause_image_is_one_static_binary_that_stops_on_sigterm(built, tmp_path):
    _, _, config = _read_archive(built["pause"])
    assert config["config"]["Entrypoint"] == ["/pause"]
    bundle = _unpack(built["pause"], tmp_path)
    assert [p.name for p in (bundle / "rootfs").iterdir()] == ["pause"]
    assert elf.is_static(bundle / "rootfs/pause")
    runc = Runc(bundle, tmp_path / "runc")
    cid, proc = runc.start()  # its own image has no libc: only a static binary can run
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            state = subprocess.run(["runc", "--root", str(runc.state), "state", cid], capture_output=True, text=True)
            if state.returncode == 0 and json.loads(state.stdout)["status"] == "running":
                break
            time.sleep(0.1)
        runc.kill(cid, "TERM")
        assert proc.wait(timeout=30) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()


@pytest.mark.images
def test_busybox_image_runs_a_local_path_helper_script(built, tmp_path):
    assert built["busybox"]["ref"] == f"ferry.local/busybox:{images_build.image_busybox.version()}"
    runc = Runc(_unpack(built["busybox"], tmp_path), tmp_path / "runc")
    script = "set -e; mkdir -m 0777 -p /tmp/pv/a; stat -c %a /tmp/pv/a; rm -rf /tmp/pv; test ! -e /tmp/pv; echo ok"
    result = runc.run(["sh", "-c", script])
    assert (result.returncode, result.stdout.split()) == (0, ["777", "ok"]), result.stderr


CONTAINERD_CONFIG = """\
version = 2
root = "{dir}/root"
state = "{dir}/state"
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.internal.v1.opt",
                    "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "{dir}/containerd.sock"
[ttrpc]
  address = "{dir}/containerd.sock.ttrpc"
"""


@pytest.fixture
def containerd(tmp_path):
    """A throwaway containerd (own root, state and socket), stopped and unmounted after."""
    home = tmp_path / "containerd"
    home.mkdir()
    (home / "config.toml").write_text(CONTAINERD_CONFIG.format(dir=home))
    log = open(home / "log", "w")
    proc = subprocess.Popen(["containerd", "--config", str(home / "config.toml")], stdout=log, stderr=log)
    address = str(home / "containerd.sock")
    try:
        deadline = time.monotonic() + 30
        while subprocess.run(["ctr", "--address", address, "version"], capture_output=True).returncode != 0:
            assert proc.poll() is None and time.monotonic() < deadline, (home / "log").read_text()
            time.sleep(0.2)
        yield address
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
        mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
        for mount in sorted((m for m in mounts if m.startswith(str(home))), key=len, reverse=True):
            subprocess.run(["umount", mount], check=False)


@pytest.mark.images
def test_import_images_into_containerd(built, containerd, tmp_path):
    # A frozen copy of the project: the tree may change while the session runs.
    frozen = _project_copy(tmp_path / "repo")
    records = images_build.build(repo=frozen)
    assert images_build.import_images(containerd, repo=frozen) == {"pause": True, "busybox": True, "ferry": True}
    ls = subprocess.run(["ctr", "--address", containerd, "-n", "k8s.io", "images", "ls"],
                        check=True, capture_output=True, text=True).stdout
    present = {line.split()[0]: line.split()[2] for line in ls.splitlines()[1:]}
    for record in records.values():
        for ref in record["refs"]:
            assert present.get(ref) == record["digest"], ref
    assert images_build.import_images(containerd, repo=frozen) == {"pause": False, "busybox": False, "ferry": False}
    assert images_build.import_images(containerd, ["pause"], repo=frozen) == {"pause": False}
