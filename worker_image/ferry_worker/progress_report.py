"""Where a worker reports its progress, for the operator to copy into `status.progress`.

Workers hold no power over ModelWeights: a worker parses untrusted bytes, so
it may change nothing but its own pod. A prepare Job's worker sets the
condition `ferry.dev/progress` on its own pod (its message: the progress as
JSON) with its pod-bound token; a local executor's worker writes a file in
its step's directory. The operator watches both, validates what it reads
against the CRD's Progress type, and writes `status.progress` itself.

The official client is imported only when the pod sink first reports, so a
step that ends within one interval never pays for it.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Protocol

from . import pod_status
from .progress import Snapshot

CONDITION = "ferry.dev/progress"
# Default minimum seconds between two reports (the last one always goes out).
DEFAULT_INTERVAL_S = 5.0


def progress_status(snapshot: Snapshot) -> dict[str, Any]:
    """`status.progress` as the CRD defines it (etaSeconds None: unknown)."""
    return {
        "step": snapshot.step,
        "bytesDone": snapshot.bytes_done,
        "bytesTotal": snapshot.bytes_total,
        "bytesPerSecond": snapshot.bytes_per_second,
        "percent": snapshot.percent,
        "updatedAt": snapshot.updated_at.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "etaSeconds": 0 if snapshot.finished else None if snapshot.failed else snapshot.eta_seconds,
    }


class Writer(Protocol):
    def write(self, snapshot: Snapshot) -> None: ...


class PodProgress:
    """The condition ferry.dev/progress on the worker's own pod."""

    def __init__(self, pod: str, namespace: str, core_api: Any) -> None:
        self.pod, self.namespace, self._api = pod, namespace, core_api

    @classmethod
    def connect(cls, pod: str, token_dir: Path = pod_status.STANDARD_TOKEN_DIR) -> "PodProgress":
        core_api, namespace = pod_status.connect(token_dir)
        return cls(pod, namespace, core_api)

    def write(self, snapshot: Snapshot) -> None:
        state = "False" if snapshot.failed else "True" if snapshot.finished else "Unknown"
        reason = "Failed" if snapshot.failed else "Finished" if snapshot.finished else "Running"
        condition = {"type": CONDITION, "status": state, "reason": reason,
                     "message": json.dumps(progress_status(snapshot), separators=(",", ":")),
                     "lastTransitionTime": snapshot.updated_at.strftime("%Y-%m-%dT%H:%M:%SZ"),
                     "lastProbeTime": None}
        pod_status.set_condition(self._api, self.pod, self.namespace, condition, "ferry-worker",
                                 "the worker ServiceAccount needs Ferry's worker ClusterRole in this namespace "
                                 "(the operator binds it) and the chart's self-report admission policy")


class ProgressFile:
    """A JSON file the local executor reads (written whole, then renamed)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, snapshot: Snapshot) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(progress_status(snapshot)))
        os.replace(tmp, self.path)


class IntervalSink:
    """A progress sink that reports at most every `interval_s` seconds, and
    not at all for a step that ends within its first interval: the operator
    records the step's end itself, and a worker that never reports never
    imports the Kubernetes client (most of a tiny step's CPU time)."""

    def __init__(self, connect: Callable[[], Writer], interval_s: float = DEFAULT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._connect = connect  # called on the first report
        self._writer: Writer | None = None
        self._interval_s = interval_s
        self._clock = clock
        self._started = clock()
        self._last: float | None = None

    @classmethod
    def from_env(cls, connect: Callable[[], Writer]) -> "IntervalSink":
        return cls(connect, float(os.environ.get("FERRY_PROGRESS_INTERVAL", DEFAULT_INTERVAL_S)))

    def _write(self, snapshot: Snapshot) -> None:
        if self._writer is None:
            self._writer = self._connect()
        self._writer.write(snapshot)

    def publish(self, snapshot: Snapshot) -> None:
        now = self._clock()
        if now - (self._last if self._last is not None else self._started) < self._interval_s:
            return
        self._last = now
        self._write(snapshot)

    def close(self, snapshot: Snapshot) -> None:
        # The last state of a progress someone could have seen; nothing for a
        # step that ended within its first interval.
        if self._last is not None or self._clock() - self._started >= self._interval_s:
            self._write(snapshot)
