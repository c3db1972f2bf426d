#!/usr/bin/env python3
"""Benchmark: `ferry fetch` from a local S3 server vs boto3's default `download_file`.

    .venv/bin/python bench/fetch_s3.py [--gib 2] [--shards 4] [--runs 3] [--workdir /tmp/ferry-bench]

Generates a safetensors checkpoint of --gib GiB (--shards files with valid
headers and random data, plus config and index), uploads it to gofakes3 on
loopback (e2e/s3) the way boto3 uploads by default (single PUTs, CRC32
checksum; --upload-checksum SHA256 for stores that advertise sha256), then
alternates, --runs times:

- baseline: one process downloading every object with `boto3` `download_file`
  and its default TransferConfig (10 threads, 8 MiB parts), no verification;
- ferry: `ferry fetch` of the same prefix with default options, which also
  computes sha256, checks each object against its advertised checksum,
  validates every safetensors header, fsyncs and writes the manifest.

Both run as child processes, so wall time includes interpreter start-up and
CPU seconds (user+sys, from getrusage of children) include everything the
client does. The server's CPU is not counted for either. Each run starts
after `sync`, so no run pays for the previous one's writeback (the baseline
never fsyncs; Ferry's time includes making its files durable). Reports
medians, the ratio baseline/ferry (> 1: Ferry is faster) and CPU seconds per
GiB.

Note: gofakes3 returns an object's full-object checksum on ranged GETs too,
which botocore's default response validation would check against each part
and fail; the baseline therefore runs with response_checksum_validation=
"when_required" (everything else default). Ferry sets the same.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "e2e" / "s3"))

from s3server import S3Server  # noqa: E402

GiB = 1 << 30
CHUNK = 64 << 20
BUCKET = "bench"
PREFIX = "llama-bench"

BASELINE = """
import sys, boto3
from botocore.config import Config
out, bucket, keys = sys.argv[1], sys.argv[2], sys.argv[3:]
s3 = boto3.client("s3", config=Config(s3={"addressing_style": "path"}, response_checksum_validation="when_required"))
for key in keys:
    s3.download_file(bucket, key, f"{out}/{key.rsplit('/', 1)[-1]}")
