"""`ferry load`: command-line wiring for the serving-side loader."""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

log = logging.getLogger("ferry")


def add_load_commands(subparsers: argparse._SubParsersAction) -> None:
    from ..cli_args import parse_size, positive_int

    load = subparsers.add_parser(
        "load", help="verify and prefetch a prepared artifact for the ranks a serving pod runs, and report it",
        description="Verify the files ARTIFACT's manifest lists for these ranks (sizes, then sha256 of every byte), "
                    "read them in parallel so vLLM's reads hit the page cache, and, in a serving pod Ferry wired, "
                    "set the pod condition ferry.dev/weights-loaded. Exit 0: loaded; 2: a file is missing, "
                    "truncated or corrupt (named); 1: anything else.",
    )
    load.add_argument("--artifact", required=True, metavar="DIR|s3://bucket/prefix")
    load.add_argument("--ranks", type=_ranks, metavar="N,N,...",
                      help="global ranks (pp_rank * TP + tp_rank) this pod serves (default: every rank of the "
                           "artifact, the whole TP x PP group of a single-node pod)")
    load.add_argument("--verify", choices=("full", "size"), default="full",
                      help="full: sha256 of every byte (default); size: sizes only (the bytes are still read)")
    load.add_argument("--expected-digest", metavar="sha256:HEX",
                      help="the manifest digest the pod was wired for; another manifest is refused")
    load.add_argument("--copy-to", type=Path, metavar="DIR",
                      help="also copy the files (and the manifest, last) to DIR, e.g. node-local disk")
    load.add_argument("--readers", type=positive_int, default=16, metavar="N",
                      help="threads reading file segments, over all files (default 16)")
    load.add_argument("--chunk-size", type=parse_size, default=8 << 20, metavar="SIZE",
                      help="bytes per read (default 8Mi)")
    load.add_argument("--no-report", action="store_true",
                      help="do not set the pod condition (the default outside a pod)")
    load.set_defaults(run=_load)


def _ranks(text: str) -> list[int]:
    try:
        ranks = [int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of ranks: {text!r}") from None
    if any(r < 0 for r in ranks):
        raise argparse.ArgumentTypeError(f"ranks are 0 or more: {text!r}")
    return ranks


def _load(args: argparse.Namespace) -> int:
    from ..manifest import IntegrityError
    from ..results import EXIT_INPUT, report_result
    from .reader import ReadOptions
    from .report import reporter_for
    from .run import LoadRequest, load
    from .selection import SelectionError

    request = LoadRequest(artifact=args.artifact, ranks=args.ranks, verify=args.verify,
                          expected_digest=args.expected_digest, copy_to=args.copy_to,
                          options=ReadOptions(readers=args.readers, chunk_size=args.chunk_size))
    try:
        result = load(request, reporter_for(args.no_report))
    except (IntegrityError, SelectionError) as e:
        # The artifact (or the ranks asked for) is wrong: loading again fails the same way.
        log.error("load failed: %s", e)
        report_result(f"load failed: {e}")
        return EXIT_INPUT
    log.info("%s", result.describe())
    print(result.describe())
    return 0
