"""The status sink against a real kube-apiserver, with a ServiceAccount that may patch only status."""
from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest
import yaml

from ferry_worker.progress import Progress
from ferry_worker.sinks import default_sinks

WORKER_SA = "ferry-worker"


def worker_rbac(namespace: str) -> list[dict]:
    """What a fetch Job's ServiceAccount gets: get and patch of modelweights/status, nothing else."""
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": WORKER_SA, "namespace": namespace}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": WORKER_SA, "namespace": namespace},
         "rules": [{"apiGroups": ["ferry.dev"], "resources": ["modelweights/status"], "verbs": ["get", "patch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": WORKER_SA, "namespace": namespace},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": WORKER_SA},
         "subjects": [{"kind": "ServiceAccount", "name": WORKER_SA, "namespace": namespace}]},
    ]


def service_account_kubeconfig(admin: Path, token: str, dest: Path) -> Path:
    config = yaml.safe_load(admin.read_text())
    for user in config["users"]:
        user["user"] = {"token": token}
    dest.write_text(yaml.safe_dump(config))
    return dest


@pytest.mark.cluster
def test_progress_lands_in_the_modelweights_status(crd, namespace: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    crd.apply({"apiVersion": "ferry.dev/v1alpha1", "kind": "ModelWeights",
               "metadata": {"name": "llama", "namespace": namespace},
               "spec": {"source": {"uri": "s3://models/llama-3-8b/"}, "storage": {"pvc": {"name": "weights"}}}})
    for obj in worker_rbac(namespace):
        crd.apply(obj)
    token = crd.kubectl("create", "token", WORKER_SA, "-n", namespace).stdout.strip()
    monkeypatch.setenv("KUBECONFIG", str(service_account_kubeconfig(crd.kubeconfig, token, tmp_path / "kubeconfig")))
    monkeypatch.setenv("FERRY_MODELWEIGHTS_NAME", "llama")
    monkeypatch.setenv("FERRY_MODELWEIGHTS_NAMESPACE", namespace)
    monkeypatch.setenv("FERRY_PROGRESS_INTERVAL", "0.2")

    def progress_status() -> dict:
        return crd.get_json("modelweights", "llama", "-n", namespace).get("status", {}).get("progress", {})

    with Progress("fetch", 4 << 30, default_sinks(io.StringIO()), tick_s=0.05) as progress:
        progress.advance(1 << 30)
        deadline = time.monotonic() + 30
        while progress_status().get("bytesDone") != 1 << 30:
            assert time.monotonic() < deadline, f"status.progress never showed 1 GiB: {progress_status()}"
            time.sleep(0.1)
        running = progress_status()
        progress.advance(3 << 30)

    assert running["step"] == "fetch" and running["bytesTotal"] == 4 << 30 and running["percent"] == 25
    assert running["bytesPerSecond"] > 0 and running["etaSeconds"] >= 0
    final = progress_status()
    assert {k: final[k] for k in ("bytesDone", "bytesTotal", "percent", "etaSeconds")} == {
        "bytesDone": 4 << 30, "bytesTotal": 4 << 30, "percent": 100, "etaSeconds": 0}
    assert final["updatedAt"].endswith("Z")

    # The same credentials cannot touch the spec: the worker can report, not reconfigure.
    denied = crd.kubectl("--kubeconfig", str(tmp_path / "kubeconfig"), "patch", "modelweights", "llama",
                         "-n", namespace, "--type", "merge", "-p", json.dumps({"spec": {"deletionPolicy": "Delete"}}),
                         check=False)
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower()