"""


def write_shard(path: Path, name_prefix: str, nbytes: int, seed: int) -> str:
    """A valid safetensors file of ~nbytes (one U8 tensor per 64 MiB); returns its sha256."""
    import numpy as np

    tensors, offset = {}, 0
    while offset < nbytes:
        size = min(CHUNK, nbytes - offset)
        tensors[f"{name_prefix}.{len(tensors)}.weight"] = {"dtype": "U8", "shape": [size], "data_offsets": [offset, offset + size]}
        offset += size
    header = json.dumps(tensors).encode()
    header += b" " * (-len(header) % 8)
    rng = np.random.default_rng(seed)
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for block in (struct.pack("<Q", len(header)), header):
            f.write(block)
            digest.update(block)
        remaining = nbytes
        while remaining:
            block = rng.bytes(min(CHUNK, remaining))
            f.write(block)
            digest.update(block)
            remaining -= len(block)
    return digest.hexdigest()


def generate_and_upload(server: S3Server, scratch: Path, gib: float, shards: int, checksum: str) -> dict[str, str]:
    from boto3.s3.transfer import TransferConfig

    client = server.client()
    client.create_bucket(Bucket=BUCKET)
    single_put = TransferConfig(multipart_threshold=5 * GiB)  # keep gofakes3 from buffering multipart uploads
    upload_args = {"ChecksumAlgorithm": checksum}
    per_shard = int(gib * GiB) // shards
    expected, weight_map = {}, {}
    for i in range(1, shards + 1):
        name = f"model-{i:05d}-of-{shards:05d}.safetensors"
        path = scratch / name
        expected[name] = write_shard(path, f"model.layers.{i}", per_shard, seed=i)
        weight_map.update({f"model.layers.{i}.{j}.weight": name for j in range((per_shard + CHUNK - 1) // CHUNK)})
        client.upload_file(str(path), BUCKET, f"{PREFIX}/{name}", Config=single_put, ExtraArgs=upload_args)
        path.unlink()
        print(f"  uploaded {name} ({per_shard / GiB:.2f} GiB)", file=sys.stderr)
    small = {
        "config.json": json.dumps({"architectures": ["LlamaForCausalLM"]}).encode(),
        "model.safetensors.index.json": json.dumps({"metadata": {}, "weight_map": weight_map}).encode(),
    }
    for name, data in small.items():
        client.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{name}", Body=data, **upload_args)
        expected[name] = hashlib.sha256(data).hexdigest()
    return expected


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user+sys) of a child process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.0, help="checkpoint size (default 2)")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ferry-bench"))
    ap.add_argument("--ferry-arg", action="append", default=[], metavar="ARG",
                    help="extra `ferry fetch` argument, e.g. --ferry-arg=--concurrency=4 (repeatable)")
    ap.add_argument("--upload-checksum", choices=["CRC32", "SHA256"], default="CRC32",
                    help="checksum the objects are uploaded with (CRC32: boto3's default; SHA256: Ferry then "
                         "checks the sha256 it computes anyway)")
    args = ap.parse_args()

    shutil.rmtree(args.workdir, ignore_errors=True)
    scratch, out = args.workdir / "scratch", args.workdir / "out"
    scratch.mkdir(parents=True)
    free = shutil.disk_usage(args.workdir).free
    if free < 3.2 * args.gib * GiB:
        print(f"need ~{3.2 * args.gib:.1f} GiB free in {args.workdir}, have {free / GiB:.1f}", file=sys.stderr)
        return 1

    with S3Server(args.workdir / "s3") as server:
        print(f"generating {args.gib} GiB in {args.shards} shards", file=sys.stderr)
        expected = generate_and_upload(server, scratch, args.gib, args.shards, args.upload_checksum)
        total = sum(o["Size"] for o in server.client().list_objects_v2(Bucket=BUCKET, Prefix=PREFIX)["Contents"])
        env = {**os.environ, **server.env()}
        keys = [f"{PREFIX}/{name}" for name in sorted(expected)]
        baseline_argv = [sys.executable, "-c", BASELINE, str(out), BUCKET, *keys]
        ferry_argv = [sys.executable, "-m", "ferry_worker.cli", "fetch", "--source", f"s3://{BUCKET}/{PREFIX}",
                      "--output", str(out), *args.ferry_arg]
        results: dict[str, list[tuple[float, float]]] = {"baseline": [], "ferry": []}
        load_before = os.getloadavg()[0]
        for run in range(args.runs):
            for name, argv in (("baseline", baseline_argv), ("ferry", ferry_argv)):
                shutil.rmtree(out, ignore_errors=True)
                out.mkdir(parents=True)
                # Start every run with nothing left to write back: the baseline never
                # fsyncs, and its dirty pages must not land in the next run's time.
                os.sync()
                results[name].append(timed(argv, env))
                if name == "ferry":
                    manifest = json.loads((out / "ferry-manifest.json").read_bytes())
                    got = {f["path"]: f["sha256"] for f in manifest["files"]}
                    assert got == expected, "ferry's manifest disagrees with the generated checkpoint"
                wall, cpu = results[name][-1]
                print(f"  run {run + 1} {name}: {wall:.2f} s wall, {cpu:.2f} s CPU", file=sys.stderr)
    shutil.rmtree(args.workdir, ignore_errors=True)

    gib = total / GiB
    med = {name: (statistics.median(w for w, _ in r), statistics.median(c for _, c in r)) for name, r in results.items()}
    paired = statistics.median(b[0] / f[0] for b, f in zip(results["baseline"], results["ferry"]))
    print(f"\nFetch of {gib:.2f} GiB ({len(expected)} objects, uploaded with {args.upload_checksum}) from gofakes3 "
          f"on loopback, median of {args.runs} runs, "
          f"{os.cpu_count()} CPUs, load average {load_before:.1f} before / {os.getloadavg()[0]:.1f} after\n")
    print("| client | wall s | MiB/s | CPU s | CPU s / GiB |")
    print("|---|---:|---:|---:|---:|")
    checks = "sha256" if args.upload_checksum == "SHA256" else "sha256 + CRC32"
    labels = {"baseline": "boto3 download_file (default TransferConfig, no verification)",
              "ferry": f"ferry fetch ({checks} + header validation + fsync + manifest)"}
    for name, (wall, cpu) in med.items():
        print(f"| {labels[name]} | {wall:.2f} | {total / wall / (1 << 20):.0f} | {cpu:.2f} | {cpu / gib:.2f} |")
    print(f"\nratio baseline/ferry (wall): **{med['baseline'][0] / med['ferry'][0]:.2f}** of the medians, "
          f"{paired:.2f} median of the per-run ratios (goal >= 1.0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
