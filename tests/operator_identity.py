"""The operator's identity in tests: a ServiceAccount token bound to the chart's
operator ClusterRole (rendered by helm), never an admin kubeconfig, so every
operator test also proves the chart grants what the operator needs."""
from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path

import yaml

import localcluster
from cluster_support import Kube



def chart_operator_role() -> dict:
    """The chart's operator ClusterRole, as helm renders it."""
    (role,) = [d for d in localcluster.render_chart("ferry", "templates/rbac.yaml")
               if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "ferry-operator"]
    return role


def without(role: dict, group: str, resource: str, verb: str) -> dict:
    role = copy.deepcopy(role)
    for rule in role["rules"]:
        if group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]:
            assert rule["resources"] == [resource], rule  # drop the verb for this resource only
            rule["verbs"].remove(verb)
            return role
    raise AssertionError(f"the chart's role has no {verb} {resource}.{group}")


@contextlib.contextmanager
def operator_identity(kube: Kube, namespace: str, role: dict, tmp_path: Path):
    """A ServiceAccount bound to `role` (renamed per test) and a kubeconfig with its token.
    Yields (kubeconfig path, apply(role) to change the role's rules)."""
    name = f"ferry-operator-{namespace}"

    def apply(r: dict) -> None:
        r = copy.deepcopy(r)
        r["metadata"] = {"name": name, "labels": {"ferry.dev/test": namespace}}
        kube.apply(r)

    kube.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "ferry-operator",
                                                                           "namespace": namespace}})
    apply(role)
    kube.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                "metadata": {"name": name, "labels": {"ferry.dev/test": namespace}},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
                "subjects": [{"kind": "ServiceAccount", "name": "ferry-operator", "namespace": namespace}]})
    token = kube.kubectl("create", "token", "ferry-operator", "-n", namespace, "--duration=1h").stdout.strip()
    admin = yaml.safe_load(kube.kubeconfig.read_text())
    config = {"apiVersion": "v1", "kind": "Config", "clusters": admin["clusters"],
              "users": [{"name": "ferry-operator", "user": {"token": token}}],
              "contexts": [{"name": "operator", "context": {"cluster": admin["clusters"][0]["name"],
                                                           "user": "ferry-operator"}}],
              "current-context": "operator"}
    path = tmp_path / "operator.kubeconfig"
    path.write_text(json.dumps(config))
    try:
        yield path, apply
    finally:
        kube.kubectl("delete", "clusterrolebinding,clusterrole", "-l", f"ferry.dev/test={namespace}",
                     "--wait=false", check=False)
