"""`ferry cache`: the node cache store from the command line: what the node
agent runs (`agent`), what a fill pod runs (`fill-slot`), and what an admin
uses to look at a node's cache."""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path


def add_cache_commands(subparsers: argparse._SubParsersAction) -> None:
    from ..load.cli import _ranks

    cache = subparsers.add_parser("cache", help="a node's weight cache: fill, check, list, pin, evict, agent",
                                  description="One verified copy per artifact (manifest digest) under --root.")
    cache.add_argument("--root", type=Path, default=Path("/var/lib/ferry/cache"),
                       help="the cache directory on node-local disk (default: the chart's, /var/lib/ferry/cache)")
    _limit_options(cache)
    actions = cache.add_subparsers(dest="action", required=True)
    fill = actions.add_parser("fill", help="fill (or find) the entry of an artifact, verified block by block")
    fill_slot = actions.add_parser("fill-slot", help="(in a fill pod) copy an artifact into the slot the "
                                                      "node agent mounted; the agent verifies and publishes it")
    fill_slot.add_argument("--slot", type=Path, required=True, help="where the slot is mounted")
    fill.add_argument("--source", type=Path, required=True, help="the artifact directory (a claim's)")
    fill_slot.add_argument("--source", required=True, metavar="DIR|s3://bucket/prefix",
                           help="the artifact: a directory (a claim's) or an S3 prefix Ferry published")
    for action in (fill, fill_slot):
        action.add_argument("--digest", required=True, metavar="sha256:HEX", help="its manifest digest")
        action.add_argument("--ranks", type=_ranks, metavar="N,N,...", help="only these ranks' files")
    for name, what in (("check", "verify every byte of an entry; a corrupt one is removed"),
                       ("pin", "keep an entry whatever the watermarks"), ("unpin", "let an entry be evicted again")):
        action = actions.add_parser(name, help=what)
        action.add_argument("--digest", required=True, metavar="sha256:HEX")
        action.add_argument("--ranks", type=_ranks, metavar="N,N,...")
    actions.add_parser("list", help="the entries, their sizes, holders and pins, as JSON")
    evict = actions.add_parser("evict", help="evict least recently used entries down to the low watermark, "
                                             "or the one entry --digest names (unless it is mounted)")
    evict.add_argument("--digest", metavar="sha256:HEX")
    evict.add_argument("--ranks", type=_ranks, metavar="N,N,...")
    agent = actions.add_parser("agent", help="the node agent: the CSI driver cache.ferry.dev, registered "
                                             "with this node's kubelet")
    _agent_options(agent)
    cache.set_defaults(run=_cache)


def _limit_options(cache: argparse.ArgumentParser) -> None:
    """The watermarks and the free disk the cache keeps, for every action."""
    cache.add_argument("--high", type=size_or_share, default="90%", metavar="SIZE|N%",
                       help="high watermark: a fill that would pass it evicts first, or is refused (default: "
                            "90%% of the filesystem)")
    cache.add_argument("--low", type=size_or_share, default="80%", metavar="SIZE|N%",
                       help="low watermark: eviction frees down to it (default: 80%% of the filesystem)")
    cache.add_argument("--eviction-hard", type=size_or_share, default="10%", metavar="SIZE|N%",
                       help="the kubelet's evictionHard nodefs.available on this disk: the cache keeps that "
                            "much free, plus --margin, whatever the watermarks (default: 10%%, the kubelet's)")
    cache.add_argument("--margin", type=size_or_share, default="2%", metavar="SIZE|N%",
                       help="free disk kept above --eviction-hard, for the other writers on it (default: 2%%)")


def _agent_options(agent: argparse.ArgumentParser) -> None:
    """The node agent's own options."""
    agent.add_argument("--kubelet-dir", type=Path, default=Path("/var/lib/kubelet"),
                       help="the kubelet's root directory, mounted at the same path (Bidirectional)")
    agent.add_argument("--node-name", required=True, help="this node's name (the pod's spec.nodeName)")
    agent.add_argument("--mount-wait", type=float, default=30.0, metavar="SECONDS",
                       help="how long a serving mount waits for a fill under way before it fails "
                            "(the kubelet retries it)")
    agent.add_argument("--namespace-share", type=size_or_share, default="0", metavar="SIZE|N%",
                       help="what one namespace's entries and fills may hold on the node (0: no limit); a fill "
                            "past it evicts only that namespace's idle entries, or is refused")
    agent.add_argument("--fill-reservation", type=float, default=4 * 3600.0, metavar="SECONDS",
                       help="how long a fill slot's declared bytes hold room (the operator's fill Job deadline "
                            "is capped the same)")
    agent.add_argument("--reverify-after", type=float, default=3600.0, metavar="SECONDS",
                       help="a serving mount verifies every byte of the entry unless it was verified less than "
                            "this long ago and its files are unchanged since (0: at every mount; the pod's "
                            "loader verifies what it reads either way; default 3600)")
    agent.add_argument("--scrub-every", type=float, default=86400.0, metavar="SECONDS",
                       help="read every byte of each entry not verified for this long again, one at a time: "
                            "a corrupt one is removed (0: never; default 86400)")


def size_or_share(text: str):
    """`90%` (a share of the cache's filesystem, resolved by `resolve`) or a size (`500Gi`, `0`)."""
    from ..cli_args import parse_size

    text = text.strip()
    if text.endswith("%"):
        try:
            share = float(text[:-1])
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a percentage: {text!r}") from None
        if not 0 <= share <= 100:
            raise argparse.ArgumentTypeError(f"a percentage must be within 0-100: {text!r}")
        return share / 100
    return 0 if text == "0" else parse_size(text)


def resolve(value, total: int) -> int:
    return int(value * total) if isinstance(value, float) else value


def open_store(args: argparse.Namespace):
    from .store import CacheStore, Watermarks

    args.root.mkdir(parents=True, exist_ok=True)
    total = shutil.disk_usage(args.root).total
    high = resolve(args.high, total)
    low = min(high, resolve(args.low, total))
    keep_free = resolve(args.eviction_hard, total) + resolve(args.margin, total)
    return CacheStore(args.root, Watermarks(high=high, low=low, keep_free=keep_free))


def _cache(args: argparse.Namespace) -> int:
    if args.action == "fill-slot":
        from ..results import report_result
        from .fill_slot import fill_slot

        outcome = fill_slot(args.slot, args.source, args.digest, args.ranks)
        print(outcome)
        report_result(outcome)  # the operator reads "already complete" as the node's proof of warmth
        return 0
    from .store import cache_key

    store = open_store(args)
    if args.action == "agent":
        from .csi.agent import serve

        from .store import Fairness

        store.reverify_after = args.reverify_after
        total = shutil.disk_usage(args.root).total
        store.fairness = Fairness(resolve(args.namespace_share, total), args.fill_reservation)
        return serve(store, args.kubelet_dir, args.node_name, args.mount_wait, args.scrub_every)
    if args.action == "fill":
        print(store.fill(args.source, args.digest, args.ranks))
    elif args.action == "check":
        store.check(cache_key(args.digest, args.ranks))
        print("ok")
    elif args.action in ("pin", "unpin"):
        store.pin(cache_key(args.digest, args.ranks), args.action == "pin")
    elif args.action == "evict":
        evicted = [store.remove(cache_key(args.digest, args.ranks))] if args.digest else store.evict()
        print(json.dumps({"evicted": evicted}))
    else:
        print(json.dumps(store.listing(), indent=1))
    return 0
