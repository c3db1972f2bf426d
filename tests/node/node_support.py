"""Helpers for the real-node tests (a module of its own: several conftest.py
files exist, so tests import helpers from here, never from a conftest)."""
from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import localcluster
from cluster_support import Kube, wait_for
from s3server import S3Server

CHART = Path(__file__).resolve().parents[2] / "charts" / "ferry"
# The namespace the chart's operator watches; every ModelWeights of these tests lives there.
NAMESPACE = "node-e2e"
# The node cache's watermarks in the session's chart: two one-rank entries of the tests' TP 2 artifact
# (about 0.7 MB each) fit under the low mark, three pass the high one, the whole artifact (1.4 MB) fits
# (test_node_cache_on_node.py).
NODE_CACHE_HIGH, NODE_CACHE_LOW = 1_750_000, 1_500_000


def modelweights(name: str, uri: str, fmt: dict, secret: str | None = None, **storage) -> dict:
    source = {"uri": uri}
    if secret:
        source["credentialsSecretRef"] = {"name": secret}
    return {"apiVersion": "ferry.dev/v1alpha1", "kind": "ModelWeights",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"source": source, "storage": {"pvc": {"size": "1Gi", **storage}}, "format": fmt,
                     "deletionPolicy": "Delete"}}


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(localcluster.binaries() / "helm"), "--kubeconfig", str(localcluster.KUBECONFIG),
                           *args], capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stderr}")
    return proc


def install_chart(kube: Kube, release: str, namespace: str, watch: str, image_ref: str, *sets: str) -> None:
    repository, _, tag = image_ref.rpartition(":")
    for ns in (watch, namespace):  # one an earlier session deleted may still be going away
        wait_for(lambda: kube.kubectl("get", "namespace", ns, "-o", "jsonpath={.status.phase}", check=False).stdout
                 != "Terminating", f"namespace {ns} to finish terminating", timeout=180)
    kube.kubectl("create", "namespace", watch, check=False)
    args = ["upgrade", "--install", release, str(CHART), "--namespace", namespace, "--create-namespace",
            "--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
            "--set", "image.pullPolicy=Never",
            "--set", f"operator.watchNamespaces={{{watch}}}",
            # Two cores on this node: small requests so Jobs and the operator fit.
            "--set", "operator.resources.requests.cpu=50m",
            "--set-json", 'worker.resources={"requests":{"cpu":"100m","memory":"256Mi"},"limits":{"memory":"1Gi"}}',
            "--set-json", 'loader.resources={"requests":{"cpu":"100m","memory":"128Mi"},"limits":{"memory":"512Mi"}}',
            "--set", "operator.logLevel=debug",
            # Every worker reports progress, however short its step (the tests read it in the audit log).
            "--set-string", "worker.progressIntervalSeconds=0",
            "--wait", "--timeout", "180s"]
    for s in sets:
        args += ["--set", s]
    proc = helm(*args, check=False)
    if proc.returncode != 0:
        pods = kube.kubectl("get", "pods", "-n", namespace, "-o", "wide", check=False).stdout
        describe = kube.kubectl("describe", "pods", "-n", namespace, check=False).stdout[-4000:]
        raise AssertionError(f"helm install {release} failed:\n{proc.stderr}\n{pods}\n{describe}")


def cluster_write_grants(kube: Kube, release: str, namespace: str) -> list[str]:
    """Every ClusterRoleBinding of the release, or to one of its ServiceAccounts, whose ClusterRole grants a verb
    beyond get/list/watch: a namespaced install must have none (its write verbs live in Roles). The one
    exception is the node cache agent's `patch nodes`, and only while the admission policy of the same name,
    which confines it to its own node's cache labels, is enforced (tests/test_node_cache_policy.py)."""
    roles = {r["metadata"]["name"]: r for r in kube.get_json("clusterroles")["items"]}
    enforced = {b["spec"]["policyName"] for b in kube.get_json("validatingadmissionpolicybindings")["items"]
                if b["spec"].get("validationActions") == ["Deny"] and not b["spec"].get("matchResources")}
    found = []
    for binding in kube.get_json("clusterrolebindings")["items"]:
        ours = binding["metadata"].get("labels", {}).get("app.kubernetes.io/instance") == release
        to_ours = any(s.get("kind") == "ServiceAccount" and s.get("namespace") == namespace
                      for s in binding.get("subjects") or [])
        if not (ours or to_ours):
            continue
        rules = roles.get(binding["roleRef"]["name"], {}).get("rules") or []
        if rules == [NODE_LABELS_RULE] and binding["roleRef"]["name"] in enforced:
            continue
        writes = sorted({v for rule in rules for v in rule.get("verbs", [])} - {"get", "list", "watch"})
        if writes:
            found.append(f"ClusterRoleBinding {binding['metadata']['name']} -> ClusterRole "
                         f"{binding['roleRef']['name']}: {', '.join(writes)}")
    return found


