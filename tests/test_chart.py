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


def worker_namespaces(docs) -> set[str]:
    return {d["metadata"]["namespace"] for d in by_kind(docs, "ServiceAccount") if d["metadata"]["name"] == "ferry-worker"}


@pytest.mark.helm
def test_watch_namespaces_and_worker_namespaces(helm):
    docs = render(helm, "operator.watchNamespaces={ml,research}", "workerNamespaces={ml}")
    (dep,) = by_kind(docs, "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=ml" in args and "--namespace=research" in args and "--all-namespaces" not in args
    assert worker_namespaces(docs) == {"ml", "ferry-system"}
    # Unset, the worker identity goes where the operator works.
    assert worker_namespaces(render(helm, "operator.watchNamespaces={ml,research}")) == {"ml", "research", "ferry-system"}
    assert worker_namespaces(render(helm)) == {"ferry-system"}


# Grants as (apiGroup, resource, verb, resourceName or "*"): what the chart gives the operator.
READS = ("get", "list", "watch")
OPERATOR_NAMESPACED = {
    *(("ferry.dev", "modelweights", v, "*") for v in (*READS, "patch", "update")),
    *(("ferry.dev", "modelweights/status", v, "*") for v in ("get", "patch", "update")),
    ("ferry.dev", "modelweights/finalizers", "update", "*"),
    *(("batch", "jobs", v, "*") for v in (*READS, "create", "delete", "patch")),
    *(("", "persistentvolumeclaims", v, "*") for v in (*READS, "create", "delete", "patch")),
    *(("apps", r, v, "*") for r in ("deployments", "statefulsets") for v in (*READS, "patch")),
    *(("leaderworkerset.x-k8s.io", "leaderworkersets", v, "*") for v in (*READS, "patch")),
    *(("", "pods", v, "*") for v in READS),
    *((g, "events", v, "*") for g in ("", "events.k8s.io") for v in ("create", "patch")),
    *(("", "serviceaccounts", v, "*") for v in ("get", "create")),
    *(("rbac.authorization.k8s.io", "rolebindings", v, "*") for v in ("get", "create")),
    *(("rbac.authorization.k8s.io", "clusterroles", "bind", n) for n in ("ferry-worker", "ferry-weights-reporter")),
}
OPERATOR_CLUSTER_READS = {
    *(("apiextensions.k8s.io", "customresourcedefinitions", v, "*") for v in READS),
    ("storage.k8s.io", "storageclasses", "get", "*"),
    ("", "nodes", "list", "*"),
    ("", "nodes", "watch", "*"),
    *(("admissionregistration.k8s.io", r, v, "*")
      for r in ("validatingadmissionpolicies", "validatingadmissionpolicybindings") for v in READS),
}
WORKER_GRANTS = {("", "pods/status", "patch", "*"), ("ferry.dev", "weightsreports", "create", "*")}


def grants(role: dict) -> set[tuple[str, str, str, str]]:
    return {(g, r, v, n) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
            for v in rule["verbs"] for n in rule.get("resourceNames", ["*"])}


def bound_roles(docs, subject_name: str, subject_namespace: str = "ferry-system"):
    """(binding kind, binding namespace or None, role) for each binding of the ServiceAccount."""
    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d
             for d in by_kind(docs, "Role") + by_kind(docs, "ClusterRole")}
    for b in by_kind(docs, "RoleBinding") + by_kind(docs, "ClusterRoleBinding"):
        if {"kind": "ServiceAccount", "name": subject_name, "namespace": subject_namespace} in b["subjects"]:
            ns = b["metadata"].get("namespace")
            ref = b["roleRef"]
            yield b["kind"], ns, roles[(ref["kind"], ns if ref["kind"] == "Role" else None, ref["name"])]


