#!/usr/bin/env python3
"""A real, Docker-free Kubernetes cluster on this machine.

etcd + kube-apiserver + kube-controller-manager + kube-scheduler, and two nodes:
- `ferry-node-0`, a real node (e2e/localnode.py): kubelet + containerd + runc
  + CNI + kube-proxy, and rancher's local-path-provisioner as the default
  StorageClass. Prepare Jobs and the operator from the chart run here.
- `ferry-gpu-node-0` and `-1`, kwok's fake 8-GPU nodes (pods are scheduled and turn
  Running without running): the vLLM serving pods that cannot run here. It
  carries the `nvidia.com/gpu` NoSchedule taint of a GPU node pool; pods that
  request `nvidia.com/gpu` get the toleration from the
  ExtendedResourceToleration admission plugin, as on GKE and AKS.
The LeaderWorkerSet controller (sigs.k8s.io/lws) runs as a host process beside
the control plane, with its CRD and webhooks (e2e/localcluster_lws.py); with
the real node, so does CoreDNS, the cluster DNS on the bridge address that
answers cluster.local names only (e2e/localcluster_dns.py).
Binaries come from e2e/controlplane/build.sh (built from the Go module proxy,
cached by version) or FERRY_K8S_ASSETS. FERRY_NODE=0 leaves the real node out
(no root needed; the API server then listens on loopback only).

    python e2e/localcluster.py up      # start in the background, write .ferry/kubeconfig
    python e2e/localcluster.py down    # stop and delete the cluster's data
    python e2e/localcluster.py status

Authentication: a static token file (`ferry-admin`, system:masters, in the
kubeconfig; one identity per control-plane component) and client certificates
(the kubelet as `system:node:ferry-node-0` under the Node authorizer and
NodeRestriction; the API server to the kubelet), so RBAC is real.

With the real node the API server listens on, and advertises, the node's
bridge address (10.250.0.1, which exists only on this machine): pods reach it
through the `kubernetes` Service; the kubeconfig points there too.
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

import localcluster_dns
import localcluster_lws
import localnode

REPO = Path(__file__).resolve().parent.parent
STATE = Path(os.environ.get("FERRY_STATE_DIR", REPO / ".ferry"))
CLUSTER = STATE / "cluster"
KUBECONFIG = STATE / "kubeconfig"
SERVICE_CIDR = "10.96.0.0/16"
# kwok's GPU node pool: two 8-GPU nodes, so a demo and the tests' Deployments
# (and their rolling updates' surge pods) fit side by side.
FAKE_NODES = ("ferry-gpu-node-0", "ferry-gpu-node-1")
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
PAUSE_IMAGE = "ferry.local/pause:3.10"


AUDIT_LOG = CLUSTER / "logs" / "audit.log"


# What the local cluster promises tests: a pod the scheduler turned away is tried again within this
# many seconds of its last try (and within a second or two of the event that frees it).
UNSCHEDULABLE_RETRY_S = 5


def write_scheduler_config(path: Path, kubeconfig_path: Path) -> Path:
    """kube-scheduler tuned for tests: back-off of 1-2 s instead of 1-10 s; no leader election. With
    --config, the scheduler reads its kubeconfig and leader election from here, not from flags."""
    path.write_text(json.dumps({
        "apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig_path)},
        "leaderElection": {"leaderElect": False},
        "podInitialBackoffSeconds": 1, "podMaxBackoffSeconds": 2}))
    return path


def write_audit_policy(path: Path) -> Path:
    """Audit only writes of ModelWeights status, and of pod status by service
    accounts (the serving pods' loaders; not the kubelet's), with their bodies;
    and, without bodies, service accounts' writes of LeaderWorkerSets (the operator's wiring)
    and their reads of namespaces (a namespaced operator reads none)."""
    path.write_text(json.dumps({
        "apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"],
        "rules": [{"level": "Request", "verbs": ["patch", "update"],
                   "resources": [{"group": "ferry.dev", "resources": ["modelweights/status"]}]},
                  {"level": "Request", "verbs": ["patch", "update"], "userGroups": ["system:serviceaccounts"],
                   "resources": [{"group": "", "resources": ["pods/status"]}]},
                  {"level": "Metadata", "verbs": ["patch", "update"], "userGroups": ["system:serviceaccounts"],
                   "resources": [{"group": "leaderworkerset.x-k8s.io", "resources": ["leaderworkersets"]}]},
                  {"level": "Metadata", "verbs": ["get", "list", "watch"], "userGroups": ["system:serviceaccounts"],
                   "resources": [{"group": "", "resources": ["namespaces"]}]},
                  {"level": "None"}]}))
    return path


def audit_events() -> list[dict]:
    """The API server's audit events so far (see write_audit_policy)."""
    if not AUDIT_LOG.exists():
        return []
    return [json.loads(line) for line in AUDIT_LOG.read_text().splitlines() if line.strip()]


