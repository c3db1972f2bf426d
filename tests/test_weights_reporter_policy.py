"""Least privilege of the serving pods' weights reporter, on the real API server.

The chart's `weights-reporter` role lets a ServiceAccount patch pods/status;
its admission policy narrows that to: with a pod-bound token only, on the
token's own pod only, the ferry.dev/weights-loaded condition only. Tokens are
minted bound to a pod exactly as the kubelet mints the projected one (the
TokenRequest API with a bound object), and the loader's own reporter sends the
patches.
"""
from __future__ import annotations

from pathlib import Path

import pytest

import localcluster
from cluster_support import Kube, in_cluster_env, token_dir, wait_for
from ferry_worker.load.report import CONDITION, PodConditionReporter

pytestmark = pytest.mark.cluster


# A release name of its own: tests/test_chart.py installs "ferry", whose objects these would collide with.
RELEASE = "policy-test"
ROLE = f"{RELEASE}-ferry-weights-reporter"


@pytest.fixture(scope="module")
def reporter_policy(kube: Kube):
    objects = localcluster.render_chart(RELEASE, "templates/weights-reporter.yaml")
    assert {o["kind"] for o in objects} == {"ClusterRole", "ValidatingAdmissionPolicy",
                                            "ValidatingAdmissionPolicyBinding"}
    assert {o["metadata"]["name"] for o in objects} == {ROLE}
    for o in objects:
        kube.apply(o)
    yield objects
    for o in objects:
        kube.kubectl("delete", o["kind"], ROLE, "--ignore-not-found", check=False)


def serving_pod(kube: Kube, namespace: str, name: str) -> dict:
    # On kwok's GPU node: the pod object is what matters here.
    kube.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
                "spec": {"serviceAccountName": "serving", "readinessGates": [{"conditionType": CONDITION}],
                         "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
                         "nodeSelector": {"type": "kwok"},
                         "containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.32.0"}]}})
    return wait_for(lambda: (p := kube.get_json("pod", name, "-n", namespace))["status"].get("podIP") and p,
                    f"pod {name} running on kwok")


def reporter(kube: Kube, pod_name: str, tokens: Path, monkeypatch) -> PodConditionReporter:
    in_cluster_env(kube, monkeypatch)  # the in-cluster loader reads the API server address from the env, as in a pod
    return PodConditionReporter.connect(pod_name, tokens)


def gate(kube: Kube, namespace: str, name: str) -> dict | None:
    pod = kube.get_json("pod", name, "-n", namespace)
    return next((c for c in pod["status"].get("conditions", []) if c["type"] == CONDITION), None)


def test_a_pod_reports_on_itself_and_cannot_touch_another_pod(kube, namespace, reporter_policy, tmp_path,
                                                              monkeypatch):
    kube.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "serving", "namespace": namespace}})
    kube.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                "metadata": {"name": "ferry-weights-reporter-serving", "namespace": namespace},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                            "name": ROLE},
                "subjects": [{"kind": "ServiceAccount", "name": "serving", "namespace": namespace}]})
    a, b = serving_pod(kube, namespace, "serving-a"), serving_pod(kube, namespace, "serving-b")
    own = reporter(kube, "serving-a", token_dir(kube, "serving", namespace, tmp_path, a), monkeypatch)
    unbound = reporter(kube, "serving-a", token_dir(kube, "serving", namespace, tmp_path, None), monkeypatch)

    # The policy in force first (a new policy and binding take a moment): a token bound to no pod is refused
    # (a harmless probe: Loading on its own pod). Then its own condition: allowed (the role binding, too,
    # may take a moment, so retry on denial).
    wait_for(lambda: "pod-bound service account token only" in _denial(lambda: unbound.report(False, "Loading", "")),
             "the self-report policy enforced")
    wait_for(lambda: _ok(lambda: own.report(True, "Loaded", "verified (sha256): 3 files")), "the reporter allowed")
    assert gate(kube, namespace, "serving-a")["reason"] == "Loaded"

    # Another pod, with pod A's token: denied by the policy, naming both pods.
    other = PodConditionReporter("serving-b", namespace, own._api)
    with pytest.raises(PermissionError, match="on itself only: pod serving-a tried to change pod serving-b"):
        other.report(True, "Loaded", "forged")
    before = gate(kube, namespace, "serving-b")
    assert before is None or before.get("reason") != "Loaded"

    # Its own pod's other conditions and fields, status and metadata alike: denied
    # (an allowlist: the new pod equals the old one but for Ferry's own conditions;
# changes the API server's own validation refuses, e.g. of podIPs, never reach it).
    from kubernetes.client.exceptions import ApiException
    for change in FORBIDDEN_CHANGES:
        with pytest.raises(ApiException) as denied:
            own._api.patch_namespaced_pod_status("serving-a", namespace, change,
                                                 _content_type="application/strategic-merge-patch+json")
        assert denied.value.status == 403, change
        assert "may change only its own ferry.dev/weights-loaded or ferry.dev/progress condition" in denied.value.body
    after = kube.get_json("pod", "serving-a", "-n", namespace)
    assert after["status"]["phase"] == "Running" and "ferry.dev/x" not in after["metadata"].get("finalizers", [])

    # A token of the same account not bound to a pod: denied, so a leaked long-lived token cannot report.
    with pytest.raises(PermissionError, match="pod-bound service account token only"):
        unbound.report(False, "Loading", "")

    # Without the role binding the reporter says what is missing.
    kube.kubectl("delete", "rolebinding", "ferry-weights-reporter-serving", "-n", namespace)
    wait_for(lambda: _denied(lambda: own.report(True, "Loaded", "again")), "the binding's removal enforced")
    with pytest.raises(PermissionError, match="needs Ferry.s weights-reporter ClusterRole"):
        own.report(True, "Loaded", "again")


FORBIDDEN_CHANGES = [
    {"status": {"conditions": [{"type": "Ready", "status": "False"}]}},
    {"status": {"phase": "Failed"}},
    {"status": {"message": "all is well", "reason": "Fine"}},
    {"status": {"nominatedNodeName": "elsewhere"}},
    {"metadata": {"finalizers": ["ferry.dev/x"]}},
    {"metadata": {"labels": {"app": "stolen"}}},
    {"metadata": {"annotations": {"ferry.dev/modelweights": "other"}}},
    # Its own condition may change; another one in the same patch may not.
    {"status": {"conditions": [{"type": CONDITION, "status": "True", "reason": "Loaded", "message": ""},
                               {"type": "PodScheduled", "status": "False"}]}},
]


def _ok(fn) -> bool:
    try:
        fn()
        return True
    except PermissionError:
        return False


def _denial(fn) -> str:
    """The PermissionError's message, or "" when allowed."""
    try:
        fn()
        return ""
    except PermissionError as exc:
        return str(exc)


def _denied(fn) -> bool:
    return not _ok(fn)
