"""The progress sinks a worker command reports to: a terminal bar or log lines
(progress.py), plus the ModelWeights status (kube_status.py) when running for one."""
from __future__ import annotations

import os
import sys
from typing import TextIO

from .kube_status import KubeStatusSink
from .progress import LogLines, ProgressSink, TerminalBar


def default_sinks(stream: TextIO | None = None) -> list[ProgressSink]:
    """A terminal bar or log lines, plus the ModelWeights status when running for one."""
    stream = stream or sys.stderr
    sinks: list[ProgressSink] = [TerminalBar(stream) if stream.isatty() else LogLines()]
    name = os.environ.get("FERRY_MODELWEIGHTS_NAME")
    namespace = os.environ.get("FERRY_MODELWEIGHTS_NAMESPACE")
    if name and namespace:
        sinks.append(KubeStatusSink.from_env(name, namespace))
    return sinks
