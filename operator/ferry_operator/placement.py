"""Where a serving workload's own pods may go, and so where Ferry's fill Jobs may go. Pure.

A fill Job runs in the tenant's namespace and `kubectl exec` reaches it, so it must never land on a node the
tenant's own wired pods could not be scheduled on (another team's dedicated or tainted nodes). The rule is
the scheduler's, for the parts a pod template states:

- every `nodeSelector` label is on the node with that value;
- the required node affinity (`requiredDuringSchedulingIgnoredDuringExecution`): one of its terms matches;
  an operator or field this module does not know matches nothing (fail closed);
- every NoSchedule and NoExecute taint of the node is tolerated. A toleration of every taint (`operator:
  Exists` with no key) is not carried to a fill Job and counts for nothing here: a fill goes to a tainted
  node only by a toleration of that taint's key.

Tolerations the API server adds at admission count too, as for the workload's pods: for every extended
resource a container requests (`nvidia.com/gpu`), the ExtendedResourceToleration plugin gives the pod
`{key: <resource>, operator: Exists, effect: NoSchedule}`, so GPU pools tainted with their resource name
take the workload's pods; the fill Job carries that toleration explicitly (it requests no GPU). The
node's own condition taints (`node.kubernetes.io/*`: cordoned, not ready, under pressure) refuse no
node: they are the scheduler's to wait on, not a rule of the tenant's.

Pod (anti-)affinity is not carried: it names the workload's own pods, which a fill pod is not, and it says
nothing about which nodes a tenant may use.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

HARD_EFFECTS = ("NoSchedule", "NoExecute")  # PreferNoSchedule only orders nodes: it keeps no pod out
SYSTEM_TAINTS = "node.kubernetes.io/"  # the node's own conditions, set and cleared by Kubernetes
NODE_NAME_FIELD = "metadata.name"


@dataclass(frozen=True)
class Placement:
    """A pod template's own constraints on its nodes, as the fill Jobs carry them."""

    tolerations: list[dict[str, Any]] = field(default_factory=list)  # tolerate-all ones left out
    node_selector: dict[str, str] = field(default_factory=dict)
    required_terms: list[dict[str, Any]] | None = None  # nodeSelectorTerms; None: no required node affinity
    tolerates_all: bool = False  # the template had a toleration of every taint (left out above)


@dataclass(frozen=True)
class NodeFacts:
    """What placement needs of a Node (the operator's node index holds these, not the Node)."""

    name: str
    labels: dict[str, str] = field(default_factory=dict)
    taints: list[dict[str, Any]] = field(default_factory=list)  # key, value, effect


def node_facts(body: Mapping[str, Any]) -> NodeFacts:
    meta, spec = body.get("metadata") or {}, body.get("spec") or {}
    taints = [{k: t[k] for k in ("key", "value", "effect") if t.get(k) is not None} for t in spec.get("taints") or []]
    return NodeFacts(name=meta.get("name", ""), labels=dict(meta.get("labels") or {}), taints=taints)


