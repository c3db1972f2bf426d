"""Compiled state: what vLLM (Dynamo, Inductor, Triton where present) writes under VLLM_CACHE_ROOT, taken
from one serving pod once it is Ready and restored, verified, into the next pods of the same configuration.

Store layout (a directory of the ModelWeights' own claim, under its uid):

    <store>/<key>/<device>/state.tar       the cache root as one uncompressed tar (regular files and dirs)
    <store>/<key>/<device>/compiled.json   {"format", "key", "device", "sha256", "bytes", "files", ...}

`key` is the operator's (the weights' manifest digest, the image, the wired command line, TP/PP), `device`
this node's kind (device_kind: GPU models, else the CPU's model and ISA flags), and for a pod of a
multi-node serving group its index as well (entry_name: `<device>-node<I>`). An entry is published once,
by rename of a complete directory: the first harvest wins, a later one finds it and stops.

Everything read back is untrusted: the manifest is read without following symlinks and bounded, the tar is
hashed as it streams and only a stream whose sha256 equals the manifest's is kept (extracted into a
staging directory first, only regular files and directories at checked relative paths, each created anew
without following a symlink), with caps
on files and bytes. A mismatch of any kind restores nothing: vLLM compiles as it would without Ferry.
"""
from __future__ import annotations

import errno
import glob
import hashlib
import json
import os
import platform
import re
import shutil
import stat
import tarfile
import tempfile
import time
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


def entry_name(device: str, group_index: int | None = None) -> str:
    """The store entry of one pod's state: its device kind, and for a pod of a multi-node serving group its
    index in the group (each pod compiles only its own ranks, so each keeps and restores its own entry)."""
    return device if group_index is None else f"{device}-node{group_index}"


def vllm_keys(root: Path) -> list[str]:
    """vLLM's own cache keys under a cache root (torch_compile_cache/<hash>): what it compiled for."""
    try:
        return sorted(e.name for e in os.scandir(root / "torch_compile_cache") if e.is_dir(follow_symlinks=False))
    except OSError:
        return []


def harvest(cache_root: Path, store: Path, key: str, device: str, limits: Limits = Limits()) -> Outcome:
    """Publish `cache_root` as <store>/<key>/<device>, unless an intact entry holds every vLLM cache key the
    cache root has (a damaged entry, or one vLLM no longer uses, is replaced)."""
    checked_name(key, "key"), checked_name(device, "device")
    final = store / key / device
    replaced = ""
    if (final / MANIFEST).exists() or final.is_symlink():
        problem = _damage(store, key, device) or _stale(store, key, device, vllm_keys(cache_root))
        if not problem:
            return Outcome("present", f"{key}/{device} was published before")
        replaced = f"; replaced the entry there ({problem})"
    (store / key).mkdir(parents=True, exist_ok=True)
    _sweep(store / key, device)
    staging = Path(tempfile.mkdtemp(prefix=f".{device}.partial-", dir=store / key))
    try:
        digest, size, files, content = write_tar(cache_root, staging / STATE, limits)
        if not files:
            return Outcome("absent", f"{cache_root} holds no file: vLLM compiled nothing to keep")
        manifest = {"format": FORMAT, "key": key, "device": device, "sha256": digest, "bytes": size,
                    "files": files, "contentBytes": content, "vllmKeys": vllm_keys(cache_root)}
        with atomic_file(staging / MANIFEST) as f:
            f.write(json.dumps(manifest, sort_keys=True).encode())
        os.chmod(staging, 0o755)  # mkdtemp's 0700 would hide it from the loader of a pod of another uid
        if replaced:
            _set_aside(store, key, device)
        try:
            os.rename(staging, final)
        except OSError:  # another pod published first (a non-empty directory is never replaced)
            return Outcome("present", f"{key}/{device} was published by another pod")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    fsync_dir(final.parent)
    return Outcome("published", f"{files} files, {size} bytes as {key}/{device}{replaced}", files, size)


LEFTOVER_SECONDS = 3600  # no harvest writes its tar for an hour: a partial directory that old was left behind