def node_enabled() -> bool:
    return os.environ.get("FERRY_NODE", "1") != "0"


def api_address() -> str:
    return localnode.NODE_IP if node_enabled() else "127.0.0.1"


def node_paths() -> localnode.NodePaths:
    return localnode.NodePaths(STATE)


def binaries() -> Path:
    out = subprocess.run(
        ["bash", str(REPO / "e2e/controlplane/build.sh")], check=True, stdout=subprocess.PIPE, text=True
    )
    return Path(out.stdout.strip().splitlines()[-1])


def storage_provisioner() -> str:
    """rancher's local-path-provisioner (e2e/storage/build.sh, cached by version)."""
    out = subprocess.run(["bash", str(REPO / "e2e/storage/build.sh")], check=True, stdout=subprocess.PIPE, text=True)
    return out.stdout.strip().splitlines()[-1]


def built_images(*names: str) -> dict[str, dict[str, str]]:
    """Build (or reuse) the node's images (default: the default set): e2e/images/build.py, cached by content hash."""
    out = subprocess.run([sys.executable, str(REPO / "e2e/images/build.py"), *names], check=True,
                         stdout=subprocess.PIPE, text=True)
    return json.loads(out.stdout)


def import_images(node: "localnode.Node", images: dict[str, dict[str, str]], names: tuple[str, ...] = ()) -> None:
    """Import into the node's containerd what it lacks of `names` (default: the default image set)."""
    subprocess.run([sys.executable, str(REPO / "e2e/images/build.py"), "import", "--address",
                    str(node.paths.containerd_sock), *names], check=True, stdout=subprocess.DEVNULL)


ADMISSION_TEMPLATES = ("templates/admission.yaml", "templates/weights-reporter.yaml")


def render_chart(release: str, *templates: str, values: tuple[str, ...] = ()) -> list[dict]:
    """The chart's objects (those of `templates`, e.g. templates/rbac.yaml) as
    `helm template` renders them for `release` in namespace ferry-system, with
    `values` (`key=value`, as --set takes them)."""
    import yaml  # the venv's; `make cluster-down` runs this module with the system python

    argv = [str(binaries() / "helm"), "template", release, str(REPO / "charts/ferry"), "--namespace", "ferry-system",
            "--kube-version", "1.34.0"]
    for template in templates:
        argv += ["--show-only", template]
    for value in values:
        argv += ["--set", value]
    rendered = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(rendered) if d]