@pytest.mark.helm
def test_namespaced_install_grants_the_operator_nothing_outside_its_namespaces(helm):
    docs = render(helm, "operator.watchNamespaces={a,b}")
    by_place = {}
    for kind, ns, role in bound_roles(docs, "ferry-operator"):
        by_place.setdefault((kind, ns), set()).update(grants(role))
    assert by_place == {("RoleBinding", "a"): OPERATOR_NAMESPACED, ("RoleBinding", "b"): OPERATOR_NAMESPACED,
                        ("ClusterRoleBinding", None): OPERATOR_CLUSTER_READS}
    # No ClusterRoleBinding of the release, to anyone, grants more than reads.
    cluster_roles = {d["metadata"]["name"]: d for d in by_kind(docs, "ClusterRole")}
    for binding in by_kind(docs, "ClusterRoleBinding"):
        verbs = {v for (_, _, v, _) in grants(cluster_roles[binding["roleRef"]["name"]])}
        assert verbs <= set(READS), f"ClusterRoleBinding {binding['metadata']['name']} grants {verbs}"
    # Namespaced objects only where the operator works, and the worker identity in the release's namespace.
    placed = {(d["kind"], d["metadata"]["namespace"], d["metadata"]["name"])
              for d in by_kind(docs, "Role") + by_kind(docs, "RoleBinding")}
    assert placed == {*((k, ns, "ferry-operator") for k in ("Role", "RoleBinding") for ns in ("a", "b")),
                      *(("RoleBinding", ns, "ferry-worker") for ns in ("a", "b", "ferry-system"))}


@pytest.mark.helm
def test_namespaced_grants_satisfy_the_operators_preflight(helm):
    from ferry_operator.preflight import CLUSTER_WATCHED, WATCHED

    docs = render(helm, "operator.watchNamespaces={a}")
    (role,) = by_kind(docs, "Role")
    (reads,) = [r for r in by_kind(docs, "ClusterRole") if r["metadata"]["name"].endswith("cluster-reads")]
    for watched, granted in ((WATCHED, grants(role)), (CLUSTER_WATCHED, grants(reads))):
        for group, resource, _ in watched:
            for verb in ("list", "watch"):
                assert (group, resource, verb, "*") in granted, f"{verb} {resource}.{group}"


@pytest.mark.helm
def test_all_namespaces_install_is_one_cluster_role(helm):
    docs = render(helm)
    assert by_kind(docs, "Role") == []
    ((kind, ns, role),) = bound_roles(docs, "ferry-operator")
    assert (kind, ns, role["metadata"]["name"]) == ("ClusterRoleBinding", None, "ferry-operator")
    # Never namespaces: watching all of them kopf does not list them, and with names it scans nothing.
    assert grants(role) == OPERATOR_NAMESPACED | OPERATOR_CLUSTER_READS


@pytest.mark.helm
@pytest.mark.parametrize("sets", [(), ("operator.watchNamespaces={a,b}",)], ids=["all-namespaces", "namespaced"])
def test_worker_may_only_report_on_its_own_pod(helm, sets):
    docs = render(helm, *sets)
    (role,) = [d for d in by_kind(docs, "ClusterRole") if d["metadata"]["name"] == "ferry-worker"]
    assert grants(role) == WORKER_GRANTS  # nothing on modelweights: progress travels as a condition of its own pod
    for ns in worker_namespaces(docs):
        assert [k for k, _, r in bound_roles(docs, "ferry-worker", ns)] == ["RoleBinding"]


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

