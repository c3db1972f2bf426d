"""The node cache's part of a plan (serving.nodeCache). Pure.

Which nodes need the artifact: those where a wired pod of the current digest
waits for its volumes (scheduled, nothing started yet), and the prewarm
nodes. Each gets fill Jobs in rounds (executors/cache_fill.py): a round that
filled is followed at once by one that finds the entry published (the
agent publishes it when the kubelet unmounts the finished pod's slot, a
moment after the Job completes); that one confirms the node is warm. A pod
that still waits on a warm node REFILL_AFTER after it came and after the
last round ended means the entry went (evicted, or removed as corrupt): a
new round fills again. That rule may
fire once too often (a very large entry whose mount is still verifying):
the extra round finds the entry complete and ends at once. A failed round
is retried after FILL_RETRY and said in the status meanwhile, with its
pod's reason. Only each node's latest round is kept; fill Jobs of other
digests (an earlier artifact) are removed.

Which nodes hold it (status.cache): on a node whose agent keeps its labels
(`cache.ferry.dev/agent`), the digest's label says, so an entry evicted from a
node with no pod of it left shows at once; on other nodes (an agent whose
admission policy is not enforced labels nothing) the fill rounds say. A node
of the previous status whose agent's labels no longer hold the digest is an
eviction, with the reason the agent left in `cache.ferry.dev/evicted.<hash>`.
Such a node gets a new round LABEL_LAG after its last one if a pod waits
there or the prewarm selects it (a prewarm node that lost the entry would
otherwise hold the rollout for good); a node whose labels say it holds the
entry gets no first round.

Where fills may go (placement.py): only to a node that one of the wired workloads' own pod templates may
use (its nodeSelector, required node affinity and tolerations), and each fill Job carries that template's
placement. A node no template may use gets no fill; `CachePlan.refused` says why, by node.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

from .api.types import Artifact, ModelWeightsSpec, NodeCacheEviction, NodeCacheStatus
from .placement import NodeFacts, Placement, refusal
from .serving.wiring import cache_evicted_label, cache_label
from .serving.weights_loaded import PodFacts

REFILL_AFTER = timedelta(minutes=2)  # a pod still waiting this long after it came and its node's fill ended
FILL_RETRY = timedelta(minutes=1)
LABEL_LAG = timedelta(seconds=30)  # a confirmed fill whose node's label has not arrived yet is not gone yet
KEEP_EVICTIONS = 8


@dataclass(frozen=True)
class FillFacts:
    """A fill Job as the executor reads it."""

    node: str
    digest: str
    phase: str  # Running, Succeeded, Failed
    finished_at: datetime | None = None
    message: str = ""  # why it failed (the pod's own words)
    round: int = 0
    confirmed: bool = False  # Succeeded, and its pod found the entry already published: the node is warm
    job: str = ""


@dataclass(frozen=True)
class FillNode:
    node: str
    artifact: Artifact
    round: int = 0
    placement: Placement = field(default_factory=Placement)  # the wired template's, which admits `node`


# (what, its placement): a wired pod template, e.g. ("deployment x's pod template", ...)
Template = tuple[str, Placement]


@dataclass(frozen=True)
class RemoveFill:
    """Remove a fill Job: of another digest, or an earlier round."""

    node: str
    digest: str
    round: int = 0


@dataclass
class CachePlan:
    actions: list[FillNode | RemoveFill] = field(default_factory=list)
    status: NodeCacheStatus | None = None
    hold: str | None = None  # why the Deployments must not be patched yet (prewarm.wait)
    notes: list[str] = field(default_factory=list)  # what the Reconciling message should say
    refused: dict[str, str] = field(default_factory=dict)  # node -> why no wired pod, so no fill, may go there


def cache_plan(spec: ModelWeightsSpec, artifact: Artifact, fills: list[FillFacts], pods: list[PodFacts],
               prewarm_nodes: list[str], at: datetime, labelled: dict[str, dict[str, str]] | None = None,
               previous: NodeCacheStatus | None = None, nodes: Mapping[str, NodeFacts] | None = None,
               templates: list[Template] = ()) -> CachePlan:
    """`labelled`: node -> its cache.ferry.dev/ labels, for the nodes whose agent keeps them;
    `previous`: status.cache as it was; `nodes`: the facts of the nodes named here (a node without them
    gets no fill); `templates`: the wired pod templates, whose placement decides where fills may go."""
    digest = artifact.manifest_digest or ""
    labelled = labelled or {}
    latest: dict[str, FillFacts] = {}
    for f in sorted((f for f in fills if f.digest == digest), key=lambda f: f.round):
        latest[f.node] = f
    out = CachePlan(actions=[RemoveFill(f.node, f.digest, f.round) for f in fills
                             if f.digest != digest or f is not latest.get(f.node)])
    waiting = _waiting_since(pods, digest)
    label = cache_label(digest)
    filling: set[str] = set()
    for node in sorted(set(prewarm_nodes) | set(waiting) | set(latest)):
        fill = latest.get(node)
        placement = place(node, (nodes or {}).get(node), templates)
        if isinstance(placement, str):
            out.refused[node] = placement
            if fill is not None and fill.phase == "Running":
                out.actions.append(RemoveFill(node, fill.digest, fill.round))
            continue
        held = labelled[node].get(label) == "true" if node in labelled else None
        again = _next_round(node, fill, waiting, at, out.notes, held, node in waiting or node in prewarm_nodes)
        if again is not None:
            out.actions.append(FillNode(node, artifact, again, placement))
        if again is not None or (fill is not None and not fill.confirmed and fill.phase != "Failed"):
            filling.add(node)
    warm = sorted({n for n, labels in labelled.items() if labels.get(label) == "true"}
                  | {n for n, f in latest.items() if f.confirmed and n not in filling and n not in labelled})
    filling -= set(warm)
    summary = f"{len(warm)}" + (f" (+{len(filling)})" if filling else "")
    out.status = NodeCacheStatus(digest=digest, warm_nodes=len(warm), filling_nodes=len(filling),
                                 nodes=warm[:64], summary=summary,
                                 evictions=_evictions(digest, labelled, warm, previous, pods, at))
    out.hold = _prewarm_hold(spec, [n for n in prewarm_nodes if n not in out.refused], warm, latest)
    return out


def place(node: str, facts: NodeFacts | None, templates: list[Template]) -> Placement | str:
    """The placement of the first wired template whose pods may run on `node`; else why none may."""
    if facts is None:
        return "the operator's node index does not hold it (deleted, or not seen yet)"
    if not templates:
        return "no wired workload's pod template was read, so nothing says its pods may go there"
    reasons = []
    for whose, placement in templates:
        why = refusal(facts, placement, whose)
        if why is None:
            return placement
        reasons.append(why)
    return "; ".join(reasons)


def refusal_notes(refused: Mapping[str, str], most: int = 3) -> list[str]:
    """The refused nodes in words for the status, the first `most` of them by name."""
    names = sorted(refused)
    notes = [f"node {n}: {refused[n]}" for n in names[:most]]
    if len(names) > most:
        notes.append(f"and {len(names) - most} more nodes no wired pod may use")
    return notes


def _next_round(node: str, fill: FillFacts | None, waiting: dict[str, datetime], at: datetime,
                notes: list[str], held: bool | None, wanted: bool) -> int | None:
    """The fill round to start on `node` now, if any. `held`: whether the node's agent labels say it holds
    the entry (None: its agent does not label); `wanted`: a pod waits there, or the prewarm selects it."""
    if fill is None:
        return None if held else 0  # a node that holds it already (another object's fill) needs none
    if fill.phase == "Running":
        if fill.message:  # e.g. its pod not scheduled: say so instead of holding silently until its deadline
            notes.append(f"the node cache fill on {node} waits: {fill.message}")
        return None
    if fill.phase == "Failed":
        notes.append(f"the node cache fill on {node} failed: {fill.message or 'no reason given'}")
        return fill.round + 1 if fill.finished_at is None or at - fill.finished_at >= FILL_RETRY else None
    if not fill.confirmed:
        return fill.round + 1  # it filled: the next round finds the entry published, or waits for it
    if held is False and wanted and fill.finished_at is not None and at - fill.finished_at >= LABEL_LAG:
        notes.append(f"the node cache on {node} no longer holds the artifact (its agent's labels): filling again")
        return fill.round + 1
    if node in waiting and fill.finished_at is not None and at - max(waiting[node], fill.finished_at) >= REFILL_AFTER:
        notes.append(f"a pod on {node} waits for the node cache entry its fill made: filling again")
        return fill.round + 1
    return None


def _evictions(digest: str, labelled: dict[str, dict[str, str]], warm: list[str],
               previous: NodeCacheStatus | None, pods: list[PodFacts], at: datetime) -> list[NodeCacheEviction]:
    """The evictions so far, and the nodes of the previous status whose agent now says the entry is gone;
    for a corrupt one, this object's pods there (they may still have it mounted: the agent removes it as
    they go)."""
    if previous is None or previous.digest != digest:
        return []
    out = list(previous.evictions)
    for node in previous.nodes:
        if node in labelled and node not in warm:
            why, _, when = labelled[node].get(cache_evicted_label(digest), "").partition(".")
            there = sorted(p.name for p in pods if p.node == node and p.digest == digest and not p.terminating
                           and not p.awaiting_volumes) if why == "corrupt" else []
            out.append(NodeCacheEviction(node=node, reason=why if why in REASONS else "unknown",
                                         at=_unix(when) or at, pods=there[:8]))
    return out[-KEEP_EVICTIONS:]


REASONS = ("lru", "corrupt", "removed")  # the agent's (ferry_worker/cache/store.py)


def _unix(text: str) -> datetime | None:
    return datetime.fromtimestamp(int(text), timezone.utc) if text.isdigit() else None


def _waiting_since(pods: list[PodFacts], digest: str) -> dict[str, datetime]:
    """Node -> when the newest pod of `digest` that waits for its volumes there was created."""
    out: dict[str, datetime] = {}
    for p in pods:
        if p.digest == digest and p.node and p.awaiting_volumes and not p.terminating and p.created is not None:
            out[p.node] = max(out.get(p.node, p.created), p.created)
    return out


def _prewarm_hold(spec: ModelWeightsSpec, prewarm_nodes: list[str], warm: list[str],
                  latest: dict[str, FillFacts]) -> str | None:
    prewarm = spec.serving.node_cache.prewarm if spec.serving and spec.serving.node_cache else None
    if prewarm is None or not prewarm.wait:
        return None
    if not prewarm_nodes:
        return None  # nothing to wait for (said in the status by the caller's notes)
    cold = [n for n in sorted(prewarm_nodes) if n not in warm]
    if not cold:
        return None
    first = latest.get(cold[0])
    # A fill pod whose slot the agent refuses (a full cache) waits in ContainerCreating: its events say why.
    where = f"; kubectl describe pods -l job-name={first.job} says why a fill waits" if first and first.job else ""
    return (f"prewarming the node cache before the rollout: {len(prewarm_nodes) - len(cold)}/{len(prewarm_nodes)} "
            f"nodes hold the artifact (waiting for {', '.join(cold[:3])}{' ...' if len(cold) > 3 else ''}{where})")
