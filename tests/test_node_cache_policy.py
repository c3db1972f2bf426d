"""Least privilege of the node cache agent, and of the node cache's fill
slots, on the real API server.

The chart's node-cache role lets the agent's ServiceAccount patch nodes (RBAC
cannot say "only your own node"); its admission policy narrows that to: with
a token bound to a pod on that node, on that node only, labels under
cache.ferry.dev/ only. Tokens are minted bound to a pod exactly as the
kubelet mints the projected one (the TokenRequest API with a bound pod, whose
node the API server writes into the token), and the agent's own labeller
sends the patches. A fill slot (`mode: fill`) is for the operator's fill Jobs
only: a tenant's pod or Job with one is refused, the operator's Job and the
pod the Job controller makes of it are admitted.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from kubernetes.client.exceptions import ApiException

import localcluster
from cluster_support import Kube, in_cluster_env, token_dir, wait_for
from ferry_worker.cache.node_labels import NodeLabeler, label_for
from ferry_worker.cache.store import CacheStore, Watermarks
from ferry_worker.pod_status import connect

pytestmark = pytest.mark.cluster

RELEASE = "policy-test"  # not the chart tests' "ferry"
AGENT = f"{RELEASE}-ferry-node-cache"
NAMESPACE = "ferry-system"
OWN, OTHER = localcluster.FAKE_NODES
DIGEST = "sha256:" + "7" * 64


@pytest.fixture(scope="module")
def agent_policy(kube: Kube):
    objects = [o for o in localcluster.render_chart(RELEASE, "templates/node-cache.yaml",
                                                   values=("nodeCache.enabled=true",))
               if o["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy",
                                "ValidatingAdmissionPolicyBinding")]
    assert sorted(o["kind"] for o in objects) == ["ClusterRole", "ClusterRoleBinding", "ServiceAccount",
                                                  *["ValidatingAdmissionPolicy"] * 2,
                                                  *["ValidatingAdmissionPolicyBinding"] * 2]
    kube.kubectl("create", "namespace", NAMESPACE, check=False)
    # One nodeCache release per cluster (the CSIDriver is cluster-scoped): when the node e2e's release is
    # installed (its session fixture outlives tests/node/), its fill policy is the cluster's, and a second
    # one would refuse its operator's Jobs as this one refuses any other account's. Then that one is tested.
    others = [p for p in kube.get_json("validatingadmissionpolicies")["items"]
              if p["metadata"]["name"].endswith("-node-cache-fill") and not p["metadata"]["name"].startswith(RELEASE)]
    if others:
        objects = [o for o in objects if not o["metadata"]["name"].endswith("-node-cache-fill")]
    for o in objects:
        kube.apply(o)
    yield objects
    for o in objects:
        kube.kubectl("delete", o["kind"], o["metadata"]["name"], "-n", NAMESPACE, "--ignore-not-found", check=False)
    for node in localcluster.FAKE_NODES:
        labels = kube.get_json("node", node)["metadata"].get("labels", {})
        for key in [k for k in labels if k.startswith("cache.ferry.dev/")]:
            kube.kubectl("label", "node", node, f"{key}-", check=False)


def agent_pod(kube: Kube, name: str) -> dict:
    kube.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE},
                "spec": {"serviceAccountName": AGENT, "nodeName": OWN,
                         "tolerations": [{"operator": "Exists"}],
                         "containers": [{"name": "agent", "image": "ferry.local/ferry:dev"}]}})
    return kube.get_json("pod", name, "-n", NAMESPACE)


def api_as(kube: Kube, tmp: Path, pod: dict | None, monkeypatch):
    in_cluster_env(kube, monkeypatch)
    return connect(token_dir(kube, AGENT, NAMESPACE, tmp, pod))[0]


def denied(call) -> str:
    with pytest.raises(ApiException) as refused:
        call()
    assert refused.value.status == 403, refused.value.body
    return refused.value.body


FORBIDDEN_CHANGES = [
    {"metadata": {"labels": {"team": "stolen"}}},
    {"metadata": {"labels": {"kubernetes.io/hostname": None}}},
    {"metadata": {"annotations": {"ferry.dev/x": "y"}}},
    {"spec": {"unschedulable": True}},
    {"spec": {"taints": [{"key": "ferry.dev/mine", "effect": "NoSchedule"}]}},
    # A cache label may change; another label in the same patch may not.
    {"metadata": {"labels": {"cache.ferry.dev/" + "8" * 63: "true", "nvidia.com/gpu.product": "x"}}},
]


def test_the_agent_labels_its_own_node_with_its_cache_and_nothing_else(kube, agent_policy, tmp_path, monkeypatch):
    pod = agent_pod(kube, "node-cache-agent")
    api = api_as(kube, tmp_path, pod, monkeypatch)
    store = CacheStore(tmp_path / "cache", Watermarks(high=1 << 30, low=1 << 29))
    (store.root / "entries" / DIGEST.removeprefix("sha256:")).mkdir()  # a complete entry, as the store lists it
    labeler = NodeLabeler(store, OWN, api, period=3600)

    # The role is in force (a dry run of a cache label passes) and so is the policy (the agent's own
    # dry-run probe, of a label outside cache.ferry.dev/, is refused): bindings may take a moment.
    wait_for(lambda: not _refused(lambda: api.patch_node(OWN, {"metadata": {"labels": {label_for(DIGEST): "true"}}},
                                                         dry_run="All")), "the agent's role in force")
    wait_for(lambda: labeler.policy_enforced(), "the node-cache policy enforced")

    # Its own node's cache labels: the labeller's sync writes exactly the entry's label.
    stop = threading.Event()
    labeler.changed()
    worker = threading.Thread(target=labeler.run, args=(stop,))
    worker.start()
    try:
        wait_for(lambda: kube.get_json("node", OWN)["metadata"]["labels"].get(label_for(DIGEST)) == "true",
                 "the agent's label on its node")
    finally:
        stop.set()
        labeler.changed()
        worker.join(10)

    # Another node, with this node's token: denied, naming both.
    body = denied(lambda: api.patch_node(OTHER, {"metadata": {"labels": {label_for(DIGEST): "true"}}}))
    assert f"labels only the node it runs on" in body and f"{OWN} tried to change node {OTHER}" in body
    assert label_for(DIGEST) not in kube.get_json("node", OTHER)["metadata"].get("labels", {})

    # Its own node, anything but cache labels: denied.
    before = kube.get_json("node", OWN)
    for change in FORBIDDEN_CHANGES:
        body = denied(lambda: api.patch_node(OWN, change))
        assert "may change only labels under cache.ferry.dev/" in body, change
    after = kube.get_json("node", OWN)
    assert after["metadata"]["labels"] == before["metadata"]["labels"] and after["spec"] == before["spec"]

    # The entry evicted: the label goes.
    (store.root / "entries" / DIGEST.removeprefix("sha256:")).rmdir()
    labeler.sync()
    assert label_for(DIGEST) not in kube.get_json("node", OWN)["metadata"]["labels"]


def test_a_token_bound_to_no_pod_labels_no_node(kube, agent_policy, tmp_path, monkeypatch):
    api = api_as(kube, tmp_path, None, monkeypatch)
    def refusal() -> str:
        try:
            api.patch_node(OWN, {"metadata": {"labels": {label_for(DIGEST): "true"}}}, dry_run="All")
            return ""
        except ApiException as exc:
            return exc.body if exc.status == 403 else ""
    # The role and the policy take a moment: wait for the policy's own words.
    body = wait_for(lambda: "tried to change node" in (b := refusal()) and b, "the node-cache policy enforced")
    assert "a token bound to no node tried to change node " + OWN in body


def _refused(call) -> bool:
    try:
        call()
        return False
    except ApiException as exc:
        return exc.status == 403


@pytest.fixture(scope="module")
def fill_operator(kube: Kube, agent_policy) -> str:
    """The operator account the cluster's fill policy admits (its `operator` variable)."""
    (policy,) = [p for p in kube.get_json("validatingadmissionpolicies")["items"]
                 if p["metadata"]["name"].endswith("-node-cache-fill")]
    return next(v["expression"] for v in policy["spec"]["variables"] if v["name"] == "operator").strip("'")