def _sweep(directory: Path, device: str) -> None:
    """What a killed harvest left on the claim (a SIGKILL skips its `finally`): its partial or set-aside
    directories, once older than any harvest takes."""
    cutoff = time.time() - LEFTOVER_SECONDS
    for entry in os.scandir(directory):
        if not entry.name.startswith((f".{device}.partial-", f".{device}.old-")):
            continue
        try:  # another harvest may sweep or rename it meanwhile; its tar's mtime moves while it is written
            if entry.is_dir(follow_symlinks=False) and max(
                    [entry.stat(follow_symlinks=False).st_mtime] +
                    [e.stat(follow_symlinks=False).st_mtime for e in os.scandir(entry.path)]) < cutoff:
                shutil.rmtree(entry.path, ignore_errors=True)
        except OSError:
            continue


def _set_aside(store: Path, key: str, device: str) -> None:
    aside = Path(tempfile.mkdtemp(prefix=f".{device}.old-", dir=store / key))
    try:
        os.rename(store / key / device, aside / "entry")
    except FileNotFoundError:  # another pod set it aside first
        pass
    finally:
        if (aside / "entry").is_symlink():
            (aside / "entry").unlink()
        shutil.rmtree(aside, ignore_errors=True)


def _stale(store: Path, key: str, device: str, keys: list[str]) -> str:
    """Why an intact entry should be replaced: vLLM compiled under a cache key the entry does not hold."""
    try:
        m = json.loads(read_beneath(store, f"{key}/{device}/{MANIFEST}", MAX_MANIFEST) or b"{}")
    except (ValueError, RecursionError, UnsafePathError, OSError) as e:
        return str(e)
    return lacking(m, keys)


def held_keys(manifest: object) -> set[str]:
    """The vLLM cache keys a stored manifest says its entry holds (untrusted: anything but strings is none)."""
    held = manifest.get("vllmKeys") if isinstance(manifest, dict) else None
    return {k for k in held if isinstance(k, str)} if isinstance(held, list) else set()


def lacking(manifest: object, keys: list[str]) -> str:
    """Why an intact entry is stale ("" if it is not): vLLM compiled under cache keys its manifest lacks."""
    missing = sorted(set(keys) - held_keys(manifest))
    return f"lacked vLLM's cache key(s) {', '.join(missing)[:200]}" if missing else ""


def _raise(error: OSError) -> None:
    raise error


def write_tar(root: Path, path: Path, limits: Limits) -> tuple[str, int, int, int]:
    """`root`'s regular files and directories as one tar at `path` (sha256, bytes, files, content bytes).
    Walked by directory fd (os.fwalk): no symlink is followed at any depth, a directory swapped during the
    walk is refused by fwalk, each file is opened beneath its directory with O_NOFOLLOW and must be a
    regular file of the size it had; a walk error publishes nothing."""
    files = members = content = 0
    with open(path, "wb") as raw:
        with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for dirpath, dirnames, filenames, dirfd in os.fwalk(root, onerror=_raise, follow_symlinks=False):
                # fwalk lists a link to a directory among dirnames (it only never descends into it): drop it.
                dirnames[:] = sorted(n for n in dirnames
                                     if stat.S_ISDIR(os.stat(n, dir_fd=dirfd, follow_symlinks=False).st_mode))
                relative_dir = Path(dirpath).relative_to(root).as_posix()
                for name in dirnames:
                    members += 1
                    _add_dir(tar, name if relative_dir == "." else f"{relative_dir}/{name}")
                for name in sorted(filenames):
                    relative = name if relative_dir == "." else f"{relative_dir}/{name}"
                    size = _add_file(tar, dirfd, name, relative, limits.bytes - content)
                    if size is None:
                        continue
                    files, members, content = files + 1, members + 1, content + size
                    if members > limits.files:
                        raise CompiledStateError(f"{root} holds more than {limits.files} entries: not harvested")
        raw.flush()
        os.fsync(raw.fileno())
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return "sha256:" + h.hexdigest(), path.stat().st_size, files, content


def _add_dir(tar: tarfile.TarFile, relative: str) -> None:
    if path_problem(relative):
        raise CompiledStateError(f"{relative[:200]!r}: {path_problem(relative)}")
    info = tarfile.TarInfo(relative)
    info.type, info.mode = tarfile.DIRTYPE, 0o755
    tar.addfile(info)


