"""The operator on the shared cluster's rules, end to end (real API server,
local executor): two ModelWeights never fight over one Deployment, and
without its admission policies the operator does nothing and says why."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import localcluster
from cluster_support import running_operator, wait_for
from test_operator_local import modelweights, tiny_checkpoint, vllm_deployment, wait_condition

pytestmark = pytest.mark.cluster


def condition(kube, namespace, name, kind):
    status = kube.get_json("mw", name, "-n", namespace).get("status") or {}
    return next((c for c in status.get("conditions", []) if c["type"] == kind), None)


def stalled_with(kube, namespace, name, reason):
    return wait_for(lambda: (c := condition(kube, namespace, name, "Stalled")) and c["status"] == "True"
                    and c["reason"] == reason and c, f"{name} Stalled with {reason}")


def test_a_deployment_another_modelweights_owns_is_refused_until_it_lets_go(crd, namespace, tmp_path):
    src = tiny_checkpoint(tmp_path / "src")
    crd.apply(vllm_deployment(namespace))
    serving = {"deployments": [{"name": "tiny-vllm", "container": "vllm"}]}
    with running_operator(crd, namespace, tmp_path / "operator.log", FERRY_EXECUTOR="local",
                          FERRY_LOCAL_ROOT=str(tmp_path / "artifacts")):
        crd.apply(modelweights("first", namespace, f"file://{src}", serving=serving))
        wait_condition(crd, namespace, "first", "Ready")
        wired = crd.get_json("deployment", "tiny-vllm", "-n", namespace)["spec"]["template"]

        crd.apply(modelweights("second", namespace, f"file://{src}", serving=serving,
                               format={"type": "safetensors", "tensorParallelSize": 2}))
        stalled = stalled_with(crd, namespace, "second", "DeploymentClaimed")
        assert "deployment tiny-vllm is wired by ModelWeights first" in stalled["message"]
        # The first keeps its Deployment, untouched by the second.
        assert crd.get_json("deployment", "tiny-vllm", "-n", namespace)["spec"]["template"] == wired
        assert condition(crd, namespace, "first", "Ready")["status"] == "True"

        # Once the first lets go, the second wires it (woken by the first's change, not a resync).
        crd.kubectl("patch", "mw", "first", "-n", namespace, "--type=json",
                    "-p", '[{"op": "remove", "path": "/spec/serving"}]')
        wait_condition(crd, namespace, "second", "Ready", timeout=60)
        template = crd.get_json("deployment", "tiny-vllm", "-n", namespace)["spec"]["template"]
        assert template["metadata"]["annotations"]["ferry.dev/modelweights"] == "second"
        assert "--tensor-parallel-size" in (args := template["spec"]["containers"][1]["args"]) \
            and args[args.index("--tensor-parallel-size") + 1] == "2"


def test_without_its_admission_policies_the_operator_does_nothing_and_says_which(crd, namespace, tmp_path):
    # Policies of a release of their own: deleting them here leaves every other test's alone.
    names = localcluster.apply_admission_policies("policy-gone", crd.kubeconfig)
    reporter = "policy-gone-ferry-weights-reporter"
    src = tiny_checkpoint(tmp_path / "src")
    log = tmp_path / "operator.log"
    with running_operator(crd, namespace, log, FERRY_EXECUTOR="local", FERRY_LOCAL_ROOT=str(tmp_path / "artifacts"),
                          FERRY_ADMISSION_POLICIES=names, FERRY_POLICY_CHECK_INTERVAL="1"):
        crd.apply(modelweights("before", namespace, f"file://{src}"))
        wait_condition(crd, namespace, "before", "Ready")  # running, past its start-up check
        crd.kubectl("delete", "validatingadmissionpolicybinding", reporter)
        crd.apply(vllm_deployment(namespace))
        crd.apply(modelweights("guarded", namespace, f"file://{src}",
                               serving={"deployments": [{"name": "tiny-vllm", "container": "vllm"}]}))
        stalled = stalled_with(crd, namespace, "guarded", "AdmissionPolicyMissing")
        assert f"no ValidatingAdmissionPolicyBinding enforces {reporter}" in stalled["message"]
        # Nothing was done on its behalf: no worker, no patch, no binding.
        assert not (tmp_path / "artifacts" / namespace / "guarded" / ".steps").exists()
        template = crd.get_json("deployment", "tiny-vllm", "-n", namespace)["spec"]["template"]
        assert "ferry.dev/modelweights" not in (template["metadata"].get("annotations") or {})
        assert not crd.get_json("rolebindings", "-n", namespace, "-l", "app.kubernetes.io/managed-by=ferry")["items"]

        localcluster.apply_admission_policies("policy-gone", crd.kubeconfig)  # restored: it converges
        wait_condition(crd, namespace, "guarded", "Ready", timeout=90)

    # And an operator started without them refuses to start, naming what is missing.
    crd.kubectl("delete", "validatingadmissionpolicy", reporter)
    proc = subprocess.run([str(Path(sys.executable).with_name("ferry-operator")), "run", "--standalone",
                           "--namespace", namespace],
                          env={**os.environ, "KUBECONFIG": str(crd.kubeconfig), "FERRY_ADMISSION_POLICIES": names},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and f"ValidatingAdmissionPolicy {reporter} is missing" in proc.stderr, proc.stderr
    for kind in ("validatingadmissionpolicy", "validatingadmissionpolicybinding"):
        crd.kubectl("delete", kind, "policy-gone-ferry-references", "--ignore-not-found")
