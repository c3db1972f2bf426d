"""The kubernetes executor against the real API server: the operator creates
the claim, the worker identity and one Job per step, each validated by
kube-apiserver, and a step's result travels back in the pod's termination
message. Here the Job pods are pinned to kwok's node, which completes them
without running them, and the test writes the termination message the worker
would have written — a stand-in for the node, said plainly here. The same
path on the real node, with the image built here: tests/node/."""
from __future__ import annotations

import json
import time

import pytest

from cluster_support import running_operator, wait_for

pytestmark = pytest.mark.cluster

IMAGE = "ghcr.io/ferry-dev/ferry:test"


@pytest.fixture
def k8s_operator(crd, namespace, tmp_path):
    with running_operator(crd, namespace, tmp_path / "operator.log", FERRY_EXECUTOR="kubernetes",
                          FERRY_WORKER_IMAGE=IMAGE,
                          # kwok's node completes pods without running them: this
                          # test's stand-in for a node (tests/node/ runs them for real).
                          FERRY_WORKER_NODE_SELECTOR=json.dumps({"type": "kwok"}),
                          FERRY_WORKER_TOLERATIONS=json.dumps([{"key": "nvidia.com/gpu", "operator": "Exists",
                                                                "effect": "NoSchedule"}]),
                          FERRY_WORKER_RESOURCES=json.dumps({"requests": {"cpu": "1", "memory": "1Gi"}})):
        yield


def jobs(kube, ns):
    return {j["metadata"]["labels"]["ferry.dev/step"]: j for j in kube.get_json("jobs", "-n", ns)["items"]}


def test_sharded_state_runs_as_jobs_on_a_created_claim(crd, namespace, k8s_operator):
    # A pre-provisioned volume for the claim Ferry creates (no dynamic provisioner here).
    crd.apply({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"pv-{namespace}"},
               "spec": {"capacity": {"storage": "10Gi"}, "accessModes": ["ReadWriteOnce"],
                        "storageClassName": f"manual-{namespace}", "hostPath": {"path": f"/tmp/{namespace}"}}})
    crd.apply({"apiVersion": "ferry.dev/v1alpha1", "kind": "ModelWeights",
               "metadata": {"name": "llama", "namespace": namespace},
               "spec": {"source": {"uri": "hf://org/tiny-llama", "credentialsSecretRef": {"name": "hf-token"}},
                        "storage": {"pvc": {"size": "5Gi", "storageClassName": f"manual-{namespace}"}},
                        "format": {"type": "sharded_state", "tensorParallelSize": 2},
                        "deletionPolicy": "Delete"}})
    mw = crd.get_json("mw", "llama", "-n", namespace)

    fetch = wait_for(lambda: jobs(crd, namespace).get("fetch"), "the fetch Job")
    pvc = crd.get_json("pvc", "llama-weights", "-n", namespace)
    assert pvc["spec"]["resources"]["requests"]["storage"] == "5Gi"
    assert pvc["metadata"]["ownerReferences"][0]["uid"] == mw["metadata"]["uid"]  # deletionPolicy Delete
    assert crd.kubectl("get", "sa", "ferry-worker", "-n", namespace).returncode == 0
    binding = crd.get_json("rolebinding", "ferry-worker", "-n", namespace)
    assert binding["roleRef"]["name"] == "ferry-worker"

    pod = fetch["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    digest_dir = c["args"][c["args"].index("--output") + 1].removesuffix("/staging")
    assert c["args"][:4] == ["fetch", "--source", "hf://org/tiny-llama", "--output"]
    assert digest_dir.startswith("/weights/llama/")
    assert c["image"] == IMAGE and pod["serviceAccountName"] == "ferry-worker"
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert c["envFrom"] == [{"secretRef": {"name": "hf-token"}}]
    assert {"name": "FERRY_MODELWEIGHTS_NAME", "value": "llama"} in c["env"]
    assert c["resources"] == {"requests": {"cpu": "1", "memory": "1Gi"}}
    assert fetch["metadata"]["ownerReferences"][0]["uid"] == mw["metadata"]["uid"]

    # kwok completes the fetch pod; the operator moves on to the shard Job.
    shard = wait_for(lambda: jobs(crd, namespace).get("shard"), "the shard Job", timeout=90)
    args = shard["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:5] == ["shard", "--source", f"{digest_dir}/staging", "--output", f"{digest_dir}/artifact"]
    assert args[args.index("--tensor-parallel-size") + 1] == "2"

    # The shard pod completes but reports no result: never Ready without a manifest.
    def stalled():
        st = crd.get_json("mw", "llama", "-n", namespace).get("status", {})
        return any(c["type"] == "Stalled" and c["status"] == "True" and c["reason"] == "ArtifactIncomplete"
                   for c in st.get("conditions", []))
    wait_for(stalled, "Stalled/ArtifactIncomplete", timeout=90)

    # Now the result the worker writes to its termination log.
    (p,) = crd.get_json("pods", "-n", namespace, "-l", f"job-name={shard['metadata']['name']}")["items"]
    statuses = p["status"]["containerStatuses"]
    result = {"manifestDigest": "sha256:" + "ab" * 32, "totalBytes": 3 << 20}
    statuses[0]["state"]["terminated"]["message"] = json.dumps(result)
    crd.kubectl("patch", "pod", p["metadata"]["name"], "-n", namespace, "--subresource=status", "--type=merge",
                "-p", json.dumps({"status": {"containerStatuses": statuses}}))
    crd.kubectl("wait", "--for=condition=Ready", "mw/llama", "-n", namespace, "--timeout=60s")
    status = crd.get_json("mw", "llama", "-n", namespace)["status"]
    assert status["artifact"]["uri"] == f"pvc://llama-weights{digest_dir.removeprefix('/weights')}/artifact"
    assert status["artifact"]["manifestDigest"] == result["manifestDigest"]
    assert status["artifact"]["size"] == "3.0Mi"
    assert {c["type"]: c["status"] for c in status["conditions"]}["Stalled"] == "False"

    # Durable facts: the status records the artifact for this spec, so the Jobs
    # may expire (TTL set once recorded) and deleting them and their pods
    # changes nothing: nothing re-runs, Ready stays.
    assert status["artifact"]["specDigest"] == digest_dir.rsplit("/", 1)[-1]
    ttls = wait_for(lambda: [j["spec"].get("ttlSecondsAfterFinished") for j in jobs(crd, namespace).values()]
                    if all(j["spec"].get("ttlSecondsAfterFinished") for j in jobs(crd, namespace).values()) else None,
                    "TTL on the finished Jobs")
    assert set(ttls) == {600}
    crd.kubectl("delete", "jobs", "--all", "-n", namespace, "--cascade=foreground", "--wait=true")
    crd.kubectl("delete", "pods", "--all", "-n", namespace, "--wait=true", "--grace-period=0", "--force")
    time.sleep(8)  # eight reconcile intervals of this operator
    assert jobs(crd, namespace) == {}
    after = crd.get_json("mw", "llama", "-n", namespace)["status"]
    assert {c["type"]: c["status"] for c in after["conditions"]}["Ready"] == "True"
    assert after["artifact"] == status["artifact"]
