"""What an interrupted fetch leaves behind for the next attempt.

`.ferry-fetch-journal.json` in the output directory records, per file, the
source version it came from and either its sha256 (complete) or how many
leading bytes of its partial file are on disk, fsynced, and were hashed
(partial). A re-run keeps complete files after re-hashing them, continues
partial ones from that prefix with ranged reads, and deletes files it wrote
earlier that the new selection no longer contains. The journal is written
atomically; a torn or foreign journal is ignored (everything is fetched again).
"""
from __future__ import annotations

import json
import logging
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from ..manifest import atomic_file

log = logging.getLogger(__name__)

JOURNAL_NAME = ".ferry-fetch-journal.json"
JOURNAL_VERSION = 1


@dataclass(frozen=True)
class JournalEntry:
    version: str
    size: int
    sha256: str | None = None  # set once the file is complete
    durable_bytes: int = 0  # partial: fsynced and hashed leading bytes


class Journal:
    def __init__(self, directory: Path, source: str, entries: dict[str, JournalEntry]) -> None:
        self._path = directory / JOURNAL_NAME
        self._source = source
        self._entries = entries
        self._lock = threading.Lock()

    @classmethod
    def open(cls, directory: Path, source: str) -> tuple["Journal", list[str]]:
        """The journal for `source`, and the files an earlier fetch of another source left."""
        path = directory / JOURNAL_NAME
        try:
            body = json.loads(path.read_bytes())
            entries = {p: JournalEntry(**e) for p, e in body["files"].items()}
            recorded_source = body["source"]
            if body.get("journalVersion") != JOURNAL_VERSION:
                raise ValueError(f"journal version {body.get('journalVersion')!r}")
        except FileNotFoundError:
            return cls(directory, source, {}), []
        except (ValueError, KeyError, TypeError) as e:
            log.warning("ignoring unreadable %s (%s): fetching everything again", path, e)
            return cls(directory, source, {}), []
        if recorded_source != source:
            return cls(directory, source, {}), sorted(entries)
        return cls(directory, source, entries), []

    def paths(self) -> set[str]:
        with self._lock:
            return set(self._entries)

    def completed_sha256(self, path: str, version: str, size: int) -> str | None:
        entry = self._entries.get(path)
        if entry and entry.sha256 and entry.version == version and entry.size == size:
            return entry.sha256
        return None

    def durable_bytes(self, path: str, version: str, size: int) -> int:
        entry = self._entries.get(path)
        if entry and not entry.sha256 and entry.version == version and entry.size == size:
            return entry.durable_bytes
        return 0

    def record_complete(self, path: str, version: str, size: int, sha256: str) -> None:
        self._put(path, JournalEntry(version, size, sha256=sha256))

    def record_partial(self, path: str, version: str, size: int, durable_bytes: int) -> None:
        self._put(path, JournalEntry(version, size, durable_bytes=durable_bytes))

    def forget(self, path: str) -> None:
        with self._lock:
            if self._entries.pop(path, None) is not None:
                self._save_locked()

    def _put(self, path: str, entry: JournalEntry) -> None:
        with self._lock:
            self._entries[path] = entry
            self._save_locked()

    def _save_locked(self) -> None:
        body = {
            "journalVersion": JOURNAL_VERSION,
            "source": self._source,
            "files": {p: asdict(e) for p, e in sorted(self._entries.items())},
        }
        with atomic_file(self._path) as f:
            f.write(json.dumps(body, indent=1).encode())
