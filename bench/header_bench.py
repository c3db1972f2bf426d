"""Benchmark safetensors header validation: it must grow linearly with the entries.

    .venv/bin/python bench/header_bench.py [--sizes 10000,20000,40000,80000] [--runs 3]

For each size N, times `validate_safetensors` (median of `--runs`) on two
headers of N one-byte tensors: a valid one, and a hostile one whose last entry
repeats the name of the one before it (the case that used to cost a scan of
every key per key: 20k entries 4.5 s, x4 per doubling). Prints the time per
size and the ratio to the previous size: linear work reads ~x2 per doubling.
Last, the time to refuse a header of 1,000,000 entries, past the entry cap.
Files go to a temporary directory, removed at the end.
"""
from __future__ import annotations

import argparse
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "worker_image"))
from ferry_worker.safetensors_header import (  # noqa: E402
    MAX_HEADER_ENTRIES, UnsafeSafetensorsError, validate_safetensors)


def header_file(path: Path, entries: int, *, duplicate_last: bool) -> Path:
    """`entries` U8[1] tensors back to back; optionally one more entry reusing the last name."""
    names = [f"model.layers.{i}.weight" for i in range(entries)]
    if duplicate_last:
        names.append(names[-1])
    body = ",".join(f'"{name}":{{"dtype":"U8","shape":[1],"data_offsets":[{i},{i + 1}]}}'
                    for i, name in enumerate(names))
    raw = ("{" + body + "}").encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * len(names))
    return path


def median_seconds(path: Path, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        try:
            validate_safetensors(path)
        except UnsafeSafetensorsError:
            pass  # the hostile header: refusing it is the work being timed
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,20000,40000,80000")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="ferry-header-bench-") as workdir:
        for label, duplicate in (("valid header", False), ("duplicate last key", True)):
            print(f"{label}:")
            previous = None
            for n in sizes:
                seconds = median_seconds(header_file(Path(workdir, "h.safetensors"), n, duplicate_last=duplicate),
                                         args.runs)
                ratio = f"x{seconds / previous:.2f}" if previous else "-"
                print(f"  {n:>7} entries  {seconds * 1000:8.1f} ms  {ratio}")
                previous = seconds
        capped = header_file(Path(workdir, "h.safetensors"), 1_000_000, duplicate_last=False)
        seconds = median_seconds(capped, 1)
        print(f"1,000,000 entries, refused at the cap of {MAX_HEADER_ENTRIES}: {seconds * 1000:.0f} ms")


if __name__ == "__main__":
    main()
