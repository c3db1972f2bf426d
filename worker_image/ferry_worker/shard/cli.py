"""`ferry shard` and `ferry unshard`: command-line wiring for the sharder.

`add_shard_commands(subparsers)` adds both to the `ferry` parser; each sets
`run`, a function of the parsed arguments returning the exit status.
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from ..cli_args import parse_size, positive_int
from .experts import DEFAULT_TARGET, PLACEMENTS, TARGETS, MoeTarget
from .versions import DEFAULT_MAX_PART_SIZE, DEFAULT_VLLM_VERSION

log = logging.getLogger("ferry")


def add_shard_commands(subparsers: argparse._SubParsersAction) -> None:
    shard = subparsers.add_parser(
        "shard", help="cut a safetensors checkpoint into vLLM sharded_state rank files (no GPU)",
        description="Write exactly the per-rank files vLLM's ShardedStateLoader expects for "
                    "--tensor-parallel-size/--pipeline-parallel-size and the target vLLM release, plus "
                    "config/tokenizer files and ferry-manifest.json (last). Serve with: vllm serve OUTPUT "
                    "--load-format sharded_state --tensor-parallel-size N [--pipeline-parallel-size M].",
    )
    shard.add_argument("--source", required=True, type=Path, metavar="DIR", help="Hugging Face checkpoint directory")
    shard.add_argument("--output", required=True, type=Path, metavar="DIR", help="empty or new directory")
    shard.add_argument("--tensor-parallel-size", "-tp", required=True, type=positive_int, metavar="N")
    shard.add_argument("--pipeline-parallel-size", "-pp", type=positive_int, default=1, metavar="M")
    shard.add_argument("--vllm-version", default=DEFAULT_VLLM_VERSION, metavar="X.Y[.Z]",
                       help=f"vLLM release that will load the artifact (default {DEFAULT_VLLM_VERSION})")
    shard.add_argument("--max-part-size", type=parse_size, default=DEFAULT_MAX_PART_SIZE, metavar="SIZE",
                       help="split a rank's tensors into parts of at most SIZE, as vLLM's saver does (default 5Gi)")
    shard.add_argument("--pp-layer-partition", type=_layer_partition, metavar="N,N,...",
                       help="layers per pipeline stage, when serving with VLLM_PP_LAYER_PARTITION set to the same")
    shard.add_argument("--jobs", type=positive_int, metavar="N", help="files written at once (default: cores, >= 2)")
    add_moe_arguments(shard)
    shard.set_defaults(run=_shard)

    rebuild = subparsers.add_parser(
        "unshard", help="rebuild the original tensors from a sharded_state artifact, checking every invariant",
        description="Verify ARTIFACT against its manifest and write OUTPUT/model.safetensors with the "
                    "checkpoint's tensors under their Hugging Face names, plus the companion files.",
    )
    rebuild.add_argument("artifact", type=Path, metavar="ARTIFACT")
    rebuild.add_argument("--output", required=True, type=Path, metavar="DIR")
    rebuild.set_defaults(run=_unshard)


def add_moe_arguments(parser: argparse.ArgumentParser) -> None:
    """How a MoE model's experts are cut (expert parallelism is refused for a dense model)."""
    parser.add_argument("--expert-parallel", action="store_true",
                        help="MoE: cut expert layers for vLLM's --enable-expert-parallel (whole experts per rank)")
    parser.add_argument("--expert-placement", choices=PLACEMENTS, default="linear",
                        help="MoE with --expert-parallel: vLLM's --expert-placement-strategy (default linear)")
    parser.add_argument("--target", choices=TARGETS, default=DEFAULT_TARGET,
                        help=f"GPU family of the serving pods, where vLLM's MoE layout depends on it "
                             f"(default {DEFAULT_TARGET})")


def moe_target(args: argparse.Namespace) -> MoeTarget:
    return MoeTarget(expert_parallel=args.expert_parallel, placement=args.expert_placement, gpu=args.target)


def _layer_partition(text: str) -> list[int]:
    try:
        return [int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of layer counts: {text!r}") from None


# The sharder (numpy) is imported when a command runs, not when the parser is
# built: `ferry load` in a serving pod's init container does not pay for it.
def _shard(args: argparse.Namespace) -> int:
    from ..progress import Progress
    from ..sinks import default_sinks
    from .job import ShardJob

    job = ShardJob.prepare(args.source, args.output, tp=args.tensor_parallel_size, pp=args.pipeline_parallel_size,
                           vllm_version=args.vllm_version, max_part_size=args.max_part_size,
                           pp_layer_partition=args.pp_layer_partition, moe=moe_target(args))
    with Progress("shard", job.total_bytes, default_sinks()) as progress:
        manifest = job.run(jobs=args.jobs, on_bytes=progress.advance)
    log.info("wrote %d files (%d bytes) to %s for vLLM %s, TP %d x PP %d", len(manifest.files),
             manifest.total_bytes, args.output, job.plan.vllm, job.plan.tp, job.plan.pp)
    return 0


def _unshard(args: argparse.Namespace) -> int:
    from .unshard import unshard

    manifest = unshard(args.artifact, args.output)
    log.info("rebuilt %s (%d bytes) in %s", manifest.files[0].path, manifest.files[0].size, args.output)
    return 0
