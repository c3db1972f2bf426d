"""`ferry-operator`: run the operator, print the CRD, validate manifests offline."""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

import yaml


def _crd(args: argparse.Namespace) -> int:
    from .api.crd import crd_yaml

    text = crd_yaml()
    if args.output:
        for out in args.output:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def _validate(args: argparse.Namespace) -> int:
    from .api.validation import InvalidSpec, parse

    failed = 0
    for path in args.files:
        for doc in yaml.safe_load_all(Path(path).read_text()):
            if not doc or doc.get("kind") != "ModelWeights":
                continue
            name = doc.get("metadata", {}).get("name", "?")
            try:
                parse(doc)
                print(f"{path}: ModelWeights/{name}: valid")
            except InvalidSpec as exc:
                failed += 1
                for err in exc.errors:
                    print(f"{path}: ModelWeights/{name}: {err}", file=sys.stderr)
    return 1 if failed else 0


def _run(args: argparse.Namespace) -> int:
    import logging

    import kopf

    from .handlers import crds  # importing the package registers the handlers

    logging.basicConfig(level=os.environ.get("FERRY_LOG_LEVEL", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # kopf logs every timer run at INFO; Ferry logs what it does itself.
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    from .preflight import check

    problem = check(args.namespace or [])
    if problem:
        logging.getLogger("ferry_operator").error("%s", problem)
        print(f"ferry-operator: {problem}", file=sys.stderr)
        return 1
    settings = kopf.OperatorSettings()
    # Exact namespace names: nothing to follow, and listing namespaces is not granted (handlers/crds.py).
    settings.scanning.disabled = bool(args.namespace)
    kopf.run(
        settings=settings,
        stop_flag=crds.stop_flag(),
        standalone=args.standalone,
        clusterwide=not args.namespace,
        namespaces=args.namespace or [],
        liveness_endpoint=args.liveness,
    )
    if crds.restart_asked():  # an optional CRD came or went: start again, watching what is there
        os.execv(sys.executable, [sys.executable, "-m", "ferry_operator.cli", *args.argv])
    return 0


def _namespace(text: str) -> str:
    """--namespace takes a namespace's exact name: kopf's patterns (ml-*, !kube-system) would need the
    namespaces listed, which a namespaced operator may not do (handlers/crds.py)."""
    from .api.types import DNS1123_LABEL

    if len(text) > 63 or not re.fullmatch(DNS1123_LABEL, text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a namespace name (a DNS label: lowercase letters, "
                                         f"digits and '-'); list each watched namespace by its exact name")
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ferry-operator", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run the operator (kopf)")
    p.add_argument("--standalone", action="store_true", help="no peering: the only operator instance")
    p.add_argument("--namespace", action="append", type=_namespace,
                   help="watch this namespace, by its exact name (repeatable); default: all")
    p.add_argument("--all-namespaces", action="store_true", help="watch all namespaces (the default)")
    p.add_argument("--liveness", help="serve a liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    p.set_defaults(func=_run)
    p = sub.add_parser("crd", help="print (or write) the ModelWeights CRD generated from the API types")
    p.add_argument("-o", "--output", action="append", help="write to this file (repeatable)")
    p.set_defaults(func=_crd)
    p = sub.add_parser("validate", help="check ModelWeights manifests against the API rules, offline")
    p.add_argument("files", nargs="+")
    p.set_defaults(func=_validate)
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
