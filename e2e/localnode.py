"""The real node of the local cluster: containerd + runc + CNI + kubelet +
kube-proxy, and rancher's local-path-provisioner for dynamic PVCs.

kwok's fake node plays the GPU node (vLLM pods cannot run here); this node
runs everything else for real: the operator installed by the chart, prepare
Jobs, storage helper pods. Started and stopped by e2e/localcluster.py.

Network, by the workplace's rule that no traffic leaves this machine:
- the node's address (also the API server's advertised address, which pods
  reach through the `kubernetes` Service and kube-proxy) lives on a bridge
  this harness creates, `ferry0`, 10.250.0.1/24; pods get addresses on it from
  the CNI `bridge` + `host-local` plugins, with routes only to the pod subnet
  and the Service range (no default route) and no masquerading;
- IP forwarding is never turned on (the bridge is not a gateway: pods talk to
  the host and to each other, which needs no forwarding), and a FORWARD rule
  drops anything from or to the pod subnet that is not pod-to-pod, in case a
  machine has forwarding on;
- host traffic to Service IPs that kube-proxy did not translate, and to
  kwok's fake pod IPs, is dropped in OUTPUT instead of following the default
  route.
  The FORWARD guard lives in the mangle table, which netfilter traverses
  before the filter table's FORWARD and which kube-proxy and the kubelet never
  write to: no rule they add (kube-proxy inserts its accepting KUBE-FORWARD
  and others at the top of filter's FORWARD whenever it resyncs) can come
  before it.
Everything it starts is stopped by `down()`: processes (kubelet, kube-proxy,
the provisioner, containerd, its shims and every container process), mounts,
network namespaces, the bridge and the iptables rules (kube-proxy's own are
removed by `kube-proxy --cleanup`).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

NODE_NAME = "ferry-node-0"
BRIDGE = "ferry0"
POD_CIDR = "10.250.0.0/24"
NODE_IP = "10.250.0.1"
KWOK_POD_CIDR = "10.244.0.0/16"
GUARD_CHAINS = {"FORWARD": "FERRY-FORWARD", "OUTPUT": "FERRY-OUTPUT"}
GUARD_TABLE = "mangle"  # of FERRY-FORWARD: traversed before filter; nobody else writes its FORWARD
CNI_BIN = Path(os.environ.get("FERRY_CNI_BIN", "/usr/lib/cni"))
STORAGE_NAMESPACE = "local-path-storage"
# Two classes from one provisioner. The default, `ferry-shared`, stands for the
# shared filesystem (NFS, Lustre, a CSI RWX driver) weights live on in a GPU
# cluster: any access mode, no node affinity, so the vLLM pods on kwok's GPU
# node can "mount" the claim the prepare Jobs filled on the real node.
# `local-path` is node-local disk (ReadWriteOnce, bound where the pod lands).
STORAGE_CLASS = "ferry-shared"
NODE_LOCAL_CLASS = "local-path"
NODE_LABEL = "ferry.dev/node"


def node_tools() -> list[str]:
    """What the node needs on the host; a missing one fails `up` with this list."""
    return ["containerd", "containerd-shim-runc-v2", "runc", "iptables", "ip", "conntrack", "mount"]


@dataclass(frozen=True)
class NodePaths:
    """Where the node keeps its state. Sockets live under /run (short paths:
    a unix socket path is limited to 107 bytes); the rest under the state dir."""

    state: Path

    @property
    def run(self) -> Path:
        digest = hashlib.sha256(str(self.state.resolve()).encode()).hexdigest()[:8]
        return Path(f"/run/ferry-{digest}")

    @property
    def root(self) -> Path:
        return self.state / "node"

    @property
    def containerd_sock(self) -> Path:
        return self.run / "containerd.sock"

    @property
    def kubelet_root(self) -> Path:
        return self.root / "kubelet"

    @property
    def volumes(self) -> Path:
        return self.root / "volumes"

    @property
    def logs(self) -> Path:
        return self.root / "logs"


def sh(*argv: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), check=check, capture_output=True, text=True, input=input)


# -- network ------------------------------------------------------------------

def network_up(service_cidr: str) -> None:
    if sh("ip", "link", "show", BRIDGE, check=False).returncode != 0:
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
    if NODE_IP not in sh("ip", "-4", "addr", "show", "dev", BRIDGE).stdout:
        sh("ip", "addr", "add", f"{NODE_IP}/24", "dev", BRIDGE)
    sh("ip", "link", "set", BRIDGE, "up")
    # Bridged pod-to-pod traffic is filtered like routed traffic (kube-proxy's
    # Service rules see it); the module is there on this kernel.
    bridge_nf = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
    if bridge_nf.exists():
        bridge_nf.write_text("1")
    _guard_down()
    forward, output = GUARD_CHAINS["FORWARD"], GUARD_CHAINS["OUTPUT"]
    mangle = ("iptables", "-w", "-t", GUARD_TABLE)
    sh(*mangle, "-N", forward)
    sh(*mangle, "-A", forward, "-s", POD_CIDR, "-d", POD_CIDR, "-j", "RETURN")
    sh(*mangle, "-A", forward, "-s", POD_CIDR, "-j", "DROP")
    sh(*mangle, "-A", forward, "-d", POD_CIDR, "-j", "DROP")
    sh(*mangle, "-I", "FORWARD", "1", "-j", forward)
    # OUTPUT must see Service IPs after kube-proxy's DNAT (nat OUTPUT), so this
    # one stays in filter; kube-proxy's filter OUTPUT chains only reject or drop,
    # so rules it puts above it cannot let anything past it.
    sh("iptables", "-w", "-N", output)
    sh("iptables", "-w", "-A", output, "-d", service_cidr, "-j", "DROP")
    sh("iptables", "-w", "-A", output, "-d", KWOK_POD_CIDR, "-j", "DROP")
    sh("iptables", "-w", "-I", "OUTPUT", "1", "-j", output)


def _guard_down() -> None:
    for table in ("filter", GUARD_TABLE):  # FERRY-FORWARD in filter: where an older harness put it
        for parent, chain in GUARD_CHAINS.items():
            while sh("iptables", "-w", "-t", table, "-D", parent, "-j", chain, check=False).returncode == 0:
                pass
            sh("iptables", "-w", "-t", table, "-F", chain, check=False)
            sh("iptables", "-w", "-t", table, "-X", chain, check=False)


# Chains the node leaves in iptables: the kubelet's (KUBE-FIREWALL and its
# canaries, which `kube-proxy --cleanup` does not touch), kube-proxy's, the CNI
# portmap plugin's and this harness's guard. Nothing else on this machine makes them.
NODE_CHAIN_PREFIXES = ("KUBE-", "CNI-", "FERRY-")


def remove_chains(prefixes: tuple[str, ...] = NODE_CHAIN_PREFIXES) -> None:
    for tool in ("iptables", "ip6tables"):
        if shutil.which(f"{tool}-save") is None:
            continue
        for table in ("filter", "nat", "mangle", "raw"):
            dump = sh(f"{tool}-save", "-t", table, check=False).stdout.splitlines()
            chains = [line[1:].split()[0] for line in dump if line.startswith(":") and line[1:].startswith(prefixes)]
            for line in dump:
                words = shlex.split(line)
                # Jumps into our chains from chains that are not ours (INPUT, OUTPUT, ...).
                if words[:1] == ["-A"] and words[1] not in chains and set(chains) & set(words):
                    sh(tool, "-w", "-t", table, "-D", *words[1:], check=False)
            for chain in chains:
                sh(tool, "-w", "-t", table, "-F", chain, check=False)
            for chain in chains:
                sh(tool, "-w", "-t", table, "-X", chain, check=False)


def network_down() -> None:
    _guard_down()
    remove_chains()
    # Pod network namespaces that containerd made (it mounts them under /run/netns).
    netns = Path("/run/netns")
    for ns in sorted(netns.glob("cni-*")) if netns.exists() else []:
        sh("ip", "netns", "delete", ns.name, check=False)
    # Any veth left on the bridge (normally gone with its namespace).
    links = json.loads(sh("ip", "-j", "link", "show", "master", BRIDGE, check=False).stdout or "[]")
    for link in links:
        sh("ip", "link", "delete", link["ifname"], check=False)
    sh("ip", "link", "delete", BRIDGE, check=False)


# -- configuration files ----------------------------------------------------

def containerd_config(paths: NodePaths, pause_image: str) -> str:
    root, run = paths.root / "containerd", paths.run
    return f"""version = 2
