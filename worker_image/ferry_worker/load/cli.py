"""`ferry load`: command-line wiring for the serving-side loader."""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

log = logging.getLogger("ferry")

GROUP_INDEX_ENV = "FERRY_GROUP_INDEX"  # what the operator passes as --group-index $(FERRY_GROUP_INDEX)


def add_load_commands(subparsers: argparse._SubParsersAction) -> None:
    from ..cli_args import parse_size, positive_int

    load = subparsers.add_parser(
        "load", help="verify and prefetch a prepared artifact for the ranks a serving pod runs, and report it",
        description="Verify the files ARTIFACT's manifest lists for these ranks (sizes, then sha256 of every byte), "
                    "read them in parallel so vLLM's reads hit the page cache, and, in a serving pod Ferry wired, "
                    "set the pod condition ferry.dev/weights-loaded. A pod of a multi-node serving group gives "
                    "--group-size and --group-index instead of --ranks. Exit 0: loaded; 2: a file is missing, "
                    "truncated or corrupt (named), or the ranks or group position do not fit the artifact; "
                    "1: anything else.",
    )
    load.add_argument("--artifact", required=True, metavar="DIR|s3://bucket/prefix")
    load.add_argument("--ranks", type=_ranks, metavar="N,N,...",
                      help="global ranks (pp_rank * TP + tp_rank) this pod serves (default: every rank of the "
                           "artifact, the whole TP x PP group of a single-node pod)")
    load.add_argument("--group-size", type=positive_int, default=1, metavar="G",
                      help="pods in this pod's multi-node serving group (a LeaderWorkerSet group, a StatefulSet; "
                           "default 1). Pod I serves the ranks `vllm serve --nnodes G --node-rank I` gives it: "
                           "[I*k, (I+1)*k), k = TP*PP/G (PP 2 over 2 pods: pod I is pipeline stage I). A format "
                           "without per-rank files is read whole by every pod. Not with --ranks")
    load.add_argument("--group-index", metavar="I",
                      help="this pod's index in its group, 0..G-1 (required with --group-size > 1); in a pod "
                           f"template, $({GROUP_INDEX_ENV}) with the env var set from the pod's index label")
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
    load.add_argument("--compiled-store", metavar="DIR|s3://BUCKET/PREFIX",
                      help="after the weights, restore vLLM's compiled state STORE/KEY/<device kind> (verified in "
                           "full, else nothing) into --compiled-to; its outcome joins the pod condition's message")
    load.add_argument("--compiled-key", metavar="KEY", help="with --compiled-store: this pod's configuration")
    load.add_argument("--compiled-to", type=Path, metavar="DIR", help="with --compiled-store: VLLM_CACHE_ROOT")
    load.add_argument("--no-report", action="store_true",
                      help="do not set the pod condition (the default outside a pod)")
    load.set_defaults(run=_load, load_parser=load)


def _compiled(args: argparse.Namespace) -> tuple[str, str, Path] | None:
    given = [args.compiled_store, args.compiled_key, args.compiled_to]
    if not any(given):
        return None
    if not all(given):
        args.load_parser.error("--compiled-store, --compiled-key and --compiled-to go together")
    return args.compiled_store, args.compiled_key, args.compiled_to


def _ranks(text: str) -> list[int]:
    try:
        ranks = [int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of ranks: {text!r}") from None
    if any(r < 0 for r in ranks):
        raise argparse.ArgumentTypeError(f"ranks are 0 or more: {text!r}")
    return ranks


def _check_group_arguments(args: argparse.Namespace) -> None:
    """Usage errors (argparse's exit 2): --ranks or a group position, and a group's pods need their index."""
    parser: argparse.ArgumentParser = args.load_parser
    grouped = args.group_size != 1 or args.group_index is not None
    if args.ranks is not None and grouped:
        parser.error("--ranks and --group-size/--group-index are mutually exclusive: give a pod of a multi-node "
                     "group its --group-size and --group-index (its ranks follow), or its --ranks, not both")
    if args.group_size > 1 and args.group_index is None:
        parser.error(f"--group-size {args.group_size} needs --group-index (this pod's index in the group, "
                     f"0..{args.group_size - 1}; in a pod template $({GROUP_INDEX_ENV}))")


def _load(args: argparse.Namespace) -> int:
    from ..manifest import IntegrityError
    from ..results import EXIT_INPUT, report_result
    from .reader import ReadOptions
    from .report import reporter_for
    from .run import LoadRequest, load, report_failure
    from .selection import Group, SelectionError, parse_group_index

    _check_group_arguments(args)
    reporter = reporter_for(args.no_report)
    try:
        try:
            group = None if args.group_index is None else Group(args.group_size, parse_group_index(args.group_index))
        except SelectionError as e:  # refused before load() begins: the condition says why
            report_failure(reporter, e)
            raise
        request = LoadRequest(artifact=args.artifact, ranks=args.ranks, group=group, verify=args.verify,
                              expected_digest=args.expected_digest, copy_to=args.copy_to,
                              options=ReadOptions(readers=args.readers, chunk_size=args.chunk_size),
                              compiled=_compiled(args))
        result = load(request, reporter)
    except (IntegrityError, SelectionError) as e:
        # The artifact (or the ranks or group position asked for) is wrong: loading again fails the same way.
        log.error("load failed: %s", e)
        report_result(f"load failed: {e}")
        return EXIT_INPUT
    log.info("%s", result.describe())
    print(result.describe())
    report_result(json.dumps(result.facts()))
    return 0
