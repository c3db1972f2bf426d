"""ModelWeights manifests shared by the offline (pydantic) and admission
(kube-apiserver) tests, so the CRD's rules and the Python rules agree."""
from __future__ import annotations

import copy
from typing import Any


def manifest(name: str = "llama", **spec_overrides: Any) -> dict[str, Any]:
    spec = {
        "source": {
            "uri": "hf://meta-llama/Meta-Llama-3-70B-Instruct",
            "revision": "main",
            "credentialsSecretRef": {"name": "hf-token"},
        },
        "storage": {"pvc": {"size": "200Gi", "storageClassName": "fast", "accessModes": ["ReadWriteMany"]}},
        "format": {"type": "sharded_state", "tensorParallelSize": 4, "pipelineParallelSize": 1, "vllmVersion": "0.32"},
        "serving": {"deployments": [{"name": "llama-70b-vllm", "container": "vllm"}]},
        "deletionPolicy": "Retain",
    }
    spec.update(spec_overrides)
    return {"apiVersion": "ferry.dev/v1alpha1", "kind": "ModelWeights", "metadata": {"name": name}, "spec": spec}


def with_(path: str, value: Any, base: dict | None = None) -> dict[str, Any]:
    """A copy of the base manifest with spec.<path> set (dots; value None deletes)."""
    obj = copy.deepcopy(base or manifest())
    node = obj["spec"]
    keys = path.split(".")
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    if value is None:
        node.pop(keys[-1], None)
    else:
        node[keys[-1]] = value
    return obj


VALID = {
    "sharded-state-tp4": manifest(),
    "minimal-safetensors": {
        "apiVersion": "ferry.dev/v1alpha1", "kind": "ModelWeights", "metadata": {"name": "tiny"},
        "spec": {"source": {"uri": "s3://models/llama-3-8b/"}, "storage": {"pvc": {"name": "shared-weights"}}},
    },
    "tensorizer-s3": manifest(
        format={"type": "tensorizer", "tensorParallelSize": 2, "tensorizer": {"numReaders": 4}},
        storage={"pvc": {"size": "200Gi"},
                 "s3": {"uri": "s3://ferry-artifacts/llama", "endpoint": "http://minio.storage:9000",
                        "credentialsSecretRef": {"name": "s3-creds"}}},
    ),
    "runai-published-to-s3": manifest(
        format={"type": "runai_streamer", "tensorParallelSize": 2},
        storage={"pvc": {"size": "200Gi"}, "s3": {"uri": "s3://ferry-artifacts/llama"}},
    ),
    "runai-sharded-to-s3": manifest(
        format={"type": "runai_streamer_sharded", "tensorParallelSize": 4, "expertParallel": True},
        storage={"pvc": {"size": "200Gi"}, "s3": {"uri": "s3://ferry-artifacts/qwen3-moe"}},
    ),
    "runai-from-s3-source": manifest(
        source={"uri": "s3://models/qwen2-7b"}, storage=None,
        format={"type": "runai_streamer", "runaiStreamer": {"concurrency": 32, "memoryLimit": -1}},
    ),
    "pp2-vllm-0.33": with_("format.pipelineParallelSize", 2, with_("format.vllmVersion", "0.33.1")),
    "pvc-source": manifest(source={"uri": "pvc://model-cache/llama-3-70b"}),
    "local-file-source": manifest(source={"uri": "file:///var/lib/models/llama"}),
    "moe-expert-parallel": manifest(format={"type": "sharded_state", "tensorParallelSize": 8, "expertParallel": True,
                                            "expertPlacement": "round_robin", "target": "ampere"}),
    "safetensors-expert-parallel": manifest(format={"type": "safetensors", "tensorParallelSize": 2,
                                                    "expertParallel": True}),
    "tensorizer-expert-parallel": manifest(
        format={"type": "tensorizer", "tensorParallelSize": 4, "expertParallel": True, "target": "rocm"},
        storage={"pvc": {"size": "200Gi"}, "s3": {"uri": "s3://ferry-artifacts/qwen3-moe"}},
    ),
}

