"""`ferry compiled harvest`: the serving pod's sidecar that keeps vLLM's compile caches once vLLM is healthy.
(The restore is `ferry load --compiled-store`, in the loader init container, before vLLM starts.)"""
from __future__ import annotations

import argparse
import functools
import logging
import signal
import ssl
import sys
import time
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
    harvest.add_argument("--store", required=True, metavar="DIR|s3://BUCKET/PREFIX",
                         help="the object's store: a directory of its claim, or its s3:// prefix (credentials "
                              "from the environment)")
    harvest.add_argument("--key", required=True)
    harvest.add_argument("--health-url", required=True, metavar="URL",
                         help="vLLM's /health: in this pod (loopback), or with --group-index its group "
                              "leader's, for a pod that serves no HTTP itself")
    harvest.add_argument("--group-index", metavar="I",
                         help="this pod's index in its multi-node serving group ($(FERRY_GROUP_INDEX)): it keeps "
                              "its own entry, <device kind>-node<I>, once the leader serves and vLLM's cache key "
                              "directory is in its own cache root")
    harvest.add_argument("--poll-seconds", type=float, default=5.0)
    harvest.add_argument("--once", action="store_true",
                         help="exit after the harvest instead of idling, 1 if the state was not kept (a warm-up "
                              "Job's one container)")
    harvest.set_defaults(run=_harvest)
    delete = subparsers.add_parser(
        "compiled-delete", help="delete an object's compiled state from S3 (its ModelWeights was deleted)",
        description="Delete every object under STORE, an s3:// prefix ending in /compiled, and abort its "
                    "unfinished uploads.")
    delete.add_argument("--store", required=True, metavar="s3://BUCKET/PREFIX/compiled")
    delete.set_defaults(run=_delete)


def _delete(args: argparse.Namespace) -> int:
    from .s3_store import delete_all

    deleted = delete_all(args.store)
    log.info("deleted %d objects under %s", deleted, args.store)
    print(f"deleted {deleted} objects under {args.store}", flush=True)
    return 0


@functools.cache
def _no_verify() -> ssl.SSLContext:
    """vLLM's TLS certificate names its Service, not 127.0.0.1 or a pod's name, and its CA is the user's: the
    harvest sends nothing and reads only the status code, so it does not verify the certificate (and loads no
    CA bundle). Made once, not at every poll."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    return context


def _healthy(url: str) -> bool:
    context = _no_verify() if url.startswith("https:") else None
    try:
        with urllib.request.urlopen(url, timeout=5, context=context) as response:  # noqa: S310 - _checked_url
            return response.status == 200
    except Exception:  # noqa: BLE001 - anything but a 200 (a refused connection, a garbled reply) is "not yet"
        return False


def _checked_url(url: str, grouped: bool) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--health-url {url!r}: expected http(s)://HOST:PORT/health")
    if parts.hostname not in LOOPBACK and not grouped:
        raise ValueError(f"--health-url {url!r}: only vLLM in this pod (http://127.0.0.1:PORT/health); a group "
                         f"leader's address goes with --group-index")
    return url


def _on_sigterm(once: bool):
    """The pod is ending: a sidecar goes at once (0). A warm-up Job's harvest fails (143), as it did when the
    kubelet's SIGKILL (137) ended it: a drained or preempted pod fails, so the Job's DisruptionTarget rule
    applies, and an interrupted warm-up never counts as Complete."""
    def handler(signum: int, frame: object) -> None:
        sys.exit(128 + signal.SIGTERM if once else 0)
    return handler


def _wait(args: argparse.Namespace) -> None:
    """Until vLLM serves (and, in a group, this pod's vLLM compiled something); says why once a minute."""
    from .state import vllm_keys

    said = 0.0
    while True:
        healthy = _healthy(args.health_url)
        compiled = args.group_index is None or bool(vllm_keys(args.cache_root))
        if healthy and compiled:
            return
        if time.monotonic() - said >= 60:
            said = time.monotonic()
            why = f"{args.health_url} does not answer 200 yet" if not healthy else \
                f"{args.cache_root}/torch_compile_cache holds no vLLM cache key yet"
            log.info("harvest waits: %s", why)
            print(f"harvest waits: {why}", flush=True)
        time.sleep(args.poll_seconds)


def _harvest(args: argparse.Namespace) -> int:
    from ..load.selection import parse_group_index
    from .s3_store import harvest_into
    from .state import checked_name, device_kind, entry_name

    # PID 1 of its container: without a handler the kernel drops SIGTERM, and the pod waits out its grace.
    signal.signal(signal.SIGTERM, _on_sigterm(args.once))
    checked_name(args.key, "--key")
    index = None if args.group_index is None else parse_group_index(args.group_index)
    _checked_url(args.health_url, index is not None)
    _wait(args)
    try:
        result = harvest_into(args.cache_root, args.store, args.key, entry_name(device_kind(), index))
        outcome, kept = result.describe(), result.state in ("published", "present")
    except Exception as e:  # noqa: BLE001 - a sidecar that exits is restarted, and the pod loses Ready meanwhile
        outcome, kept = f"compiled state not kept: {type(e).__name__}: {e}", False
    log.info("%s", outcome)
    print(outcome, flush=True)
    while not args.once:
        time.sleep(3600)
    return 0 if kept else 1
