"""Benchmark filling the node cache against `cp -r` + `sync` of the same bytes, in one run.

    .venv/bin/python bench/cache_bench.py [--workdir DIR] [--layers 5] [--tp 2] [--runs 3] [--source s3]

Generates a Llama-3-8B-shaped checkpoint (bench/shard_bench.py's; `--layers 5`
gives 4.28 GB), shards it with `ferry shard --tensor-parallel-size TP` (the
artifact a claim holds), then times, alternating and each from a cold page
cache when the kernel lets us drop it:

- `cp -r` of the artifact followed by `sync` (the cache fsyncs every file
  before it publishes it, so the baseline does too);
- `ferry cache fill`: the agent's own fill path (store.fill): every file
  copied and verified block by block as it is written, then published;
- the fill-pod path as the node agent runs it: a slot made (store.slot),
  `ferry cache fill-slot` copying into it, then the agent taking the slot
  over and verifying every byte again before it publishes (store.adopt).

With `--source s3` the artifact is published (`ferry publish`) to the local
S3 server process (gofakes3 on loopback, its objects on this disk) and the
paths are:

- a plain download of every object with boto3's managed transfer (the same
  TransferConfig the fill uses), then `sync`: the baseline;
- the fill-pod path from S3: `ferry cache fill-slot --source s3://...` (each
  ETag checked, each object downloaded, then read back against the
  manifest) into a slot, then the agent's adoption as above.

Reports medians and the ratios baseline / path. Everything it writes is
removed at the end.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e" / "s3"))
from cache_state import try_drop_page_cache  # noqa: E402
from shard_bench import write_checkpoint  # noqa: E402

FERRY = Path(sys.executable).with_name("ferry")


def timed(fn) -> float:
    cold = try_drop_page_cache()
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    if not cold:
        print("  (page cache not dropped: not root)", file=sys.stderr)
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--source", choices=("claim", "s3"), default="claim",
                    help="fill from a directory (a claim's), or from an S3 prefix (the local S3 server)")
    args = ap.parse_args()

    from ferry_worker.cache.fill_slot import fill_slot
    from ferry_worker.cache.store import CacheStore, Watermarks, cache_key
    from ferry_worker.manifest import manifest_digest

    work = Path(tempfile.mkdtemp(prefix="ferry-cache-bench-", dir=args.workdir))
    try:
        checkpoint, artifact = work / "checkpoint", work / "artifact"
        size = write_checkpoint(checkpoint, args.layers)
        subprocess.run([str(FERRY), "shard", "--source", str(checkpoint), "--output", str(artifact),
                        "--tensor-parallel-size", str(args.tp)], check=True, capture_output=True)
        shutil.rmtree(checkpoint)
        digest = manifest_digest(artifact)
        nbytes = sum(p.stat().st_size for p in artifact.rglob("*") if p.is_file())
        print(f"artifact: TP {args.tp}, {nbytes / 1e9:.2f} GB ({size / 1e9:.2f} GB checkpoint, {args.layers} layers)")
        marks = Watermarks(high=1 << 50, low=1 << 49)
        if args.source == "s3":
            return s3_bench(work, artifact, nbytes, marks, args.runs)
        times: dict[str, list[float]] = {"cp -r + sync": [], "ferry cache fill": [], "fill pod + adoption": []}

        def cp() -> None:
            subprocess.run(["cp", "-r", str(artifact), str(work / "copy")], check=True)
            subprocess.run(["sync"], check=True)

        def store_fill() -> None:
            CacheStore(work / "cache-a", marks).fill(artifact, digest)

        def pod_fill() -> None:
            store = CacheStore(work / "cache-b", marks)
            key = cache_key(digest)
            slot = store.slot(key, nbytes)
            fill_slot(slot, artifact, digest, None)
            store.adopt(key, nbytes)

        for run in range(args.runs):
            for name, fn in (("cp -r + sync", cp), ("ferry cache fill", store_fill), ("fill pod + adoption", pod_fill)):
                times[name].append(timed(fn))
                print(f"run {run + 1} {name}: {times[name][-1]:.2f} s")
            for leftover in ("copy", "cache-a", "cache-b"):
                remove_tree(work / leftover)
        report(times, nbytes, "cp + sync")
    finally:
        remove_tree(work)
    return 0


def report(times: dict[str, list[float]], nbytes: int, baseline: str) -> None:
    """The medians as a table, each against the first path (the baseline)."""
    base = statistics.median(next(iter(times.values())))
    print(f"\n| path | median s | GB/s | ({baseline}) / path |\n|---|---:|---:|---:|")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.2f} | {nbytes / 1e9 / median:.2f} | {base / median:.2f} |")


def s3_bench(work: Path, artifact: Path, nbytes: int, marks, runs: int) -> int:
    import hashlib
    import os

    from boto3.s3.transfer import TransferConfig
    from s3server import S3Server

    from ferry_worker.cache import s3_source
    from ferry_worker.cache.fill_slot import fill_slot
    from ferry_worker.cache.store import CacheStore, cache_key
    from ferry_worker.manifest import MANIFEST_NAME

    with S3Server(work / "s3") as server:
        os.environ.update(server.env())  # as a fill pod gets them from its Secret
        client = server.client()
        client.create_bucket(Bucket="bench")
        subprocess.run([str(FERRY), "publish", "--source", str(artifact), "--output", "s3://bench/artifact"],
                       check=True, capture_output=True)
        shutil.rmtree(artifact)
        manifest = client.get_object(Bucket="bench", Key=f"artifact/{MANIFEST_NAME}")["Body"].read()
        digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
        keys = [o["Key"] for o in client.list_objects_v2(Bucket="bench", Prefix="artifact/")["Contents"]]
        config = TransferConfig(multipart_threshold=s3_source.PART_BYTES, multipart_chunksize=s3_source.PART_BYTES,
                                max_concurrency=s3_source.CONCURRENCY)
        times: dict[str, list[float]] = {"boto3 download + sync": [], "fill pod from S3 + adoption": []}

        def download() -> None:
            for key in keys:
                dest = work / "download" / key
                dest.parent.mkdir(parents=True, exist_ok=True)
                client.download_file("bench", key, str(dest), Config=config)
            subprocess.run(["sync"], check=True)

        def pod_fill() -> None:
            store = CacheStore(work / "cache-s3", marks)
            key = cache_key(digest)
            fill_slot(store.slot(key, nbytes), "s3://bench/artifact", digest, None)
            store.adopt(key, nbytes)

        for run in range(runs):
            for name, fn in zip(times, (download, pod_fill)):
                times[name].append(timed(fn))
                print(f"run {run + 1} {name}: {times[name][-1]:.2f} s")
            for leftover in ("download", "cache-s3"):
                remove_tree(work / leftover)
    report(times, nbytes, "download + sync")
    return 0


def remove_tree(path: Path) -> None:
    """Remove a tree the cache made read-only."""
    if path.exists():
        subprocess.run(["chmod", "-R", "u+w", str(path)], check=False)
        shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
