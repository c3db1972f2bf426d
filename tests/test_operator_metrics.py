"""The operator's Prometheus endpoint, read after a real reconcile (local executor)."""
from __future__ import annotations

import socket
import urllib.request

import pytest
from cluster_support import running_operator, wait_for
from prometheus_client.parser import text_string_to_metric_families
from test_operator_local import modelweights, tiny_checkpoint, wait_condition

pytestmark = pytest.mark.cluster


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_count_reconciles_steps_bytes_and_phases(crd, namespace, tmp_path):
    port = free_port()
    with running_operator(crd, namespace, tmp_path / "operator.log", FERRY_EXECUTOR="local",
                          FERRY_LOCAL_ROOT=str(tmp_path / "artifacts"), FERRY_METRICS_BIND=f"127.0.0.1:{port}"):
        crd.apply(modelweights("metered", namespace, f"file://{tiny_checkpoint(tmp_path / 'src')}"))
        empty = tmp_path / "empty"
        empty.mkdir()
        (empty / "config.json").write_text("{}")
        crd.apply(modelweights("broken", namespace, f"file://{empty}"))
        wait_condition(crd, namespace, "metered", "Ready")
        wait_condition(crd, namespace, "broken", "Stalled")
        def with_both_phases():
            samples = scrape(port)
            return samples if samples.get(("ferry_modelweights", (("phase", "Failed"),))) else None
        samples = wait_for(with_both_phases, "the phase gauge", timeout=30)
        assert samples[("ferry_reconcile_total", (("result", "ok"),))] >= 2
        assert samples[("ferry_reconcile_duration_seconds_count", ())] >= 2
        assert samples[("ferry_step_duration_seconds_count", (("format", "safetensors"), ("step", "fetch")))] == 1
        size = crd.get_json("mw", "metered", "-n", namespace)["status"]["artifact"]["totalBytes"]
        assert samples[("ferry_step_bytes_total", (("format", "safetensors"), ("step", "fetch")))] == size
        errors = {dict(labels)["reason"]: v for (name, labels), v in samples.items()
                  if name == "ferry_reconcile_errors_total"}
        assert errors == {"FetchFailed": 1}, errors
        assert samples[("ferry_modelweights", (("phase", "Ready"),))] == 1
        assert samples[("ferry_modelweights", (("phase", "Failed"),))] == 1
