"""Before kopf starts: can this identity watch what the operator's indexes
watch, and are Ferry's admission policies enforced (admission_policies.py)?

kopf feeds its indexes from list+watch; without the permission it retries in
the background and never runs a handler, so a missing grant would look like an
operator doing nothing. Checked up front with SelfSubjectAccessReviews, a
missing one stops the operator with a message that names it.
"""
from __future__ import annotations

from typing import Any

# (group, resource, why) the operator lists and watches.
WATCHED = [
    ("ferry.dev", "modelweights", "the objects it reconciles"),
    ("apps", "deployments", "the serving Deployments it wires"),
    ("batch", "jobs", "its prepare Jobs"),
    ("", "pods", "its prepare Jobs' pods and the serving pods' weights-loaded condition"),
]


# Cluster-scoped: watched once, whichever namespaces the operator serves.
CLUSTER_WATCHED = [
    ("admissionregistration.k8s.io", "validatingadmissionpolicies", "its admission policies, which it acts only under"),
    ("admissionregistration.k8s.io", "validatingadmissionpolicybindings", "that its admission policies are enforced"),
]


def missing_permissions(authorization_api: Any, namespaces: list[str]) -> list[str]:
    from kubernetes import client

    problems = []
    checks = [(ns, w) for ns in namespaces or [""] for w in WATCHED] + [("", w) for w in CLUSTER_WATCHED]
    for namespace, (group, resource, why) in checks:
        for verb in ("list", "watch"):
            review = client.V1SelfSubjectAccessReview(spec=client.V1SelfSubjectAccessReviewSpec(
                resource_attributes=client.V1ResourceAttributes(group=group, resource=resource, verb=verb,
                                                                namespace=namespace or None)))
            if not authorization_api.create_self_subject_access_review(review).status.allowed:
                where = f"in namespace {namespace}" if namespace else "cluster-wide"
                what = f"{resource}.{group}" if group else resource
                problems.append(f"may not {verb} {what} {where} (it watches {why})")
    return problems


def check(namespaces: list[str]) -> str | None:
    """None if every watch is allowed; else what to grant, in words."""
    import kubernetes

    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    problems = missing_permissions(kubernetes.client.AuthorizationV1Api(), namespaces)
    if problems:
        return ("the operator's identity " + "; ".join(problems)
                + ". Grant it the chart's operator role (charts/ferry/templates/rbac.yaml: a Role in each "
                "watched namespace, or the ClusterRole when it watches all; docs/rbac.md).")
    from .admission_policies import check as check_policies, policy_names

    return check_policies(kubernetes.client.AdmissionregistrationV1Api(), policy_names())
