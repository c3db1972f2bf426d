"""The Helm chart: rendered by a real helm, installed into the real local
control plane, and its RBAC checked with `kubectl auth can-i` both ways."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

import localcluster
REPO = Path(__file__).resolve().parent.parent

CHART = REPO / "charts" / "ferry"
KUBE_VERSION = "1.34.0"


@pytest.fixture(scope="session")
def helm() -> str:
    return str(localcluster.binaries() / "helm")


def run_helm(helm, *args, check=True, env=None):
    proc = subprocess.run([helm, *args], capture_output=True, text=True, env=env, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)}:\n{proc.stderr}")
    return proc


def render(helm, *sets):
    args = ["template", "ferry", str(CHART), "--namespace", "ferry-system", "--kube-version", KUBE_VERSION]
    for s in sets:
        args += ["--set", s]
    return [d for d in yaml.safe_load_all(run_helm(helm, *args).stdout) if d]


def by_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


@pytest.mark.helm
def test_chart_lints(helm):
    run_helm(helm, "lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION)


@pytest.mark.helm
def test_operator_deployment_is_hardened(helm):
    (dep,) = by_kind(render(helm), "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert "--liveness=http://0.0.0.0:8080/healthz" in c["args"]
    assert pod["serviceAccountName"] == "ferry-operator"
    assert "--all-namespaces" in c["args"]


@pytest.mark.helm
def test_watch_namespaces_and_worker_namespaces(helm):
    docs = render(helm, "operator.watchNamespaces={ml,research}", "workerNamespaces={ml,research}")
    (dep,) = by_kind(docs, "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=ml" in args and "--namespace=research" in args and "--all-namespaces" not in args
    worker_sas = {(d["metadata"]["namespace"]) for d in by_kind(docs, "ServiceAccount")
                  if d["metadata"]["name"] == "ferry-worker"}
    assert worker_sas == {"ml", "research", "ferry-system"}


@pytest.mark.helm
@pytest.mark.parametrize("bad,words", [
    ("operator.bogus=1", "bogus"),
    ("image.pullPolicy=Sometimes", "pullPolicy"),
    ("workerNamespaces={Not_A_Namespace}", "workerNamespaces"),
])
def test_values_schema_rejects_bad_values(helm, bad, words):
    proc = run_helm(helm, "template", "ferry", str(CHART), "--kube-version", KUBE_VERSION, "--set", bad, check=False)
    assert proc.returncode != 0 and words in proc.stderr, proc.stderr


@pytest.mark.helm
def test_chart_ships_the_generated_crd():
    assert (CHART / "crds" / "ferry.dev_modelweights.yaml").read_text() == \
        (REPO / "crds" / "ferry.dev_modelweights.yaml").read_text()


@pytest.fixture(scope="module")
def installed(kube, helm, images):
    env = {**os.environ, "KUBECONFIG": str(kube.kubeconfig),
           "HELM_CACHE_HOME": str(localcluster.STATE / "helm/cache"),
           "HELM_CONFIG_HOME": str(localcluster.STATE / "helm/config"),
           "HELM_DATA_HOME": str(localcluster.STATE / "helm/data")}
    # The worker's namespace exists before the release, as a user's would.
    kube.kubectl("create", "namespace", "ml", check=False)
    # The operator really runs (on the real node, with the image built here);
    # it watches only `ml`, so it leaves other tests' ModelWeights alone.
    repository, _, tag = images["ferry"]["ref"].rpartition(":")
    run_helm(helm, "upgrade", "--install", "ferry", str(CHART), "--namespace", "ferry-system", "--create-namespace",
             "--set", "workerNamespaces={ml}", "--set", "operator.watchNamespaces={ml}",
             "--set", f"image.repository={repository}", "--set", f"image.tag={tag}", "--set", "image.pullPolicy=Never",
             "--set", "operator.resources.requests.cpu=50m", "--wait", "--timeout", "120s", env=env)
    yield kube
    run_helm(helm, "uninstall", "ferry", "--namespace", "ferry-system", "--wait", check=False, env=env)


OPERATOR = "system:serviceaccount:ferry-system:ferry-operator"
WORKER = "system:serviceaccount:ml:ferry-worker"

# (who, verb, resource, namespace, allowed)
RBAC_MATRIX = [
    (OPERATOR, "watch", "modelweights.ferry.dev", None, True),
    (OPERATOR, "patch", "modelweights.ferry.dev/status", "ml", True),
    (OPERATOR, "update", "modelweights.ferry.dev/finalizers", "ml", True),
    (OPERATOR, "create", "jobs.batch", "ml", True),
    (OPERATOR, "create", "persistentvolumeclaims", "ml", True),
    (OPERATOR, "patch", "deployments.apps", "ml", True),
    # The serving pods report their own condition; the operator never writes pod status.
    (OPERATOR, "patch", "pods/status", "ml", False),
    (OPERATOR, "bind", "clusterroles.rbac.authorization.k8s.io/ferry-weights-reporter", None, True),
    (OPERATOR, "create", "rolebindings.rbac.authorization.k8s.io", "ml", True),
    (OPERATOR, "create", "events", "ml", True),
    (OPERATOR, "create", "serviceaccounts", "ml", True),
    (OPERATOR, "bind", "clusterroles.rbac.authorization.k8s.io/ferry-worker", None, True),
    # Why a claim stays Pending: its StorageClass, by name; never the cluster's events.
    (OPERATOR, "get", "storageclasses.storage.k8s.io", None, True),
    (OPERATOR, "list", "storageclasses.storage.k8s.io", None, False),
    (OPERATOR, "list", "events", "ml", False),
    (OPERATOR, "list", "pods", "ml", True),
    (OPERATOR, "get", "secrets", "ml", False),
    (OPERATOR, "list", "secrets", None, False),
    (OPERATOR, "create", "deployments.apps", "ml", False),
    (OPERATOR, "delete", "deployments.apps", "ml", False),
    (OPERATOR, "create", "pods", "ml", False),
    (OPERATOR, "delete", "modelweights.ferry.dev", "ml", False),
    (OPERATOR, "bind", "clusterroles.rbac.authorization.k8s.io/cluster-admin", None, False),
    (OPERATOR, "escalate", "clusterroles.rbac.authorization.k8s.io", None, False),
    (OPERATOR, "update", "customresourcedefinitions.apiextensions.k8s.io", None, False),
    (WORKER, "patch", "modelweights.ferry.dev/status", "ml", True),
    (WORKER, "get", "modelweights.ferry.dev/status", "ml", True),
    (WORKER, "patch", "modelweights.ferry.dev", "ml", False),
    (WORKER, "update", "modelweights.ferry.dev", "ml", False),
    (WORKER, "delete", "modelweights.ferry.dev", "ml", False),
    (WORKER, "patch", "modelweights.ferry.dev/status", "default", False),
    (WORKER, "get", "secrets", "ml", False),
    (WORKER, "create", "jobs.batch", "ml", False),
    (WORKER, "patch", "deployments.apps", "ml", False),
    (WORKER, "list", "pods", "ml", False),
    (WORKER, "patch", "pods/status", "ml", False),
]


@pytest.mark.cluster
@pytest.mark.helm
def test_operator_runs_as_installed(installed):
    dep = installed.get_json("deployment", "ferry-operator", "-n", "ferry-system")
    assert dep["status"].get("readyReplicas") == 1
    assert installed.kubectl("get", "crd", "modelweights.ferry.dev").returncode == 0


@pytest.mark.cluster
@pytest.mark.helm
@pytest.mark.parametrize("who,verb,resource,ns,allowed", RBAC_MATRIX,
                         ids=[f"{w.split(':')[-1]}-{v}-{r.replace('.ferry.dev', '')}{'-' + n if n else ''}"
                              for w, v, r, n, _ in RBAC_MATRIX])
def test_rbac_matrix(installed, who, verb, resource, ns, allowed):
    # kubectl reads "type/x" as a resource name; subresources need their own flag.
    resource, _, sub = resource.partition("/")
    if sub in ("status", "finalizers"):
        args = ["auth", "can-i", verb, resource, f"--subresource={sub}", "--as", who]
    else:
        args = ["auth", "can-i", verb, f"{resource}/{sub}" if sub else resource, "--as", who]
    args += ["-n", ns] if ns else ["--all-namespaces"]
    proc = installed.kubectl(*args, check=False)
    answer = proc.stdout.strip()
    assert answer in ("yes", "no"), proc.stderr
    assert (answer == "yes") is allowed, f"{who} {verb} {resource} in {ns}: {answer}"


@pytest.mark.helm
def test_metrics_service_by_default_and_a_service_monitor_on_request(helm):
    docs = render(helm)
    (svc,) = [d for d in by_kind(docs, "Service") if d["metadata"]["name"].endswith("-metrics")]
    assert svc["spec"]["ports"][0]["port"] == 9090
    (dep,) = by_kind(docs, "Deployment")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "FERRY_METRICS_BIND", "value": "0.0.0.0:9090"} in c["env"]
    assert by_kind(docs, "ServiceMonitor") == []
    (monitor,) = by_kind(render(helm, "metrics.serviceMonitor.enabled=true"), "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    off = render(helm, "metrics.enabled=false")
    assert not [d for d in by_kind(off, "Service") if d["metadata"]["name"].endswith("-metrics")]