root = "{root}"
state = "{run}/containerd"
oom_score = 0
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]

[grpc]
  address = "{paths.containerd_sock}"

[ttrpc]
  address = "{run}/containerd.sock.ttrpc"

[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = "{root}/opt"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause_image}"
  # This VM refuses negative oom_score_adj even to root: without this every
  # sandbox fails in runc's nsexec.
  restrict_oom_score_adj = true
  disable_apparmor = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{run}/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{paths.root}/cni/net.d"
    max_conf_num = 1
"""


def cni_config(paths: NodePaths, service_cidr: str) -> dict:
    return {
        "cniVersion": "1.0.0",
        "name": "ferry",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                # Not a gateway: the harness owns the bridge address, and the
                # plugin would otherwise switch IP forwarding on.
                "isGateway": False,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_CIDR, "gateway": NODE_IP}]],
                    # The pod subnet is on-link; the Service range goes to the
                    # host, where kube-proxy translates it. No default route.
                    "routes": [{"dst": service_cidr, "gw": NODE_IP}],
                    "dataDir": str(paths.root / "cni" / "ipam"),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def kubelet_config(paths: NodePaths, ca: Path, healthz_port: int) -> dict:
    resolv = paths.root / "resolv.conf"
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": NODE_IP,
        "port": 10250,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                           "x509": {"clientCAFile": str(ca)}},
        "authorization": {"mode": "Webhook"},
        "cgroupDriver": "cgroupfs",
        "failCgroupV1": False,
        "failSwapOn": False,
        "containerRuntimeEndpoint": f"unix://{paths.containerd_sock}",
        "podLogsDir": str(paths.root / "pod-logs"),
        # ClusterFirst pods ask CoreDNS on the bridge (localcluster_dns.py), which
        # answers cluster.local names only; pods with dnsPolicy Default get this
        # file, which names no server: the host's resolver is off this machine.
        "resolvConf": str(resolv),
        "clusterDNS": [NODE_IP],
        "clusterDomain": "cluster.local",
        "maxPods": 40,
        "serializeImagePulls": False,
        # Images are imported, never pulled: never garbage-collect them, and
        # evict only when the machine is really out of room.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                         "nodefs.inodesFree": "1%"},
        "registerNode": True,
        "nodeStatusUpdateFrequency": "4s",
        "syncFrequency": "10s",
    }


def provisioner_config(paths: NodePaths) -> dict:
    return {"storageClassConfigs": {
        STORAGE_CLASS: {"sharedFileSystemPath": str(paths.volumes / "shared")},
        NODE_LOCAL_CLASS: {"nodePathMap": [{"node": "DEFAULT_PATH_FOR_NON_LISTED_NODES",
                                            "paths": [str(paths.volumes / "local")]}]},
    }}


# The provisioner's helper pods run these scripts with busybox's sh on the node.
PROVISIONER_SETUP = """#!/bin/sh
set -eu
while getopts "m:s:p:" opt; do
  case $opt in p) absolutePath=$OPTARG ;; s) sizeInBytes=$OPTARG ;; m) volMode=$OPTARG ;; esac