def placement_of(pod: Mapping[str, Any]) -> Placement:
    """A pod spec's placement (as the API serves it)."""
    required = ((pod.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution")
    return Placement(
        tolerations=[t for t in pod.get("tolerations") or [] if not _tolerates_all(t)] + _extended_resources(pod),
        node_selector={str(k): str(v) for k, v in (pod.get("nodeSelector") or {}).items()},
        required_terms=None if required is None else list(required.get("nodeSelectorTerms") or []),
        tolerates_all=any(_tolerates_all(t) for t in pod.get("tolerations") or []),
    )


def _extended_resources(pod: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The tolerations ExtendedResourceToleration adds for the extended resources the containers request."""
    names = set()
    for c in [*(pod.get("containers") or []), *(pod.get("initContainers") or [])]:
        resources = c.get("resources") or {}
        for part in ("requests", "limits"):
            names |= {n for n in (resources.get(part) or {}) if "/" in n and not n.startswith("kubernetes.io/")
                      and not n.startswith("requests.") and not n.startswith("hugepages-")}
    return [{"key": n, "operator": "Exists", "effect": "NoSchedule"} for n in sorted(names)]


def selected(nodes: Mapping[str, NodeFacts], selector: Mapping[str, str]) -> list[str]:
    """The nodes whose labels hold every `selector` label (a prewarm's nodeSelector), by name."""
    return sorted(n.name for n in nodes.values() if all(n.labels.get(k) == v for k, v in selector.items()))


def refusal(node: NodeFacts, placement: Placement, whose: str = "the pod template") -> str | None:
    """Why a pod of `placement` (`whose`: e.g. "deployment x's pod template") may not run on `node`, in
    words; None if it may."""
    for key, value in sorted(placement.node_selector.items()):
        if node.labels.get(key) != value:
            have = f"{key}={node.labels[key]}" if key in node.labels else f"no label {key}"
            return f"{whose} has nodeSelector {key}={value} and the node has {have}"
    if placement.required_terms is not None:
        reasons = [_term_refusal(node, t) for t in placement.required_terms]
        if not reasons or all(reasons):
            return (f"{whose}'s required node affinity matches no term: "
                    + ("; ".join(r for r in reasons if r) or "it has no nodeSelectorTerms"))
    for taint in node.taints:
        if str(taint.get("key", "")).startswith(SYSTEM_TAINTS):
            continue
        if taint.get("effect") in HARD_EFFECTS and not any(_tolerates(t, taint) for t in placement.tolerations):
            hint = (" (a toleration of every taint is not carried to fill Jobs: tolerate this taint by its key)"
                    if placement.tolerates_all else "")
            return f"taint {_taint_text(taint)} is not tolerated by {whose}{hint}"
    return None


def pinned_affinity(placement: Placement, node: str) -> dict[str, Any]:
    """The template's required node affinity with every term narrowed to `node` (terms are ORed; a term's
    expressions and fields are ANDed), so the scheduler itself enforces both the pin and the template's own
    rule, taints and nodeSelector included."""
    pin = {"key": NODE_NAME_FIELD, "operator": "In", "values": [node]}
    terms = placement.required_terms if placement.required_terms else [{}]
    narrowed = [{**t, "matchFields": [*(t.get("matchFields") or []), pin]} for t in terms]
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": narrowed}}}


def _term_refusal(node: NodeFacts, term: Mapping[str, Any]) -> str | None:
    exprs, fields = term.get("matchExpressions") or [], term.get("matchFields") or []
    if not exprs and not fields:
        return "an empty term matches no node"
    for e in exprs:
        why = _expression_refusal(node.labels, e, "label")
        if why:
            return why
    for f in fields:
        if f.get("key") != NODE_NAME_FIELD:
            return f"matchFields {f.get('key')!r} is not understood (only {NODE_NAME_FIELD})"
        why = _expression_refusal({NODE_NAME_FIELD: node.name}, f, "field")
        if why:
            return why
    return None


def _expression_refusal(labels: Mapping[str, str], e: Mapping[str, Any], what: str) -> str | None:
    key, op, values = str(e.get("key", "")), e.get("operator"), [str(v) for v in e.get("values") or []]
    have = labels.get(key)
    if op == "In":
        ok = have is not None and have in values
    elif op == "NotIn":
        ok = have is None or have not in values
    elif op == "Exists":
        ok = have is not None
    elif op == "DoesNotExist":
        ok = have is None
    elif op in ("Gt", "Lt"):
        ok = _compare(have, op, values)
    else:
        return f"operator {op!r} of {key} is not understood, so it matches no node"
    if ok:
        return None
    rule = f"{key} {op}" if op in ("Exists", "DoesNotExist") else f"{key} {op} {values}"
    return f"{rule} does not match (the node's {what} {key} is {'absent' if have is None else repr(have)})"


def _compare(have: str | None, op: str, values: list[str]) -> bool:
    if have is None or len(values) != 1:
        return False
    try:
        a, b = int(have), int(values[0])
    except ValueError:
        return False
    return a > b if op == "Gt" else a < b


def _tolerates_all(t: Mapping[str, Any]) -> bool:
    return t.get("operator") == "Exists" and not t.get("key")


def _tolerates(t: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    """The API's ToleratesTaint, for one toleration that names a key."""
    if t.get("effect") and t.get("effect") != taint.get("effect"):
        return False
    if not t.get("key") or t.get("key") != taint.get("key"):
        return False
    if (t.get("operator") or "Equal") == "Exists":
        return True
    return t.get("operator", "Equal") == "Equal" and (t.get("value") or "") == (taint.get("value") or "")


def _taint_text(taint: Mapping[str, Any]) -> str:
    value = f"={taint['value']}" if taint.get("value") else ""
    return f"{taint.get('key', '')}{value}:{taint.get('effect', '')}"