def apply_admission_policies(release: str, kubeconfig: Path = KUBECONFIG) -> str:
    """The chart's admission policies (references authorised as the user; pods
    report on themselves only) rendered for `release` and applied: an operator
    run outside the chart refuses to act without them. Returns their names as
    FERRY_ADMISSION_POLICIES takes them."""
    objects = render_chart(release, *ADMISSION_TEMPLATES)
    subprocess.run([kubectl_path(), "--kubeconfig", str(kubeconfig), "apply", "-f", "-"],
                   input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}),
                   capture_output=True, text=True, check=True)
    return ",".join(d["metadata"]["name"] for d in objects if d["kind"] == "ValidatingAdmissionPolicy")


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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def signed_cert(pki: Path, name: str, subject: str, ext: str, out: Path | None = None) -> None:
    """`<out>/<name>.key` and `.crt` (out: `pki`), signed by the CA in `pki`."""
    out = out or pki
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", subject,
            "-keyout", str(out / f"{name}.key"), "-out", str(out / f"{name}.csr"))
    (out / f"{name}.ext").write_text(ext + "\n")
    openssl("x509", "-req", "-in", str(out / f"{name}.csr"), "-CA", str(pki / "ca.crt"), "-CAkey",
            str(pki / "ca.key"), "-CAcreateserial", "-days", "3650", "-extfile", str(out / f"{name}.ext"),
            "-out", str(out / f"{name}.crt"))


def make_pki(pki: Path) -> None:
    """A CA, the apiserver's serving cert, client certs for the kubelet (a node
    identity) and for the apiserver to the kubelet, and the service-account keys."""
    pki.mkdir(parents=True, exist_ok=True)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650", "-subj", "/CN=ferry-local-ca",
            "-keyout", str(pki / "ca.key"), "-out", str(pki / "ca.crt"))
    signed_cert(pki, "apiserver", "/CN=kube-apiserver",
                f"subjectAltName=IP:127.0.0.1,IP:{localnode.NODE_IP},IP:10.96.0.1,DNS:localhost,DNS:kubernetes,"
                "DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local")
    client = "extendedKeyUsage=clientAuth"
    signed_cert(pki, "kubelet", f"/O=system:nodes/CN=system:node:{localnode.NODE_NAME}", client)
    signed_cert(pki, "apiserver-kubelet-client", "/CN=kube-apiserver-kubelet-client", client)
    openssl("genrsa", "-out", str(pki / "sa.key"), "2048")
    openssl("rsa", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))


