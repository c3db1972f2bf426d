"""`ferry publish`: a prepared checkpoint directory, as it is, into a store.

For `--load-format runai_streamer` (vLLM streams the safetensors straight from
S3; config and tokenizer files are pulled next to them), or, with a
`ferry shard` artifact, `runai_streamer_sharded`. The same rules as the other
steps: every object uploaded and checked (store.py), the manifest last.

The files: those the source's own ferry-manifest.json lists, each checked
against its sha256 while it is read (a fetched directory; a sharded one's
rank files, which record only block digests, are first read once to check
their blocks and compute the sha256 the upload is then held to), else
every file of the directory but Ferry's own, with every `.safetensors` header
validated first. The published manifest keeps the source manifest's format
and facts (`sharded_state`, its TP size, ...) and adds where it came from.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

from .. import __version__
from ..manifest import (
    ContentCheck,
    FileEntry,
    IntegrityError,
    Manifest,
    check_sizes,
    manifest_digest,
    opened,
    read_manifest,
    reserved_name,
)
from ..paths import safe_relative_path
from ..progress import Progress
from ..safetensors_header import UnsafeSafetensorsError, validate_safetensors
from . import artifact
from .errors import ArtifactError, StoreError
from .location import LocalLocation, Location, parse_location
from .s3_client import S3Options
from .store import StoredObject, open_store

log = logging.getLogger(__name__)


@dataclass
class PublishJob:
    source: Path
    location: Location
    # (relative path, size, what the source's manifest records: its sha256, else "blocks:" + a digest of its block
    # digests; None without a manifest). The third is the request's identity of the file, not always a sha256.
    files: list[tuple[str, int, str | None]]
    format: str
    extra: dict
    source_digest: str | None
    s3: S3Options = field(default_factory=S3Options)
    part_size: int | None = None
    block_checked: dict[str, FileEntry] = field(default_factory=dict)  # entries with only block digests

    @classmethod
    def prepare(cls, source: Path, output: str, *, s3: S3Options | None = None,
                part_size: int | None = None) -> "PublishJob":
        location = parse_location(output)
        source = Path(source).resolve()
        if not source.is_dir():
            raise ArtifactError(f"{source}: not a directory")
        if isinstance(location, LocalLocation) and location.path == source:
            raise ArtifactError("the output must differ from the source directory")
        manifest = read_manifest(source)  # IntegrityError, naming the entry, for one Ferry never writes
        if manifest is not None:
            try:
                check_sizes(source, manifest.files)  # opened beneath the source: no symlink followed
            except IntegrityError as e:
                raise ArtifactError(f"{source}: {e}; run `ferry verify {source}`") from None
            files = [(e.path, e.size, _identity(e)) for e in sorted(manifest.files, key=lambda e: e.path)]
            return cls(source, location, files, manifest.format, dict(manifest.extra), manifest_digest(source),
                       s3 or S3Options(), part_size, {e.path: e for e in manifest.files if not e.sha256})
        files = []
        for path in sorted(p for p in source.rglob("*") if p.is_file()):
            rel = path.relative_to(source).as_posix()
            if _ferrys_own(rel):
                continue
            safe_relative_path(rel, origin=str(source))
            if path.suffix == ".safetensors":
                try:
                    validate_safetensors(path)
                except UnsafeSafetensorsError as e:
                    raise ArtifactError(str(e)) from None
            files.append((rel, path.stat().st_size, None))
        if not any(rel.endswith(".safetensors") for rel, _, _ in files):
            raise ArtifactError(f"{source}: no .safetensors files (the Run:ai streamer loads only safetensors)")
        return cls(source, location, files, "safetensors", {}, None, s3 or S3Options(), part_size)

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size, _ in self.files)

    def request(self) -> dict:
        return {"format": self.format, "publishedFrom": self.source_digest,
                "files": {rel: [size, sha] for rel, size, sha in self.files}}

    def run(self, progress: Progress | None = None) -> artifact.Published:
        store = open_store(self.location, self.s3, self.part_size)
        request = self.request()
        reused = artifact.reuse(store, request)
        if reused is not None:
            return reused
        artifact.begin(store, [rel for rel, _, _ in self.files])
        on_bytes = progress.advance if progress else None
        stored: list[StoredObject] = []
        for rel, _, identity in self.files:
            expected = self._expected_sha256(rel, identity)
            if identity is None:  # no manifest: every file of the directory, as listed
                stored.append(store.put_file(rel, self.source / rel, on_bytes, expected_sha256=expected))
                continue
            with opened(self.source, rel) as fd:  # no symlink followed
                stored.append(store.put_file(rel, fd, on_bytes, expected_sha256=expected))
        manifest = Manifest(files=[o.entry() for o in stored], source=str(self.source), format=self.format,
                            tool=f"ferry {__version__}",
                            extra={**self.extra, "request": request, "publishedFrom": self.source_digest})
        return artifact.publish(store, manifest, stored)

    def _expected_sha256(self, rel: str, identity: str | None) -> str | None:
        """The sha256 the store must read from the source file: the manifest's, or (block digests only) that of
        the bytes whose blocks were just checked, so a change between the two reads is caught by the upload."""
        entry = self.block_checked.get(rel)
        if entry is None:
            return identity
        check = ContentCheck(entry, whole=True)
        try:
            with opened(self.source, rel) as fd, open(fd, "rb", buffering=0, closefd=False) as f:
                while data := f.read(8 << 20):
                    check.update(data)
            return check.finish()
        except IntegrityError as e:
            # As a whole-file mismatch in the store's own check: a changed source, which a retry may find whole.
            raise StoreError(f"{self.source}: {e}: the source changed or is damaged") from None


_BLOCKS = "blocks:"


def _identity(entry: FileEntry) -> str:
    if entry.sha256:
        return entry.sha256
    # sha256 blocks keep the identity earlier releases gave them; another block hash is named in it.
    kind = _BLOCKS if entry.block_hash == "sha256" else f"{entry.block_hash}-{_BLOCKS}"
    return kind + hashlib.sha256("".join(entry.blocks).encode()).hexdigest()


def _ferrys_own(rel: str) -> bool:
    return reserved_name(rel)
