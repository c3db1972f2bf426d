"""`ferry compiled harvest`: the serving pod's sidecar that keeps vLLM's compile caches once vLLM is healthy.
(The restore is `ferry load --compiled-store`, in the loader init container, before vLLM starts.)"""
from __future__ import annotations

import argparse
import logging
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

log = logging.getLogger("ferry")

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def add_compiled_commands(subparsers: argparse._SubParsersAction) -> None:
    harvest = subparsers.add_parser(
        "compiled-harvest", help="keep vLLM's compile caches once it serves (a serving pod's sidecar)",
        description="Wait until vLLM in this pod answers HEALTH_URL with 200, then publish CACHE_ROOT (vLLM's "
                    "VLLM_CACHE_ROOT) as STORE/KEY/<this node's device kind>, once: an entry already there is "
                    "left as it is. Then idle (a native sidecar that exits is restarted).",
    )
    harvest.add_argument("--cache-root", type=Path, required=True, metavar="DIR")
    harvest.add_argument("--store", type=Path, required=True, metavar="DIR")
    harvest.add_argument("--key", required=True)
    harvest.add_argument("--health-url", required=True, metavar="URL",
                         help="vLLM's /health in this pod (loopback only)")
    harvest.add_argument("--poll-seconds", type=float, default=5.0)
    harvest.add_argument("--once", action="store_true",
                         help="exit after the harvest instead of idling, 1 if the state was not kept (a warm-up "
                              "Job's one container)")
    harvest.set_defaults(run=_harvest)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 - loopback, checked
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _harvest(args: argparse.Namespace) -> int:
    from .state import checked_name, device_kind, harvest

    checked_name(args.key, "--key")
    parts = urlsplit(args.health_url)
    if parts.scheme not in ("http", "https") or parts.hostname not in LOOPBACK:
        raise ValueError(f"--health-url {args.health_url!r}: only vLLM in this pod (http://127.0.0.1:PORT/health)")
    while not _healthy(args.health_url):
        time.sleep(args.poll_seconds)
    try:
        result = harvest(args.cache_root, args.store, args.key, device_kind())
        outcome, kept = result.describe(), result.state in ("published", "present")
    except Exception as e:  # noqa: BLE001 - a sidecar that exits is restarted, and the pod loses Ready meanwhile
        outcome, kept = f"compiled state not kept: {type(e).__name__}: {e}", False
    log.info("%s", outcome)
    print(outcome, flush=True)
    while not args.once:
        time.sleep(3600)
    return 0 if kept else 1
