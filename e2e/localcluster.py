#!/usr/bin/env python3
"""A real, Docker-free Kubernetes control plane on loopback.

etcd + kube-apiserver + kube-controller-manager + kube-scheduler, plus kwok,
which gives a fake GPU node and pod lifecycles (pods are scheduled and turn
Running without a kubelet). Binaries come from e2e/controlplane/build.sh
(built from the Go module proxy, cached by version) or FERRY_K8S_ASSETS.

    python e2e/localcluster.py up      # start in the background, write .ferry/kubeconfig
    python e2e/localcluster.py down    # stop and delete the cluster's data
    python e2e/localcluster.py status

Authentication is a static token file: `ferry-admin` (system:masters) in the
kubeconfig, and one identity per control-plane component, so RBAC is real.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STATE = Path(os.environ.get("FERRY_STATE_DIR", REPO / ".ferry"))
CLUSTER = STATE / "cluster"
KUBECONFIG = STATE / "kubeconfig"
SERVICE_CIDR = "10.96.0.0/16"
FAKE_NODE = "ferry-gpu-node-0"


def binaries() -> Path:
    out = subprocess.run(
        ["bash", str(REPO / "e2e/controlplane/build.sh")], check=True, stdout=subprocess.PIPE, text=True
    )
    return Path(out.stdout.strip().splitlines()[-1])


def kubectl_path() -> str:
    """The kubectl built with the control plane (same release, no version skew)."""
    return str(binaries() / "kubectl")


def wait_crd_established(crd: str, kubeconfig: Path = KUBECONFIG, timeout: float = 60) -> None:
    """Poll until the CRD serves. (`kubectl wait` errors out while a new CRD has no conditions yet.)"""
    jsonpath = '{.status.conditions[?(@.type=="Established")].status}'
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run([kubectl_path(), "--kubeconfig", str(kubeconfig), "get", "crd", crd, "-o",
                              f"jsonpath={jsonpath}"], capture_output=True, text=True)
        if out.stdout.strip() == "True":
            return
        time.sleep(0.2)
    raise TimeoutError(f"CRD {crd} not Established after {timeout}s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_pki(pki: Path) -> None:
    """A CA, an apiserver serving cert for loopback, and the service-account key pair."""
    pki.mkdir(parents=True, exist_ok=True)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650", "-subj", "/CN=ferry-local-ca",
            "-keyout", str(pki / "ca.key"), "-out", str(pki / "ca.crt"))
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=kube-apiserver",
            "-keyout", str(pki / "apiserver.key"), "-out", str(pki / "apiserver.csr"))
    ext = pki / "apiserver.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,"
                   "DNS:kubernetes.default,DNS:kubernetes.default.svc\n")
    openssl("x509", "-req", "-in", str(pki / "apiserver.csr"), "-CA", str(pki / "ca.crt"), "-CAkey",
            str(pki / "ca.key"), "-CAcreateserial", "-days", "3650", "-extfile", str(ext),
            "-out", str(pki / "apiserver.crt"))
    openssl("genrsa", "-out", str(pki / "sa.key"), "2048")
    openssl("rsa", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))


def kubeconfig(server: str, ca: Path, token: str, user: str) -> str:
    return json.dumps({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "ferry-local", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "ferry-local", "context": {"cluster": "ferry-local", "user": user}}],
        "current-context": "ferry-local",
    }, indent=2)


class Cluster:
    def __init__(self) -> None:
        self.pids_file = CLUSTER / "pids.json"
        self.logs = CLUSTER / "logs"

    def running(self) -> bool:
        if not KUBECONFIG.exists() or not self.pids_file.exists():
            return False
        pids = json.loads(self.pids_file.read_text())
        return all(_alive(p) for p in pids.values()) and self._ready(json.loads((CLUSTER / "endpoint.json").read_text()))

    def _ready(self, ep: dict) -> bool:
        ctx = ssl.create_default_context(cafile=ep["ca"])
        req = urllib.request.Request(ep["server"] + "/readyz", headers={"Authorization": f"Bearer {ep['token']}"})
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def up(self, timeout: float = 120) -> None:
        if self.running():
            print(f"local cluster already running; KUBECONFIG={KUBECONFIG}")
            return
        self.down(quiet=True)
        bin_dir = binaries()
        pki = CLUSTER / "pki"
        make_pki(pki)
        self.logs.mkdir(parents=True, exist_ok=True)
        tokens = {u: secrets.token_hex(16) for u in ("admin", "controller-manager", "scheduler", "kwok")}
        (pki / "tokens.csv").write_text(
            f'{tokens["admin"]},ferry-admin,ferry-admin,"system:masters"\n'
            f'{tokens["controller-manager"]},system:kube-controller-manager,kcm\n'
            f'{tokens["scheduler"]},system:kube-scheduler,scheduler\n'
            # kwok plays the kubelet of every fake node (and deletes their pods).
            f'{tokens["kwok"]},kwok-controller,kwok,"system:masters"\n'
        )
        etcd_port, etcd_peer, api_port, kcm_port, sched_port = (free_port() for _ in range(5))
        server = f"https://127.0.0.1:{api_port}"
        ca = pki / "ca.crt"
        cfgs = {}
        for user, name in (("controller-manager", "system:kube-controller-manager"),
                           ("scheduler", "system:kube-scheduler"), ("kwok", "kwok-controller")):
            cfgs[user] = CLUSTER / f"{user}.kubeconfig"
            cfgs[user].write_text(kubeconfig(server, ca, tokens[user], name))

        pids: dict[str, int] = {}
        pids["etcd"] = self._spawn("etcd", [
            str(bin_dir / "etcd"), "--data-dir", str(CLUSTER / "etcd"), "--name", "ferry",
            "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
            "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
            "--listen-peer-urls", f"http://127.0.0.1:{etcd_peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{etcd_peer}",
            "--initial-cluster", f"ferry=http://127.0.0.1:{etcd_peer}",
            "--unsafe-no-fsync",  # test data only: trades durability for speed
            "--quota-backend-bytes", str(2 << 30),
        ])
        pids["kube-apiserver"] = self._spawn("kube-apiserver", [
            str(bin_dir / "kube-apiserver"),
            "--etcd-servers", f"http://127.0.0.1:{etcd_port}",
            "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1",
            "--secure-port", str(api_port),
            "--tls-cert-file", str(pki / "apiserver.crt"), "--tls-private-key-file", str(pki / "apiserver.key"),
            "--client-ca-file", str(ca),
            "--requestheader-client-ca-file", str(ca),
            "--requestheader-username-headers", "X-Remote-User",
            "--requestheader-group-headers", "X-Remote-Group",
            "--token-auth-file", str(pki / "tokens.csv"),
            "--authorization-mode", "Node,RBAC",
            "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
            "--service-account-key-file", str(pki / "sa.pub"),
            "--service-account-signing-key-file", str(pki / "sa.key"),
            "--service-cluster-ip-range", SERVICE_CIDR,
            "--allow-privileged=true",
            "--enable-priority-and-fairness=false",
            "--endpoint-reconciler-type", "none",
        ])
        ep = {"server": server, "ca": str(ca), "token": tokens["admin"]}
        (CLUSTER / "endpoint.json").write_text(json.dumps(ep))
        self.pids_file.write_text(json.dumps(pids))
        self._wait(lambda: self._ready(ep), timeout, "kube-apiserver /readyz", pids)

        pids["kube-controller-manager"] = self._spawn("kube-controller-manager", [
            str(bin_dir / "kube-controller-manager"),
            "--kubeconfig", str(cfgs["controller-manager"]),
            "--authentication-kubeconfig", str(cfgs["controller-manager"]),
            "--authorization-kubeconfig", str(cfgs["controller-manager"]),
            "--use-service-account-credentials=true",
            "--service-account-private-key-file", str(pki / "sa.key"),
            "--root-ca-file", str(ca),
            "--leader-elect=false",
            "--bind-address", "127.0.0.1", "--secure-port", str(kcm_port),
            # nodelifecycle stays: it lifts the not-ready taint once kwok reports the node Ready.
            "--controllers", "*,-nodeipam,-cloud-node-lifecycle,-service-lb-controller,-route",
            "--concurrent-deployment-syncs", "2",
        ])
        pids["kube-scheduler"] = self._spawn("kube-scheduler", [
            str(bin_dir / "kube-scheduler"),
            "--kubeconfig", str(cfgs["scheduler"]),
            "--authentication-kubeconfig", str(cfgs["scheduler"]),
            "--authorization-kubeconfig", str(cfgs["scheduler"]),
            "--leader-elect=false",
            "--bind-address", "127.0.0.1", "--secure-port", str(sched_port),
        ])
        pids["kwok"] = self._spawn("kwok", [
            str(bin_dir / "kwok"),
            "--kubeconfig", str(cfgs["kwok"]),
            "--manage-all-nodes=false",
            "--manage-nodes-with-annotation-selector", "kwok.x-k8s.io/node=fake",
            "--node-ip", "127.0.0.1",
            "--cidr", "10.244.0.0/16",
            # Renew node Leases, or the node-lifecycle controller marks the node
            # and its pods NotReady after the grace period.
            "--node-lease-duration-seconds", "40",
            "--server-address", f"127.0.0.1:{free_port()}",
        ])
        self.pids_file.write_text(json.dumps(pids))
        KUBECONFIG.write_text(kubeconfig(server, ca, tokens["admin"], "ferry-admin"))
        self._create_fake_node()
        # The serviceaccount controller must have made `default` before pods can be created.
        self._wait(lambda: self._kubectl("get", "serviceaccount", "default", "-n", "default", check=False) == 0,
                   timeout, "default ServiceAccount", pids)
        print(f"local cluster up: {server}\nexport KUBECONFIG={KUBECONFIG}")

    def _create_fake_node(self) -> None:
        node = {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {
                "name": FAKE_NODE,
                "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                "labels": {"kubernetes.io/hostname": FAKE_NODE, "kubernetes.io/os": "linux",
                           "kubernetes.io/arch": "amd64", "type": "kwok",
                           "nvidia.com/gpu.present": "true"},
            },
            "status": {
                "allocatable": {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": "8",
                                "ephemeral-storage": "2Ti"},
                "capacity": {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": "8",
                             "ephemeral-storage": "2Ti"},
            },
        }
        subprocess.run([kubectl_path(), "--kubeconfig", str(KUBECONFIG), "apply", "-f", "-"],
                       input=json.dumps(node), text=True, check=True, capture_output=True)

    def _kubectl(self, *args: str, check: bool = True) -> int:
        return subprocess.run([kubectl_path(), "--kubeconfig", str(KUBECONFIG), *args],
                              capture_output=True, check=check).returncode

    def _spawn(self, name: str, argv: list[str]) -> int:
        log = open(self.logs / f"{name}.log", "ab")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        return proc.pid

    def _wait(self, ok, timeout: float, what: str, pids: dict[str, int]) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ok():
                return
            dead = [n for n, p in pids.items() if not _alive(p)]
            if dead:
                tail = (self.logs / f"{dead[0]}.log").read_text(errors="replace")[-3000:]
                self.down(quiet=True)
                raise SystemExit(f"{dead[0]} exited while waiting for {what}:\n{tail}")
            time.sleep(0.5)
        self.down(quiet=True)
        raise SystemExit(f"timed out after {timeout}s waiting for {what}; logs in {self.logs}")

    def down(self, quiet: bool = False) -> None:
        if self.pids_file.exists():
            pids = json.loads(self.pids_file.read_text())
            for pid in reversed(list(pids.values())):
                _kill(pid)
        if CLUSTER.exists():
            subprocess.run(["rm", "-rf", str(CLUSTER)], check=True)
        KUBECONFIG.unlink(missing_ok=True)
        if not quiet:
            print("local cluster down")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not reaped) is not alive.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    for _ in range(50):
        if not _alive(pid):
            return
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["up", "down", "status", "build"])
    args = ap.parse_args()
    cluster = Cluster()
    if args.command == "up":
        cluster.up()
    elif args.command == "down":
        cluster.down()
    elif args.command == "build":
        print(binaries())
    else:
        ok = cluster.running()
        print("running" if ok else "not running")
        sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
