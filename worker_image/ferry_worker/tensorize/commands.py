"""`ferry tensorize`, `ferry publish`, `ferry delete-artifact`: command-line wiring.

`add_tensorize_commands(subparsers)` adds them to the `ferry` parser, the way
`shard.cli.add_shard_commands` does; each reports its step result (the
manifest digest, size, file count and URI) through results.report_result.
Nothing heavy is imported here: torch and tensorizer load only when a
tensorize command runs.
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from ..cli_args import parse_size, positive_int
from ..results import report_result
from ..shard.cli import add_moe_arguments, moe_target
from ..shard.versions import DEFAULT_VLLM_VERSION
from .s3_client import DEFAULT_ATTEMPTS, DEFAULT_TIMEOUT_S, S3Options

log = logging.getLogger("ferry")
DEFAULT_PART_SIZE = 32 << 20


def add_tensorize_commands(subparsers: argparse._SubParsersAction) -> None:
    tensorize = subparsers.add_parser(
        "tensorize", help="write a safetensors checkpoint as tensorizer files to S3 or a directory (no GPU)",
        description="Serialize the checkpoint with tensorizer: --layout hf, one model.tensors in the checkpoint's "
                    "names (vLLM loads it through load_weights); --layout vllm, model-rank-%%03d.tensors with "
                    "vLLM's per-rank modules (cut like ferry shard). Config, generation config and tokenizer "
                    "files go next to them, ferry-manifest.json last. Serve with --load-format tensorizer and "
                    "tensorizer_uri = OUTPUT/<extra.tensorizerUri of the manifest>.",
    )
    tensorize.add_argument("--source", required=True, type=Path, metavar="DIR", help="Hugging Face checkpoint")
    tensorize.add_argument("--output", required=True, metavar="URI", help="s3://bucket/prefix or a directory")
    tensorize.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1, metavar="N")
    tensorize.add_argument("--layout", choices=("hf", "vllm"), default="hf",
                           help="hf: Hugging Face names, one file (TP 1); vllm: vLLM-tensorized, one file per rank")
    tensorize.add_argument("--vllm-version", default=DEFAULT_VLLM_VERSION, metavar="X.Y[.Z]",
                           help=f"vLLM release that will load the artifact (default {DEFAULT_VLLM_VERSION})")
    tensorize.add_argument("--encryption-key-file", type=Path, metavar="FILE",
                           help="32 raw key bytes: encrypt every tensor (vLLM: encryption_keyfile)")
    add_moe_arguments(tensorize)
    _store_options(tensorize)
    tensorize.set_defaults(run=_tensorize)

    publish = subparsers.add_parser(
        "publish", help="upload a prepared checkpoint directory to S3 (Run:ai streamer), verified",
        description="Upload every file of DIR (those its ferry-manifest.json lists, checked against it) to "
                    "s3://bucket/prefix, check each object, and write ferry-manifest.json last. Serve with "
                    "--model s3://bucket/prefix --load-format runai_streamer (or runai_streamer_sharded for a "
                    "ferry shard artifact).",
    )
    publish.add_argument("--source", required=True, type=Path, metavar="DIR")
    publish.add_argument("--output", required=True, metavar="URI", help="s3://bucket/prefix or a directory")
    _store_options(publish)
    publish.set_defaults(run=_publish)

    delete = subparsers.add_parser(
        "delete-artifact", help="delete exactly the objects of a ferry artifact (its manifest's, and an "
                                "unfinished run's), nothing else under the prefix")
    delete.add_argument("uri", metavar="URI", help="s3://bucket/prefix or a directory")
    delete.add_argument("--endpoint", metavar="URL", help="S3 endpoint (default: AWS_ENDPOINT_URL[_S3])")
    delete.set_defaults(run=_delete)


def add_endpoint_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", metavar="URL", help="S3 endpoint for s3:// URIs (default: AWS_ENDPOINT_URL[_S3])")


def _store_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", metavar="URL",
                        help="S3 endpoint (default: AWS_ENDPOINT_URL[_S3]; a custom endpoint means path-style)")
    parser.add_argument("--part-size", type=parse_size, default=DEFAULT_PART_SIZE, metavar="SIZE",
                        help="multipart part size, at least 5Mi (default 32Mi; larger when 10,000 parts would "
                             "not hold an object)")
    parser.add_argument("--concurrency", type=positive_int, default=4, metavar="N",
                        help="parts in flight per object (upload and read-back; default 4)")
    parser.add_argument("--attempts", type=positive_int, default=DEFAULT_ATTEMPTS, metavar="N",
                        help=f"tries per S3 request, retries of 5xx/timeouts/connection errors included "
                             f"(default {DEFAULT_ATTEMPTS})")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                        help=f"S3 connect and read timeout (default {DEFAULT_TIMEOUT_S:g})")


def s3_options(args: argparse.Namespace) -> S3Options:
    return S3Options(endpoint=getattr(args, "endpoint", None), attempts=getattr(args, "attempts", DEFAULT_ATTEMPTS),
                     timeout_s=getattr(args, "timeout", DEFAULT_TIMEOUT_S), concurrency=getattr(args, "concurrency", 4))


def _check_part_size(size: int) -> int:
    from .errors import ArtifactError
    from .s3_upload import MIN_PART_SIZE

    if size < MIN_PART_SIZE:
        raise ArtifactError(f"--part-size must be at least 5Mi (S3's minimum part size), got {size}")
    return size


def _tensorize(args: argparse.Namespace) -> int:
    from ..progress import Progress
    from ..sinks import default_sinks
    from .tensorize import TensorizeJob

    job = TensorizeJob.prepare(args.source, args.output, layout=args.layout, tp=args.tensor_parallel_size,
                               vllm_version=args.vllm_version, key_file=args.encryption_key_file,
                               s3=s3_options(args), part_size=_check_part_size(args.part_size),
                               moe=moe_target(args))
    with Progress("tensorize", job.total_bytes, default_sinks()) as progress:
        published = job.run(progress)
    log.info("%s: %s layout, TP %d, vLLM %s: %d files, %d bytes%s", published.uri, job.layout, job.tp,
             job.vllm_version, len(published.manifest.files), published.manifest.total_bytes,
             " (already complete)" if published.reused else "")
    return _report(published)


def _publish(args: argparse.Namespace) -> int:
    from ..progress import Progress
    from ..sinks import default_sinks
    from .publish import PublishJob

    job = PublishJob.prepare(args.source, args.output, s3=s3_options(args), part_size=_check_part_size(args.part_size))
    with Progress("publish", job.total_bytes, default_sinks()) as progress:
        published = job.run(progress)
    log.info("%s: %d files, %d bytes (%s)%s", published.uri, len(published.manifest.files),
             published.manifest.total_bytes, published.manifest.format,
             " (already complete)" if published.reused else "")
    return _report(published)


def _delete(args: argparse.Namespace) -> int:
    from .delete import delete_artifact

    deleted = delete_artifact(args.uri, s3_options(args))
    log.info("%s: deleted %d objects", deleted.uri, len(deleted.objects))
    report_result(json.dumps({"uri": deleted.uri, "deleted": len(deleted.objects)}))
    return 0


def _report(published) -> int:
    report_result(json.dumps(published.step_result()))
    print(published.digest)
    return 0