done
mkdir -m 0777 -p "$absolutePath"
"""
PROVISIONER_TEARDOWN = """#!/bin/sh
set -eu
while getopts "m:s:p:" opt; do
  case $opt in p) absolutePath=$OPTARG ;; s) sizeInBytes=$OPTARG ;; m) volMode=$OPTARG ;; esac
done
rm -rf "$absolutePath"
"""


def storage_objects(paths: NodePaths, helper_image: str, user: str) -> list[dict]:
    """The provisioner's namespace, RBAC (its upstream ClusterRole), config and
    the default StorageClass."""
    helper_pod = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "helper-pod"},
        # The provisioner tolerates every taint; only the real node has the
        # "shared filesystem" for real, so its helper pods run there.
        "spec": {"priorityClassName": "system-node-critical", "nodeSelector": {NODE_LABEL: "real"},
                 "tolerations": [{"key": "node.kubernetes.io/disk-pressure", "operator": "Exists",
                                  "effect": "NoSchedule"}],
                 "containers": [{"name": "helper-pod", "image": helper_image, "imagePullPolicy": "Never"}]},
    }
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": STORAGE_NAMESPACE}},
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": {"name": "local-path-provisioner-service-account", "namespace": STORAGE_NAMESPACE}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": "local-path-provisioner-role"},
         "rules": [
             {"apiGroups": [""], "resources": ["nodes", "persistentvolumeclaims", "configmaps", "pods/log"],
              "verbs": ["get", "list", "watch"]},
             {"apiGroups": [""], "resources": ["endpoints", "persistentvolumes", "pods"], "verbs": ["*"]},
             {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
             {"apiGroups": ["storage.k8s.io"], "resources": ["storageclasses"], "verbs": ["get", "list", "watch"]},
             {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
              "verbs": ["get", "list", "watch", "create", "update", "patch"]},
         ]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "local-path-provisioner-bind"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                     "name": "local-path-provisioner-role"},
         "subjects": [{"kind": "User", "apiGroup": "rbac.authorization.k8s.io", "name": user}]},
        {"apiVersion": "v1", "kind": "ConfigMap",
         "metadata": {"name": "local-path-config", "namespace": STORAGE_NAMESPACE},
         "data": {"config.json": json.dumps(provisioner_config(paths)), "setup": PROVISIONER_SETUP,
                  "teardown": PROVISIONER_TEARDOWN, "helperPod.yaml": json.dumps(helper_pod)}},
        {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
         "metadata": {"name": STORAGE_CLASS,
                      "annotations": {"storageclass.kubernetes.io/is-default-class": "true"}},
         "provisioner": "rancher.io/local-path", "volumeBindingMode": "Immediate", "reclaimPolicy": "Delete"},
        {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": NODE_LOCAL_CLASS},
         "provisioner": "rancher.io/local-path", "volumeBindingMode": "WaitForFirstConsumer",
         "reclaimPolicy": "Delete"},
    ]


# -- processes ------------------------------------------------------------------

def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (OSError, IndexError):
        return False


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def pids_mentioning(*needles: str) -> list[int]:
    """Processes whose command line names one of our paths (e.g. the shims,
    which containerd starts detached)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            cmd = _cmdline(int(entry.name))
            if any(n in cmd for n in needles):
                out.append(int(entry.name))
    return out


