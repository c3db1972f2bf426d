"""Prometheus metrics of the operator, served over HTTP when
FERRY_METRICS_BIND (host:port) is set (the chart sets 0.0.0.0:9090).

    ferry_reconcile_total{result}               reconciles: ok | error | forbidden
    ferry_reconcile_errors_total{reason}        Stalled reasons seen (SecretNotFound, WorkerFailed, ...)
    ferry_reconcile_duration_seconds            one reconcile: observe, plan, act
    ferry_step_duration_seconds{step,format}    a prepare step, started -> succeeded (as this process saw it)
    ferry_step_bytes_total{step,format}         bytes of the artifacts prepare steps completed
    ferry_modelweights{phase}                   objects by phase
    ferry_serving_pod_start_seconds{compiled}   a wired serving pod, created -> Ready, once per pod; compiled:
                                                restored (started warm), absent or refused (compiled afresh),
                                                off (serving.compiledState not used)
"""
from __future__ import annotations

import time
from collections import OrderedDict

from prometheus_client import Counter, Gauge, Histogram, start_http_server

RECONCILES = Counter("ferry_reconcile_total", "Reconciles of ModelWeights, by result.", ["result"])
ERRORS = Counter("ferry_reconcile_errors_total", "Transitions to Stalled, by reason.", ["reason"])
RECONCILE_SECONDS = Histogram("ferry_reconcile_duration_seconds", "Duration of one reconcile.",
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
STEP_SECONDS = Histogram("ferry_step_duration_seconds", "Duration of a prepare step, started to succeeded.",
                         ["step", "format"], buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200))
STEP_BYTES = Counter("ferry_step_bytes_total", "Bytes of the artifacts prepare steps completed.", ["step", "format"])
OBJECTS = Gauge("ferry_modelweights", "ModelWeights by phase.", ["phase"])
POD_START_SECONDS = Histogram("ferry_serving_pod_start_seconds",
                              "A wired serving pod's start, created to Ready, by how its compiled state went.",
                              ["compiled"], buckets=(5, 10, 20, 30, 45, 60, 90, 120, 180, 300, 600, 1200, 3600))
COMPILED_OUTCOMES = ("restored", "absent", "refused", "off")
MAX_PODS_REMEMBERED = 10_000
_pods_started: OrderedDict[str, None] = OrderedDict()  # pod uids observed, oldest first

_started: dict[str, float] = {}  # step id -> when this process started it
_phases: dict[str, str] = {}  # object uid -> its phase
_seen: set[str] = set()  # every phase the gauge has a series for


def serve(bind: str) -> None:
    host, _, port = bind.rpartition(":")
    start_http_server(int(port), addr=host or "0.0.0.0")


def step_started(step_id: str) -> None:
    _started.setdefault(step_id, time.monotonic())


def step_succeeded(step_id: str, step: str, fmt: str, total_bytes: int | None = None) -> None:
    began = _started.pop(step_id, None)
    if began is not None:
        STEP_SECONDS.labels(step, fmt).observe(time.monotonic() - began)
    if total_bytes:
        STEP_BYTES.labels(step, fmt).inc(total_bytes)


def phase(uid: str, value: str | None) -> None:
    """Record an object's phase (None: it is gone) and refresh the gauge."""
    if value is None:
        _phases.pop(uid, None)
    else:
        _phases[uid] = value
        _seen.add(value)
    counts = {p: 0 for p in _seen}  # a phase nobody is in any more reads 0, not its last count
    for p in _phases.values():
        counts[p] += 1
    for p, n in counts.items():
        OBJECTS.labels(p).set(n)


def pod_started(uid: str, seconds: float, compiled: str) -> None:
    """Observe a serving pod's start once (the uids of the last MAX_PODS_REMEMBERED are remembered)."""
    if not uid or uid in _pods_started or seconds < 0:
        return
    _pods_started[uid] = None
    while len(_pods_started) > MAX_PODS_REMEMBERED:
        _pods_started.popitem(last=False)
    POD_START_SECONDS.labels(compiled if compiled in COMPILED_OUTCOMES else "off").observe(seconds)
