"""An OCI image layout driven by umoci, and its export as an archive that
`ctr images import` reads.

Images grow one layer at a time: `umoci new` (an empty image), then
`umoci insert DIR /` per layer (the directory's tree becomes a gzip layer),
then `umoci config` (user, env, entrypoint). Each step writes a new tag, so
every stage of every image stays addressable by its cache key.
"""
from __future__ import annotations

import io
import json
import subprocess
import tarfile
from pathlib import Path

REF_NAME = "org.opencontainers.image.ref.name"
CONTAINERD_NAME = "io.containerd.image.name"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"


class Layout:
    def __init__(self, path: Path):
        self.path = path

    def _umoci(self, *args: str) -> None:
        subprocess.run(["umoci", *args], check=True)

    def _image(self, tag: str) -> str:
        return f"{self.path}:{tag}"

    def ensure(self) -> None:
        if not (self.path / "index.json").exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._umoci("init", "--layout", str(self.path))

    def index(self) -> dict:
        return json.loads((self.path / "index.json").read_text())

    def descriptor(self, tag: str) -> dict | None:
        for desc in self.index()["manifests"]:
            if desc.get("annotations", {}).get(REF_NAME) == tag:
                return desc
        return None

    def has(self, tag: str) -> bool:
        return self.descriptor(tag) is not None

    def blob(self, digest: str) -> Path:
        algo, hexdigest = digest.split(":", 1)
        return self.path / "blobs" / algo / hexdigest

    def manifest(self, tag: str) -> dict:
        return json.loads(self.blob(self.descriptor(tag)["digest"]).read_bytes())

    def config(self, tag: str) -> dict:
        return json.loads(self.blob(self.manifest(tag)["config"]["digest"]).read_bytes())

    def new(self, tag: str) -> None:
        self._umoci("new", "--image", self._image(tag))

    def add_layer(self, tag: str, tree: Path, new_tag: str, created_by: str) -> None:
        """new_tag = tag plus one layer holding tree's contents at /."""
        self._umoci("insert", "--image", self._image(tag), "--tag", new_tag,
                    "--history.created_by", created_by, str(tree), "/")

    def configure(self, tag: str, new_tag: str, *, user: str | None = None, env: dict[str, str] | None = None,
                  entrypoint: list[str] | None = None, cmd: list[str] | None = None,
                  workdir: str | None = None, labels: dict[str, str] | None = None) -> None:
        """new_tag = tag with this runtime config (env replaces the whole environment)."""
        args = ["config", "--image", self._image(tag), "--tag", new_tag, "--history.created_by", "umoci config",
                "--clear=config.env", "--clear=config.entrypoint", "--clear=config.cmd"]
        if user is not None:
            args += ["--config.user", user]
        for key, value in (env or {}).items():
            args += ["--config.env", f"{key}={value}"]
        for arg in entrypoint or []:
            args += ["--config.entrypoint", arg]
        for arg in cmd or []:
            args += ["--config.cmd", arg]
        if workdir:
            args += ["--config.workingdir", workdir]
        for key, value in (labels or {}).items():
            args += ["--config.label", f"{key}={value}"]
        self._umoci(*args)

    def compressed_size(self, tag: str) -> int:
        """Bytes of the compressed layers, config and manifest (what an archive or a registry moves)."""
        desc = self.descriptor(tag)
        manifest = self.manifest(tag)
        return desc["size"] + manifest["config"]["size"] + sum(layer["size"] for layer in manifest["layers"])

    def export(self, tag: str, refs: list[str], archive: Path) -> None:
        """An OCI archive (tar of a layout) holding only tag's blobs, named refs.

        Each ref is one index entry with both annotations containerd's importer
        reads: io.containerd.image.name, and org.opencontainers.image.ref.name
        (a full reference, as containerd and umoci both accept).
        """
        desc = self.descriptor(tag)
        manifest = self.manifest(tag)
        blobs = [desc["digest"], manifest["config"]["digest"], *(layer["digest"] for layer in manifest["layers"])]
        index = {"schemaVersion": 2, "manifests": [
            {"mediaType": desc.get("mediaType", MANIFEST), "digest": desc["digest"], "size": desc["size"],
             "annotations": {REF_NAME: ref, CONTAINERD_NAME: ref}} for ref in refs]}
        tmp = archive.with_name(archive.name + ".tmp")
        archive.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
            _add_bytes(tar, "oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
            _add_bytes(tar, "index.json", json.dumps(index).encode())
            for digest in dict.fromkeys(blobs):
                algo, hexdigest = digest.split(":", 1)
                tar.add(self.blob(digest), arcname=f"blobs/{algo}/{hexdigest}", filter=_root_owned)
        tmp.replace(archive)


def _root_owned(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    info.mode = 0o644
    return info


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = _root_owned(tarfile.TarInfo(name))
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def read_archive_index(archive: Path) -> dict:
    with tarfile.open(archive) as tar:
        return json.load(tar.extractfile("index.json"))
