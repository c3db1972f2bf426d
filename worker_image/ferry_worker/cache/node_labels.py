"""The node's labels for what its cache holds: `cache.ferry.dev/<hash of the
digest>: "true"` for each whole-artifact entry, so the operator can give wired pods a
*preferred* node affinity towards nodes that already hold their artifact and
count the nodes that hold it (status.cache). Two more kinds of label:
`cache.ferry.dev/agent: "true"` says these labels are kept (the agent runs and
its policy is enforced: the operator counts from them and not from its fill
rounds), and `cache.ferry.dev/evicted.<hash>: "<why>.<unix time>"` says for
REMOVAL_MEMORY_S why an entry left (least recently used, corrupt, removed by
an admin), so the operator can post it as an Event.

The agent is the one writer that knows what its disk holds (fills, evictions,
an admin's `ferry cache evict`), so it keeps the labels itself: after each
publish and removal, and every `period` seconds in case a patch failed. It
may touch nothing else. Its ServiceAccount may patch nodes (RBAC cannot say
"only your own node"), and the chart's admission policy narrows that to: with
a token bound to a pod on that node, on that node only, only labels under
cache.ferry.dev/ (charts/ferry/templates/node-cache.yaml). The agent checks
the policy is enforced before its first write (a dry run the policy must
refuse in its own words) and labels nothing until it is: it fails closed.
"""
from __future__ import annotations

import hashlib
import logging
import threading
from typing import Any

from .store import CORRUPT, CacheStore

log = logging.getLogger(__name__)

LABEL_PREFIX = "cache.ferry.dev/"
LABEL_SALT = b"cache.ferry.dev node label of "  # the operator's serving.cache_label hashes the same
AGENT_LABEL = LABEL_PREFIX + "agent"
EVICTED_PREFIX = LABEL_PREFIX + "evicted."
PROBE_LABEL = "ferry.dev/node-cache-policy-probe"  # outside the prefix: the policy must refuse it
POLICY_WORDS = "may change only labels under cache.ferry.dev/"  # the chart's policy's message (node-cache.yaml)
FIELD_MANAGER = "ferry-node-cache"


def label_for(digest: str) -> str:
    """The label of an artifact's entry: a hash of its digest, not the digest. Anyone who may read nodes
    reads their labels, and a digest is what a pod's cache volume names, so the label must not give it
    away. 63 hex digits: a label name's limit."""
    return LABEL_PREFIX + _hash(digest)[:63]


def evicted_label_for(digest: str) -> str:
    """The label that says why an artifact's entry left the node (63 characters: a label name's limit)."""
    return EVICTED_PREFIX + _hash(digest)[:55]


def _hash(digest: str) -> str:
    return hashlib.sha256(LABEL_SALT + digest.removeprefix("sha256:").encode()).hexdigest()


def wanted_labels(store: CacheStore) -> dict[str, str]:
    """The agent's label, one per complete whole-artifact entry (entries of some ranks only serve no
    wired pod), and one per recent removal, or entry found corrupt under its pods, with why and when."""
    corrupt = store.corrupt()
    held = [key for key in store.keys() if "." not in key and key not in corrupt]
    wanted = {AGENT_LABEL: "true"} | {label_for(key): "true" for key in held}
    gone = {key: (why, at) for key, (why, at) in store.removals().items()}
    gone |= {key: (CORRUPT, at) for key, at in corrupt.items()}  # still mounted by its pods, held no longer
    for key, (why, at) in gone.items():
        if "." not in key:
            wanted[evicted_label_for(key)] = f"{why}.{int(at)}"
    return wanted


def label_patch(current: dict[str, str], wanted: dict[str, str]) -> dict[str, Any] | None:
    """The merge patch that makes the node's cache labels exactly `wanted`, leaving every other label."""
    ours = {k for k in current if k.startswith(LABEL_PREFIX)}
    changes: dict[str, str | None] = {k: v for k, v in sorted(wanted.items()) if current.get(k) != v}
    changes |= {k: None for k in sorted(ours - set(wanted))}
    return {"metadata": {"labels": changes}} if changes else None


class NodeLabeler:
    def __init__(self, store: CacheStore, node_name: str, core_api: Any, period: float = 60.0):
        self.store, self.node_name, self._api, self.period = store, node_name, core_api, period
        self._dirty = threading.Event()

    def changed(self) -> None:
        """The store published or removed an entry: sync soon."""
        self._dirty.set()

    def policy_enforced(self) -> bool:
        """Whether the admission policy refuses this agent a label outside cache.ferry.dev/ on its own
        node (a dry run: nothing is written either way). A refusal in other words (RBAC not in force yet)
        is an error: asked again later."""
        from kubernetes.client.exceptions import ApiException

        try:
            self._api.patch_node(self.node_name, {"metadata": {"labels": {PROBE_LABEL: "x"}}}, dry_run="All",
                                 field_manager=FIELD_MANAGER)
        except ApiException as exc:
            if exc.status == 403 and POLICY_WORDS in str(exc.body):
                return True
            raise
        log.error("the admission policy that confines this agent to its own node's %s labels is not enforced "
                  "(a dry-run patch of %s was allowed): labelling nothing until it is (install the chart's "
                  "node-cache policy)", LABEL_PREFIX, PROBE_LABEL)
        return False

    def sync(self) -> dict[str, Any] | None:
        """Patch the node's cache labels to match the store; returns the patch (None: already matched)."""
        node = self._api.read_node(self.node_name)
        patch = label_patch(dict(node.metadata.labels or {}), wanted_labels(self.store))
        if patch is not None:
            self._api.patch_node(self.node_name, patch, field_manager=FIELD_MANAGER)
            log.info("node %s labels: %s", self.node_name,
                     ", ".join(f"{k}={'removed' if v is None else v}" for k, v in patch["metadata"]["labels"].items()))
        return patch

    def run(self, stop: threading.Event) -> None:
        """Once the policy is seen enforced (asked every `period` until it is: a new policy takes a moment,
        and until then nothing is labelled, failing closed): sync at start, after each change, and every
        `period` seconds, until `stop`."""
        while not stop.is_set():
            try:
                if self.policy_enforced():
                    break
            except Exception as exc:  # the API server away, the role not in force yet
                log.warning("could not check the node-cache admission policy (%s); retrying in %.0f s",
                            exc, self.period)
            stop.wait(self.period)
        self._dirty.set()
        while not stop.is_set():
            self._dirty.wait(self.period)
            if stop.is_set():
                return
            self._dirty.clear()
            try:
                self.sync()
            except Exception as exc:  # the API server away, a denial: said, and tried again next period
                log.warning("could not label node %s with its cache entries (%s); retrying in %.0f s",
                            self.node_name, exc, self.period)
