"""Multi-node serving groups: what each pod of a group is told about its place in it. Pure.

A workload whose pods form serving groups (ServingTarget.groupSize > 1: an LWS's group, a StatefulSet's
replicas) runs vLLM's multiprocessing multi-node launch. Each pod learns its index from a pod label (the
kubelet sets FERRY_GROUP_INDEX from it and expands `$(FERRY_GROUP_INDEX)` in args); its loader verifies only
its slice of the ranks, and its compiled state is its own (`<device kind>-node<I>`: it compiled only its
ranks). Only the group's leader (index 0) serves HTTP.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .loader import VLLM_DEFAULT_PORT

GROUP_INDEX_ENV = "FERRY_GROUP_INDEX"
# The group size Ferry wired a template for: tells Ferry's multi-node flags and env from a user's, so
# going back to groupSize 1 removes them.
GROUP_ANNOTATION = "ferry.dev/group-size"


@dataclass(frozen=True)
class Group:
    """A template whose pods form serving groups of `size`. `index_label`: the pod label holding a pod's
    index; `master_addr`: the leader pod's address (vLLM's --master-addr); `leader_port`: the port the
    leader's vLLM serves /health on."""

    size: int
    index_label: str
    master_addr: str
    headless: bool = False  # Ferry adds --headless: the template's pods run no API server (an LWS's workers)
    # Ferry may probe /health: only where every pod of the template serves HTTP (an LWS's leader). A
    # StatefulSet's pods share one template and all but pod 0 run headless, so its readiness is the gate.
    probe: bool = False
    leader_port: int = VLLM_DEFAULT_PORT
    leader_scheme: str = "http"  # "https" where the leader's vLLM serves TLS (--ssl-keyfile)

    def env(self) -> dict[str, Any]:
        return {"name": GROUP_INDEX_ENV, "valueFrom": {"fieldRef": {
            "fieldPath": f"metadata.labels['{self.index_label}']"}}}

    def vllm_flags(self) -> list[str]:
        return (["--nnodes", str(self.size), "--node-rank", f"$({GROUP_INDEX_ENV})", "--master-addr",
                 self.master_addr] + (["--headless"] if self.headless else []))

    def loader_args(self) -> list[str]:
        return ["--group-size", str(self.size), "--group-index", f"$({GROUP_INDEX_ENV})"]

    def health_address(self, own_port: int, own_scheme: str = "http") -> str:
        """Where a pod of this template learns that the group's vLLM serves: its own /health where every pod
        serves HTTP, else the leader's (vLLM's leader answers only once every pod's ranks are up)."""
        if self.probe:
            return f"{own_scheme}://127.0.0.1:{own_port}/health"
        return f"{self.leader_scheme}://{self.master_addr}:{self.leader_port}/health"
