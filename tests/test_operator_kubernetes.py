"""The kubernetes executor against the real API server: the operator creates
the claim, the worker identity and one Job per step, each validated by
kube-apiserver, and a step's result travels back in the pod's termination
message. Here the Job pods are pinned to kwok's node, which completes them
without running them, and the test writes the termination message the worker
would have written — a stand-in for the node, said plainly here. The same
path on the real node, with the image built here: tests/node/. Only the Job's
own pods report: a pod planted with the Job's labels is ignored."""
from __future__ import annotations

import json

import pytest

from cluster_support import running_operator, wait_for
from ferry_operator.api.validation import parse
from ferry_operator.executors import jobs as ferry_jobs
from ferry_operator.steps import prepare_steps
from test_operator_local import reconcile_on_request
from test_operator_metrics import free_port

pytestmark = pytest.mark.cluster

IMAGE = "ghcr.io/ferry-dev/ferry:test"


@pytest.fixture
def k8s_operator(crd, namespace, tmp_path):
    """The operator with the kubernetes executor; yields the port of its Prometheus metrics."""
    port = free_port()
    with running_operator(crd, namespace, tmp_path / "operator.log", FERRY_EXECUTOR="kubernetes",
                          FERRY_METRICS_BIND=f"127.0.0.1:{port}",
                          FERRY_WORKER_IMAGE=IMAGE,
                          # kwok's node completes pods without running them: this
                          # test's stand-in for a node (tests/node/ runs them for real).
                          FERRY_WORKER_NODE_SELECTOR=json.dumps({"type": "kwok"}),
                          FERRY_WORKER_TOLERATIONS=json.dumps([{"key": "nvidia.com/gpu", "operator": "Exists",
                                                                "effect": "NoSchedule"}]),
                          FERRY_WORKER_RESOURCES=json.dumps({"requests": {"cpu": "1", "memory": "1Gi"}})):
        yield port


def jobs(kube, ns):
    return {j["metadata"]["labels"]["ferry.dev/step"]: j for j in kube.get_json("jobs", "-n", ns)["items"]}


def true_condition(kube, ns, type_, reason, name="llama"):
    """The ModelWeights' condition `type_` if it is True with `reason`."""
    st = kube.get_json("mw", name, "-n", ns).get("status", {})
    return next((c for c in st.get("conditions", []) if c["type"] == type_ and c["status"] == "True"
                 and c["reason"] == reason), None)


