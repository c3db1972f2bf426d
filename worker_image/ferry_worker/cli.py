"""`ferry`: the worker CLI that prepare Jobs (and the local executor) run."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from . import __version__
from .cache.cli import add_cache_commands
from .compiled.cli import add_compiled_commands
from .fetch.cli import add_fetch_commands
from .results import EXIT_FAILED, EXIT_INPUT, is_input_error, report_result, step_result
from .load.cli import add_load_commands
from .shard.cli import add_shard_commands
from .tensorize.commands import add_tensorize_commands

__all__ = ["EXIT_FAILED", "EXIT_INPUT", "is_input_error", "main"]

log = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ferry", description=__doc__)
    ap.add_argument("--version", action="version", version=f"ferry {__version__}")
    commands = ap.add_subparsers(dest="command", title="commands")
    add_fetch_commands(commands)
    add_shard_commands(commands)
    add_load_commands(commands)
    add_tensorize_commands(commands)
    add_cache_commands(commands)
    add_compiled_commands(commands)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.command is None:
        ap.print_help()
        return 2
    # Ferry's own messages at INFO; libraries (httpx, botocore) only when they warn.
    logging.basicConfig(level=logging.WARNING, format="ferry: %(message)s", stream=sys.stderr)
    for name in ("ferry", "ferry_worker"):
        logging.getLogger(name).setLevel(logging.INFO)
    try:
        status = args.run(args)
    except Exception as e:  # noqa: BLE001 - every failure ends as one clear line and exit 1 or 2
        log.debug("details", exc_info=True)
        message = f"{args.command} failed: {e if str(e) else type(e).__name__}"
        log.error("%s", message)
        report_result(message)
        return EXIT_INPUT if is_input_error(e) else EXIT_FAILED
    if status == 0 and isinstance(getattr(args, "output", None), Path):
        report_result(json.dumps(step_result(args.output)))
    return status


if __name__ == "__main__":
    sys.exit(main())
