"""`ferry cache`: the node cache store from the command line (what the node
agent runs, and what an admin uses to look at a node's cache)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_cache_commands(subparsers: argparse._SubParsersAction) -> None:
    from ..cli_args import parse_size
    from ..load.cli import _ranks

    cache = subparsers.add_parser("cache", help="a node's weight cache: fill, check, list, pin, evict",
                                  description="One verified copy per artifact (manifest digest) under --root.")
    cache.add_argument("--root", type=Path, required=True, help="the cache directory (node-local disk)")
    cache.add_argument("--high", type=parse_size, default=None, metavar="SIZE",
                       help="high watermark: a fill that would pass it evicts first, or is refused (default: "
                            "90%% of the filesystem)")
    cache.add_argument("--low", type=parse_size, default=None, metavar="SIZE",
                       help="low watermark: eviction frees down to it (default: 80%% of the filesystem)")
    actions = cache.add_subparsers(dest="action", required=True)
    fill = actions.add_parser("fill", help="fill (or find) the entry of an artifact, verified block by block")
    fill.add_argument("--source", type=Path, required=True, help="the artifact directory (a claim's)")
    fill.add_argument("--digest", required=True, metavar="sha256:HEX", help="its manifest digest")
    fill.add_argument("--ranks", type=_ranks, metavar="N,N,...", help="only these ranks' files (sharded_state)")
    for name, what in (("check", "verify every byte of an entry; a corrupt one is removed"),
                       ("pin", "keep an entry whatever the watermarks"), ("unpin", "let an entry be evicted again")):
        action = actions.add_parser(name, help=what)
        action.add_argument("--digest", required=True, metavar="sha256:HEX")
        action.add_argument("--ranks", type=_ranks, metavar="N,N,...")
    actions.add_parser("list", help="the entries, their sizes, holders and pins, as JSON")
    actions.add_parser("evict", help="evict least recently used entries down to the low watermark")
    cache.set_defaults(run=_cache)


def _store(args: argparse.Namespace):
    import shutil

    from .store import CacheStore, Watermarks

    args.root.mkdir(parents=True, exist_ok=True)
    total = shutil.disk_usage(args.root).total
    high = args.high if args.high is not None else int(0.9 * total)
    low = args.low if args.low is not None else min(high, int(0.8 * total))
    return CacheStore(args.root, Watermarks(high=high, low=low))


def _cache(args: argparse.Namespace) -> int:
    from .store import cache_key

    store = _store(args)
    if args.action == "fill":
        print(store.fill(args.source, args.digest, args.ranks))
    elif args.action == "check":
        store.check(cache_key(args.digest, args.ranks))
        print("ok")
    elif args.action in ("pin", "unpin"):
        store.pin(cache_key(args.digest, args.ranks), args.action == "pin")
    elif args.action == "evict":
        print(json.dumps({"evicted": store.evict()}))
    else:
        print(json.dumps(store.listing(), indent=1))
    return 0