def kubeconfig(server: str, ca: Path, token: str | None, user: str, cert: Path | None = None) -> str:
    creds = {"token": token} if token else {"client-certificate": str(cert.with_suffix(".crt")),
                                            "client-key": str(cert.with_suffix(".key"))}
    return json.dumps({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "ferry-local", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": creds}],
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
            running = json.loads(self.pids_file.read_text())
            if "kubelet" in running and localcluster_dns.PROCESS not in running:
                raise SystemExit("the running local cluster was started without cluster DNS (an older harness): "
                                 "its kubelet gives pods no nameserver. Run `make cluster-down` and start it again.")
            self._ensure_lws(timeout)
            print(f"local cluster already running; KUBECONFIG={KUBECONFIG}")
            return
        self.down(quiet=True)
        bin_dir = binaries()
        with_node = node_enabled()
        CLUSTER.mkdir(parents=True, exist_ok=True)
        (CLUSTER / "bin.json").write_text(json.dumps({"bin": str(bin_dir)}))
        provisioner_bin = storage_provisioner() if with_node else ""
        lws_assets = localcluster_lws.assets()
        coredns_bin = localcluster_dns.binary() if with_node else ""
        pki = CLUSTER / "pki"
        make_pki(pki)
        self.logs.mkdir(parents=True, exist_ok=True)
        users = {"admin": ("ferry-admin", "system:masters"), "controller-manager": ("system:kube-controller-manager", ""),
                 "scheduler": ("system:kube-scheduler", ""),
                 # kwok plays the kubelet of every fake node (and deletes their pods).
                 "kwok": ("kwok-controller", "system:masters"),
                 "kube-proxy": ("system:kube-proxy", ""),
                 "local-path-provisioner": ("system:local-path-provisioner", "")}
        tokens = {u: secrets.token_hex(16) for u in users}
        (pki / "tokens.csv").write_text("".join(
            f'{tokens[u]},{name},{u}' + (f',"{group}"' if group else "") + "\n" for u, (name, group) in users.items()))
        address = api_address()
        if with_node:
            # The bridge carries the API server's address: it must exist first. The node's
            # directory marks, for `down`, that this cluster owns the node's network.
            node_paths().root.mkdir(parents=True, exist_ok=True)
            localnode.network_up(SERVICE_CIDR)
        etcd_port, etcd_peer, kcm_port, sched_port = (free_port() for _ in range(4))
        api_port = free_port(address)
        server = f"https://{address}:{api_port}"
        ca = pki / "ca.crt"
        cfgs = {}
        for user, (name, _) in users.items():
            cfgs[user] = CLUSTER / f"{user}.kubeconfig"
            cfgs[user].write_text(kubeconfig(server, ca, tokens[user], name))
        cfgs["kubelet"] = CLUSTER / "kubelet.kubeconfig"
        cfgs["kubelet"].write_text(kubeconfig(server, ca, None, "kubelet", cert=pki / "kubelet.crt"))

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
            "--bind-address", address, "--advertise-address", address,
            "--secure-port", str(api_port),
            "--tls-cert-file", str(pki / "apiserver.crt"), "--tls-private-key-file", str(pki / "apiserver.key"),
            "--client-ca-file", str(ca),
            "--requestheader-client-ca-file", str(ca),
            "--requestheader-username-headers", "X-Remote-User",
            "--requestheader-group-headers", "X-Remote-Group",
            "--token-auth-file", str(pki / "tokens.csv"),
            "--authorization-mode", "Node,RBAC",
            "--enable-admission-plugins", "NodeRestriction,ExtendedResourceToleration",
            "--kubelet-client-certificate", str(pki / "apiserver-kubelet-client.crt"),
            "--kubelet-client-key", str(pki / "apiserver-kubelet-client.key"),
            # By address, never by node name: a name would go to the machine's DNS resolver.
            "--kubelet-preferred-address-types", "InternalIP",
            "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
            "--service-account-key-file", str(pki / "sa.pub"),
            "--service-account-signing-key-file", str(pki / "sa.key"),
            "--service-cluster-ip-range", SERVICE_CIDR,
            "--allow-privileged=true",
            "--enable-priority-and-fairness=false",
            # Who wrote a ModelWeights' status, from which address (tests read it).
            "--audit-policy-file", str(write_audit_policy(CLUSTER / "audit-policy.json")),
            "--audit-log-path", str(AUDIT_LOG), "--audit-log-format", "json",
            # The `kubernetes` Service's endpoint is the advertised address, which
            # Endpoints validation refuses when it is loopback.
            "--endpoint-reconciler-type", "lease" if with_node else "none",
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
            # nodelifecycle stays: it lifts the not-ready taint once a node reports Ready.
            "--controllers", "*,-nodeipam,-cloud-node-lifecycle,-service-lb-controller,-route",
            "--concurrent-deployment-syncs", "2",
            # A claim binds within a second of its volume appearing (default: a 15 s resync).
            "--pvclaimbinder-sync-period", "1s",
            # A benchmark that rolls hundreds of Deployments at once raises the
            # controllers' API rate (client-go's default: 20/s, bursts of 30).
            *os.environ.get("FERRY_CONTROLLER_MANAGER_ARGS", "").split(),
        ])
        pids["kube-scheduler"] = self._spawn("kube-scheduler", [
            str(bin_dir / "kube-scheduler"),
            "--config", str(write_scheduler_config(CLUSTER / "scheduler.yaml", cfgs["scheduler"])),
            "--authentication-kubeconfig", str(cfgs["scheduler"]),
            "--authorization-kubeconfig", str(cfgs["scheduler"]),
            "--bind-address", "127.0.0.1", "--secure-port", str(sched_port),
            # A pod that raced its claim (or a node's room) is retried within seconds, not after the
            # default 5 minutes in the unschedulable pool (deprecated, still honoured in 1.34:
            # kubernetes#122013 keeps it as the workaround for pods stuck there).
            "--pod-max-in-unschedulable-pods-duration", f"{UNSCHEDULABLE_RETRY_S}s",
        ])
        pids["kwok"] = self._spawn("kwok", [
            str(bin_dir / "kwok"),
            "--kubeconfig", str(cfgs["kwok"]),
            "--manage-all-nodes=false",
            "--manage-nodes-with-annotation-selector", "kwok.x-k8s.io/node=fake",
            "--node-ip", "127.0.0.1",
            "--cidr", localnode.KWOK_POD_CIDR,
            # Renew node Leases, or the node-lifecycle controller marks the node
            # and its pods NotReady after the grace period.
            "--node-lease-duration-seconds", "40",
            "--server-address", f"127.0.0.1:{free_port()}",
        ])
        self.pids_file.write_text(json.dumps(pids))
        KUBECONFIG.write_text(kubeconfig(server, ca, tokens["admin"], "ferry-admin"))
        # LWS starts here and initialises while the node comes up; its webhooks are hooked in at the end.
        pids[localcluster_lws.PROCESS] = self._start_lws(lws_assets, pki, server, ca)
        self.pids_file.write_text(json.dumps(pids))
        for name in FAKE_NODES:
            self._create_fake_node(name)
        if with_node:
            pids[localcluster_dns.PROCESS] = self._start_dns(coredns_bin, pki, server, ca)
            self.pids_file.write_text(json.dumps(pids))
            self._start_node(pids, bin_dir, provisioner_bin, cfgs, ca, timeout)
            dns = localcluster_dns.Server(CLUSTER / "dns")
            self._wait(dns.ready, timeout, "CoreDNS /ready (its informers synced)", pids)
        # The serviceaccount controller must have made `default` before pods can be created.
        self._wait(lambda: self._kubectl("get", "serviceaccount", "default", "-n", "default", check=False) == 0,
                   timeout, "default ServiceAccount", pids)
        self._register_lws(ca, pids, timeout)
        print(f"local cluster up: {server}\nexport KUBECONFIG={KUBECONFIG}")

    def _start_lws(self, assets: localcluster_lws.Assets, pki: Path, server: str, ca: Path) -> int:
        """The LeaderWorkerSet controller: its CRD, its own client-certificate identity
        with admin rights, its serving cert and config; returns its pid. Its webhooks
        are registered by `_register_lws` once it serves them."""
        # --server-side: the CRD (1.3 MB) is over the last-applied annotation's limit.
        applied = subprocess.run([kubectl_path(), "--kubeconfig", str(KUBECONFIG), "apply", "--server-side",
                                  "--force-conflicts", "-f", str(assets.crd_dir)], capture_output=True, text=True)
        if applied.returncode != 0:
            raise SystemExit(f"cannot install the LeaderWorkerSet CRD from {assets.crd_dir}:\n{applied.stderr}")
        wait_crd_established(localcluster_lws.CRD)
        self._apply(localcluster_lws.admin_binding())
        signed_cert(pki, "lws-controller", f"/CN={localcluster_lws.USER}", "extendedKeyUsage=clientAuth")
        cfg = CLUSTER / "lws-controller.kubeconfig"
        cfg.write_text(kubeconfig(server, ca, None, "lws-controller", cert=pki / "lws-controller.crt"))
        lws = localcluster_lws.Controller(CLUSTER / "lws")
        lws.prepare(lambda out, name, subject, ext: signed_cert(pki, name, subject, ext, out=out), free_port,
                    localnode.NODE_IP)
        return self._spawn(localcluster_lws.PROCESS, lws.argv(assets.binary, cfg))

    def _start_dns(self, binary: str, pki: Path, server: str, ca: Path) -> int:
        """CoreDNS on the node's bridge address with its own client-certificate
        identity (list/watch of Services, EndpointSlices, pods, namespaces); returns its pid."""
        for obj in localcluster_dns.rbac():
            self._apply(obj)
        signed_cert(pki, "coredns", f"/CN={localcluster_dns.USER}", "extendedKeyUsage=clientAuth")
        cfg = CLUSTER / "coredns.kubeconfig"
        cfg.write_text(kubeconfig(server, ca, None, "coredns", cert=pki / "coredns.crt"))
        dns = localcluster_dns.Server(CLUSTER / "dns")
        dns.prepare(localnode.NODE_IP, cfg, free_port())
        return self._spawn(localcluster_dns.PROCESS, dns.argv(binary))

    def _register_lws(self, ca: Path, pids: dict[str, int], timeout: float, teardown: bool = True) -> None:
        """Once the LWS webhook server answers, point the API server at it."""
        lws = localcluster_lws.Controller(CLUSTER / "lws")
        self._wait(lambda: lws.serving(ca), timeout, "the LeaderWorkerSet webhook server", pids, teardown)
        for obj in lws.webhook_configurations(ca):
            self._apply(obj)

    def _ensure_lws(self, timeout: float) -> None:
        """Add LWS to a running cluster that was started without it (by an older harness),
        leaving the rest of the cluster as it is."""
        pids = json.loads(self.pids_file.read_text())
        if localcluster_lws.PROCESS in pids:
            return
        ep = json.loads((CLUSTER / "endpoint.json").read_text())
        ca = Path(ep["ca"])
        pids[localcluster_lws.PROCESS] = self._start_lws(localcluster_lws.assets(), CLUSTER / "pki", ep["server"], ca)
        self.pids_file.write_text(json.dumps(pids))
        self._register_lws(ca, pids, timeout, teardown=False)
        print("started the LeaderWorkerSet controller in the running cluster")

    def _start_node(self, pids: dict[str, int], bin_dir: Path, provisioner_bin: str, cfgs: dict[str, Path],
                    ca: Path, timeout: float) -> None:
        node = localnode.Node(node_paths())
        # The API server's own identity towards kubelets (logs, exec, port-forward).
        self._apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                     "metadata": {"name": "ferry-local:apiserver-kubelet-client"},
                     "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                 "name": "system:kubelet-api-admin"},
                     "subjects": [{"kind": "User", "apiGroup": "rbac.authorization.k8s.io",
                                   "name": "kube-apiserver-kubelet-client"}]})
        images = built_images()
        for obj in localnode.storage_objects(node.paths, images["busybox"]["ref"], "system:local-path-provisioner"):
            self._apply(obj)
        pids.update(node.start_runtime(self._spawn, PAUSE_IMAGE, SERVICE_CIDR))
        self.pids_file.write_text(json.dumps(pids))
        import_images(node, images)
        creds = localnode.NodeCredentials(ca=ca, kubelet_kubeconfig=cfgs["kubelet"],
                                          proxy_kubeconfig=cfgs["kube-proxy"],
                                          provisioner_kubeconfig=cfgs["local-path-provisioner"],
                                          provisioner_user="system:local-path-provisioner")
        pids.update(node.start_node(self._spawn, bin_dir, provisioner_bin, images["busybox"]["ref"], creds, free_port))
        self.pids_file.write_text(json.dumps(pids))
        jsonpath = '{.status.conditions[?(@.type=="Ready")].status}'
        self._wait(lambda: subprocess.run([kubectl_path(), "--kubeconfig", str(KUBECONFIG), "get", "node",
                                           localnode.NODE_NAME, "-o", f"jsonpath={jsonpath}"],
                                          capture_output=True, text=True).stdout == "True",
                   timeout, f"node {localnode.NODE_NAME} Ready", pids)

    def _apply(self, obj: dict) -> None:
        subprocess.run([kubectl_path(), "--kubeconfig", str(KUBECONFIG), "apply", "-f", "-"],
                       input=json.dumps(obj), text=True, check=True, capture_output=True)

    def _create_fake_node(self, name: str, pods: int = 110, gpus: int = 8) -> None:
        capacity = {"cpu": "64", "memory": "512Gi", "pods": str(pods), "nvidia.com/gpu": str(gpus),
                    "ephemeral-storage": "2Ti"}
        node = {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {
                "name": name,
                "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                           "kubernetes.io/arch": "amd64", "type": "kwok",
                           "nvidia.com/gpu.present": "true"},
            },
            "spec": {"taints": [GPU_TAINT]},
            "status": {"allocatable": capacity, "capacity": dict(capacity)},
        }
        subprocess.run([kubectl_path(), "--kubeconfig", str(KUBECONFIG), "apply", "-f", "-"],
                       input=json.dumps(node), text=True, check=True, capture_output=True)

    def _kubectl(self, *args: str, check: bool = True) -> int:
        return subprocess.run([kubectl_path(), "--kubeconfig", str(KUBECONFIG), *args],
                              capture_output=True, check=check).returncode

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> int:
        log = open(self.logs / f"{name}.log", "ab")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, **(env or {})})
        return proc.pid

    def _wait(self, ok, timeout: float, what: str, pids: dict[str, int], teardown: bool = True) -> None:
        """Poll `ok`; on a dead process or the timeout, stop the cluster (unless not `teardown`) and exit."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ok():
                return
            dead = [n for n, p in pids.items() if not _alive(p)]
            if dead:
                log = self.logs / f"{dead[0]}.log"
                tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
                if teardown:
                    self.down(quiet=True)
                raise SystemExit(f"{dead[0]} exited while waiting for {what}:\n{tail}")
            time.sleep(0.5)
        if teardown:
            self.down(quiet=True)
        raise SystemExit(f"timed out after {timeout}s waiting for {what}; logs in {self.logs}")

    def down(self, quiet: bool = False) -> None:
        # The demo's operator first (it talks to this cluster), then the cluster.
        stop_pid_file(STATE / "operator.pid")
        if self.pids_file.exists():
            pids = json.loads(self.pids_file.read_text())
            for pid in reversed(list(pids.values())):
                _kill(pid)
        # An LWS controller that a crashed `up` did not record, found by its config path.
        localnode.stop(localnode.pids_mentioning(str(localcluster_lws.Controller(CLUSTER / "lws").config)))
        localnode.stop(localnode.pids_mentioning(str(localcluster_dns.Server(CLUSTER / "dns").corefile)))
        # The node's leftovers whether or not it was recorded (a crashed `up`).
        paths = node_paths()
        # Only this state dir's node: the bridge and iptables are the machine's, and
        # another cluster (another FERRY_STATE_DIR, FERRY_NODE=0) must not tear them down.
        if paths.root.exists() or paths.run.exists():
            bin_dir = Path(json.loads((CLUSTER / "bin.json").read_text())["bin"]) if (CLUSTER / "bin.json").exists() \
                else None
            localnode.Node(paths).stop(bin_dir)
        if CLUSTER.exists():
            subprocess.run(["rm", "-rf", str(CLUSTER)], check=True)
        KUBECONFIG.unlink(missing_ok=True)
        if not quiet:
            print("local cluster down")


def leftovers() -> dict[str, list[str]]:
    """What of the cluster is still on this machine after `down`: the node's
    leftovers, and any process that names the LWS controller's or CoreDNS's files."""
    left = localnode.leftovers(node_paths())
    ours = [f"{p} {localnode._cmdline(p)[:120]}"
            for p in localnode.pids_mentioning(str(CLUSTER / "lws"), str(CLUSTER / "dns"))]
    left["processes"] = left["processes"] + [p for p in ours if p not in left["processes"]]
    return left


def stop_pid_file(path: Path) -> None:
    """Stop the process (group) whose pid a file records, and remove the file."""
    if path.exists():
        try:
            _kill(int(path.read_text()))
        except ValueError:
            pass
        path.unlink(missing_ok=True)


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
    ap.add_argument("command", choices=["up", "down", "status", "build", "leftovers"])
    args = ap.parse_args()
    cluster = Cluster()
    if args.command == "up":
        cluster.up()
    elif args.command == "down":
        cluster.down()
    elif args.command == "build":
        print(binaries())
    elif args.command == "leftovers":
        # After `down`: anything of the node or of LWS still on this machine fails this.
        left = {k: v for k, v in leftovers().items() if v}
        print(json.dumps(left, indent=2) if left else "nothing of the local cluster is left on this machine")
        sys.exit(1 if left else 0)
    else:
        ok = cluster.running()
        print("running" if ok else "not running")
        sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