# (who, verb, resource, namespace or None for cluster-wide, allowed). The release watches `ml` only.
RBAC_MATRIX = [
    (OPERATOR, "watch", "modelweights.ferry.dev", "ml", True),
    (OPERATOR, "patch", "modelweights.ferry.dev/status", "ml", True),
    (OPERATOR, "update", "modelweights.ferry.dev/finalizers", "ml", True),
    (OPERATOR, "create", "jobs.batch", "ml", True),
    (OPERATOR, "create", "persistentvolumeclaims", "ml", True),
    (OPERATOR, "patch", "deployments.apps", "ml", True),
    # The serving pods report their own condition; the operator never writes pod status.
    (OPERATOR, "patch", "pods/status", "ml", False),
    (OPERATOR, "bind", "clusterroles.rbac.authorization.k8s.io/ferry-weights-reporter", "ml", True),
    (OPERATOR, "create", "rolebindings.rbac.authorization.k8s.io", "ml", True),
    (OPERATOR, "create", "events", "ml", True),
    (OPERATOR, "create", "serviceaccounts", "ml", True),
    (OPERATOR, "bind", "clusterroles.rbac.authorization.k8s.io/ferry-worker", "ml", True),
    # Why a claim stays Pending: its StorageClass, by name; never the cluster's events.
    (OPERATOR, "get", "storageclasses.storage.k8s.io", None, True),
    (OPERATOR, "list", "storageclasses.storage.k8s.io", None, False),
    # Which nodes a node cache prewarm selects, and which hold an artifact: never a node's own writes.
    (OPERATOR, "list", "nodes", None, True),
    (OPERATOR, "watch", "nodes", None, True),
    (OPERATOR, "patch", "nodes", None, False),
    (OPERATOR, "list", "events", "ml", False),
    (OPERATOR, "list", "pods", "ml", True),
    (OPERATOR, "get", "secrets", "ml", False),
    (OPERATOR, "list", "secrets", None, False),
    (OPERATOR, "create", "deployments.apps", "ml", False),
    (OPERATOR, "delete", "deployments.apps", "ml", False),
    (OPERATOR, "delete", "modelweights.ferry.dev", "ml", False),
    (OPERATOR, "bind", "clusterroles.rbac.authorization.k8s.io/cluster-admin", "ml", False),
    (OPERATOR, "escalate", "clusterroles.rbac.authorization.k8s.io", None, False),
    # Cluster-scoped: reads only.
    (OPERATOR, "watch", "customresourcedefinitions.apiextensions.k8s.io", None, True),
    (OPERATOR, "update", "customresourcedefinitions.apiextensions.k8s.io", None, False),
    (OPERATOR, "watch", "validatingadmissionpolicies.admissionregistration.k8s.io", None, True),
    (OPERATOR, "get", "validatingadmissionpolicybindings.admissionregistration.k8s.io", None, True),
    (OPERATOR, "delete", "validatingadmissionpolicies.admissionregistration.k8s.io", None, False),
    (OPERATOR, "update", "validatingadmissionpolicybindings.admissionregistration.k8s.io", None, False),
    (OPERATOR, "list", "namespaces", None, False),
    # Namespaced install: nothing outside the watched namespaces, its own release namespace included.
    *((OPERATOR, verb, resource, ns, False) for ns in ("kube-system", "default", "ferry-system", None)
      for verb, resource in (("create", "jobs.batch"), ("patch", "deployments.apps"),
                             ("delete", "persistentvolumeclaims"), ("create", "rolebindings.rbac.authorization.k8s.io"),
                             ("create", "serviceaccounts"), ("list", "modelweights.ferry.dev"), ("list", "pods"),
                             ("bind", "clusterroles.rbac.authorization.k8s.io/ferry-worker"))),
    # It never creates pods itself, anywhere (its Jobs do).
    *((OPERATOR, "create", "pods", ns, False) for ns in ("ml", "kube-system", "default", "ferry-system", None)),
    # The worker: only its own pod's condition (an admission policy narrows pods/status to that pod).
    # (Its marker, weightsreports.ferry.dev, is no served resource, which `kubectl auth can-i`
    # cannot ask about: tests/test_worker_identity.py proves the chart's worker role holds it.)
    (WORKER, "patch", "pods/status", "ml", True),
    (WORKER, "patch", "pods/status", "default", False),
    (WORKER, "patch", "modelweights.ferry.dev/status", "ml", False),
    (WORKER, "get", "modelweights.ferry.dev/status", "ml", False),
    (WORKER, "get", "modelweights.ferry.dev", "ml", False),
    (WORKER, "patch", "modelweights.ferry.dev", "ml", False),
    (WORKER, "update", "modelweights.ferry.dev", "ml", False),
    (WORKER, "delete", "modelweights.ferry.dev", "ml", False),
    (WORKER, "get", "secrets", "ml", False),
    (WORKER, "create", "jobs.batch", "ml", False),
    (WORKER, "patch", "deployments.apps", "ml", False),
    (WORKER, "list", "pods", "ml", False),
    (WORKER, "patch", "pods", "ml", False),
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


@pytest.mark.cluster
@pytest.mark.helm
@pytest.mark.parametrize("ns,cluster_role,allowed", [
    ("ml", "ferry-worker", True), ("ml", "ferry-weights-reporter", True),
    ("ml", "cluster-admin", False), ("ml", "edit", False),
    ("kube-system", "ferry-worker", False), ("default", "ferry-weights-reporter", False),
])
def test_operator_binds_only_the_chart_roles_only_in_watched_namespaces(installed, ns, cluster_role, allowed):
    """The real API server's escalation check: `bind` granted by a Role (by resourceNames) is checked in the
    namespace of the RoleBinding being created. Server-side dry run: checked in full, nothing stored."""
    proc = installed.kubectl("create", "rolebinding", "ferry-bind-check", f"--clusterrole={cluster_role}",
                             "--serviceaccount=ml:ferry-worker", "-n", ns, "--as", OPERATOR, "--dry-run=server",
                             check=False)
    assert (proc.returncode == 0) is allowed, proc.stderr
    if not allowed:
        assert "forbidden" in proc.stderr, proc.stderr


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


@pytest.mark.helm
def test_admission_policies_ship_enforced_and_the_operator_is_told_their_names(helm):
    docs = render(helm)
    policies = {p["metadata"]["name"]: p for p in by_kind(docs, "ValidatingAdmissionPolicy")}
    assert set(policies) == {"ferry-references", "ferry-weights-reporter"}
    bindings = by_kind(docs, "ValidatingAdmissionPolicyBinding")
    assert {b["spec"]["policyName"]: b["spec"]["validationActions"] for b in bindings} == {
        name: ["Deny"] for name in policies}
    assert all(p["spec"]["failurePolicy"] == "Fail" for p in policies.values())
    (dep,) = by_kind(docs, "Deployment")
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["FERRY_ADMISSION_POLICIES"] == "ferry-references,ferry-weights-reporter"


@pytest.mark.helm
def test_with_the_node_cache_on_the_operator_also_requires_the_fill_policy(helm):
    """Without the fill policy a tenant's own `mode: fill` pod writes into slots: with the node cache on,
    the operator is told its name and acts only while it is enforced, as for the others."""
    from ferry_operator.admission_policies import problems

    docs = render(helm, "nodeCache.enabled=true")
    (dep,) = by_kind(docs, "Deployment")
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    names = env["FERRY_ADMISSION_POLICIES"].split(",")
    assert names == ["ferry-references", "ferry-weights-reporter", "ferry-node-cache-fill"]
    policies = {p["metadata"]["name"]: p for p in by_kind(docs, "ValidatingAdmissionPolicy")}
    bindings = by_kind(docs, "ValidatingAdmissionPolicyBinding")
    assert {name: problems(policies.get(name), bindings, name) for name in names} == {name: [] for name in names}


@pytest.mark.helm
def test_every_serving_deployment_a_spec_can_hold_is_authorised(helm):
    """The references policy checks deployments[0..N-1] and targets[0..N-1] one by one (a message may
    not call the authorizer): N must be the API's own limit on each list."""
    from ferry_operator.api.types import MAX_WORKLOADS, Serving

    (policy,) = [p for p in by_kind(render(helm), "ValidatingAdmissionPolicy")
                 if p["metadata"]["name"] == "ferry-references"]
    for field in ("deployments", "targets"):
        checked = [v for v in policy["spec"]["validations"] if f"spec.serving.{field}[" in v["messageExpression"]]
        limit = next(m.max_length for m in Serving.model_fields[field].metadata if hasattr(m, "max_length"))
        assert len(checked) == limit == MAX_WORKLOADS, field


NODE_CACHE = "ferry-node-cache"


def node_cache_objects(docs):
    return [d for d in docs if d["kind"] == "CSIDriver" or d["metadata"]["name"] == NODE_CACHE
            or d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "node-cache"]


@pytest.mark.helm
def test_node_cache_is_off_by_default(helm):
    assert node_cache_objects(render(helm)) == []
    assert node_cache_objects(render(helm, "nodeCache.enabled=false")) == []


@pytest.mark.helm
def test_the_operator_is_told_whether_the_node_agent_runs(helm):
    """FERRY_NODE_CACHE is how the operator knows: without the agent it makes no fill Job (a fill pod would
    wait for a CSI driver no node serves) and stalls a serving.nodeCache object saying why."""
    for sets, value in (((), "false"), (("nodeCache.enabled=true",), "true")):
        (dep,) = by_kind(render(helm, *sets), "Deployment")
        env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["FERRY_NODE_CACHE"] == value, sets


@pytest.mark.helm
def test_node_cache_agent_when_enabled(helm):
    docs = render(helm, "nodeCache.enabled=true")
    (driver,) = by_kind(docs, "CSIDriver")
    assert driver["metadata"]["name"] == "cache.ferry.dev"
    assert driver["spec"] == {"attachRequired": False, "podInfoOnMount": True, "volumeLifecycleModes": ["Ephemeral"],
                              "fsGroupPolicy": "None", "requiresRepublish": False, "storageCapacity": False}
    (sa,) = [d for d in by_kind(docs, "ServiceAccount") if d["metadata"]["name"] == NODE_CACHE]
    assert sa.get("automountServiceAccountToken", True) is True
    # Its one grant: get and patch nodes (its own node's cache labels, as the policy narrows it), bound
    # cluster-wide to it alone; nothing namespaced, nothing else.
    assert [(kind, ns, role["rules"]) for kind, ns, role in bound_roles(docs, NODE_CACHE)] == [
        ("ClusterRoleBinding", None, [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}])]
    (binding,) = [b for b in by_kind(docs, "ClusterRoleBinding") if b["metadata"]["name"] == NODE_CACHE]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": NODE_CACHE, "namespace": "ferry-system"}]
    assert not [b for b in by_kind(docs, "RoleBinding") if any(s.get("name") == NODE_CACHE for s in b["subjects"])]
    (policy,) = [p for p in by_kind(docs, "ValidatingAdmissionPolicy") if p["metadata"]["name"] == NODE_CACHE]
    assert policy["spec"]["failurePolicy"] == "Fail"
    assert policy["spec"]["matchConstraints"]["resourceRules"] == [
        {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"], "resources": ["nodes"]}]
    assert policy["spec"]["matchConditions"][0]["expression"] == (
        f"request.userInfo.username == 'system:serviceaccount:ferry-system:{NODE_CACHE}'")
    (vapb,) = [b for b in by_kind(docs, "ValidatingAdmissionPolicyBinding") if b["metadata"]["name"] == NODE_CACHE]
    assert vapb["spec"] == {"policyName": NODE_CACHE, "validationActions": ["Deny"]}
    # Fill slots for the operator's fill Jobs only: pods and Jobs, enforced, naming the operator's account.
    (fill,) = [p for p in by_kind(docs, "ValidatingAdmissionPolicy") if p["metadata"]["name"] == f"{NODE_CACHE}-fill"]
    assert fill["spec"]["failurePolicy"] == "Fail"
    assert [(r["apiGroups"], r["resources"], r["operations"]) for r in fill["spec"]["matchConstraints"]["resourceRules"]] \
        == [([""], ["pods"], ["CREATE"]), (["batch"], ["jobs"], ["CREATE"])]
    operator = next(v for v in fill["spec"]["variables"] if v["name"] == "operator")
    assert operator["expression"] == "'system:serviceaccount:ferry-system:ferry-operator'"
    (fill_binding,) = [b for b in by_kind(docs, "ValidatingAdmissionPolicyBinding")
                       if b["metadata"]["name"] == f"{NODE_CACHE}-fill"]
    assert fill_binding["spec"] == {"policyName": f"{NODE_CACHE}-fill", "validationActions": ["Deny"]}

    (ds,) = by_kind(docs, "DaemonSet")
    assert ds["metadata"]["name"] == NODE_CACHE and ds["metadata"]["namespace"] == "ferry-system"
    pod = ds["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == NODE_CACHE and pod["automountServiceAccountToken"] is True
    assert pod["priorityClassName"] == "system-node-critical" and pod["hostNetwork"] is False
    assert pod["tolerations"] == [{"operator": "Exists"}]
    # Its own selector: the operator's Deployment (and metrics Service) must not select it.
    (dep,) = by_kind(docs, "Deployment")
    assert ds["spec"]["selector"]["matchLabels"] != dep["spec"]["selector"]["matchLabels"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()

    (c,) = pod["containers"]
    assert c["name"] == "agent" and c["image"] == "ghcr.io/ferry-dev/ferry:0.1.0"
    assert c["securityContext"]["privileged"] is True
    assert c["command"] == ["ferry", "cache", "--root", "/var/lib/ferry/cache", "--high", "90%", "--low", "80%",
                            "--eviction-hard", "10%", "agent", "--kubelet-dir", "/var/lib/kubelet",
                            "--node-name", "$(NODE_NAME)", "--mount-wait", "30", "--namespace-share", "50%",
                            "--fill-reservation", "14400", "--reverify-after", "3600",
                            "--scrub-every", "86400"]
    assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in c["env"]
    assert c["resources"] == {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    (kubelet,) = [m for m in c["volumeMounts"] if m.get("mountPropagation") == "Bidirectional"]
    assert volumes[kubelet["name"]]["hostPath"] == {"path": "/var/lib/kubelet", "type": "Directory"}
    assert kubelet["mountPath"] == "/var/lib/kubelet"
    cache = mounts["/var/lib/ferry/cache"]
    assert "mountPropagation" not in cache
    assert volumes[cache["name"]]["hostPath"] == {"path": "/var/lib/ferry/cache", "type": "DirectoryOrCreate"}


@pytest.mark.helm
def test_node_cache_values_reach_the_agent(helm, tmp_path):
    docs = render(helm, "nodeCache.enabled=true", "nodeCache.high=3500000", "nodeCache.low=500Gi",
                  "nodeCache.kubeletEvictionHard=1Gi", "nodeCache.mountWaitSeconds=5", "nodeCache.reverifyAfterSeconds=0",
                  "nodeCache.scrubIntervalSeconds=0", "nodeCache.kubeletDir=/data/kubelet", "nodeCache.hostPath=/mnt/nvme/ferry",
                  "nodeCache.nodeSelector.pool=gpu", "nodeCache.namespaceShare=200Gi", "nodeCache.fillDeadlineSeconds=3600")
    (ds,) = by_kind(docs, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    args = c["command"]
    assert args[args.index("--namespace-share") + 1] == "200Gi"
    # The agent holds a fill's room as long as the operator lets its fill Job live.
    assert args[args.index("--fill-reservation") + 1] == "3600"
    (dep,) = by_kind(docs, "Deployment")
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["FERRY_FILL_DEADLINE_SECONDS"] == "3600"
    assert env["FERRY_PREWARM_NODE_LABELS"] == ""  # any label, by default
    listed = render(helm, "nodeCache.enabled=true", "nodeCache.prewarmNodeLabels={ferry.dev/pool,zone}")
    (dep,) = by_kind(listed, "Deployment")
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["FERRY_PREWARM_NODE_LABELS"] == "ferry.dev/pool,zone"
    flags = dict(zip(args[2:10:2], args[3:10:2]))
    assert flags == {"--root": "/var/lib/ferry/cache", "--high": "3500000", "--low": "500Gi", "--eviction-hard": "1Gi"}
    assert args[args.index("--mount-wait") + 1] == "5"
    assert args[args.index("--reverify-after") + 1] == "0"
    assert args[args.index("--scrub-every") + 1] == "0"
    assert args[args.index("--kubelet-dir") + 1] == "/data/kubelet"
    (kubelet,) = [m for m in c["volumeMounts"] if m.get("mountPropagation") == "Bidirectional"]
    assert kubelet["mountPath"] == "/data/kubelet"
    assert {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}[kubelet["name"]] == "/data/kubelet"
    assert "/mnt/nvme/ferry" in [v["hostPath"]["path"] for v in pod["volumes"]]
    assert pod["nodeSelector"] == {"pool": "gpu"}
    # A values file's big integers reach helm as floats: still a whole byte count, not 3.5e+06.
    values = tmp_path / "values.yaml"
    values.write_text("nodeCache: {enabled: true, high: 3500000000000, low: 3000000}\n")
    out = run_helm(helm, "template", "ferry", str(CHART), "--kube-version", KUBE_VERSION, "-f", str(values)).stdout
    (ds,) = by_kind([d for d in yaml.safe_load_all(out) if d], "DaemonSet")
    args = ds["spec"]["template"]["spec"]["containers"][0]["command"]
    assert args[args.index("--high") + 1] == "3500000000000" and args[args.index("--low") + 1] == "3000000"


@pytest.mark.helm
@pytest.mark.parametrize("bad,words", [
    ("nodeCache.hostPath=relative/path", "hostPath"),
    ("nodeCache.kubeletDir=var/lib/kubelet", "kubeletDir"),
    ("nodeCache.high=lots", "high"),
    ("nodeCache.low=5P", "low"),
    ("nodeCache.high=150%", "high"),
    ("nodeCache.kubeletEvictionHard=-1", "kubeletEvictionHard"),
    ("nodeCache.mountWaitSeconds=-1", "mountWaitSeconds"),
    ("nodeCache.reverifyAfterSeconds=-1", "reverifyAfterSeconds"),
    ("nodeCache.bogus=1", "bogus"),
])
def test_node_cache_values_schema_rejects_bad_values(helm, bad, words):
    proc = run_helm(helm, "template", "ferry", str(CHART), "--kube-version", KUBE_VERSION,
                    "--set", "nodeCache.enabled=true", "--set", bad, check=False)
    assert proc.returncode != 0 and "nodeCache" in proc.stderr and words in proc.stderr, proc.stderr


@pytest.mark.helm
@pytest.mark.parametrize("sets", [
    (), ("nodeCache.high=3500000", "nodeCache.low=500Gi", "nodeCache.kubeletEvictionHard=1Gi"),
], ids=["defaults", "sizes"])
def test_node_cache_command_parses_with_the_worker_cli(helm, sets):
    from ferry_worker.cli import _parser

    (ds,) = by_kind(render(helm, "nodeCache.enabled=true", *sets), "DaemonSet")
    command = ds["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[0] == "ferry"
    args = _parser().parse_args([a.replace("$(NODE_NAME)", "node-1") for a in command[1:]])
    assert (args.command, args.action, args.node_name) == ("cache", "agent", "node-1")
    assert str(args.root) == "/var/lib/ferry/cache" and str(args.kubelet_dir) == "/var/lib/kubelet"
    assert args.mount_wait == 30


@pytest.mark.helm
def test_node_cache_chart_lints(helm):
    run_helm(helm, "lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION, "--set", "nodeCache.enabled=true")
