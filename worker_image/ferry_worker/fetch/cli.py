"""`ferry fetch` and `ferry verify`: command-line wiring for the fetcher.

`add_fetch_commands(subparsers)` adds both to the `ferry` parser; each sets
`run`, a function of the parsed arguments returning the exit status.
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from ..cli_args import parse_size, positive_int
from ..tensorize.commands import add_endpoint_option
from .transfer import default_concurrency

log = logging.getLogger(__name__)


def add_fetch_commands(subparsers: argparse._SubParsersAction) -> None:
    fetch = subparsers.add_parser(
        "fetch", help="fetch a checkpoint (vLLM's file selection), verified, with a manifest",
        description="Fetch the files vLLM would load from a checkpoint into DIR, verify them, "
                    "and write ferry-manifest.json last. Re-running resumes an interrupted fetch.",
    )
    fetch.add_argument("--source", required=True, metavar="URI",
                       help="hf://org/name, s3://bucket/prefix, file:///path or pvc://claim/path")
    fetch.add_argument("--output", required=True, type=Path, metavar="DIR")
    fetch.add_argument("--revision", help="Hub branch, tag or commit (hf:// only; default main)")
    fetch.add_argument("--allow-pattern", action="append", default=[], metavar="GLOB",
                       help="weight file pattern, tried in order, first match wins (replaces "
                            "*.safetensors, *.bin, *.pt); repeatable")
    fetch.add_argument("--ignore-pattern", action="append", default=[], metavar="GLOB",
                       help="skip matching files, on top of original/**/*; repeatable")
    fetch.add_argument("--concurrency", type=positive_int, default=default_concurrency(),
                       help="parallel ranged reads; for hf://, parallel file downloads (default: one per core, 2 to 16)")
    fetch.add_argument("--part-size", type=parse_size, default=32 << 20, metavar="SIZE",
                       help="bytes per ranged read (default 32Mi)")
    fetch.add_argument("--max-bandwidth", type=parse_size, metavar="SIZE",
                       help="cap on bytes per second over all transfers, e.g. 200M (hf:// excepted)")
    fetch.set_defaults(run=_fetch)

    verify = subparsers.add_parser("verify", help="re-check every file of a prepared directory (or S3 prefix) "
                                                  "against its manifest")
    verify.add_argument("directory", metavar="DIR|s3://bucket/prefix")
    add_endpoint_option(verify)
    verify.set_defaults(run=_verify)


def _fetch(args: argparse.Namespace) -> int:
    from ..sinks import default_sinks
    from .run import FetchRequest, fetch
    from .transfer import TransferOptions

    request = FetchRequest(
        source=args.source,
        output=args.output,
        revision=args.revision,
        allow_patterns=args.allow_pattern,
        ignore_patterns=args.ignore_pattern,
        options=TransferOptions(
            concurrency=args.concurrency, part_size=args.part_size, max_bandwidth=args.max_bandwidth
        ),
    )
    result = fetch(request, default_sinks())
    log.info("%d files, %d bytes from %s in %s", len(result.manifest.files), result.manifest.total_bytes,
             result.manifest.source, args.output)
    print(result.digest)
    return 0


def _verify(args: argparse.Namespace) -> int:
    if args.directory.startswith("s3://"):
        from ..tensorize.commands import s3_options
        from ..tensorize.verify import verify_artifact

        manifest = verify_artifact(args.directory, s3_options(args))
    else:
        from ..manifest import verify

        manifest = verify(Path(args.directory))
    log.info("%s: %d files, %d bytes verified", args.directory, len(manifest.files), manifest.total_bytes)
    return 0
