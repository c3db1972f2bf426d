"""`ferry fetch`: a checkpoint from a source into a directory, selected, verified, with a manifest.

1. List the source (every name checked to stay inside the output). Only
   then is the manifest of an earlier fetch removed, so the directory never
   claims to be complete while it is being changed.
2. Fetch the safetensors index first when there is one: the selection needs it.
3. Select the files vLLM would load (selection.py).
4. Drop files an earlier fetch into this directory wrote that are no longer
   wanted, check there is room, fetch the rest (transfer.py).
5. Write `ferry-manifest.json` last: its presence means complete.
"""
from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from ..manifest import MANIFEST_NAME, FileEntry, Manifest, fsync_dir, partial_name, reserved_name, write_manifest
from ..paths import inside
from ..progress import Progress, ProgressSink
from ..sources import RemoteFile, Source, SourceError, open_source
from .journal import Journal
from .selection import SAFETENSORS_INDEX, needs_index, parse_index, select
from .transfer import TransferEngine, TransferOptions

log = logging.getLogger(__name__)

STAGING_DIR = ".ferry-staging"


@dataclass(frozen=True)
class FetchRequest:
    source: str
    output: Path
    revision: str | None = None
    allow_patterns: Sequence[str] = ()
    ignore_patterns: Sequence[str] = ()
    options: TransferOptions = field(default_factory=TransferOptions)


@dataclass(frozen=True)
class FetchResult:
    manifest: Manifest
    digest: str  # of the manifest, sha256:<hex>


def fetch(request: FetchRequest, sinks: Sequence[ProgressSink] = ()) -> FetchResult:
    output = request.output
    output.mkdir(parents=True, exist_ok=True)
    source = open_source(
        request.source, revision=request.revision, staging=output / STAGING_DIR,
        max_connections=request.options.concurrency,
    )
    return fetch_listed(request, source, source.list_files(), sinks)


def fetch_listed(request: FetchRequest, source: Source, files: list[RemoteFile],
                 sinks: Sequence[ProgressSink] = ()) -> FetchResult:
    """Steps 2-5 for a listing already taken (fetch() lists; tests can interpose here)."""
    output = request.output
    files = _without_reserved_names(files)
    _check_unique_layout(files, source.uri)
    _unpublish(output)
    journal, foreign = Journal.open(output, source.uri)
    _remove(output, foreign, journal)

    index_entries: list[FileEntry] = []
    weight_map = None
    if needs_index(files, request.ignore_patterns):
        index = next(f for f in files if f.path == SAFETENSORS_INDEX)
        with Progress("fetch", index.size, ()) as quiet:
            index_entries = TransferEngine(source, output, journal, quiet, request.options).fetch([index])
        weight_map = parse_index((output / SAFETENSORS_INDEX).read_bytes(), origin=f"{source.uri}: {SAFETENSORS_INDEX}")

    selection = select(
        files, weight_map=weight_map, allow_patterns=request.allow_patterns,
        ignore_patterns=request.ignore_patterns, source=source.uri,
    )
    wanted = {f.path for f in selection.files}
    _remove(output, sorted(journal.paths() - wanted), journal)
    remaining = [f for f in selection.files if f.path != SAFETENSORS_INDEX or not index_entries]
    _check_free_space(output, remaining, journal)
    log.info(
        "fetching %d weight files (%s) and %d other files from %s",
        len(selection.weights), selection.pattern, len(selection.metadata), source.uri,
    )

    with Progress("fetch", sum(f.size for f in remaining), sinks) as progress:
        entries = TransferEngine(source, output, journal, progress, request.options).fetch(remaining)

    manifest = Manifest(
        files=index_entries + entries,
        source=source.uri,
        revision=source.revision,
        format="safetensors" if selection.safetensors else "pt",
    )
    digest = write_manifest(output, manifest)
    shutil.rmtree(output / STAGING_DIR, ignore_errors=True)
    return FetchResult(manifest, digest)


def _unpublish(output: Path) -> None:
    manifest = output / MANIFEST_NAME
    if manifest.exists():
        log.info("%s: removing the manifest of an earlier fetch while this one runs", output)
        manifest.unlink()
        fsync_dir(output)


def _without_reserved_names(files: list[RemoteFile]) -> list[RemoteFile]:
    """A source's own ferry-manifest.json (or journal, ...) must never land where Ferry's goes."""
    kept = [f for f in files if not reserved_name(f.path)]
    for f in files:
        if reserved_name(f.path):
            log.info("not fetching %s: a name Ferry reserves for its own files", f.path)
    return kept


def _check_unique_layout(files: list[RemoteFile], origin: str) -> None:
    """Two names one filesystem cannot hold together ("a" as a file and "a/b") are refused up front."""
    paths = {f.path for f in files}
    for f in files:
        parts = f.path.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in paths:
                raise SourceError(f"{origin}: {'/'.join(parts[:i])!r} is both a file and a directory ({f.path!r})")


def _remove(output: Path, paths: list[str], journal: Journal) -> None:
    """Delete files an earlier fetch into `output` wrote (final and partial) that are not wanted now."""
    for path in paths:
        final = inside(output, path)
        log.info("removing %s: no longer part of the selection", path)
        final.unlink(missing_ok=True)
        partial_name(final).unlink(missing_ok=True)
        journal.forget(path)


def _check_free_space(output: Path, files: list[RemoteFile], journal: Journal) -> None:
    needed = sum(
        f.size - journal.durable_bytes(f.path, f.version, f.size)
        for f in files
        if journal.completed_sha256(f.path, f.version, f.size) is None
    )
    free = shutil.disk_usage(output).free
    if needed > free:
        raise OSError(f"{output}: {needed} bytes to fetch but only {free} free")