# (id, manifest, field the error must name, words the message must contain)
INVALID = [
    ("scheme", with_("source.uri", "ftp://host/model"), "spec.source.uri", "must start with hf://"),
    ("hf-no-name", with_("source.uri", "hf://meta-llama"), "spec.source.uri", "hf://org/name"),
    ("s3-bad-bucket", with_("source.uri", "s3://My_Bucket/llama"), "spec.source.uri", "s3://bucket/prefix"),
    ("dotdot", with_("source.uri", "file:///models/../etc"), "spec.source.uri", "'..'"),
    ("format-enum", with_("format.type", "gguf"), "spec.format.type", "gguf"),
    ("tp-zero", with_("format.tensorParallelSize", 0), "spec.format.tensorParallelSize", "1"),
    ("pp-negative", with_("format.pipelineParallelSize", -2), "spec.format.pipelineParallelSize", "1"),
    ("tp-string", with_("format.tensorParallelSize", "four"), "spec.format.tensorParallelSize", "integer"),
    ("vllm-version", with_("format.vllmVersion", "latest"), "spec.format.vllmVersion", "latest"),
    ("pvc-size-quantity", with_("storage.pvc.size", "lots"), "spec.storage.pvc.size", "lots"),
    ("pvc-neither-name-nor-size", with_("storage.pvc", {"accessModes": ["ReadWriteOnce"]}), "spec.storage.pvc",
     "set name"),
    ("storage-class-name", with_("storage.pvc.storageClassName", "Fast_SSD"), "spec.storage.pvc.storageClassName",
     "Fast_SSD"),
    ("access-mode", with_("storage.pvc.accessModes", ["ReadWriteSometimes"]), "spec.storage.pvc.accessModes[0]",
     "ReadWriteSometimes"),
    ("tensorizer-needs-s3", with_("format", {"type": "tensorizer"}), "spec.storage.s3",
     "required when format.type is tensorizer"),
    ("tensorizer-needs-pvc", manifest(format={"type": "tensorizer"}, storage={"s3": {"uri": "s3://bucket/x"}}),
     "spec.storage.pvc", "the checkpoint is fetched to the claim first"),
    ("tensorizer-no-pp", manifest(format={"type": "tensorizer", "pipelineParallelSize": 2},
                                  storage={"pvc": {"size": "1Gi"}, "s3": {"uri": "s3://bucket/x"}}),
     "spec.format.pipelineParallelSize", "tensorizer artifacts are cut per tensor-parallel rank only"),
    ("sharded-needs-pvc", with_("storage", {"s3": {"uri": "s3://bucket/x"}}), "spec.storage.pvc",
     "required when format.type is safetensors or sharded_state"),
    ("runai-needs-s3", manifest(storage=None, format={"type": "runai_streamer"}), "spec.format.type",
     "runai_streamer streams from S3"),
    ("runai-sharded-needs-storage-s3", manifest(source={"uri": "s3://models/qwen"},
                                               format={"type": "runai_streamer_sharded", "tensorParallelSize": 2}),
     "spec.storage.s3", "required when format.type is runai_streamer_sharded"),
    ("runai-sharded-needs-pvc", manifest(format={"type": "runai_streamer_sharded", "tensorParallelSize": 2},
                                         storage={"s3": {"uri": "s3://bucket/x"}}),
     "spec.storage.pvc", "the checkpoint is fetched to the claim first"),
    ("runai-sharded-old-vllm", manifest(format={"type": "runai_streamer_sharded", "vllmVersion": "0.31"},
                                        storage={"pvc": {"size": "1Gi"}, "s3": {"uri": "s3://bucket/x"}}),
     "spec.format.vllmVersion", "runai_streamer_sharded needs vllmVersion >= 0.32"),
    ("runai-sharded-no-streamer-options", manifest(
        format={"type": "runai_streamer_sharded", "runaiStreamer": {"concurrency": 4}},
        storage={"pvc": {"size": "1Gi"}, "s3": {"uri": "s3://bucket/x"}}),
     "spec.format.runaiStreamer", "only valid when format.type is runai_streamer"),
    ("tensorizer-options-wrong-format", with_("format.tensorizer", {"numReaders": 2}), "spec.format.tensorizer",
     "only valid when format.type is tensorizer"),
    ("deployment-name", with_("serving.deployments", [{"name": "Llama_VLLM"}]), "spec.serving.deployments[0].name",
     "Llama_VLLM"),
    ("deployment-duplicate", with_("serving.deployments", [{"name": "a"}, {"name": "a", "container": "c"}]),
     "spec.serving.deployments[1]", "uplicate"),
    ("container-name", with_("serving.deployments", [{"name": "a", "container": "vLLM"}]),
     "spec.serving.deployments[0].container", "vLLM"),
    ("deletion-policy", with_("deletionPolicy", "Keep"), "spec.deletionPolicy", "Keep"),
    ("missing-source", with_("source", None), "spec.source", "equired"),
    ("secret-name", with_("source.credentialsSecretRef", {"name": "HF Token"}), "spec.source.credentialsSecretRef.name",
     "HF Token"),
    ("s3-endpoint", manifest(format={"type": "tensorizer"}, storage={"s3": {"uri": "s3://b1/x", "endpoint": "minio:9000"}}),
     "spec.storage.s3.endpoint", "minio:9000"),
    ("s3-endpoint-userinfo", manifest(format={"type": "tensorizer"},
                                      storage={"pvc": {"size": "1Gi"},
                                               "s3": {"uri": "s3://b1/x", "endpoint": "http://ak:sk@minio:9000"}}),
     "spec.storage.s3.endpoint", "must not carry credentials"),
    ("pp-old-vllm", with_("format.pipelineParallelSize", 2, with_("format.vllmVersion", "0.31")),
     "spec.format.pipelineParallelSize", "vllmVersion >= 0.32"),
    ("unknown-field", with_("formatt", {"type": "safetensors"}), "spec.formatt", "unknown field"),
    ("expert-parallel-tp1", with_("format", {"type": "sharded_state", "tensorParallelSize": 1,
                                             "pipelineParallelSize": 2, "expertParallel": True}),
     "spec.format.expertParallel", "expertParallel needs tensorParallelSize > 1"),
    ("expert-placement-without-ep", with_("format.expertPlacement", "round_robin"), "spec.format.expertPlacement",
     "expertPlacement other than linear needs expertParallel"),
    ("expert-placement-enum", with_("format.expertPlacement", "random"), "spec.format.expertPlacement", "random"),
    ("target-enum", with_("format.target", "h100"), "spec.format.target", "h100"),
    ("expert-parallel-not-bool", with_("format.expertParallel", "yes"), "spec.format.expertParallel", "boolean"),
]