def write_result(kube, ns, pod_name, message, phase=None):
    """Set the worker container's termination message, as the kubelet reports what the worker wrote."""
    pod = kube.get_json("pod", pod_name, "-n", ns)
    statuses = pod["status"].get("containerStatuses") or [
        {"name": "worker", "image": IMAGE, "imageID": "", "ready": False, "restartCount": 0, "state": {}}]
    terminated = statuses[0]["state"].get("terminated") or {"exitCode": 0, "reason": "Completed"}
    statuses[0]["state"] = {"terminated": {**terminated, "message": message}}
    status = {"containerStatuses": statuses, **({"phase": phase} if phase else {})}
    kube.kubectl("patch", "pod", pod_name, "-n", ns, "--subresource=status", "--type=merge",
                 "-p", json.dumps({"status": status}))


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
    assert digest_dir.startswith(f"/weights/llama/{mw['metadata']['uid']}/")  # this object's own directory
    assert c["image"] == IMAGE and pod["serviceAccountName"] == "ferry-worker"
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert "envFrom" not in c  # the Secret's keys by name only (api.types.SECRET_KEYS)
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN",
                                                               "optional": False}}} in c["env"]
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}}} \
        in c["env"]  # the worker reports progress on its own pod
    assert c["resources"] == {"requests": {"cpu": "1", "memory": "1Gi"}}
    assert fetch["metadata"]["ownerReferences"][0]["uid"] == mw["metadata"]["uid"]

    # kwok completes the fetch pod; the operator moves on to the shard Job.
    shard = wait_for(lambda: jobs(crd, namespace).get("shard"), "the shard Job", timeout=90)
    args = shard["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:5] == ["shard", "--source", f"{digest_dir}/staging", "--output", f"{digest_dir}/artifact"]
    assert args[args.index("--tensor-parallel-size") + 1] == "2"

    # The shard pod completes but reports no result: never Ready without a manifest.
    wait_for(lambda: true_condition(crd, namespace, "Stalled", "ResultMissing"), "Stalled/ResultMissing", timeout=90)

    # Now the result the worker writes to its termination log.
    (p,) = crd.get_json("pods", "-n", namespace, "-l", f"job-name={shard['metadata']['name']}")["items"]
    result = {"manifestDigest": "sha256:" + "ab" * 32, "totalBytes": 3 << 20}
    write_result(crd, namespace, p["metadata"]["name"], json.dumps(result))
    crd.kubectl("wait", "--for=condition=Ready", "mw/llama", "-n", namespace, "--timeout=60s")
    status = crd.get_json("mw", "llama", "-n", namespace)["status"]
    assert status["artifact"]["uri"] == f"pvc://llama-weights{digest_dir.removeprefix('/weights')}/artifact"
    assert status["artifact"]["manifestDigest"] == result["manifestDigest"]
    assert status["artifact"]["size"] == "3.0Mi"
    assert {c["type"]: c["status"] for c in status["conditions"]}["Stalled"] == "False"

    # Durable facts: the status records the artifact for this spec, so the earlier Jobs
    # may expire (TTL set once recorded; the last step's Job stays, its result the record of the
    # artifact's size) and deleting them and their pods changes nothing: nothing re-runs, Ready
    # stays, through the reconciles their deletion woke and one asked for after it and waited for.
    assert status["artifact"]["specDigest"] == digest_dir.rsplit("/", 1)[-1]
    earlier = lambda: {n: j for n, j in jobs(crd, namespace).items() if n != "shard"}  # noqa: E731
    ttls = wait_for(lambda: [j["spec"].get("ttlSecondsAfterFinished") for j in earlier().values()]
                    if all(j["spec"].get("ttlSecondsAfterFinished") for j in earlier().values()) else None,
                    "TTL on the finished Jobs")
    assert set(ttls) == {600} and "ttlSecondsAfterFinished" not in jobs(crd, namespace)["shard"]["spec"]
    crd.kubectl("delete", "jobs", "--all", "-n", namespace, "--cascade=foreground", "--wait=true")
    crd.kubectl("delete", "pods", "--all", "-n", namespace, "--wait=true", "--grace-period=0", "--force")
    after = reconcile_on_request(crd, namespace, "llama", k8s_operator)
    assert jobs(crd, namespace) == {}
    assert {c["type"]: c["status"] for c in after["conditions"]}["Ready"] == "True"
    assert after["artifact"] == status["artifact"]


@pytest.fixture
def storage_class(crd, namespace):
    """A StorageClass with no provisioner: its claims wait (Pending, a waiting state however long it
    lasts) until a PersistentVolume of the class appears."""
    name = f"manual-{namespace}"
    crd.apply({"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": name},
               "provisioner": "kubernetes.io/no-provisioner", "volumeBindingMode": "Immediate"})
    yield name
    crd.kubectl("delete", "pv", f"pv-{namespace}", "--wait=false", check=False)
    crd.kubectl("delete", "storageclass", name, "--wait=false", check=False)


