"""The progress sinks a worker command reports to: a terminal bar or log lines
(progress.py), plus the operator's channel (progress_report.py) when running
for one: a file (FERRY_PROGRESS_FILE, the local executor) or the worker's own
pod condition (POD_NAME in a prepare Job's pod)."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TextIO

from .progress import LogLines, ProgressSink, TerminalBar
from .progress_report import IntervalSink, PodProgress, ProgressFile


def default_sinks(stream: TextIO | None = None) -> list[ProgressSink]:
    stream = stream or sys.stderr
    sinks: list[ProgressSink] = [TerminalBar(stream) if stream.isatty() else LogLines()]
    path, pod = os.environ.get("FERRY_PROGRESS_FILE"), os.environ.get("POD_NAME")
    if path:
        sinks.append(IntervalSink.from_env(lambda: ProgressFile(Path(path))))
    elif pod and os.environ.get("KUBERNETES_SERVICE_HOST"):
        sinks.append(IntervalSink.from_env(lambda: PodProgress.connect(pod)))
    return sinks
