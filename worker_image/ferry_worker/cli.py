"""`ferry`: the worker CLI that prepare Jobs (and the local executor) run."""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from pathlib import Path

from . import __version__
from .transfer import default_concurrency
from .shard_cli import add_shard_commands
from .tensorize.commands import add_endpoint_option, add_tensorize_commands

log = logging.getLogger(__name__)

# Exit statuses. A prepare Job's podFailurePolicy fails the Job at once on
# EXIT_INPUT instead of retrying it (executors/jobs.py); argparse exits 2 on a
# usage error too.
EXIT_FAILED = 1  # may succeed on a retry: network, storage, a changed source, a crash
EXIT_INPUT = 2  # the source, the checkpoint or the arguments are wrong: the same command fails again

# Errors of huggingface_hub and S3 that are answers, not accidents (by class
# name / error code, so this module imports neither SDK).
_HUB_REFUSALS = {"RepositoryNotFoundError", "RevisionNotFoundError", "RemoteEntryNotFoundError", "DisabledRepoError"}
_S3_REFUSALS = {"NoSuchBucket", "InvalidBucketName", "AccessDenied", "AllAccessDisabled", "InvalidAccessKeyId",
                "SignatureDoesNotMatch"}

_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]i?)?B?$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4,
          "KI": 1 << 10, "MI": 1 << 20, "GI": 1 << 30, "TI": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from `123`, `64Mi`, `1.5G`, `100MB` (K/M/G/T: powers of 1000; Ki/Mi/Gi/Ti: of 1024)."""
    match = _SIZE.match(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 64Mi, 100M, 1G)")
    value = float(match.group(1)) * _UNITS[(match.group(2) or "").upper()]
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be at least 1 byte: {text!r}")
    return int(value)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ferry", description=__doc__)
    ap.add_argument("--version", action="version", version=f"ferry {__version__}")
    commands = ap.add_subparsers(dest="command", title="commands")

    fetch = commands.add_parser(
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
    fetch.add_argument("--concurrency", type=_positive_int, default=default_concurrency(),
                       help="parallel ranged reads; for hf://, parallel file downloads (default: one per core, 2 to 16)")
    fetch.add_argument("--part-size", type=parse_size, default=32 << 20, metavar="SIZE",
                       help="bytes per ranged read (default 32Mi)")
    fetch.add_argument("--max-bandwidth", type=parse_size, metavar="SIZE",
                       help="cap on bytes per second over all transfers, e.g. 200M (hf:// excepted)")
    fetch.set_defaults(run=_fetch)

    verify = commands.add_parser("verify", help="re-check every file of a prepared directory (or S3 prefix) "
                                                "against its manifest")
    verify.add_argument("directory", metavar="DIR|s3://bucket/prefix")
    add_endpoint_option(verify)
    verify.set_defaults(run=_verify)
    add_shard_commands(commands)
    add_tensorize_commands(commands)
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


def is_input_error(error: BaseException) -> bool:
    """Whether `error` (or what it wraps) says the input is wrong, so a retry would fail the same way."""
    from .paths import UnsafePathError
    from .safetensors_header import UnsafeSafetensorsError
    from .selection import BadIndexError, NoWeightsError
    from .shard_model import ShardError
    from .sources.base import BadSourceError
    from .tensorize.errors import ArtifactError

    deterministic = (BadSourceError, NoWeightsError, BadIndexError, UnsafePathError, UnsafeSafetensorsError, ShardError,
                     ArtifactError)
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, deterministic):
            return True
        if _HUB_REFUSALS & {c.__name__ for c in type(e).__mro__}:  # GatedRepoError is a RepositoryNotFoundError
            return True
        # botocore raises modeled errors (NoSuchBucket, ...) as ClientError subclasses.
        is_client_error = "ClientError" in {c.__name__ for c in type(e).__mro__}
        code = (getattr(e, "response", None) or {}).get("Error", {}).get("Code") if is_client_error else None
        if code in _S3_REFUSALS:
            return True
        e = e.__cause__
    return False


def step_result(directory: Path) -> dict:
    """What the operator learns about a finished step: the manifest's digest and size."""
    from .manifest import manifest_digest, read_manifest

    manifest = read_manifest(directory)
    return {"manifestDigest": manifest_digest(directory), "totalBytes": manifest.total_bytes,
            "files": len(manifest.files)}


def report_result(text: str) -> None:
    """Write a step's result where the executor reads it ($FERRY_RESULT_FILE: a
    Job's termination log, or a file of the local executor); a no-op otherwise."""
    path = os.environ.get("FERRY_RESULT_FILE")
    if path:
        # The kubelet keeps at most 4 KiB of a termination message.
        Path(path).write_text(text[:4000])


def _fetch(args: argparse.Namespace) -> int:
    from .fetch import FetchRequest, fetch
    from .progress import default_sinks
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
        from .tensorize.commands import s3_options
        from .tensorize.verify import verify_artifact

        manifest = verify_artifact(args.directory, s3_options(args))
    else:
        from .manifest import verify

        manifest = verify(Path(args.directory))
    log.info("%s: %d files, %d bytes verified", args.directory, len(manifest.files), manifest.total_bytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
