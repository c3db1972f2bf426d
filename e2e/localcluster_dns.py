"""Cluster DNS for the local cluster: CoreDNS (github.com/coredns/coredns, its
`kubernetes` plugin) as a host process on the node's bridge address, port 53,
which the kubelet writes into every ClusterFirst pod's resolv.conf
(`clusterDNS`). Real clusters run it as a Deployment behind the kube-dns
Service; here it is a host process like the rest of the control plane, so it
needs no image and is up before the first pod.

Pods resolve Service names (`svc.ns.svc.cluster.local`) and the per-pod names
of headless Services: StatefulSet pods (`pod.svc.ns.svc.cluster.local`) and
the LeaderWorkerSet leader address LWS injects into every pod of a group
(LWS_LEADER_ADDRESS), which vLLM's multi-node launch needs as --master-addr.

It serves the cluster's zones only (cluster.local and the reverse zones) and
has no `forward` plugin: any other name is REFUSED, so no query leaves this
machine. The binary comes from e2e/coredns/build.sh (the Go module proxy,
cached by version); e2e/coredns/NOTES.md has what was learnt about running it.
"""
from __future__ import annotations

import subprocess
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROCESS = "coredns"  # its name in the cluster's pids file and logs directory
DOMAIN = "cluster.local"
ZONES = (DOMAIN, "in-addr.arpa", "ip6.arpa")
# Its own client-certificate identity (a user of the cluster CA), bound to CLUSTER_ROLE.
USER = "ferry-local:coredns"
CLUSTER_ROLE = "ferry-local:coredns"


def binary() -> str:
    """The coredns binary (e2e/coredns/build.sh; FERRY_COREDNS for a prebuilt one)."""
    out = subprocess.run(["bash", str(REPO / "e2e/coredns/build.sh")], check=True, stdout=subprocess.PIPE, text=True)
    return out.stdout.strip().splitlines()[-1]


def rbac() -> list[dict]:
    """What the kubernetes plugin reads, through informers: upstream's `system:coredns` role."""
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": CLUSTER_ROLE},
            "rules": [{"apiGroups": [""], "resources": ["services", "pods", "namespaces"], "verbs": ["list", "watch"]},
                      {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                       "verbs": ["list", "watch"]}]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
               "metadata": {"name": CLUSTER_ROLE},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": CLUSTER_ROLE},
               "subjects": [{"kind": "User", "apiGroup": "rbac.authorization.k8s.io", "name": USER}]}
    return [role, binding]


class Server:
    """CoreDNS's Corefile under `state` (the cluster's state directory)."""

    def __init__(self, state: Path):
        self.state = state
        self.corefile = state / "Corefile"

    def prepare(self, address: str, kubeconfig: Path, ready_port: int, port: int = 53) -> None:
        zones = " ".join(f"{zone}:{port}" for zone in ZONES)
        self.state.mkdir(parents=True, exist_ok=True)
        # `ready` answers 200 once the kubernetes plugin's informers have synced: before
        # that, every cluster name would get SERVFAIL. No `cache`: a headless Service's
        # pod records appear as pods start, and a pod must see them at once.
        self.corefile.write_text(f"""{zones} {{
    bind {address}
    errors
    ready 127.0.0.1:{ready_port}
    kubernetes {" ".join(ZONES)} {{
        kubeconfig {kubeconfig}
    }}
}}
""")

    @property
    def ready_port(self) -> int:
        for line in self.corefile.read_text().splitlines():
            if line.strip().startswith("ready "):
                return int(line.rsplit(":", 1)[1])
        raise ValueError(f"{self.corefile} has no ready plugin")

    def argv(self, binary: str) -> list[str]:
        return [binary, "-conf", str(self.corefile)]

    def ready(self) -> bool:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(f"http://127.0.0.1:{self.ready_port}/ready", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False