def stop(pids: list[int], sig: int = signal.SIGTERM, timeout: float = 10) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    for pid in pids:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def pod_cgroups() -> list[Path]:
    """The kubelet's pod cgroups (cgroupfs driver) in every v1 hierarchy and the
    unified one, deepest first."""
    found: list[Path] = []
    base = Path("/sys/fs/cgroup")
    for hierarchy in base.iterdir() if base.exists() else []:
        top = hierarchy / "kubepods"
        if top.is_dir():
            found.extend(sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)))
            found.append(top)
    return found


def kill_pod_processes() -> None:
    """Every process left in a pod cgroup (a container the runtime did not stop)."""
    pids: set[int] = set()
    for cg in pod_cgroups():
        procs = cg / "cgroup.procs"
        if procs.exists():
            pids.update(int(p) for p in procs.read_text().split())
    stop(sorted(pids), signal.SIGKILL, timeout=5)
    # A cgroup whose last process just died stays busy for a moment (EBUSY): try again for a while.
    deadline = time.monotonic() + 10
    while pod_cgroups() and time.monotonic() < deadline:
        for cg in pod_cgroups():
            try:
                cg.rmdir()
            except OSError:
                pass
        if pod_cgroups():
            time.sleep(0.2)


def mounts_under(*prefixes: Path) -> list[str]:
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mount_point = line.split()[4].replace("\\040", " ")
        if any(mount_point == str(p) or mount_point.startswith(f"{p}/") for p in prefixes):
            out.append(mount_point)
    return out


