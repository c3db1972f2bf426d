"""`ferry`: the worker CLI that prepare Jobs (and the local executor) run."""
from __future__ import annotations

import argparse
import sys

from . import __version__


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ferry", description=__doc__)
    ap.add_argument("--version", action="version", version=f"ferry {__version__}")
    ap.add_subparsers(dest="command", title="commands")
    args = ap.parse_args(argv)
    if args.command is None:
        ap.print_help()
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
