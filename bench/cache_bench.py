"""Benchmark filling the node cache against `cp -r` + `sync` of the same bytes, in one run.

    .venv/bin/python bench/cache_bench.py [--workdir DIR] [--layers 5] [--tp 2] [--runs 3]

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

Reports medians and the ratios (cp + sync) / path. Everything it writes is
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
        base = statistics.median(times["cp -r + sync"])
        print(f"\n| path | median s | GB/s | (cp + sync) / path |\n|---|---:|---:|---:|")
        for name, values in times.items():
            median = statistics.median(values)
            print(f"| {name} | {median:.2f} | {nbytes / 1e9 / median:.2f} | {base / median:.2f} |")
    finally:
        remove_tree(work)
    return 0


def remove_tree(path: Path) -> None:
    """Remove a tree the cache made read-only."""
    if path.exists():
        subprocess.run(["chmod", "-R", "u+w", str(path)], check=False)
        shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
