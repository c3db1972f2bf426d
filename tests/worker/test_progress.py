"""Progress: the numbers, the thread safety, and each sink's rate limit."""
from __future__ import annotations

import io
import json
import logging
import threading
import time
from datetime import datetime, timezone

import pytest

from ferry_worker.progress_report import IntervalSink, ProgressFile, progress_status
from ferry_worker.progress import LogLines, Progress, Snapshot, TerminalBar
from ferry_worker.sinks import default_sinks

MiB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Recorder:
    def __init__(self) -> None:
        self.published: list[Snapshot] = []
        self.closed: list[Snapshot] = []

    def publish(self, snapshot: Snapshot) -> None:
        self.published.append(snapshot)

    def close(self, snapshot: Snapshot) -> None:
        self.closed.append(snapshot)


def snapshot(done: int, total: int, rate: int = 0, eta: int | None = None, finished: bool = False) -> Snapshot:
    return Snapshot("fetch", done, total, rate, eta, datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc), finished)


def test_rate_eta_and_percent() -> None:
    clock = Clock()
    progress = Progress("fetch", 100 * MiB, [], clock=clock)
    progress.start()
    progress.advance(30 * MiB)
    clock.now += 3
    snap = progress.snapshot()
    assert (snap.bytes_done, snap.bytes_total, snap.percent) == (30 * MiB, 100 * MiB, 30)
    assert snap.bytes_per_second == 10 * MiB
    assert snap.eta_seconds == 7
    assert "30.0 MiB of 100.0 MiB (30%), 10.0 MiB/s, ETA 7s" in snap.describe()


def test_eta_is_unknown_until_bytes_move() -> None:
    clock = Clock()
    progress = Progress("fetch", 10, [], clock=clock)
    progress.start()
    clock.now += 1
    assert progress.snapshot().eta_seconds is None


def test_advance_from_many_threads_loses_nothing() -> None:
    progress = Progress("fetch", 0, [])

    def work() -> None:
        for _ in range(20_000):
            progress.advance(3)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert progress.bytes_done == 8 * 20_000 * 3


def test_sinks_get_ticks_and_exactly_one_final_snapshot() -> None:
    sink = Recorder()
    with Progress("fetch", 1000, [sink], tick_s=0.01) as progress:
        progress.advance(400)
        deadline = time.monotonic() + 10
        while not sink.published and time.monotonic() < deadline:
            time.sleep(0.01)
        progress.advance(600)
    assert sink.published and sink.published[0].bytes_total == 1000
    assert len(sink.closed) == 1
    final = sink.closed[0]
    assert final.finished and final.percent == 100 and final.bytes_done == 1000


def test_a_failed_step_is_reported_as_failed_not_done() -> None:
    sink = Recorder()
    with pytest.raises(OSError):
        with Progress("fetch", 100, [sink], tick_s=0.01) as progress:
            progress.advance(40)
            raise OSError("disk full")
    [final] = sink.closed
    assert final.failed and not final.finished and final.describe().endswith("(40%) failed")
    assert progress_status(final)["etaSeconds"] is None


def test_a_failing_sink_never_fails_the_step(caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        def publish(self, snapshot: Snapshot) -> None:
            raise ConnectionError("apiserver down")

        close = publish

    good = Recorder()
    with caplog.at_level(logging.WARNING), Progress("fetch", 10, [Broken(), good], tick_s=0.01) as progress:
        progress.advance(10)
    assert len(good.closed) == 1
    assert "apiserver down" in caplog.text


def test_log_lines_are_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    sink = LogLines(interval_s=10, clock=clock)
    with caplog.at_level(logging.INFO, logger="ferry_worker.progress"):
        for step in range(25):  # 25 s of 1 s ticks
            clock.now += 1
            sink.publish(snapshot(step, 100))
        sink.close(snapshot(100, 100, finished=True))
    lines = caplog.messages
    assert len(lines) == 3  # at 10 s, at 20 s, and the final one
    assert lines[-1].endswith("(100%) done")


def test_terminal_bar_redraws_one_line() -> None:
    out = io.StringIO()
    bar = TerminalBar(out)
    bar.publish(snapshot(50, 100, rate=10, eta=5))
    bar.close(snapshot(100, 100, finished=True))
    text = out.getvalue()
    assert text.count("\r") == 2 and text.endswith("done\n")
    assert "[" + "#" * 15 + "-" * 15 + "]" in text


def test_status_body_matches_the_crd() -> None:
    assert progress_status(snapshot(50, 200, rate=25, eta=6)) == {
        "step": "fetch", "bytesDone": 50, "bytesTotal": 200, "bytesPerSecond": 25,
        "etaSeconds": 6, "percent": 25, "updatedAt": "2026-01-02T03:04:05Z",
    }
    assert progress_status(snapshot(1, 200))["etaSeconds"] is None  # merge patch: removes a stale ETA
    done = progress_status(snapshot(200, 200, finished=True))
    assert (done["percent"], done["etaSeconds"]) == (100, 0)


class PatchedStatus:
    """What the sink reported: bytes done per report."""

    def __init__(self) -> None:
        self.patches: list[int] = []

    def write(self, snap: Snapshot) -> None:
        self.patches.append(snap.bytes_done)


def test_interval_sink_patches_at_most_every_interval() -> None:
    clock, status = Clock(), PatchedStatus()
    sink = IntervalSink(lambda: status, interval_s=5, clock=clock)  # type: ignore[arg-type,return-value]
    for second in range(12):
        sink.publish(snapshot(second, 100))
        clock.now += 1
    sink.close(snapshot(100, 100, finished=True))
    assert status.patches == [5, 10, 100]


def test_interval_sink_stays_silent_for_a_step_shorter_than_its_interval() -> None:
    connected: list[bool] = []

    def connect() -> object:
        connected.append(True)
        raise AssertionError("a step that ends within its first interval must not connect")

    clock = Clock()
    sink = IntervalSink(connect, interval_s=5, clock=clock)  # type: ignore[arg-type]
    for second in range(4):
        sink.publish(snapshot(second, 100))
        clock.now += 1
    sink.close(snapshot(100, 100, finished=True))
    assert connected == []


def test_default_sinks_follow_the_terminal_and_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    for var in ("FERRY_PROGRESS_FILE", "POD_NAME", "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(var, raising=False)
    [only] = default_sinks(io.StringIO())  # not a TTY, not for the operator
    assert isinstance(only, LogLines)

    monkeypatch.setenv("POD_NAME", "llama-fetch-abc")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    assert [type(s).__name__ for s in default_sinks(io.StringIO())] == ["LogLines", "IntervalSink"]

    # The local executor's file wins, and is written whole.
    monkeypatch.setenv("FERRY_PROGRESS_FILE", str(tmp_path / "progress.json"))
    monkeypatch.setenv("FERRY_PROGRESS_INTERVAL", "0")
    _, sink = default_sinks(io.StringIO())
    sink.close(snapshot(100, 100, finished=True))
    assert json.loads((tmp_path / "progress.json").read_text())["percent"] == 100
    assert not (tmp_path / "progress.json.tmp").exists()


def test_interval_sink_with_no_interval_reports_even_a_step_with_no_tick() -> None:
    status = PatchedStatus()
    sink = IntervalSink(lambda: status, interval_s=0, clock=Clock())  # type: ignore[arg-type]
    sink.close(snapshot(100, 100, finished=True))
    assert status.patches == [100]
