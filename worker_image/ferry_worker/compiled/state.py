"""Compiled state: what vLLM (Dynamo, Inductor, Triton where present) writes under VLLM_CACHE_ROOT, taken
from one serving pod once it is Ready and restored, verified, into the next pods of the same configuration.

Store layout (a directory of the ModelWeights' own claim, under its uid):

    <store>/<key>/<device>/state.tar       the cache root as one uncompressed tar (regular files and dirs)
    <store>/<key>/<device>/compiled.json   {"format", "key", "device", "sha256", "bytes", "files", ...}

`key` is the operator's (the weights' manifest digest, the image, the wired command line, TP/PP), `device`
this node's kind (device_kind: GPU models, else the CPU's model and ISA flags). An entry is published once,
by rename of a complete directory: the first harvest wins, a later one finds it and stops.

Everything read back is untrusted: the manifest is read without following symlinks and bounded, the tar is
hashed as it streams and only a stream whose sha256 equals the manifest's is kept (extracted into a
staging directory first, only regular files and directories at checked relative paths, each created anew
without following a symlink), with caps
on files and bytes. A mismatch of any kind restores nothing: vLLM compiles as it would without Ferry.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import platform
import re
import shutil
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ..manifest import atomic_file, fsync_dir
from ..paths import UnsafePathError, open_beneath, open_dir_beneath, path_problem, read_beneath

FORMAT = "ferry-compiled/1"
STATE = "state.tar"
MANIFEST = "compiled.json"
_NAME = re.compile(r"^[0-9a-z][0-9a-z-]{0,79}$")
MAX_MANIFEST = 64 << 10


@dataclass(frozen=True)
class Limits:
    files: int = 100_000
    bytes: int = 16 << 30


@dataclass(frozen=True)
class Outcome:
    """What a harvest or a restore did: `state` is one of published, present, restored, absent, refused."""

    state: str
    reason: str
    files: int = 0
    bytes: int = 0

    def describe(self) -> str:
        return f"compiled state {self.state}: {self.reason}"


class CompiledStateError(ValueError):
    """A stored compiled state that is not what its manifest says, or not one at all."""


def checked_name(value: str, what: str) -> str:
    if not _NAME.match(value or ""):
        raise ValueError(f"{what} {value!r}: expected lowercase letters, digits and '-' (at most 80)")
    return value


def device_kind() -> str:
    """This node's device kind, as a store directory name: the GPU models the driver lists, else the CPU's
    model name and ISA flags (Inductor's CPU code is specialised to them)."""
    gpus = sorted(_gpu_models())
    if gpus:
        return "gpu-" + hashlib.sha256("\n".join(gpus).encode()).hexdigest()[:16]
    model, flags = "", ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() == "model name" and not model:
                    model = value.strip()
                elif name.strip() == "flags" and not flags:
                    flags = " ".join(sorted(value.split()))
    except OSError:
        pass
    seen = f"{platform.machine()}\n{model}\n{flags}"
    return "cpu-" + hashlib.sha256(seen.encode()).hexdigest()[:16]


def _gpu_models() -> list[str]:
    models = []
    for info in glob.glob("/proc/driver/nvidia/gpus/*/information"):
        try:
            text = Path(info).read_text(errors="replace")
        except OSError:
            continue
        models += [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Model:")]
    return models


def _members(root: Path, limits: Limits) -> list[tuple[str, os.stat_result]]:
    """Regular files and directories under `root`, relative, sorted; symlinks and special files skipped."""
    out: list[tuple[str, os.stat_result]] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        for name in sorted(dirnames) + sorted(filenames):
            path = Path(dirpath) / name
            st = path.lstat()
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                continue
            relative = path.relative_to(root).as_posix()
            if path_problem(relative):
                continue
            out.append((relative, st))
            total += st.st_size if stat.S_ISREG(st.st_mode) else 0
            if len(out) > limits.files or total > limits.bytes:
                raise CompiledStateError(f"{root} holds more than {limits.files} files or {limits.bytes} bytes: "
                                         f"not harvested")
    return out


def harvest(cache_root: Path, store: Path, key: str, device: str, limits: Limits = Limits()) -> Outcome:
    """Publish `cache_root` as <store>/<key>/<device> unless an entry is there already."""
    checked_name(key, "key"), checked_name(device, "device")
    final = store / key / device
    replaced = ""
    if (final / MANIFEST).exists() or final.is_symlink():
        problem = _damage(store, key, device)
        if not problem:
            return Outcome("present", f"{key}/{device} was published before")
        # A damaged entry (refused by every restore) is replaced by this pod's state.
        aside = store / key / f".{device}.damaged-{os.getpid()}"
        os.rename(final, aside)
        if aside.is_symlink():
            aside.unlink()
        else:
            shutil.rmtree(aside, ignore_errors=True)
        replaced = f"; replaced a damaged entry ({problem})"
    members = _members(cache_root, limits)
    if not any(stat.S_ISREG(st.st_mode) for _, st in members):
        return Outcome("absent", f"{cache_root} holds no file: vLLM compiled nothing to keep")
    staging = store / key / f".{device}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    digest, size, files = _write_tar(cache_root, members, staging / STATE)
    manifest = {"format": FORMAT, "key": key, "device": device, "sha256": digest, "bytes": size, "files": files,
                "contentBytes": sum(st.st_size for _, st in members if stat.S_ISREG(st.st_mode))}
    with atomic_file(staging / MANIFEST) as f:
        f.write(json.dumps(manifest, sort_keys=True).encode())
    try:
        os.rename(staging, final)
    except OSError:  # another pod published first (a non-empty directory is never replaced)
        shutil.rmtree(staging, ignore_errors=True)
        return Outcome("present", f"{key}/{device} was published by another pod")
    fsync_dir(final.parent)
    return Outcome("published", f"{files} files, {size} bytes as {key}/{device}{replaced}", files, size)


def _damage(store: Path, key: str, device: str) -> str:
    """Why the published entry would be refused by a restore ("" if it is intact): its manifest and the
    sha256 of its whole state.tar, read as a restore reads them."""
    where = f"{key}/{device}"
    try:
        m = _manifest(read_beneath(store, f"{where}/{MANIFEST}", MAX_MANIFEST) or b"", key, device, Limits())
        with open(open_beneath(store, f"{where}/{STATE}"), "rb") as f:
            h, n = hashlib.sha256(), 0
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
                n += len(block)
    except (CompiledStateError, UnsafePathError, OSError) as e:
        return str(e)
    if n != m["bytes"] or "sha256:" + h.hexdigest() != m["sha256"]:
        return f"{STATE} differs from its manifest"
    return ""


def _write_tar(root: Path, members: list[tuple[str, os.stat_result]], path: Path) -> tuple[str, int, int]:
    files = 0
    with open(path, "wb") as raw:
        with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for relative, st in members:
                info = tarfile.TarInfo(relative)
                info.mtime, info.mode = int(st.st_mtime), 0o755 if stat.S_ISDIR(st.st_mode) else 0o644
                if stat.S_ISDIR(st.st_mode):
                    info.type = tarfile.DIRTYPE
                    tar.addfile(info)
                    continue
                fd = os.open(root / relative, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                with open(fd, "rb") as f:
                    info.size = os.fstat(fd).st_size
                    tar.addfile(info, f)
                files += 1
        raw.flush()
        os.fsync(raw.fileno())
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return "sha256:" + h.hexdigest(), path.stat().st_size, files


class _Hashing:
    """A read-only stream that hashes what passes and refuses to pass more than `limit` bytes."""

    def __init__(self, f: IO[bytes], limit: int) -> None:
        self.f, self.limit, self.read_bytes, self.h = f, limit, 0, hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n if n >= 0 else self.limit + 1 - self.read_bytes)
        self.read_bytes += len(data)
        if self.read_bytes > self.limit:
            raise CompiledStateError(f"{STATE} is longer than its manifest says")
        self.h.update(data)
        return data


def restore(store: Path, key: str, device: str, dest: Path, limits: Limits = Limits()) -> Outcome:
    """Restore <store>/<key>/<device> into `dest` (vLLM's empty cache root) once it is verified in full;
    on any mismatch nothing is left in `dest` and the outcome says why."""
    checked_name(key, "key"), checked_name(device, "device")
    where = f"{key}/{device}"
    try:
        raw = read_beneath(store, f"{where}/{MANIFEST}", MAX_MANIFEST)
    except (UnsafePathError, NotADirectoryError) as e:
        return Outcome("refused", f"{where}/{MANIFEST}: {e}")
    if raw is None:
        return Outcome("absent", f"none for this configuration and device ({where}) yet: vLLM compiles, and the "
                                 f"first pod to turn Ready keeps what it compiled")
    try:
        manifest = _manifest(raw, key, device, limits)
        files, size = _extract(store, where, dest, manifest, limits)
    except (CompiledStateError, UnsafePathError, tarfile.TarError, OSError) as e:
        return Outcome("refused", f"{where} failed verification and is not used ({e}): vLLM compiles afresh")
    return Outcome("restored", f"{files} files, {size} bytes from {where}, verified", files, size)


def _manifest(raw: bytes, key: str, device: str, limits: Limits) -> dict:
    try:
        m = json.loads(raw)
    except (ValueError, RecursionError):
        raise CompiledStateError(f"{MANIFEST} is not JSON") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CompiledStateError(f"{MANIFEST} is not a {FORMAT} manifest")
    if m.get("key") != key or m.get("device") != device:
        raise CompiledStateError(f"{MANIFEST} names another configuration ({m.get('key')!r}/{m.get('device')!r})")
    if not isinstance(m.get("sha256"), str) or not re.fullmatch(r"sha256:[0-9a-f]{64}", m["sha256"]):
        raise CompiledStateError(f"{MANIFEST}: sha256 is not sha256:<64 hex>")
    size = m.get("bytes")
    if type(size) is not int or not 0 < size <= limits.bytes + (limits.files + 2) * 1536:
        raise CompiledStateError(f"{MANIFEST}: bytes {size!r} is not a size within the limit")
    return m


def _extract(store: Path, where: str, dest: Path, manifest: dict, limits: Limits) -> tuple[int, int]:
    fd = open_beneath(store, f"{where}/{STATE}")
    staging = dest / ".ferry-restore"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        with open(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_size != manifest["bytes"]:
                raise CompiledStateError(f"{STATE} holds {st.st_size} bytes, its manifest says {manifest['bytes']}")
            stream = _Hashing(f, manifest["bytes"])
            files, size = _members_out(stream, staging, limits)
            while stream.read(1 << 20):
                pass  # the end-of-archive padding is part of what was hashed
        if "sha256:" + stream.h.hexdigest() != manifest["sha256"]:
            raise CompiledStateError(f"{STATE}'s sha256 differs from its manifest's")
        for entry in os.listdir(staging):
            os.rename(staging / entry, dest / entry)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return files, size


def _members_out(stream: _Hashing, staging: Path, limits: Limits) -> tuple[int, int]:
    files = size = 0
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for member in tar:
            if not (member.isfile() or member.isdir()):
                raise CompiledStateError(f"member {member.name[:200]!r} is neither a file nor a directory")
            problem = path_problem(member.name)
            if problem:
                raise CompiledStateError(f"member {member.name[:200]!r}: {problem}")
            files += member.isfile()
            size += member.size
            if files > limits.files or size > limits.bytes:
                raise CompiledStateError(f"more than {limits.files} files or {limits.bytes} bytes")
            _write_member(tar, member, staging)
    return files, size


def _write_member(tar: tarfile.TarFile, member: tarfile.TarInfo, staging: Path) -> None:
    """One checked member under `staging`: no component followed through a symlink, a file created anew
    (O_EXCL: a name given twice is refused), modes Ferry's own, never the archive's owners or modes."""
    if member.isdir():
        os.close(open_dir_beneath(staging, member.name, make_dirs=True))
        return
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    source = tar.extractfile(member)
    assert source is not None  # a regular file
    with open(open_beneath(staging, member.name, flags, 0o644, make_dirs=True), "wb") as out:
        shutil.copyfileobj(source, out, 1 << 20)