def cache_pod_spec(mode: str) -> dict:
    return {"nodeName": OWN, "restartPolicy": "Never", "tolerations": [{"operator": "Exists"}],
            "volumes": [{"name": "slot", "csi": {"driver": "cache.ferry.dev", "volumeAttributes": {
                "digest": DIGEST, "mode": mode, "bytes": "1000"}}}],
            "containers": [{"name": "fill", "image": "ferry.local/ferry:dev",
                            "volumeMounts": [{"name": "slot", "mountPath": "/slot"}]}]}


def create_as(kube: Kube, user: str, obj: dict, dry_run: bool = True) -> str:
    """"" when admitted, else the API server's refusal."""
    argv = ["create", "-f", "-", "--as", user] + (["--dry-run=server"] if dry_run else [])
    proc = kube.kubectl(*argv, input=json.dumps(obj), check=False)
    return "" if proc.returncode == 0 else proc.stderr


def test_only_the_operators_fill_jobs_get_a_fill_slot(kube, agent_policy, fill_operator, namespace):
    operator = fill_operator
    # Both a tenant and the operator may create pods and Jobs here (RBAC): the policy is what tells them apart.
    kube.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                "metadata": {"name": "edit", "namespace": namespace},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
                "subjects": [{"kind": "User", "name": "dev-a", "apiGroup": "rbac.authorization.k8s.io"},
                             {"kind": "ServiceAccount", "name": operator.rsplit(":", 1)[1],
                              "namespace": operator.split(":")[2]}]})
    meta = {"name": "fill", "namespace": namespace}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": cache_pod_spec("fill")}
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
           "spec": {"backoffLimit": 0, "template": {"spec": cache_pod_spec("fill")}}}

    # A tenant's pod with a fill slot: refused, in the policy's words (a new policy takes a moment).
    refused = wait_for(lambda: "only the Ferry operator" in (r := create_as(kube, "dev-a", pod)) and r,
                       "the fill policy enforced")
    assert "dev-a is not the Job controller" in refused and "mode serve" in refused, refused
    # Her Job with one: refused, naming the one account that may.
    refused = create_as(kube, "dev-a", job)
    assert f"dev-a is not {operator}" in refused, refused
    # Her pod with the cache in serve mode (read-only, content addressed): admitted.
    assert create_as(kube, "dev-a", {**pod, "spec": cache_pod_spec("serve")}) == ""

    # The operator's Job: admitted, and so is the pod the Job controller makes of it.
    assert create_as(kube, operator, job, dry_run=False) == ""
    made = wait_for(lambda: kube.get_json("pods", "-n", namespace, "-l", "job-name=fill")["items"],
                    "the Job controller's fill pod")
    assert made[0]["metadata"]["ownerReferences"][0]["kind"] == "Job"
    # Updates go through (a label; the garbage collector removing its finalizer in a foreground delete).
    kube.kubectl("label", "job", "fill", "-n", namespace, "--as", "dev-a", "team=a")
    kube.kubectl("delete", "job", "fill", "-n", namespace, "--cascade=foreground", "--timeout=60s", timeout=90)
    assert kube.kubectl("get", "job", "fill", "-n", namespace, check=False).returncode != 0
