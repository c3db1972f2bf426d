"""The operator acts on watch events, not on a clock: with both of its polls
set to ten minutes, everything below still converges within the tests' usual
timeouts — a worker's exit, a Deployment's rollout, a spec change and the
retry annotation each wake the object's reconciler. A regression to polling
shows up as a timeout here (nothing asserts how fast)."""
from __future__ import annotations

import time

import pytest
from cluster_support import running_operator, wait_for
from test_operator_local import (modelweights, tiny_checkpoint, vllm_deployment, wait_condition,
                                 wait_ready_generation)

pytestmark = pytest.mark.cluster

NO_POLL = {"FERRY_RECONCILE_INTERVAL": "600", "FERRY_RESYNC_INTERVAL": "600"}


@pytest.fixture
def operator(crd, namespace, tmp_path):
    root = tmp_path / "artifacts"
    with running_operator(crd, namespace, tmp_path / "operator.log", FERRY_EXECUTOR="local",
                          FERRY_LOCAL_ROOT=str(root), **NO_POLL):
        yield root


def test_worker_exit_rollout_and_spec_change_each_wake_the_reconciler(crd, namespace, operator, tmp_path):
    src = tiny_checkpoint(tmp_path / "src")
    crd.apply(vllm_deployment(namespace))
    served = {"serving": {"deployments": [{"name": "tiny-vllm", "container": "vllm"}]}}
    crd.apply(modelweights("served", namespace, f"file://{src}", **served))
    # Step started, worker exited (wake), Deployment patched, rollout finished (Deployment events).
    wait_condition(crd, namespace, "served", "Ready", timeout=90)
    dep = crd.get_json("deployment", "tiny-vllm", "-n", namespace)
    assert dep["spec"]["template"]["metadata"]["annotations"]["ferry.dev/modelweights"] == "served"

    # A spec change wakes it through the ModelWeights' own watch event.
    crd.apply(modelweights("served", namespace, f"file://{src}", format={"tensorParallelSize": 2}, **served))
    wait_ready_generation(crd, namespace, "served", 2)
    vllm = crd.get_json("deployment", "tiny-vllm", "-n", namespace)["spec"]["template"]["spec"]["containers"][1]
    assert vllm["args"][vllm["args"].index("--tensor-parallel-size") + 1] == "2"


def test_the_retry_annotation_wakes_a_stalled_object(crd, namespace, operator, tmp_path):
    src = tmp_path / "late"
    src.mkdir()
    (src / "config.json").write_text("{}")
    crd.apply(modelweights("late", namespace, f"file://{src}"))
    wait_condition(crd, namespace, "late", "Stalled", timeout=90)

    # The weights arrive; only the annotation says so (a stalled object is not polled).
    tiny = tiny_checkpoint(tmp_path / "tiny")
    for f in tiny.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    crd.kubectl("annotate", "mw/late", "-n", namespace, f"ferry.dev/requested-at={time.time()}", "--overwrite")
    wait_condition(crd, namespace, "late", "Ready", timeout=90)


def test_an_idle_ready_object_is_not_written(crd, namespace, operator, tmp_path):
    crd.apply(modelweights("idle", namespace, f"file://{tiny_checkpoint(tmp_path / 'src')}"))
    wait_condition(crd, namespace, "idle", "Ready", timeout=90)
    # Let the last status write and kopf's own bookkeeping land.
    first = wait_for(lambda: _settled(crd, namespace, "idle"), "the object to settle")
    time.sleep(5)
    assert crd.get_json("mw", "idle", "-n", namespace)["metadata"]["resourceVersion"] == first


def _settled(crd, namespace, name):
    before = crd.get_json("mw", name, "-n", namespace)["metadata"]["resourceVersion"]
    time.sleep(2)
    after = crd.get_json("mw", name, "-n", namespace)["metadata"]["resourceVersion"]
    return after if after == before else None
