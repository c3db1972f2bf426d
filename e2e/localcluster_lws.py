"""The LeaderWorkerSet controller (sigs.k8s.io/lws) in the local cluster, run as a
host process like the rest of the control plane (e2e/localcluster.py starts it).

The binary and its CRD come from e2e/lws/build.sh (built from the Go module
proxy, cached by version; e2e/lws/NOTES.md has what was learnt about running it).
The controller runs without leader election, internal cert management or a
metrics server. Its webhook server listens on 127.0.0.1 with a serving cert
signed by the cluster CA. The API server, which also runs on this machine,
calls it through `url:` webhook configurations. LWS's pod webhook matters most:
it adds the group labels and injects LWS_LEADER_ADDRESS, LWS_GROUP_SIZE and
LWS_WORKER_INDEX into every container and init container. The controller
itself builds the worker StatefulSets from the labels that webhook adds.
"""
from __future__ import annotations

import base64
import json
import ssl
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
PROCESS = "lws-controller"  # its name in the cluster's pids file and logs directory
CRD = "leaderworkersets.leaderworkerset.x-k8s.io"
NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
# Its own client-certificate identity (a user of the cluster CA), bound to cluster-admin.
USER = "ferry-local:lws-controller"
# Upstream's names (config/default adds the `lws-` prefix).
MUTATING = "lws-mutating-webhook-configuration"
VALIDATING = "lws-validating-webhook-configuration"
# (name, path, API group, resource, operations, only LWS pods), in upstream's config/webhook.
MUTATING_HOOKS = (
    ("mleaderworkerset.kb.io", "/mutate-leaderworkerset-x-k8s-io-v1-leaderworkerset", "leaderworkerset.x-k8s.io",
     "leaderworkersets", ["CREATE", "UPDATE"], False),
    ("mpod.kb.io", "/mutate--v1-pod", "", "pods", ["CREATE"], True),
)
VALIDATING_HOOKS = (
    ("vleaderworkerset.kb.io", "/validate-leaderworkerset-x-k8s-io-v1-leaderworkerset", "leaderworkerset.x-k8s.io",
     "leaderworkersets", ["CREATE", "UPDATE"], False),
    ("vpod.kb.io", "/validate--v1-pod", "", "pods", ["CREATE", "UPDATE"], True),
)


@dataclass(frozen=True)
class Assets:
    binary: str
    crd_dir: Path


def assets() -> Assets:
    """The controller binary and the CRD directory (e2e/lws/build.sh; FERRY_LWS_ASSETS for prebuilt ones)."""
    out = subprocess.run(["bash", str(REPO / "e2e/lws/build.sh")], check=True, stdout=subprocess.PIPE, text=True)
    binary, crd_dir = out.stdout.strip().splitlines()[-2:]
    return Assets(binary, Path(crd_dir))


def admin_binding() -> dict:
    """Admin rights for USER. Upstream's ClusterRole grants nearly as much
    (pods, StatefulSets, Services, Secrets, the webhook configurations...)."""
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": USER},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
            "subjects": [{"kind": "User", "apiGroup": "rbac.authorization.k8s.io", "name": USER}]}


class Controller:
    """The controller's files under `state` (the cluster's state directory): its
    config, its serving cert and key, and the webhook port the config records."""

    def __init__(self, state: Path):
        self.state = state
        self.cert_dir = state / "certs"
        self.config = state / "config.json"

    def prepare(self, sign: Callable[[Path, str, str, str], None], free_port: Callable[[], int],
                node_ip: str) -> None:
        """Write the serving cert (tls.crt and tls.key, which controller-runtime reads
        from certDir) and the controller's Configuration. `sign(dir, name, subject, ext)`
        signs with the cluster CA."""
        self.cert_dir.mkdir(parents=True, exist_ok=True)
        sign(self.cert_dir, "tls", "/CN=lws-webhook",
             f"subjectAltName=IP:127.0.0.1,IP:{node_ip}\nextendedKeyUsage=serverAuth")
        self.config.write_text(json.dumps({
            "apiVersion": "config.lws.x-k8s.io/v1alpha1", "kind": "Configuration",
            # Leader election would need a Lease in lws-system; the internal cert
            # rotator issues certs for a Service's DNS name only, not for 127.0.0.1.
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            # The defaults (9443, :8443, :8081) bind every interface.
            "webhook": {"host": "127.0.0.1", "port": free_port(), "certDir": str(self.cert_dir)},
            "metrics": {"bindAddress": "0"},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{free_port()}"},
        }, indent=2))

    @property
    def port(self) -> int:
        return json.loads(self.config.read_text())["webhook"]["port"]

    def argv(self, binary: str, kubeconfig: Path) -> list[str]:
        # --zap-devel=false: upstream's default is development logging (console, debug level).
        return [binary, "--kubeconfig", str(kubeconfig), "--config", str(self.config),
                "--zap-devel=false", "--leader-elect=false"]

    def serving(self, ca: Path) -> bool:
        """Whether every webhook path answers over TLS verified by the cluster CA.
        The server can accept connections before the handlers are registered (404),
        and /readyz says nothing about the webhooks."""
        ctx = ssl.create_default_context(cafile=str(ca))
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=ctx))
        for _, path, *_ in (*MUTATING_HOOKS, *VALIDATING_HOOKS):
            req = urllib.request.Request(f"https://127.0.0.1:{self.port}{path}", data=b"{}",
                                         headers={"Content-Type": "application/json"})
            try:
                with opener.open(req, timeout=2):
                    pass
            except urllib.error.HTTPError as e:
                if e.code == 404:
                    return False
            except OSError:
                return False
        return True

    def webhook_configurations(self, ca: Path) -> list[dict]:
        """The four webhooks of upstream's config, calling this process by URL.
        The pod webhooks select LWS pods only, so no other pod depends on LWS being up."""
        bundle = base64.b64encode(ca.read_bytes()).decode()

        def hook(name: str, path: str, group: str, resource: str, operations: list[str], lws_pods: bool) -> dict:
            h = {"name": name, "admissionReviewVersions": ["v1"], "sideEffects": "None", "failurePolicy": "Fail",
                 "clientConfig": {"url": f"https://127.0.0.1:{self.port}{path}", "caBundle": bundle},
                 "rules": [{"apiGroups": [group], "apiVersions": ["v1"], "operations": operations,
                            "resources": [resource]}]}
            if lws_pods:
                h["objectSelector"] = {"matchExpressions": [{"key": NAME_LABEL, "operator": "Exists"}]}
            return h

        return [{"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
                 "metadata": {"name": MUTATING}, "webhooks": [hook(*h) for h in MUTATING_HOOKS]},
                {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
                 "metadata": {"name": VALIDATING}, "webhooks": [hook(*h) for h in VALIDATING_HOOKS]}]