NODE_LABELS_RULE = {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}


def uninstall_chart(kube: Kube, release: str, namespace: str, watch: str) -> None:
    # The operator must still run to let its ModelWeights go (kopf's finalizer).
    kube.kubectl("delete", "mw", "--all", "-n", watch, "--timeout=90s", check=False, timeout=120)
    # Pods that mount node cache entries need the chart's agent to unmount them: they go first.
    kube.kubectl("delete", "deployments,statefulsets,leaderworkersets,pods", "--all", "-n", watch, "--wait=true", "--timeout=120s", check=False,
                 timeout=150)
    helm("uninstall", release, "--namespace", namespace, "--wait", "--timeout", "120s", check=False)
    kube.kubectl("delete", "namespace", watch, "--wait=false", check=False)


def operator_pod(kube: Kube, namespace: str) -> dict:
    (pod,) = kube.get_json("pods", "-n", namespace, "-l", "app.kubernetes.io/component=operator")["items"]
    return pod


def s3_secret(kube: Kube, namespace: str, name: str, s3: S3Server, extra: dict[str, str] | None = None) -> None:
    """The credentials Secret a ModelWeights references (the keys of api.types.SECRET_KEYS["s3"] reach the
    worker by name; `extra` keys are in the Secret too, and reach nothing)."""
    env = {**s3.env(), **(extra or {})}
    kube.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": namespace},
                "stringData": env})


def upload_dir(s3: S3Server, bucket: str, prefix: str, directory: Path) -> None:
    client = s3.client()
    client.create_bucket(Bucket=bucket)
    for f in sorted(directory.rglob("*")):
        if f.is_file():
            client.upload_file(str(f), bucket, f"{prefix}/{f.relative_to(directory)}")


def claim_dir(kube: Kube, claim: str) -> Path:
    """The host directory behind a claim the local-path provisioner bound."""
    pvc = kube.get_json("pvc", claim, "-n", NAMESPACE)
    pv = kube.get_json("pv", pvc["spec"]["volumeName"])
    return Path((pv["spec"].get("hostPath") or pv["spec"].get("local"))["path"])


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def mw_status(kube: Kube, namespace: str, name: str) -> dict:
    return kube.get_json("mw", name, "-n", namespace).get("status", {})


def condition(status: dict, kind: str) -> dict:
    return next((c for c in status.get("conditions", []) if c["type"] == kind), {})


def wait_ready(kube: Kube, namespace: str, name: str, timeout: float = 240, stalled_ok: bool = False) -> dict:
    def ready():
        status = mw_status(kube, namespace, name)
        stalled = condition(status, "Stalled")
        if stalled.get("status") == "True" and not stalled_ok:
            raise AssertionError(f"{name} Stalled: {stalled.get('reason')}: {stalled.get('message')}")
        return status if condition(status, "Ready").get("status") == "True" else None
    try:
        return wait_for(ready, f"{name} Ready", timeout)
    except AssertionError:
        pods = kube.kubectl("get", "pods", "-n", namespace, "-o", "wide", check=False).stdout
        print(pods, json.dumps(mw_status(kube, namespace, name), indent=1))
        raise


def wait_stalled(kube: Kube, namespace: str, name: str, timeout: float = 120) -> dict:
    def stalled():
        c = condition(mw_status(kube, namespace, name), "Stalled")
        return c if c.get("status") == "True" else None
    return wait_for(stalled, f"{name} Stalled", timeout)


