"""`ferry load`: verify, prefetch, report — for one serving pod's ranks.

1. The manifest: its sha256 must be the digest the serving Deployment was
   wired for (`--expected-digest`; the operator passes the one it recorded),
   so a manifest swapped under the pod is refused before any file is trusted.
2. Cheap checks of every file this pod needs (present, the manifest's size),
   so a missing or truncated file is named at once.
3. Every byte read in parallel (the page cache is then warm for vLLM) and
   hashed against the manifest (a rank file's block digests, another file's
   sha256): a wrong byte is named by file (and block). `--verify size`
   skips the hashing (the read still happens).
4. With `--copy-to`, the same pass writes a copy (node-local disk, for slow
   network filesystems), its manifest last.

A pod of a multi-node serving group (`--group-size G --group-index I`) loads
the ranks `vllm serve --nnodes G --node-rank I` gives it (selection.group_ranks).

Object-store artifacts (s3://) are checked without reading: every object's
size and ETag against the manifest; their content hashes are not re-computed
(vLLM streams them; `ferry verify s3://...` reads them all).
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from ..manifest import MANIFEST_NAME, IntegrityError, Manifest, atomic_file, check_sizes, read_manifest_bytes
from ..progress import LogLines, Progress, human_bytes
from . import report as reasons
from .reader import ReadOptions, read_files  # noqa: F401 (ReadOptions: LoadRequest's type)
from .report import Reporter
from .selection import Group, Selection, SelectionError, select

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadRequest:
    artifact: str  # a directory or s3://bucket/prefix
    ranks: list[int] | None = None  # None: every rank of the artifact (or, with group, the group pod's)
    group: Group | None = None  # a pod of a multi-node serving group: its ranks follow from its index
    verify: str = "full"  # full | size
    expected_digest: str | None = None
    copy_to: Path | None = None
    options: ReadOptions = ReadOptions()
    # (store, key, VLLM_CACHE_ROOT): vLLM's compiled state restored after the weights (compiled/state.py).
    compiled: tuple[str | Path, str, Path] | None = None


@dataclass(frozen=True)
class LoadResult:
    manifest_digest: str
    selection: Selection
    seconds: float
    verified: str  # what was checked, in words

    def describe(self) -> str:
        n, size = len(self.selection.entries), self.selection.total_bytes
        rate = f" ({human_bytes(size / self.seconds)}/s)" if self.seconds > 0 and size else ""
        return (f"{self.verified}: {n} files, {human_bytes(size)} for {self.selection.describe()} in "
                f"{self.seconds:.1f}s{rate}; artifact {self.manifest_digest}")

    def facts(self) -> dict:
        """The step result ($FERRY_RESULT_FILE): what this pod loaded, and its place in its group."""
        group = self.selection.group
        return {"loaded": self.describe(), "manifestDigest": self.manifest_digest,
                "files": len(self.selection.entries), "totalBytes": self.selection.total_bytes,
                "ranks": self.selection.ranks,  # null: every file (no per-rank files, or an object store)
                "groupSize": group.size if group else 1, "groupIndex": group.index if group else 0}


def load(request: LoadRequest, reporter: Reporter) -> LoadResult:
    started = time.monotonic()
    reporter.report(False, reasons.LOADING, f"verifying {request.artifact}")
    try:
        if request.artifact.startswith("s3://"):
            result = _load_s3(request, started)
        else:
            result = _load_dir(request, started)
    except Exception as e:
        report_failure(reporter, e)
        raise
    message = result.describe()
    if request.compiled is not None:
        message += "; " + _restore_compiled(*request.compiled, request.group)
    reporter.report(True, reasons.LOADED, message)
    return result


def _restore_compiled(store: str | Path, key: str, dest: Path, group: Group | None = None) -> str:
    """The compiled state's outcome, in words; never a failed load (without it vLLM compiles, as before).
    A pod of a group restores its own entry (it compiled only its own ranks)."""
    from ..compiled.s3_store import restore_from
    from ..compiled.state import device_kind, entry_name

    try:
        outcome = restore_from(str(store), key, entry_name(device_kind(), group.index if group else None), dest)
    except Exception as e:  # noqa: BLE001 - the weights are loaded; the pod starts cold
        log.warning("compiled state not restored: %s", e)
        return f"compiled state refused: {type(e).__name__}: {e}"
    log.info("%s", outcome.describe())
    return outcome.describe()


def report_failure(reporter: Reporter, error: Exception) -> None:
    """The pod condition for a load that failed (or a request refused before it began)."""
    if isinstance(error, IntegrityError):
        reporter.report(False, reasons.VERIFICATION_FAILED, str(error))
    elif isinstance(error, SelectionError):  # the ranks or group position asked for: the message says what to fix
        reporter.report(False, reasons.LOAD_FAILED, str(error))
    else:
        reporter.report(False, reasons.LOAD_FAILED, f"{type(error).__name__}: {error}")


def _check_digest(data: bytes, expected: str | None, where: str) -> str:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    if expected and digest != expected:
        raise IntegrityError(f"{where}/{MANIFEST_NAME}: digest {digest}, but the serving Deployment was wired for "
                             f"{expected}: the artifact changed after it was prepared; prepare it again")
    return digest


def _load_dir(request: LoadRequest, started: float) -> LoadResult:
    root = Path(request.artifact)
    data = read_manifest_bytes(root)  # never through a symlink, bounded
    if data is None:
        raise IntegrityError(f"{root}: no {MANIFEST_NAME} (incomplete, or not prepared by ferry)")
    digest = _check_digest(data, request.expected_digest, str(root))
    manifest = Manifest.from_json(data)
    selection = select(manifest, request.ranks, request.group)
    check_sizes(root, selection.entries)  # each opened beneath the root, no symlink followed
    full = request.verify == "full"
    options = dataclasses.replace(request.options, hash=full)
    with Progress("load", selection.total_bytes, [LogLines()]) as progress:
        # Checks each file against its digest (block digests, else sha256) as it reads it.
        read_files(root, selection.entries, options, progress.advance, request.copy_to)
    if request.copy_to is not None:
        with atomic_file(request.copy_to / MANIFEST_NAME) as f:  # last: the copy is complete
            f.write(data)
    verified = "verified (sha256)" if full else "verified (sizes), read"
    return LoadResult(digest, selection, time.monotonic() - started, verified)


def _load_s3(request: LoadRequest, started: float) -> LoadResult:
    from ..tensorize import artifact
    from ..tensorize.location import parse_location
    from ..tensorize.s3_client import S3Options
    from ..tensorize.store import open_store

    store = open_store(parse_location(request.artifact), S3Options())
    data = store.read(MANIFEST_NAME)
    if data is None:
        raise IntegrityError(f"{request.artifact}: no {MANIFEST_NAME} (incomplete, or not prepared by ferry)")
    digest = _check_digest(data, request.expected_digest, request.artifact.rstrip("/"))
    manifest = Manifest.from_json(data)
    if request.group is not None:
        select(manifest, None, request.group)  # a group position the artifact cannot have is refused here too
    problem = artifact.damage(store, manifest)
    if problem:
        raise IntegrityError(f"{request.artifact}: {problem}")
    # Every object is checked, whatever this pod's ranks.
    selection = Selection(sorted(manifest.files, key=lambda e: e.path), None, request.group,
                          whole="every object of an object-store artifact is checked, by every pod of the group")
    return LoadResult(digest, selection, time.monotonic() - started,
                      "checked (sizes and ETags; content not read: vLLM streams it)")