def _add_file(tar: tarfile.TarFile, dirfd: int, name: str, relative: str, budget: int) -> int | None:
    """One file, opened beneath its directory without following a symlink; None for anything but a regular
    file (a symlink, a fifo, a socket: skipped). Refused before a byte is written when it would take the
    content past `budget` (the tar's scratch space is capped: a tar past it would get the pod evicted)."""
    if path_problem(relative):
        raise CompiledStateError(f"{relative[:200]!r}: {path_problem(relative)}")
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dirfd)
    except OSError as e:
        if e.errno == errno.ELOOP:  # a symlink
            return None
        raise
    with open(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        if st.st_size > budget:
            raise CompiledStateError(f"{relative[:200]!r} ({st.st_size} bytes) takes the state past its limit of "
                                     f"bytes: not harvested")
        info = tarfile.TarInfo(relative)
        info.size, info.mtime, info.mode = st.st_size, int(st.st_mtime), 0o644
        tar.addfile(info, f)  # a file that shrank meanwhile fails the harvest (tarfile: unexpected end)
    return st.st_size


def _damage(store: Path, key: str, device: str) -> str:
    """Why the published entry would be refused by a restore ("" if it is intact): its manifest and the
    sha256 of its whole state.tar, read as a restore reads them."""
    where = f"{key}/{device}"
    try:
        m = manifest_of(read_beneath(store, f"{where}/{MANIFEST}", MAX_MANIFEST) or b"", key, device, Limits())
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
        held = os.listdir(dest)
    except OSError as e:
        return Outcome("refused", f"{dest}: {e}")
    if held:  # the init container ran before in this pod (its sandbox was recreated): vLLM has what is there
        return Outcome("refused", f"{dest} already holds {len(held)} entries; nothing restored over them")
    try:
        manifest = manifest_of(raw, key, device, limits)
        files, size = _extract(store, where, dest, manifest, limits)
    except (CompiledStateError, UnsafePathError, tarfile.TarError, OSError, ValueError, RecursionError) as e:
        return Outcome("refused", f"{where} failed verification and is not used ({e}): vLLM compiles afresh")
    return Outcome("restored", f"{files} files, {size} bytes from {where}, verified", files, size)


def manifest_of(raw: bytes, key: str, device: str, limits: Limits) -> dict:
    """A stored manifest, checked against the entry it was read from."""
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
    with open(open_beneath(store, f"{where}/{STATE}"), "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size != manifest["bytes"]:
            raise CompiledStateError(f"{STATE} holds {st.st_size} bytes, its manifest says {manifest['bytes']}")
        return extract_verified(f, dest, manifest, limits)


def extract_verified(f: IO[bytes], dest: Path, manifest: dict, limits: Limits) -> tuple[int, int]:
    """The tar `f` streams (whatever store it comes from) into `dest`, only once every byte of it hashed to the
    manifest's sha256 and every member passed the checks; (files, bytes). On any mismatch `dest` is as it was."""
    staging = dest / ".ferry-restore"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        stream = _Hashing(f, manifest["bytes"])
        files, size = _members_out(stream, staging, limits)
        while stream.read(1 << 20):
            pass  # the end-of-archive padding is part of what was hashed
        if stream.read_bytes != manifest["bytes"]:
            raise CompiledStateError(f"the state holds {stream.read_bytes} bytes, its manifest says "
                                     f"{manifest['bytes']}")
        if "sha256:" + stream.h.hexdigest() != manifest["sha256"]:
            raise CompiledStateError(f"{STATE}'s sha256 differs from its manifest's")
        for directory, _, _ in os.walk(staging):  # parents made on the way, too (nothing here is a link)
            os.chmod(directory, 0o777)
        for entry in os.listdir(staging):
            os.rename(staging / entry, dest / entry)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return files, size


MAX_EXTENDED_HEADER = 2 << 10  # a PAX header: a path (at most MAX_PATH_BYTES), a size, times; never more
# The PAX records Python's tarfile writes for a harvest's members (a long path, a size or time out of the
# ustar fields' range); anything else (GNU.sparse.*, hdrcharset, comments) harvest never writes.
PAX_KEYS = frozenset({"path", "linkpath", "size", "mtime", "atime", "ctime", "uid", "gid", "uname", "gname"})
NOT_WRITTEN = (tarfile.GNUTYPE_SPARSE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME,
               tarfile.GNUTYPE_LONGLINK)


class _BoundedInfo(tarfile.TarInfo):
    """Member headers as harvest writes them, parsed in linear time and bounded memory: one PAX extended
    header per member at most, at most MAX_EXTENDED_HEADER, with only PAX_KEYS records; global headers,
    GNU long names and sparse members are refused before tarfile reads them (tarfile keeps global records
    for every later member, and its own PAX parsing is quadratic in the header's size)."""

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in NOT_WRITTEN:
            raise tarfile.HeaderError(f"a tar header of type {self.type!r} (a sparse member, a global header or "
                                      f"a GNU long name), which harvest never writes")
        if self.type == tarfile.XHDTYPE:
            if self.size > MAX_EXTENDED_HEADER:
                raise tarfile.HeaderError(f"an extended header of {self.size} bytes")
            if getattr(tarfile_, "_ferry_extended", False):
                raise tarfile.HeaderError("an extended header follows another")
        return super()._proc_member(tarfile_)

    def _proc_pax(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        """tarfile's own, restricted: the records parsed linearly (_pax_records), then the member they
        describe, which may not be another extended header."""
        records = _pax_records(tarfile_.fileobj.read(self._block(self.size))[:self.size])
        tarfile_._ferry_extended = True
        try:
            member = self.fromtarfile(tarfile_)
        except tarfile.HeaderError as e:
            raise tarfile.SubsequentHeaderError(str(e)) from None
        finally:
            tarfile_._ferry_extended = False
        member._apply_pax_info(records, tarfile_.encoding, tarfile_.errors)
        member.offset = self.offset
        if "size" in records:  # the member's data ends where its PAX size says
            whole = member.isreg() or member.type not in tarfile.SUPPORTED_TYPES
            tarfile_.offset = member.offset_data + (member._block(member.size) if whole else 0)
        return member


def _pax_records(buf: bytes) -> dict[str, str]:
    """PAX records ("<length> <keyword>=<value>\n"), each checked in one pass: a length of at most five
    digits that ends on a newline inside the header, a keyword in PAX_KEYS, a UTF-8 value."""
    records: dict[str, str] = {}
    pos = 0
    while pos < len(buf):
        space = buf.find(b" ", pos, pos + 6)
        length = int(buf[pos:space]) if space > pos and buf[pos:space].isdigit() else 0
        end = pos + length
        if length <= space - pos + 3 or end > len(buf) or buf[end - 1:end] != b"\n":
            raise tarfile.HeaderError(f"a malformed PAX record at byte {pos}")
        keyword, eq, value = buf[space + 1:end - 1].partition(b"=")
        name = keyword.decode("ascii", "replace")
        if not eq or name not in PAX_KEYS:
            raise tarfile.HeaderError(f"a PAX record {name[:40]!r}, which harvest never writes")
        try:
            records[name] = value.decode("utf-8")
        except UnicodeDecodeError:
            raise tarfile.HeaderError(f"a PAX record {name!r} that is not UTF-8") from None
        pos = end
    return records


def _members_out(stream: _Hashing, staging: Path, limits: Limits) -> tuple[int, int]:
    """Every member checked, counted (directories too) and written under `staging`; (files, bytes)."""
    files = members = size = 0
    with tarfile.open(fileobj=stream, mode="r|", tarinfo=_BoundedInfo) as tar:
        while (member := tar.next()) is not None:
            tar.members.clear()  # tarfile keeps every header read (each up to MAX_EXTENDED_HEADER): keep none
            if not (member.isfile() or member.isdir()) or member.sparse is not None:
                raise CompiledStateError(f"member {member.name[:200]!r} is neither a file nor a directory")
            problem = path_problem(member.name)
            if problem:
                raise CompiledStateError(f"member {member.name[:200]!r}: {problem}")
            files, members, size = files + member.isfile(), members + 1, size + member.size
            if members > limits.files or size > limits.bytes:
                raise CompiledStateError(f"more than {limits.files} entries or {limits.bytes} bytes")
            _write_member(tar, member, staging)
    return files, size


def _write_member(tar: tarfile.TarFile, member: tarfile.TarInfo, staging: Path) -> None:
    """One checked member under `staging`: no component followed through a symlink, a file created anew
    (O_EXCL: a name given twice is refused), modes Ferry's own, never the archive's owners or modes."""
    if member.isdir():
        fd = open_dir_beneath(staging, member.name, make_dirs=True)
        os.fchmod(fd, 0o777)  # the pod's own emptyDir: vLLM, whatever its uid, adds its entries beside these
        os.close(fd)
        return
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    source = tar.extractfile(member)
    assert source is not None  # a regular file
    with open(open_beneath(staging, member.name, flags, 0o644, make_dirs=True), "wb") as out:
        os.fchmod(out.fileno(), 0o666)
        shutil.copyfileobj(source, out, 1 << 20)
