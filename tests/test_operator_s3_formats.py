"""The object-store formats end to end on the embedded default: the operator
(local executor) fetches a checkpoint, tensorizes it (or publishes it for the
Run:ai streamer, whole or cut per rank: runai_streamer_sharded) into storage.s3 on the real S3 server process, records the
artifact, wires the Deployment with the flags and environment vLLM 0.32 reads
(no secret value in it), and with deletionPolicy Delete removes exactly the
prefix it wrote."""
from __future__ import annotations

import json

import pytest

from checkpoints import LLAMA3, write_checkpoint
from cluster_support import running_operator, wait_for
from s3server import S3Server

pytestmark = pytest.mark.cluster
BUCKET = "ferry-artifacts"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with S3Server(tmp_path_factory.mktemp("s3-formats")) as server:
        server.client().create_bucket(Bucket=BUCKET)
        server.client().put_object(Bucket=BUCKET, Key="other/keep.txt", Body=b"not Ferry's")
        yield server


@pytest.fixture
def operator(crd, namespace, tmp_path):
    # The local executor runs the worker itself, so it reads storage.s3's Secret
    # (with the admin kubeconfig here); the chart's operator never reads Secrets.
    with running_operator(crd, namespace, tmp_path / "operator.log", FERRY_EXECUTOR="local",
                          FERRY_LOCAL_ROOT=str(tmp_path / "artifacts"), KUBECONFIG=str(crd.kubeconfig)):
        yield


def deployment(namespace: str, name: str) -> dict:
    labels = {"app": name}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": namespace},
            "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.32.0",
                                         "args": ["--model", "tiny-llama", "--max-model-len", "256"],
                                         "resources": {"limits": {"nvidia.com/gpu": "2"}}}]}}}}


def keys(s3: S3Server, prefix: str) -> set[str]:
    listed = s3.client().list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return {o["Key"].removeprefix(prefix) for o in listed.get("Contents", [])}


@pytest.mark.parametrize("fmt,files", [
    ({"type": "tensorizer", "tensorParallelSize": 2, "tensorizer": {"numReaders": 2}},
     {"model-rank-000.tensors", "model-rank-001.tensors"}),
    ({"type": "runai_streamer", "tensorParallelSize": 2, "runaiStreamer": {"concurrency": 8}},
     {"model.safetensors.index.json", "model-00001-of-00002.safetensors"}),
    ({"type": "runai_streamer_sharded", "tensorParallelSize": 2},
     {"model-rank-0-part-0.safetensors", "model-rank-1-part-0.safetensors"}),
], ids=["tensorizer-tp2", "runai-published", "runai-sharded-tp2"])
def test_prepared_into_s3_wired_and_deleted(crd, namespace, operator, s3, tmp_path, fmt, files):
    source = tmp_path / "tiny-llama"
    write_checkpoint(source, LLAMA3)
    crd.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "store", "namespace": namespace},
               "stringData": {"AWS_ACCESS_KEY_ID": s3.env()["AWS_ACCESS_KEY_ID"],
                              "AWS_SECRET_ACCESS_KEY": s3.env()["AWS_SECRET_ACCESS_KEY"]}})
    crd.apply(deployment(namespace, "tiny-vllm"))
    crd.apply({"apiVersion": "ferry.dev/v1alpha1", "kind": "ModelWeights",
               "metadata": {"name": "tiny", "namespace": namespace},
               "spec": {"source": {"uri": f"file://{source}"},
                        "storage": {"pvc": {"size": "1Gi"},
                                    "s3": {"uri": f"s3://{BUCKET}/models", "endpoint": s3.endpoint,
                                           "credentialsSecretRef": {"name": "store"}}},
                        "format": fmt, "deletionPolicy": "Delete",
                        "serving": {"deployments": [{"name": "tiny-vllm", "container": "vllm"}]}}})

    def ready():
        status = crd.get_json("mw", "tiny", "-n", namespace).get("status", {})
        stalled = next((c for c in status.get("conditions", []) if c["type"] == "Stalled"), {})
        assert stalled.get("status") != "True", json.dumps(status, indent=1)
        return status if status.get("phase") == "Ready" else None
    status = wait_for(ready, "tiny Ready", timeout=240)

    artifact = status["artifact"]
    uid = crd.get_json("mw", "tiny", "-n", namespace)["metadata"]["uid"]
    prefix = f"models/{namespace}/tiny/{uid}/{artifact['specDigest']}/"
    assert artifact["uri"] == f"s3://{BUCKET}/{prefix}".rstrip("/")
    stored = keys(s3, prefix)
    assert files | {"ferry-manifest.json", "config.json", "tokenizer.json"} <= stored, stored

    dep = crd.get_json("deployment", "tiny-vllm", "-n", namespace)
    pod = dep["spec"]["template"]["spec"]
    c = next(c for c in pod["containers"] if c["name"] == "vllm")
    args = c["args"]
    assert args[args.index("--model") + 1] == artifact["uri"]
    assert args[args.index("--load-format") + 1] == fmt["type"]
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    extra = json.loads(args[args.index("--model-loader-extra-config") + 1]) if "--model-loader-extra-config" in \
        args else None
    if fmt["type"] == "tensorizer":
        assert extra == {"tensorizer_uri": f"{artifact['uri']}/model-rank-%03d.tensors", "num_readers": 2}
    elif fmt["type"] == "runai_streamer":
        assert extra == {"concurrency": 8}
    else:  # vLLM's ShardedStateLoader takes no extra config but a file pattern; the rank files are the default's
        assert extra is None and not any(k.endswith(".safetensors") and "rank" not in k for k in stored), stored
    env = {e["name"]: e for e in c["env"]}
    assert env["AWS_ENDPOINT_URL"]["value"] == s3.endpoint
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {"name": "store", "key": "AWS_ACCESS_KEY_ID",
                                                                     "optional": False}
    # The loader checks the objects against the manifest, with the same environment.
    (init,) = pod["initContainers"]
    assert init["args"][:3] == ["load", "--artifact", artifact["uri"]]
    assert {e["name"] for e in init["env"]} >= {"AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID"}
    # No secret value anywhere in the Deployment.
    assert s3.env()["AWS_SECRET_ACCESS_KEY"] not in json.dumps(dep)

    crd.kubectl("delete", "mw", "tiny", "-n", namespace, "--timeout=120s", timeout=130)
    assert keys(s3, prefix) == set()
    assert keys(s3, "other/") == {"keep.txt"}  # only what Ferry wrote
