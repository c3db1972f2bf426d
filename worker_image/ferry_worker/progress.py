"""Progress of a worker step: bytes done/total, recent bytes/s, ETA.

`Progress` is fed from the data path (`advance`, any thread, a lock and an
addition) and a reporter thread publishes snapshots to sinks at a steady tick,
so a slow sink (the Kubernetes API) never stalls a transfer. Each sink decides
how often it really emits:

- `TerminalBar`: a redrawn one-line bar, when stderr is a terminal;
- `LogLines`: a plain line every few seconds otherwise (Job logs);
- `progress_report.IntervalSink`: the operator's channel (a file, or the worker's own
  pod condition), which it copies into `status.progress` of the ModelWeights.

`sinks.default_sinks()` picks them for a command:

    with Progress("fetch", total, default_sinks()) as progress:
        ...
        progress.advance(len(chunk))
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable, Protocol, Sequence, TextIO

log = logging.getLogger(__name__)

# Throughput is averaged over this window: recent enough to show a stall,
# long enough not to jitter.
RATE_WINDOW_S = 10.0


@dataclass(frozen=True)
class Snapshot:
    step: str
    bytes_done: int
    bytes_total: int
    bytes_per_second: int
    eta_seconds: int | None  # None while the rate is unknown
    updated_at: datetime
    finished: bool = False  # the step completed
    failed: bool = False  # the step stopped on an error

    @property
    def percent(self) -> int:
        if self.bytes_total <= 0:
            return 100 if self.finished else 0
        return min(100, self.bytes_done * 100 // self.bytes_total)

    def describe(self) -> str:
        text = f"{self.step}: {human_bytes(self.bytes_done)} of {human_bytes(self.bytes_total)} ({self.percent}%)"
        if self.finished:
            return text + " done"
        if self.failed:
            return text + " failed"
        text += f", {human_bytes(self.bytes_per_second)}/s"
        if self.eta_seconds is not None:
            text += f", ETA {human_duration(self.eta_seconds)}"
        return text


class ProgressSink(Protocol):
    def publish(self, snapshot: Snapshot) -> None:
        """Called on every tick; rate-limit here."""

    def close(self, snapshot: Snapshot) -> None:
        """Called once with the final snapshot; always emit it."""


class Progress:
    def __init__(
        self,
        step: str,
        total_bytes: int,
        sinks: Sequence[ProgressSink],
        *,
        tick_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.step = step
        self._total = total_bytes
        self._done = 0
        self._sinks = list(sinks)
        self._tick_s = tick_s
        self._clock = clock
        self._lock = threading.Lock()
        self._samples: deque[tuple[float, int]] = deque()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._report, name=f"progress-{step}", daemon=True)
        self._started = False

    def __enter__(self) -> "Progress":
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.finish(failed=exc_type is not None)

    def start(self) -> None:
        self._record_sample()
        if self._sinks:
            self._thread.start()
            self._started = True

    def advance(self, n: int) -> None:
        with self._lock:
            self._done += n

    @property
    def bytes_done(self) -> int:
        return self._done

    def snapshot(self, finished: bool = False, failed: bool = False) -> Snapshot:
        now = self._clock()
        with self._lock:
            done = self._done
        rate = self._rate(now, done)
        remaining = max(0, self._total - done)
        eta = int(remaining / rate + 0.5) if rate > 0 else (0 if remaining == 0 else None)
        return Snapshot(
            step=self.step,
            bytes_done=done,
            bytes_total=self._total,
            bytes_per_second=int(rate),
            eta_seconds=eta,
            updated_at=datetime.now(timezone.utc),
            finished=finished,
            failed=failed,
        )

    def finish(self, failed: bool = False) -> None:
        """Stop reporting; the sinks get the final snapshot (done, or failed)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._started:
            self._thread.join()
        final = self.snapshot(finished=not failed, failed=failed)
        for sink in self._sinks:
            _guarded(sink.close, final)

    def _record_sample(self) -> None:
        now = self._clock()
        with self._lock:
            self._samples.append((now, self._done))
            while len(self._samples) > 1 and now - self._samples[0][0] > RATE_WINDOW_S:
                self._samples.popleft()

    def _rate(self, now: float, done: int) -> float:
        with self._lock:
            if not self._samples:
                return 0.0
            t0, d0 = self._samples[0]
        return (done - d0) / (now - t0) if now > t0 else 0.0

    def _report(self) -> None:
        while not self._stop.wait(self._tick_s):
            self._record_sample()
            snap = self.snapshot()
            for sink in self._sinks:
                _guarded(sink.publish, snap)


def _guarded(emit: Callable[[Snapshot], None], snapshot: Snapshot) -> None:
    # Reporting is best effort: a failing sink must never fail the step.
    try:
        emit(snapshot)
    except Exception as e:  # noqa: BLE001
        log.warning("progress report via %s failed: %s", type(getattr(emit, "__self__", emit)).__name__, e)


class TerminalBar:
    """One line, redrawn in place on an interactive terminal."""

    WIDTH = 30

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def publish(self, snapshot: Snapshot) -> None:
        filled = self.WIDTH * snapshot.percent // 100
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        self._stream.write(f"\r\x1b[2K[{bar}] {snapshot.describe()}")
        self._stream.flush()

    def close(self, snapshot: Snapshot) -> None:
        self.publish(snapshot)
        self._stream.write("\n")
        self._stream.flush()


class LogLines:
    """A log line at most every `interval_s` seconds (plus the final one)."""

    def __init__(self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._last = clock()

    def publish(self, snapshot: Snapshot) -> None:
        now = self._clock()
        if now - self._last >= self._interval_s:
            self._last = now
            log.info("%s", snapshot.describe())

    def close(self, snapshot: Snapshot) -> None:
        log.info("%s", snapshot.describe())


def human_bytes(n: float) -> str:
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if abs(n) < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} TiB"


def human_duration(seconds: int) -> str:
    if seconds < 60:
        return f"{seconds}s"
    minutes, s = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{s:02d}s"
    hours, m = divmod(minutes, 60)
    return f"{hours}h{m:02d}m"
