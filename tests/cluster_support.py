"""Helpers for tests against the local control plane (imported by tests and
conftest alike; a module of its own because several conftest.py files exist)."""
from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Kube:
    kubeconfig: Path
    kubectl_bin: str

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 60) -> subprocess.CompletedProcess:
        argv = [self.kubectl_bin, "--kubeconfig", str(self.kubeconfig), *args]
        proc = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
        return proc

    def get_json(self, *args: str) -> dict:
        """`kubectl get ARGS -o json`: for the resources tests poll (_KINDS), one HTTP GET on a kept-alive
        connection as this kubeconfig's user, with kubectl's output shape; anything else through kubectl."""
        path = _read_path(args)
        if path is None or self._session is None:
            return json.loads(self.kubectl("get", *args, "-o", "json").stdout)
        url, params, listed = path
        got = self._session.get(self._server + url, params=params, timeout=60)
        if got.status_code != 200:
            raise AssertionError(f"kubectl get {' '.join(args)} failed (HTTP {got.status_code}):\n{got.text}")
        body = got.json()
        if listed is None:
            return body
        api_version, kind = listed
        items = [{"apiVersion": api_version, "kind": kind, **item} for item in body.get("items", [])]
        return {"apiVersion": "v1", "kind": "List", "items": items, "metadata": {"resourceVersion": ""}}

    def apply(self, obj: dict | str, *extra: str) -> subprocess.CompletedProcess:
        text = obj if isinstance(obj, str) else json.dumps(obj)
        return self.kubectl("apply", "-f", "-", *extra, input=text)

    @functools.cached_property
    def _server(self) -> str:
        return self._config["clusters"][0]["cluster"]["server"]

    @functools.cached_property
    def _config(self) -> dict:
        import yaml

        return yaml.safe_load(Path(self.kubeconfig).read_text())

    @functools.cached_property
    def _session(self):
        """A session as the kubeconfig's one user (a token or a client certificate, a CA file); None for
        any other kind of kubeconfig."""
        import requests

        config = self._config
        cluster, user = config["clusters"][0]["cluster"], config["users"][0]["user"]
        if len(config["users"]) != 1 or "certificate-authority" not in cluster:
            return None
        session = requests.Session()
        session.trust_env = False  # no proxy, CA bundle or netrc from the environment: this cluster only
        session.verify = cluster["certificate-authority"]
        if "token" in user:
            session.headers["Authorization"] = f"Bearer {user['token']}"
        elif "client-certificate" in user and "client-key" in user:
            session.cert = (user["client-certificate"], user["client-key"])
        else:
            return None
        return session


# kubectl's names for the resources tests poll: API path, plural, namespaced, apiVersion and kind.
_KINDS = {
    "modelweights": ("/apis/ferry.dev/v1alpha1", "modelweights", True, "ferry.dev/v1alpha1", "ModelWeights"),
    "pods": ("/api/v1", "pods", True, "v1", "Pod"),
    "events": ("/api/v1", "events", True, "v1", "Event"),
    "persistentvolumeclaims": ("/api/v1", "persistentvolumeclaims", True, "v1", "PersistentVolumeClaim"),
    "persistentvolumes": ("/api/v1", "persistentvolumes", False, "v1", "PersistentVolume"),
    "nodes": ("/api/v1", "nodes", False, "v1", "Node"),
    "configmaps": ("/api/v1", "configmaps", True, "v1", "ConfigMap"),
    "deployments": ("/apis/apps/v1", "deployments", True, "apps/v1", "Deployment"),
    "replicasets": ("/apis/apps/v1", "replicasets", True, "apps/v1", "ReplicaSet"),
    "statefulsets": ("/apis/apps/v1", "statefulsets", True, "apps/v1", "StatefulSet"),
    "jobs": ("/apis/batch/v1", "jobs", True, "batch/v1", "Job"),
}
_ALIASES = {"mw": "modelweights", "pod": "pods", "po": "pods", "event": "events", "pvc": "persistentvolumeclaims",
            "pv": "persistentvolumes", "node": "nodes", "no": "nodes", "configmap": "configmaps", "cm": "configmaps",
            "deployment": "deployments", "deploy": "deployments", "rs": "replicasets", "replicaset": "replicasets",
            "statefulset": "statefulsets", "sts": "statefulsets", "job": "jobs"}

# The flags of `kubectl get` the fast path reads: where they go in the request.
_FLAGS = {"-n": "namespace", "--namespace": "namespace", "-l": "labelSelector", "--selector": "labelSelector",
          "--field-selector": "fieldSelector"}