def share_mounts(path: Path) -> None:
    """Make `path` a shared mount, as systemd makes every mount on a real node (this machine's / is
    private): a CSI driver's mounts under the kubelet's directory (the node cache agent's, with
    mountPropagation Bidirectional, which containerd refuses on a private mount) then reach the host
    and the pods. A bind of the directory onto itself makes it a mount point of its own."""
    if str(path) not in mounts_under(path):
        sh("mount", "--bind", str(path), str(path))
    sh("mount", "--make-rshared", str(path))


def unmount_all(*prefixes: Path) -> None:
    # Deepest first; lazy as a last resort for a mount still busy.
    for _ in range(3):
        mounts = sorted(set(mounts_under(*prefixes)), key=lambda m: -len(m))
        if not mounts:
            return
        for m in mounts:
            if sh("umount", m, check=False).returncode != 0:
                sh("umount", "-l", m, check=False)


def leftovers(paths: NodePaths) -> dict[str, list[str]]:
    """What of the node is still on this machine (empty lists after `down`)."""
    iptables = [line for tool in ("iptables-save", "ip6tables-save") if shutil.which(tool)
                for line in sh(tool, check=False).stdout.splitlines()]
    return {
        "processes": [f"{p} {_cmdline(p)[:120]}" for p in
                      pids_mentioning(str(paths.root), str(paths.run))],
        "mounts": mounts_under(paths.root, paths.run) + [m for m in mounts_under(Path("/run/netns"))
                                                          if "/cni-" in m],
        "links": [BRIDGE] if sh("ip", "link", "show", BRIDGE, check=False).returncode == 0 else [],
        "iptables": [line for line in iptables if any(p in line for p in NODE_CHAIN_PREFIXES)],
        "cgroups": [str(c) for c in pod_cgroups()],
    }


def missing_tools() -> list[str]:
    return [t for t in node_tools() if shutil.which(t) is None]


# -- the node -----------------------------------------------------------------

@dataclass
class NodeCredentials:
    ca: Path
    kubelet_kubeconfig: Path
    proxy_kubeconfig: Path
    provisioner_kubeconfig: Path
    provisioner_user: str