def test_a_planted_pod_with_the_jobs_labels_cannot_report_the_result(crd, namespace, storage_class, k8s_operator):
    """Anyone who may create pods in the namespace can copy a Job's labels; only the pod the Job
    controller made (its controller reference is the Job's uid) reports the step's result."""
    body = {"apiVersion": "ferry.dev/v1alpha1", "kind": "ModelWeights",
            "metadata": {"name": "llama", "namespace": namespace},
            "spec": {"source": {"uri": "hf://org/tiny-llama"},
                     "storage": {"pvc": {"size": "1Gi", "storageClassName": storage_class}},
                     "format": {"type": "safetensors"}}}
    # The claim has no volume yet (its class exists: a wait, not a stall), so the Job's own pod waits: the
    # pod is planted meanwhile, with the Job's name (which carries the object's uid: the attacker reads it)
    # and a forged result.
    crd.apply(body)
    mw = parse(crd.get_json("mw", "llama", "-n", namespace))
    (fetch,) = prepare_steps(mw.spec)
    job_name = ferry_jobs.job_name(mw, fetch)
    crd.apply({"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": "planted", "namespace": namespace,
                            "labels": {"job-name": job_name, "batch.kubernetes.io/job-name": job_name,
                                       "ferry.dev/modelweights": "llama", "ferry.dev/step": "fetch"}},
               "spec": {"restartPolicy": "Never", "nodeSelector": {"ferry.dev/test-node": "none"},
                        "containers": [{"name": "worker", "image": IMAGE}]}})
    forged = {"manifestDigest": "sha256:" + "66" * 32, "totalBytes": 1}
    write_result(crd, namespace, "planted", json.dumps(forged), phase="Succeeded")
    # The planted result is in place while the Job still waits for its claim.
    wait_for(lambda: true_condition(crd, namespace, "Reconciling", "PersistentVolumeClaimPending"),
             "Reconciling/PersistentVolumeClaimPending")
    crd.apply({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"pv-{namespace}"},
               "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                        "storageClassName": storage_class, "hostPath": {"path": f"/tmp/{namespace}"}}})

    # kwok completes the Job's own pod, which reports nothing: the planted result is not taken.
    missing = wait_for(lambda: true_condition(crd, namespace, "Stalled", "ResultMissing"), "Stalled/ResultMissing",
                       timeout=90)
    assert f"Job {namespace}/{job_name} completed, but none of its pods reported a result" in missing["message"]
    assert not (crd.get_json("mw", "llama", "-n", namespace)["status"].get("artifact") or {}).get("manifestDigest")

    # The Job's own pod reports: that result, and only it, is recorded.
    uid = jobs(crd, namespace)["fetch"]["metadata"]["uid"]
    (own,) = crd.get_json("pods", "-n", namespace, "-l", f"batch.kubernetes.io/controller-uid={uid}")["items"]
    result = {"manifestDigest": "sha256:" + "ab" * 32, "totalBytes": 3 << 20}
    write_result(crd, namespace, own["metadata"]["name"], json.dumps(result))
    crd.kubectl("wait", "--for=condition=Ready", "mw/llama", "-n", namespace, "--timeout=60s")
    artifact = crd.get_json("mw", "llama", "-n", namespace)["status"]["artifact"]
    assert (artifact["manifestDigest"], artifact["totalBytes"]) == (result["manifestDigest"], result["totalBytes"])


def test_a_forged_status_artifact_changes_no_job_ferry_writes(crd, namespace, storage_class, k8s_operator):
    """Whoever may write modelweights/status can record any size and MoE facts for the right URI and
    digest. The operator takes them from the last step's validated result (its Job's own pod, and its
    record of it), never from the status: the Jobs stay as they were and the forged facts are put back."""
    crd.apply({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"pv-{namespace}"},
               "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                        "storageClassName": storage_class, "hostPath": {"path": f"/tmp/{namespace}"}}})
    crd.apply({"apiVersion": "ferry.dev/v1alpha1", "kind": "ModelWeights",
               "metadata": {"name": "llama", "namespace": namespace},
               "spec": {"source": {"uri": "hf://org/tiny-llama"},
                        "storage": {"pvc": {"size": "1Gi", "storageClassName": storage_class}},
                        "format": {"type": "safetensors"}}})
    fetch = wait_for(lambda: jobs(crd, namespace).get("fetch"), "the fetch Job")
    (own,) = wait_for(lambda: crd.get_json("pods", "-n", namespace, "-l",
                                           f"batch.kubernetes.io/controller-uid={fetch['metadata']['uid']}")["items"],
                      "the fetch Job's pod")
    result = {"manifestDigest": "sha256:" + "ab" * 32, "totalBytes": 3 << 20}
    write_result(crd, namespace, own["metadata"]["name"], json.dumps(result))
    crd.kubectl("wait", "--for=condition=Ready", "mw/llama", "-n", namespace, "--timeout=60s")
    before = {n: (j["metadata"]["uid"], j["spec"]) for n, j in jobs(crd, namespace).items()}

    crd.kubectl("patch", "mw", "llama", "-n", namespace, "--subresource=status", "--type=merge", "-p",
                json.dumps({"status": {"artifact": {"totalBytes": 1 << 50, "size": "1.0Pi", "experts": 256,
                                                    "expertParallel": True}}}))
    after = reconcile_on_request(crd, namespace, "llama", k8s_operator)
    assert (after["artifact"]["totalBytes"], after["artifact"]["size"]) == (3 << 20, "3.0Mi")
    assert "experts" not in after["artifact"] and "expertParallel" not in after["artifact"]
    assert after["artifact"]["manifestDigest"] == result["manifestDigest"]
    assert {n: (j["metadata"]["uid"], j["spec"]) for n, j in jobs(crd, namespace).items()} == before
    assert {c["type"]: c["status"] for c in after["conditions"]}["Ready"] == "True"