def _read_path(args: tuple[str, ...]) -> tuple[str, dict[str, str], tuple[str, str] | None] | None:
    """The API path and query `kubectl get ARGS` reads, and for a list its items' (apiVersion, kind);
    None where the args are not a plain read of one of _KINDS (kubectl then answers)."""
    names, namespace, params = [], "default", {}
    rest = iter(args)
    for arg in rest:
        if arg in _FLAGS:
            value = next(rest, None)
            if value is None:
                return None
            if _FLAGS[arg] == "namespace":
                namespace = value
            else:
                params[_FLAGS[arg]] = value
        elif arg.startswith("-") or "/" in arg or "," in arg:
            return None
        else:
            names.append(arg)
    kind = _KINDS.get(_ALIASES.get(names[0], names[0])) if names else None
    if kind is None or len(names) > 2 or (len(names) == 2 and params):
        return None
    prefix, plural, namespaced, api_version, kind_name = kind
    url = f"{prefix}/namespaces/{namespace}/{plural}" if namespaced else f"{prefix}/{plural}"
    if len(names) == 2:
        return f"{url}/{names[1]}", params, None
    return url, params, (api_version, kind_name)


@contextlib.contextmanager
def running_operator(kube: Kube, namespace: str, log_path: Path, **env: str):
    """`ferry-operator run` for one namespace, as a process, with extra env. It
    runs as a ServiceAccount bound to the chart's operator ClusterRole unless
    env names a KUBECONFIG of its own."""
    with contextlib.ExitStack() as stack:
        if "KUBECONFIG" not in env:
            from operator_identity import chart_operator_role, operator_identity

            kubeconfig, _ = stack.enter_context(operator_identity(kube, namespace, chart_operator_role(),
                                                                  log_path.parent))
            env = {**env, "KUBECONFIG": str(kubeconfig)}
        yield stack.enter_context(_operator_process(kube, namespace, log_path, env))


# The operator logs the current test wrote: a failing test's report shows their tails (conftest.py).
OPERATOR_LOGS: list[Path] = []


@contextlib.contextmanager
def _operator_process(kube: Kube, namespace: str, log_path: Path, env: dict[str, str]):
    OPERATOR_LOGS.append(log_path)
    full_env = {**os.environ, "FERRY_RECONCILE_INTERVAL": "1",
                "FERRY_ADMISSION_POLICIES": admission_policies(kube), **env}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(Path(sys.executable).with_name("ferry-operator")), "run", "--standalone",
                                 "--namespace", namespace], env=full_env, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield proc
        finally:
            # kopf's finalizer (it guards the per-object timer) needs the operator
            # running to let the test's ModelWeights go.
            kube.kubectl("delete", "mw", "--all", "-n", namespace, "--timeout=60s", check=False)
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
    if os.environ.get("FERRY_SHOW_OPERATOR_LOG"):
        print(log_path.read_text())


TEST_RELEASE = "ferry-tests"
_policies: dict[str, str] = {}


def token_dir(kube: Kube, account: str, namespace: str, tmp: Path, pod: dict | None) -> Path:
    """A service account token directory as the kubelet projects one (token, namespace, ca.crt): the token
    minted by the TokenRequest API bound to `pod` (whose node the API server writes into it), or bound to
    nothing. Points the in-cluster config at this API server (KUBERNETES_SERVICE_HOST/PORT), as in a pod;
    see in_cluster_env."""
    argv = ["create", "token", account, "-n", namespace, "--duration=10m"]
    if pod is not None:
        argv += ["--bound-object-kind", "Pod", "--bound-object-name", pod["metadata"]["name"],
                 "--bound-object-uid", pod["metadata"]["uid"]]
    d = tmp / (pod["metadata"]["name"] if pod else f"{account}-unbound")
    d.mkdir()
    (d / "token").write_text(kube.kubectl(*argv).stdout.strip())
    (d / "namespace").write_text(namespace)
    (d / "ca.crt").write_text(kube.get_json("configmap", "kube-root-ca.crt", "-n", namespace)["data"]["ca.crt"])
    return d


def in_cluster_env(kube: Kube, monkeypatch) -> None:
    """KUBERNETES_SERVICE_HOST/PORT of this API server, which the in-cluster config reads in a pod."""
    import yaml

    server = yaml.safe_load(kube.kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
    host, port = server.removeprefix("https://").rsplit(":", 1)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", host)
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", port)


def admission_policies(kube: Kube) -> str:
    """The chart's admission policies (release ferry-tests), applied once per
    test process: operators started by tests refuse to act without them."""
    import localcluster

    if str(kube.kubeconfig) not in _policies:
        _policies[str(kube.kubeconfig)] = localcluster.apply_admission_policies(TEST_RELEASE, kube.kubeconfig)
    return _policies[str(kube.kubeconfig)]


def wait_for(fn, what: str, timeout: float = 60):
    """Poll `fn` until it returns something truthy; return that."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