class Node:
    """Start and stop the node's processes. `spawn(name, argv) -> pid` is the
    cluster's (it logs to the cluster's log directory)."""

    def __init__(self, paths: NodePaths):
        self.paths = paths

    def start_runtime(self, spawn, pause_image: str, service_cidr: str) -> dict[str, int]:
        missing = missing_tools()
        if missing:
            raise SystemExit(f"the real node needs {', '.join(missing)} on this machine "
                             "(Debian: apt-get install containerd runc containernetworking-plugins iptables "
                             "conntrack); or set FERRY_NODE=0 for a cluster with only kwok's fake node")
        if os.geteuid() != 0:
            raise SystemExit("the real node runs containerd and a kubelet: it needs root (or set FERRY_NODE=0)")
        p = self.paths
        for d in (p.root / "cni" / "net.d", p.volumes / "shared", p.volumes / "local", p.kubelet_root,
                  p.root / "pod-logs", p.run):
            d.mkdir(parents=True, exist_ok=True)
        share_mounts(p.kubelet_root)
        (p.root / "containerd.toml").write_text(containerd_config(p, pause_image))
        (p.root / "cni" / "net.d" / "10-ferry.conflist").write_text(json.dumps(cni_config(p, service_cidr), indent=2))
        (p.root / "resolv.conf").write_text("# dnsPolicy Default: no server (the host's is off this machine)\n"
                                            "options ndots:1\n")
        # No registry is reachable, and none may be tried: every image is
        # imported. A pull (an image missing from the node) goes to a proxy on
        # a closed loopback port and fails at once, without even a DNS lookup.
        no_pulls = {"HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9", "NO_PROXY": "",
                    "https_proxy": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9", "no_proxy": ""}
        pid = spawn("containerd", ["containerd", "--config", str(p.root / "containerd.toml")], no_pulls)
        deadline = time.monotonic() + 30
        while not self.ctr_ok():
            if time.monotonic() > deadline or not _alive(pid):
                raise SystemExit("containerd did not start; see its log in the cluster's logs directory")
            time.sleep(0.2)
        return {"containerd": pid}

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return sh("ctr", "--address", str(self.paths.containerd_sock), "-n", "k8s.io", *args, check=check)

    def ctr_ok(self) -> bool:
        return self.paths.containerd_sock.exists() and self.ctr("version", check=False).returncode == 0

    def start_node(self, spawn, bin_dir: Path, provisioner_bin: str, helper_image: str, creds: NodeCredentials,
                   free_port) -> dict[str, int]:
        p = self.paths
        cfg = p.root / "kubelet.json"
        cfg.write_text(json.dumps(kubelet_config(p, creds.ca, free_port()), indent=2))
        pids = {"kubelet": spawn("kubelet", [
            str(bin_dir / "kubelet"), "--config", str(cfg), "--kubeconfig", str(creds.kubelet_kubeconfig),
            "--root-dir", str(p.kubelet_root), "--cert-dir", str(p.root / "kubelet-pki"),
            "--hostname-override", NODE_NAME, "--node-ip", NODE_IP,
            "--node-labels", f"{NODE_LABEL}=real", "--v=1",
        ])}
        pids["kube-proxy"] = spawn("kube-proxy", [
            str(bin_dir / "kube-proxy"), "--kubeconfig", str(creds.proxy_kubeconfig),
            "--hostname-override", NODE_NAME, "--proxy-mode", "iptables",
            "--cluster-cidr", POD_CIDR, "--nodeport-addresses", f"{NODE_IP}/32",
            "--metrics-bind-address", f"127.0.0.1:{free_port()}",
            "--healthz-bind-address", f"127.0.0.1:{free_port()}",
            # Leave the machine's conntrack sysctls as they are.
            "--conntrack-max-per-core", "0",
            "--conntrack-tcp-timeout-established", "0", "--conntrack-tcp-timeout-close-wait", "0",
        ])
        config = p.root / "local-path-config.json"
        config.write_text(json.dumps(provisioner_config(p)))
        pids["local-path-provisioner"] = spawn("local-path-provisioner", [
            provisioner_bin, "start", "--kubeconfig", str(creds.provisioner_kubeconfig),
            "--config", str(config), "--namespace", STORAGE_NAMESPACE,
            "--service-account-name", "local-path-provisioner-service-account",
            "--helper-image", helper_image,
        ])
        return pids

    def stop(self, bin_dir: Path | None) -> None:
        """Everything the node started; safe to call when nothing runs."""
        p = self.paths
        stop(pids_mentioning(str(p.kubelet_root)))
        stop(pids_mentioning(str(p.root / "local-path-config.json")))
        kill_pod_processes()
        stop(pids_mentioning(str(p.run)), signal.SIGKILL)  # shims, then containerd
        stop(pids_mentioning(str(p.root / "containerd.toml")))
        if bin_dir is not None and (bin_dir / "kube-proxy").exists():
            # Its iptables chains and rules (the process itself is stopped by now).
            sh(str(bin_dir / "kube-proxy"), "--cleanup", check=False)
        unmount_all(p.root, p.run)
        network_down()
        left = mounts_under(p.root, p.run)
        if left:
            # Never rm -rf through a mount.
            raise SystemExit(f"cannot remove the node's state: still mounted: {left}")
        shutil.rmtree(p.run, ignore_errors=True)
        if p.root.exists():
            shutil.rmtree(p.root, ignore_errors=True)