# vLLM's stand-in: refuses to start without the artifact, then answers /health. With compiled state wired
# (VLLM_CACHE_ROOT) it "compiles" when the cache root holds nothing (COLD) and says WARM with what it found.
STANDIN = """#!/bin/sh
test -f /ferry/weights/ferry-manifest.json || { echo "no artifact at /ferry/weights" >&2; exit 1; }
echo "vllm $*"
if [ -n "$VLLM_CACHE_ROOT" ]; then
  root="$VLLM_CACHE_ROOT/torch_compile_cache/standin/rank_0_0"
  if [ -f "$root/graph.py" ]; then
    echo "WARM $(cat "$root/graph.py")"
  else
    echo "COLD"
    mkdir -p "$root" && echo "compiled-by-$HOSTNAME" > "$root/graph.py"
  fi
fi
mkdir -p /tmp/www && echo ok > /tmp/www/health
trap 'exit 0' TERM  # as the pod's PID 1, httpd would ignore SIGTERM: each pod would take its 30 s grace to go
httpd -f -p 8000 -h /tmp/www &
wait
"""


def pods_of(kube, app: str) -> list[dict]:
    return kube.get_json("pods", "-n", NAMESPACE, "-l", f"app={app}")["items"]


def standin_template(kube, name: str) -> dict:
    """A pod template running the stand-in as vLLM's `vllm serve tiny-llama` (its ConfigMap applied)."""
    kube.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-vllm", "namespace": NAMESPACE},
                "data": {"vllm": STANDIN}})
    busybox = localcluster.built_images()["busybox"]["ref"]
    return {"metadata": {"labels": {"app": name}}, "spec": {
        "containers": [{"name": "vllm", "image": busybox, "imagePullPolicy": "Never",
                        "command": ["env", "PATH=/standin:/bin", "vllm", "serve", "tiny-llama"],
                        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}},
                        "volumeMounts": [{"name": "standin", "mountPath": "/standin"}]}],
        "volumes": [{"name": "standin", "configMap": {"name": f"{name}-vllm", "defaultMode": 0o755}}]}}


def standin_deployment(kube, name: str) -> None:
    labels = {"app": name}
    kube.apply({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": NAMESPACE},
                "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                         "strategy": {"rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                         "progressDeadlineSeconds": 600, "template": standin_template(kube, name)}})


def job_pods(kube, name: str) -> list[dict]:
    """The pods of this object's prepare steps (not of the Job that removes its staging afterwards)."""
    return kube.get_json("pods", "-n", NAMESPACE, "-l", f"ferry.dev/modelweights={name},ferry.dev/step!=staging")[
        "items"]


# Secret keys that would run a tenant's code in the prepare pod, were the Secret imported whole (envFrom). The
# paths are on the claim the prepare pod mounts at /weights (where test_node_cache_on_node.py plants the code).
HOSTILE_KEYS = {"PYTHONPATH": "/weights/evil", "LD_PRELOAD": "/weights/evil/hook.so", "TENANT_NOTE": "x"}


def assert_no_hostile_env(kube, name: str, keys: dict[str, str] = HOSTILE_KEYS, fetched: bool = True) -> None:
    """No Job pod of `name` got a Secret key it does not use: credentials by secretKeyRef only, never
    envFrom, so PYTHONPATH and LD_PRELOAD never reached the prepare pod (glibc would have said so on stderr
    for a preload it could not open). `fetched`: the fetch pod, the one that gets the source's Secret, must
    be among those inspected (False once its Job may have gone: ttlSecondsAfterFinished)."""
    pods = job_pods(kube, name)
    steps = {p["metadata"]["labels"].get("ferry.dev/step") for p in pods}
    assert not fetched or "fetch" in steps, f"no fetch pod of {name} left to inspect: {sorted(map(str, steps))}"
    for pod in pods:
        for c in pod["spec"]["containers"] + pod["spec"].get("initContainers", []):
            assert "envFrom" not in c, (pod["metadata"]["name"], c["envFrom"])
            assert not {e["name"] for e in c.get("env") or []} & set(keys), (pod["metadata"]["name"], c["env"])
            for e in c.get("env") or []:
                ref = (e.get("valueFrom") or {}).get("secretKeyRef")
                assert ref is None or ref["key"] == e["name"], e  # each key under its own name
        log = kube.kubectl("logs", pod["metadata"]["name"], "-n", NAMESPACE, check=False).stdout
        assert "LD_PRELOAD" not in log and "ld.so" not in log, log[-2000:]
