"""Retries against the real API server with the local executor running the
real worker: a step failing twice then succeeding reaches Ready by itself; a
failure that waits on a fix stalls, and the ferry.dev/requested-at annotation
retries it at once."""
from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
from cluster_support import running_operator, wait_for
from test_operator_local import modelweights, tiny_checkpoint, wait_condition

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "e2e" / "s3"))
from s3server import ACCESS_KEY, REGION, SECRET_KEY, S3Server  # noqa: E402

pytestmark = pytest.mark.cluster


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status(kube, namespace, name):
    return kube.get_json("mw", name, "-n", namespace).get("status", {})


def test_a_step_failing_twice_then_succeeding_reaches_ready_by_itself(crd, namespace, tmp_path):
    port = closed_port()  # the S3 endpoint is down at first: the fetch fails (exit 1, retryable)
    env = {"FERRY_EXECUTOR": "local", "FERRY_LOCAL_ROOT": str(tmp_path / "artifacts"),
           "FERRY_RETRY_BACKOFF_S": "1", "FERRY_RETRY_LIMIT": "4",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": ACCESS_KEY,
           "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true",
           "AWS_MAX_ATTEMPTS": "1"}
    with running_operator(crd, namespace, tmp_path / "operator.log", **env):
        crd.apply(modelweights("flaky", namespace, "s3://models/tiny"))
        # Two retries started, and both failed (the worker really ran and exited 1 each time).
        wait_for(lambda: (status(crd, namespace, "flaky").get("retry") or {}).get("attempt", 0) >= 2
                 and (status(crd, namespace, "flaky")["retry"].get("nextAttemptAt")), "the second retry to fail",
                 timeout=120)
        retry = status(crd, namespace, "flaky")["retry"]
        assert "fetch failed" in retry["lastError"]
        # The bucket is filled out of the operator's sight (any free port), so
        # that no retry can see it half-uploaded...
        with S3Server(tmp_path / "s3") as s3:
            s3.client().create_bucket(Bucket="models")
            for f in tiny_checkpoint(tmp_path / "src").iterdir():
                s3.client().upload_file(str(f), "models", f"tiny/{f.name}")
        # ...then the endpoint comes back: the next retry succeeds, with no human action.
        with S3Server(tmp_path / "s3", port=port):
            wait_condition(crd, namespace, "flaky", "Ready")
        final = status(crd, namespace, "flaky")
        assert "retry" not in final and final["phase"] == "Ready"
        events = crd.get_json("events", "-n", namespace, "--field-selector", "involvedObject.name=flaky")["items"]
        assert sum(e.get("count") or 1 for e in events if e["reason"] == "StepRetrying") >= 2


def test_a_failure_that_waits_on_a_fix_stalls_and_the_annotation_retries_it(crd, namespace, tmp_path):
    source = tmp_path / "src"
    root = tmp_path / "artifacts"
    with running_operator(crd, namespace, tmp_path / "operator.log", FERRY_EXECUTOR="local",
                          FERRY_LOCAL_ROOT=str(root)):
        crd.apply(modelweights("later", namespace, f"file://{source}"))  # nothing there yet: exit 2
        wait_condition(crd, namespace, "later", "Stalled")
        stalled = next(c for c in status(crd, namespace, "later")["conditions"] if c["type"] == "Stalled")
        assert str(source) in stalled["message"]
        assert "retry" not in status(crd, namespace, "later")  # not retried by itself
        tiny_checkpoint(source)  # the fix
        crd.kubectl("annotate", "mw/later", "-n", namespace, "ferry.dev/requested-at=1764583200")
        wait_condition(crd, namespace, "later", "Ready")
        assert status(crd, namespace, "later")["lastHandledRequestedAt"] == "1764583200"
