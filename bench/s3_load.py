#!/usr/bin/env python3
"""Benchmark: stream-loading a checkpoint from a local S3 server into memory,
and uploading one, in the same run and the same cache state.

    .venv/bin/python bench/s3_load.py [--size 2Gi] [--repeat 3] [--cases runai,...] [--cold] [--check]
                                      [--preload] [--work /tmp/ferry-s3-bench] [--out result.json]

Needs the bench extra plus runai-model-streamer-s3 (the streamer's S3
backend, same version as runai-model-streamer; without it the streamer
refuses s3:// paths) and the tensorize extra (tensorizer, torch).

Starts the project's S3-compatible server (gofakes3, e2e/s3/s3server.py) on
127.0.0.1 with its filesystem backend under --work, generates (once; reused
while complete) a Llama-shaped BF16 checkpoint of at least --size bytes of
safetensors (bench/load_bench.py's generator: random bytes streamed to disk,
two or more files), and puts it in the server twice (once; reused):

- `ferry publish` -> s3://bench/KEY/hf/         (the HF layout, as vLLM's
  runai_streamer load format reads it);
- `ferry tensorize --layout hf` -> s3://bench/KEY/tensorized/model.tensors.

Load cases (each in a fresh Python child that imports everything and runs
its case twice on a tiny 1-layer model uploaded the same way: code paged in,
and the second run's time reported as the case's fixed cost; then it is
timed from the start of the load to the last tensor held in CPU memory, a
new client / stream / streamer included; every tensor is materialised and
kept alive, as a model's parameters are). That is a serving process's first
load; --preload times a second one instead (an untimed load of the whole
checkpoint first, in the same child):

  runai       Run:ai Model Streamer (runai-model-streamer + its -s3 backend)
              SafetensorsStreamer.stream_files over the s3:// URIs of the
              safetensors files; RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING=0,
              endpoint AWS_ENDPOINT_URL, credentials from AWS_ACCESS_KEY_ID /
              AWS_SECRET_ACCESS_KEY (the C++ AWS SDK's default chain),
              AWS_EC2_METADATA_DISABLED=true; its default concurrency;
  tensorizer  tensorizer's TensorDeserializer(lazy_load=False) over
              stream_io.open_stream(s3://.../model.tensors, s3_endpoint,
              explicit credentials, force_http for the http:// endpoint): a
              curl stream per reader, its default (dynamic) num_readers;
  boto3       the baseline: for each safetensors file in turn, boto3
              get_object (default client config) read whole into memory,
              then safetensors.torch.load(bytes).

Upload cases (child commands, wall-clock from spawn to exit, so interpreter
start-up and imports are included: each command's import floor is timed
and reported separately), each to a fresh prefix that is deleted after it:

  ferry_tensorize  `ferry tensorize --layout hf` of the local checkpoint:
                   reads the safetensors, serializes with tensorizer, uploads
                   32 MiB parts with Content-MD5 (4 in flight), then reads the
                   object back to compute its sha256, writes the manifest;
  ferry_publish    `ferry publish` of the same directory (sha256 + MD5 while
                   sending, header validation, manifest);
  boto3_upload     the baseline: boto3 upload_file of each safetensors file in
                   turn, default TransferConfig (8 MiB parts, 10 threads,
                   CRC32 part checksums), no verification, no manifest.

Within each repetition the cases run in an order rotated by one (load cases
first, then upload cases), so no case always follows the same one. Before
every measurement: `sync`, then, by default (warm), the files the case reads
are read once, untimed (the server's object files for load cases, the local
checkpoint for uploads); with --cold the page cache is dropped instead
(`echo 3 > /proc/sys/vm/drop_caches`, root). The server shares the machine's
CPUs with the client; its CPU seconds during each measurement are reported.

gofakes3 keeps every part of a multipart upload in memory and concatenates
them into one more buffer when the upload completes: a 2 GiB object costs
the server ~4 GiB of RAM for a moment, and the copy and its write to disk are
inside both upload cases' times.

`--check`: after each load is timed, the child also hashes every tensor
(name, dtype, shape, bytes); every case must give the same digest as the
local checkpoint read with safetensors.

Reports per case the median seconds, the tensor bytes, the object bytes
(what was fetched or stored), GB/s (1e9 tensor bytes per second for loads,
object bytes for uploads), the client's CPU seconds and peak RSS (loads), the
server's CPU seconds; ratios: boto3 s / runai s, boto3 s / tensorizer s,
boto3_upload s / ferry_tensorize s, boto3_upload s / ferry_publish s (> 1:
faster than the baseline), of the medians and the median of per-repetition
ratios. Prints a markdown table and JSON; writes the JSON to --out.

Disk: the checkpoint, two copies in the server and one upload at a time:
about 4x --size (~9 GB at 2Gi); other sizes' data in --work is removed first.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "e2e" / "s3"))
sys.path.insert(0, str(REPO / "worker_image"))
sys.path.insert(0, str(HERE))
from cache_state import drop_page_cache as _drop, read_through  # noqa: E402

BENCH_VERSION = 1  # part of the data key, with load_bench's GENERATOR_VERSION
BUCKET = "bench"
UPLOADS = "uploads"  # prefix of the upload cases' fresh prefixes
DISK_BUDGET = 10 * 10**9
LOAD_CASES = ("runai", "tensorizer", "boto3")
UPLOAD_CASES = ("ferry_tensorize", "ferry_publish", "boto3_upload")
ALL_CASES = LOAD_CASES + UPLOAD_CASES
LABELS = {
    "runai": "Run:ai streamer `SafetensorsStreamer` (s3:// safetensors files)",
    "tensorizer": "tensorizer `TensorDeserializer` (s3:// model.tensors, lazy_load=False)",
    "boto3": "baseline: boto3 `get_object` of each file whole + `safetensors.torch.load`",
    "ferry_tensorize": "`ferry tensorize --layout hf` (serialize + MD5 parts + read-back sha256 + manifest)",
    "ferry_publish": "`ferry publish` (sha256 + MD5 + header validation + manifest)",
    "boto3_upload": "baseline: boto3 `upload_file` of each safetensors file (default TransferConfig)",
}
RATIOS = (  # (name, numerator case, denominator case): > 1 means the denominator is faster
    ("load: boto3 s / Run:ai streamer s", "boto3", "runai"),
    ("load: boto3 s / tensorizer s", "boto3", "tensorizer"),
    ("load: tensorizer s / Run:ai streamer s", "tensorizer", "runai"),
    ("upload: boto3 upload_file s / ferry tensorize s", "boto3_upload", "ferry_tensorize"),
    ("upload: boto3 upload_file s / ferry publish s", "boto3_upload", "ferry_publish"),
)
RUNAI_ENV = {"RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0", "AWS_EC2_METADATA_DISABLED": "true"}


def log(message: str) -> None:
    print(f"[s3_load] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the child (one load case)


def child_imports(case: str) -> None:
    """What a serving process has loaded before it loads weights."""
    import torch  # noqa: F401
    import safetensors.torch  # noqa: F401

    if case == "runai":
        import runai_model_streamer  # noqa: F401
        from runai_model_streamer.s3_utils.s3_utils import get_s3_credentials_module

        if get_s3_credentials_module() is None:
            raise SystemExit("runai: runai-model-streamer has no S3 backend: pip install runai-model-streamer-s3 "
                             "(the same version as runai-model-streamer)")
    elif case == "tensorizer":
        import tensorizer  # noqa: F401
        import tensorizer.stream_io  # noqa: F401
    elif case == "boto3":
        import boto3  # noqa: F401
    else:
        raise ValueError(case)


def load_runai(target: dict) -> tuple[dict, dict]:
    from runai_model_streamer import SafetensorsStreamer

    out = {}
    with SafetensorsStreamer() as streamer:
        streamer.stream_files(target["uris"], device="cpu")
        for name, tensor in streamer.get_tensors():  # owned tensors: valid while held
            out[name] = tensor
    return out, {}


def load_tensorizer(target: dict) -> tuple[dict, dict]:
    from tensorizer import TensorDeserializer
    from tensorizer.stream_io import open_stream

    endpoint = os.environ["AWS_ENDPOINT_URL"]
    stream = open_stream(target["uri"], "rb", s3_access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
                         s3_secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"], s3_endpoint=endpoint,
                         force_http=endpoint.startswith("http://"))
    with stream, TensorDeserializer(stream, device="cpu", lazy_load=False) as deserializer:
        out = dict(deserializer.items())  # lazy_load=False: all read in the constructor
        readers = deserializer._num_readers
    return out, {"numReaders": readers}


def load_boto3(target: dict) -> tuple[dict, dict]:
    import boto3
    from safetensors.torch import load

    client = boto3.session.Session().client("s3")  # endpoint, credentials, region from the environment
    out = {}
    for key in target["keys"]:
        data = client.get_object(Bucket=target["bucket"], Key=key)["Body"].read()
        out.update(load(data))
        del data
    return out, {}


LOADERS = {"runai": load_runai, "tensorizer": load_tensorizer, "boto3": load_boto3}


def tensor_digest(tensors: dict) -> str:
    import torch

    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous()
        digest.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        if t.numel():
            digest.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return digest.hexdigest()


def read_bytes() -> int:
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def child_main(spec: dict) -> int:
    """`s3_load.py --child JSON`: import, warm up on the tiny model, print `ready`,
    wait for a line on stdin, time the case, print one JSON line."""
    case = spec["case"]
    child_imports(case)
    loader = LOADERS[case]
    start = time.perf_counter()
    warm, _ = loader(spec["warmup"])  # pages the code in, initialises lazily-built state
    warmup_seconds = time.perf_counter() - start
    del warm
    start = time.perf_counter()
    warm, _ = loader(spec["warmup"])  # again: the fixed cost of one load (client, streams, threads)
    fixed_seconds = time.perf_counter() - start
    del warm
    preload_seconds = None
    if spec.get("preload"):  # --preload: one untimed load of the checkpoint itself first
        start = time.perf_counter()
        warm, _ = loader(spec["target"])
        preload_seconds = time.perf_counter() - start
        del warm
    print("ready", flush=True)
    if not sys.stdin.readline():
        return 1
    usage0, io0 = resource.getrusage(resource.RUSAGE_SELF), read_bytes()
    start = time.perf_counter()
    tensors, extra = loader(spec["target"])
    seconds = time.perf_counter() - start
    usage1 = resource.getrusage(resource.RUSAGE_SELF)
    result = {
        "seconds": seconds,
        "cpuSeconds": (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime),
        "peakRssBytes": usage1.ru_maxrss * 1024,
        "readBytes": read_bytes() - io0,
        "tensors": len(tensors),
        "tensorBytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        "firstWarmupSeconds": warmup_seconds,
        "tinyLoadSeconds": fixed_seconds,
        **({"preloadSeconds": preload_seconds} if preload_seconds is not None else {}),
        **extra,
    }
    if spec.get("check"):
        result["digest"] = tensor_digest(tensors)
    print(json.dumps(result), flush=True)
    return 0


# ---------------------------------------------------------------- the data


@dataclass(frozen=True)
class Dataset:
    name: str  # also its S3 prefix: s3://bench/NAME/hf, s3://bench/NAME/tensorized
    root: Path
    config: dict

    @property
    def checkpoint(self) -> Path:
        return self.root / "checkpoint"

    @property
    def marker(self) -> Path:
        return self.root / "bench-data.json"  # outside the checkpoint: not published

    def weight_files(self) -> list[Path]:
        index = json.loads((self.checkpoint / "model.safetensors.index.json").read_text())
        return [self.checkpoint / f for f in sorted(set(index["weight_map"].values()))]

    def weight_bytes(self) -> int:
        return 2 * sum(math.prod(s) for s in _load_bench().tensor_shapes(self.config).values())

    @property
    def hf_prefix(self) -> str:
        return f"{self.name}/hf"

    @property
    def tensorized_prefix(self) -> str:
        return f"{self.name}/tensorized"


def _load_bench():
    import load_bench  # bench/load_bench.py: llama_config, tensor_shapes, write_checkpoint

    return load_bench


def dataset_for(work: Path, kind: str, size: int, config: dict) -> Dataset:
    lb = _load_bench()
    key = hashlib.sha256(json.dumps([BENCH_VERSION, lb.GENERATOR_VERSION, size, config],
                                    sort_keys=True).encode()).hexdigest()[:12]
    name = f"{kind}-{key}"
    return Dataset(name, work / name, config)


def ensure_checkpoint(data: Dataset) -> bool:
    """The generated checkpoint; True when it was (re)written now."""
    if data.marker.is_file():
        return False
    if data.root.exists():
        shutil.rmtree(data.root)
    log(f"writing a checkpoint ({data.config['num_hidden_layers']} layers, hidden {data.config['hidden_size']}, "
        f"{data.weight_bytes() / 1e9:.2f} GB) to {data.checkpoint}")
    _load_bench().write_checkpoint(data.checkpoint, data.config)
    data.marker.write_text(json.dumps({"config": data.config}))
    return True


def list_objects(client, prefix: str = "") -> list[dict]:
    objects = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        objects += page.get("Contents", [])
    return objects


def delete_objects(client, objects: list[dict], uploads_under: str | None = None) -> None:
    """Delete these objects, and abort unfinished multipart uploads of keys under `uploads_under`
    ("" for every key): gofakes3 keeps their parts in memory."""
    for i in range(0, len(objects), 1000):
        client.delete_objects(Bucket=BUCKET, Delete={"Objects": [{"Key": o["Key"]} for o in objects[i:i + 1000]]})
    if uploads_under is None:
        return
    try:
        uploads = client.list_multipart_uploads(Bucket=BUCKET, Prefix=uploads_under).get("Uploads", [])
    except client.exceptions.NoSuchUpload:  # gofakes3's answer when there are none
        uploads = []
    for upload in uploads:
        client.abort_multipart_upload(Bucket=BUCKET, Key=upload["Key"], UploadId=upload["UploadId"])


def remove_stale(work: Path, client, keep: list[Dataset]) -> None:
    """Other sizes' checkpoints and objects, and leftovers of interrupted upload cases."""
    names = {d.name for d in keep}
    for path in work.iterdir():
        if path.is_dir() and path.name.split("-")[0] in ("llama", "warmup") and path.name not in names:
            log(f"removing {path} (another size)")
            shutil.rmtree(path)
    stale = [o for o in list_objects(client) if o["Key"].split("/", 1)[0] not in names]
    if stale:
        log(f"deleting {len(stale)} objects of other sizes or interrupted upload cases from the server")
        delete_objects(client, stale)
    delete_objects(client, [], uploads_under=UPLOADS + "/")


def ensure_uploaded(data: Dataset, client, ferry: str, env: dict, logs: Path) -> None:
    """The published and the tensorized copies (each complete once its ferry-manifest.json is there)."""
    for prefix, command in ((data.hf_prefix, ["publish"]), (data.tensorized_prefix, ["tensorize", "--layout", "hf"])):
        if any(o["Key"] == f"{prefix}/ferry-manifest.json" for o in list_objects(client, prefix + "/")):
            continue
        log(f"ferry {' '.join(command)} -> s3://{BUCKET}/{prefix}")
        run_logged([ferry, *command, "--source", str(data.checkpoint), "--output", f"s3://{BUCKET}/{prefix}"],
                   env, logs / f"setup-{data.name}-{command[0]}.log")


def run_logged(argv: list[str], env: dict, log_path: Path, timeout: float | None = None) -> float:
    with open(log_path, "wb") as out:
        start = time.perf_counter()
        rc = subprocess.run(argv, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout).returncode
        seconds = time.perf_counter() - start
    if rc:
        raise SystemExit(f"{' '.join(argv[:3])}... exited {rc}:\n{log_path.read_text()[-3000:]}")
    return seconds


# ---------------------------------------------------------------- measuring


def prepare(files: list[Path], cold: bool) -> None:
    if cold:
        drop_page_cache()
    else:
        os.sync()  # no writeback of an earlier case's objects inside this one
        read_through(files)


class Server:
    """The S3Server helper, plus its CPU seconds and the files behind its objects."""

    def __init__(self, root: Path) -> None:
        from s3server import S3Server

        self.helper = S3Server(root, backend="fs", host="127.0.0.1")
        self.root = root

    def __enter__(self) -> "Server":
        self.helper.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.helper.stop()

    def env(self) -> dict[str, str]:
        return self.helper.env()

    def client(self):
        return self.helper.client()

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.helper.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime

    def object_file(self, key: str) -> Path:
        """gofakes3's fs backend keeps each object as data/buckets/BUCKET/KEY (read to warm it)."""
        return self.root / "data" / "buckets" / BUCKET / key


@dataclass
class Case:
    key: str
    kind: str  # "load" | "upload"
    warm_files: list[Path]
    spec: dict | None = None  # load: the child's spec
    argv: list[str] | None = None  # upload: the command (OUTPUT replaced by the fresh URI)
    floor_argv: list[str] | None = None  # upload: the command's imports, no work
    env: dict = field(default_factory=dict)
    object_bytes: int = 0


def measure_load(case: Case, server: Server, cold: bool, timeout: float) -> dict:
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(case.spec)]
    child = subprocess.Popen(argv, env=case.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    watchdog = threading.Timer(timeout, child.kill)  # a stalled load fails instead of hanging the run
    watchdog.start()
    try:
        ready = child.stdout.readline().strip()
        if ready != "ready":
            raise SystemExit(f"{case.key}: the child did not start (exit {child.wait()}): {ready}")
        prepare(case.warm_files, cold)
        cpu0 = server.cpu_seconds()
        child.stdin.write("go\n")
        child.stdin.flush()
        line = child.stdout.readline()
        cpu1 = server.cpu_seconds()
        if child.wait() or not line:
            raise SystemExit(f"{case.key}: the child failed (exit {child.returncode})")
    finally:
        watchdog.cancel()
        if child.poll() is None:
            child.kill()
            child.wait()
    return {**json.loads(line), "serverCpuSeconds": cpu1 - cpu0, "objectBytes": case.object_bytes}


def measure_upload(case: Case, server: Server, cold: bool, rep: int, logs: Path, timeout: float) -> dict:
    client = server.client()
    prefix = f"{UPLOADS}/{case.key}-{rep}"
    delete_objects(client, list_objects(client, prefix + "/"), uploads_under=prefix + "/")
    argv = [a.replace("{OUTPUT}", prefix) for a in case.argv]
    prepare(case.warm_files, cold)
    floor = case.floor_argv
    subprocess.run(floor, env=case.env, check=True, stdout=subprocess.DEVNULL)  # reads the code in (--cold)
    start = time.perf_counter()
    subprocess.run(floor, env=case.env, check=True, stdout=subprocess.DEVNULL)
    floor_s = time.perf_counter() - start
    usage0, cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN), server.cpu_seconds()
    seconds = run_logged(argv, case.env, logs / f"{case.key}-{rep}.log", timeout)
    usage1, cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN), server.cpu_seconds()
    objects = list_objects(client, prefix + "/")
    stored = sum(o["Size"] for o in objects)
    delete_objects(client, objects)
    return {"seconds": seconds, "importFloorSeconds": floor_s, "objectBytes": stored, "objects": len(objects),
            "cpuSeconds": (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime),
            "serverCpuSeconds": cpu1 - cpu0}


def build_cases(keys: list[str], data: Dataset, warmup: Dataset, server: Server, ferry: str,
                check: bool, preload: bool) -> list[Case]:
    client = server.client()
    env = {**os.environ, **server.env()}
    files = [f.name for f in data.weight_files()]

    def targets(d: Dataset) -> dict:
        names = [f.name for f in d.weight_files()]
        return {
            "runai": {"uris": [f"s3://{BUCKET}/{d.hf_prefix}/{n}" for n in names]},
            "tensorizer": {"uri": f"s3://{BUCKET}/{d.tensorized_prefix}/model.tensors"},
            "boto3": {"bucket": BUCKET, "keys": [f"{d.hf_prefix}/{n}" for n in names]},
        }

    main_targets, warm_targets = targets(data), targets(warmup)
    sizes = {o["Key"]: o["Size"] for o in list_objects(client, data.name + "/")}
    hf_keys = [f"{data.hf_prefix}/{n}" for n in files]
    load_objects = {"runai": hf_keys, "boto3": hf_keys, "tensorizer": [f"{data.tensorized_prefix}/model.tensors"]}
    py = sys.executable
    upload_script = ("import sys, boto3\n"
                     "client = boto3.session.Session().client('s3')\n"
                     "bucket, prefix, paths = sys.argv[1], sys.argv[2], sys.argv[3:]\n"
                     "for path in paths:\n"
                     "    client.upload_file(path, bucket, prefix + '/' + path.rsplit('/', 1)[-1])\n")
    ferry_out = f"s3://{BUCKET}/{{OUTPUT}}"
    cases = []
    for key in keys:
        if key in LOAD_CASES:
            missing = [k for k in load_objects[key] if k not in sizes]
            if missing:
                raise SystemExit(f"{key}: objects missing from the server: {missing}")
            spec = {"case": key, "target": main_targets[key], "warmup": warm_targets[key], "check": check,
                    "preload": preload}
            warm = [server.object_file(k) for k in load_objects[key]]
            cases.append(Case(key, "load", [p for p in warm if p.is_file()], spec=spec,
                              env={**env, **RUNAI_ENV} if key == "runai" else env,
                              object_bytes=sum(sizes[k] for k in load_objects[key])))
        elif key == "ferry_tensorize":
            cases.append(Case(key, "upload", data.weight_files(), env=env,
                              argv=[ferry, "tensorize", "--layout", "hf", "--source", str(data.checkpoint),
                                    "--output", ferry_out],
                              floor_argv=[py, "-c", "import ferry_worker.cli, ferry_worker.tensorize.tensorize, "
                                                    "ferry_worker.tensorize.s3_store, torch, tensorizer"]))
        elif key == "ferry_publish":
            cases.append(Case(key, "upload", data.weight_files(), env=env,
                              argv=[ferry, "publish", "--source", str(data.checkpoint), "--output", ferry_out],
                              floor_argv=[py, "-c", "import ferry_worker.cli, ferry_worker.tensorize.publish, "
                                                    "ferry_worker.tensorize.s3_store"]))
        elif key == "boto3_upload":
            cases.append(Case(key, "upload", data.weight_files(), env=env,
                              argv=[py, "-c", upload_script, BUCKET, "{OUTPUT}", *map(str, data.weight_files())],
                              floor_argv=[py, "-c", "import boto3; boto3.session.Session().client('s3')"]))
    for case in cases:
        if case.kind == "load" and not case.warm_files:
            log(f"{case.key}: the server's object files were not found under {server.root}: not warmed")
    return cases


def reference_digest(data: Dataset) -> str:
    from safetensors.torch import load_file

    tensors = {}
    for path in data.weight_files():
        tensors.update(load_file(path))
    return tensor_digest(tensors)


# ---------------------------------------------------------------- report


def ratio(cases: dict, top: str, bottom: str) -> dict | None:
    if top not in cases or bottom not in cases:
        return None
    t, b = cases[top]["seconds"], cases[bottom]["seconds"]
    return {"ofMedians": statistics.median(t) / statistics.median(b),
            "medianOfRuns": statistics.median(x / y for x, y in zip(t, b))}


def markdown(report: dict) -> str:
    lines = [f"{report['checkpoint']['safetensorsBytes'] / 1e9:.2f} GB checkpoint "
             f"({report['checkpoint']['files']} safetensors files, {report['checkpoint']['tensors']} tensors), "
             f"gofakes3 on 127.0.0.1, {report['machine']['cpus']} CPUs, {report['cacheState'].split(':')[0]}, "
             f"median of {report['repeat']}, load average {report['loadAverage']['before']:.1f} before / "
             f"{report['loadAverage']['after']:.1f} after", "",
             "| case | median s | GB | GB/s | client CPU s | server CPU s | peak RSS | runs (s) |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for key, r in report["cases"].items():
        rss = f"{r['peakRssBytes'] / 2**30:.2f} GiB" if "peakRssBytes" in r else "—"
        lines.append(f"| {r['label']} | {r['medianSeconds']:.2f} | {r['bytes'] / 1e9:.3f} | {r['gbPerSecond']:.2f} | "
                     f"{r['medianCpuSeconds']:.2f} | {r['medianServerCpuSeconds']:.2f} | {rss} | "
                     f"{', '.join(f'{s:.2f}' for s in r['seconds'])} |")
    fixed = {k: r["medianTinyLoadSeconds"] for k, r in report["cases"].items() if "medianTinyLoadSeconds" in r}
    if fixed:
        lines += ["", f"Fixed cost of one load (the child's second load of the 1-layer, "
                      f"{report['warmupModel']['tensorBytes'] / 1e6:.1f} MB model; not in the times above), median: " + ", ".join(f"{k} {s:.2f} s" for k, s in fixed.items()) + "."]
    floors = {k: r["medianImportFloorSeconds"] for k, r in report["cases"].items() if "medianImportFloorSeconds" in r}
    if floors:
        lines += ["", "Upload times include each command's start-up; its import floor (the same imports, no work), "
                      "median: " + ", ".join(f"{k} {s:.2f} s" for k, s in floors.items()) + "."]
    lines += ["", "| ratio (> 1: the case after the slash is faster) | of medians | median of runs |", "|---|---:|---:|"]
    for name, r in report["ratios"].items():
        lines.append(f"| {name} | {r['ofMedians']:.2f} | {r['medianOfRuns']:.2f} |")
    return "\n".join(lines)


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("ferry", "boto3", "safetensors", "torch", "tensorizer", "runai-model-streamer",
                 "runai-model-streamer-s3"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    from s3server import HERE as s3_dir

    for line in (s3_dir / "versions.env").read_text().splitlines():
        if line.startswith("GOFAKES3_VERSION="):
            found["gofakes3"] = line.split("=", 1)[1]
    return found


# ---------------------------------------------------------------- main


def _terminate(signum, frame):  # SIGTERM: unwind like Ctrl-C, so the server and children are stopped
    raise KeyboardInterrupt


def main() -> int:
    from ferry_worker.cli_args import parse_size, positive_int

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="2Gi", help="safetensors bytes of the generated checkpoint, at least "
                                                  "(default %(default)s)")
    ap.add_argument("--repeat", type=positive_int, default=3, help="repetitions; medians are quoted (default 3)")
    ap.add_argument("--cases", default=",".join(ALL_CASES),
                    help=f"comma-separated, of {','.join(ALL_CASES)} (default: all)")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before every measurement (root) "
                                                         "instead of reading the case's files once")
    ap.add_argument("--check", action="store_true", help="also hash every loaded tensor (after timing) and "
                                                          "require the local checkpoint's digest from every case")
    ap.add_argument("--preload", action="store_true",
                    help="load cases: each child first loads the whole checkpoint once, untimed, then the timed "
                         "load runs (a process's second load; the default times its first)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/ferry-s3-bench"),
                    help="generated data and the server's objects, reused across runs (default %(default)s)")
    ap.add_argument("--ferry", default=str(Path(sys.executable).parent / "ferry"),
                    help="the ferry command (default %(default)s)")
    ap.add_argument("--out", type=Path, help="write the JSON report here")
    args = ap.parse_args()
    size = parse_size(args.size)
    keys = [k for k in args.cases.split(",") if k]
    unknown = [k for k in keys if k not in ALL_CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}: choose from {', '.join(ALL_CASES)}")
    if not Path(args.ferry).exists() and not shutil.which(args.ferry):
        ap.error(f"no ferry command at {args.ferry} (--ferry)")
    signal.signal(signal.SIGTERM, _terminate)

    lb = _load_bench()
    args.work.mkdir(parents=True, exist_ok=True)
    logs = args.work / "logs"
    logs.mkdir(exist_ok=True)
    data = dataset_for(args.work, "llama", size, lb.llama_config(size))
    warmup = dataset_for(args.work, "warmup", 0, lb.llama_config(0, (512,), 1024))
    weights = data.weight_bytes()
    # checkpoint + published + tensorized + one upload case at a time (the server keeps objects as files)
    if 4 * weights > DISK_BUDGET:
        log(f"warning: this size needs about {4 * weights / 1e9:.1f} GB of disk, over the "
            f"{DISK_BUDGET / 1e9:.0f} GB budget")

    with Server(args.work / "s3") as server:
        log(f"S3 server at {server.helper.endpoint} (pid {server.helper.pid}), objects under {server.root}")
        client = server.client()
        try:
            client.create_bucket(Bucket=BUCKET)
        except client.exceptions.ClientError as e:
            if e.response["Error"]["Code"] not in ("BucketAlreadyExists", "BucketAlreadyOwnedByYou"):
                raise
        remove_stale(args.work, client, [data, warmup])
        stored = sum(o["Size"] for o in list_objects(client, data.name + "/"))
        need = (0 if data.marker.is_file() else weights) + max(0, 2 * weights - stored) + weights
        if shutil.disk_usage(args.work).free < need * 1.05:
            raise SystemExit(f"{args.work}: needs {need * 1.05 / 1e9:.1f} GB free")
        env = {**os.environ, **server.env()}
        for d in (warmup, data):
            if ensure_checkpoint(d):  # new files: objects of an earlier, interrupted run are not theirs
                delete_objects(client, list_objects(client, d.name + "/"), uploads_under=d.name + "/")
            ensure_uploaded(d, client, args.ferry, env, logs)
        cases = build_cases(keys, data, warmup, server, args.ferry, args.check, args.preload)
        timeout = 600 + weights / 5e6  # a stalled case fails instead of hanging the run
        samples: dict[str, list[dict]] = {c.key: [] for c in cases}
        load_before = os.getloadavg()[0]
        for rep in range(args.repeat):
            # Each repetition starts one case later within each group.
            order = []
            for kind in ("load", "upload"):
                group = [c for c in cases if c.kind == kind]
                shift = rep % len(group) if group else 0
                order += group[shift:] + group[:shift]
            for case in order:
                if case.kind == "load":
                    sample = measure_load(case, server, args.cold, timeout)
                else:
                    sample = measure_upload(case, server, args.cold, rep, logs, timeout)
                samples[case.key].append(sample)
                log(f"repetition {rep + 1}/{args.repeat} {case.key}: {sample['seconds']:.2f} s, "
                    f"client CPU {sample['cpuSeconds']:.2f} s, server CPU {sample['serverCpuSeconds']:.2f} s")
        load_after = os.getloadavg()[0]

    checkpoint_bytes = sum(p.stat().st_size for p in data.weight_files())
    tensor_count = len(lb.tensor_shapes(data.config))
    expected_digest = reference_digest(data) if args.check and any(c.kind == "load" for c in cases) else None
    report_cases = {}
    for case in cases:
        runs = samples[case.key]
        seconds = [s["seconds"] for s in runs]
        median = statistics.median(seconds)
        r = {"label": LABELS[case.key], "seconds": seconds, "medianSeconds": median,
             "medianCpuSeconds": statistics.median(s["cpuSeconds"] for s in runs),
             "medianServerCpuSeconds": statistics.median(s["serverCpuSeconds"] for s in runs),
             "objectBytes": runs[0]["objectBytes"], "runs": runs}
        if case.kind == "load":
            got = {(s["tensors"], s["tensorBytes"]) for s in runs}
            if got != {(tensor_count, weights)}:
                raise SystemExit(f"{case.key}: loaded (tensors, bytes) {got}, expected {(tensor_count, weights)}")
            if expected_digest is not None and any(s["digest"] != expected_digest for s in runs):
                raise SystemExit(f"{case.key}: the loaded tensors differ from the checkpoint's")
            r |= {"bytes": weights, "gbPerSecond": weights / 1e9 / median,
                  "peakRssBytes": max(s["peakRssBytes"] for s in runs),
                  "medianTinyLoadSeconds": statistics.median(s["tinyLoadSeconds"] for s in runs)}
        else:
            r |= {"bytes": runs[0]["objectBytes"], "gbPerSecond": runs[0]["objectBytes"] / 1e9 / median,
                  "medianImportFloorSeconds": statistics.median(s["importFloorSeconds"] for s in runs)}
        report_cases[case.key] = r
    ratios = {name: r for name, top, bottom in RATIOS if (r := ratio(report_cases, top, bottom)) is not None}
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release()},
        "loadAverage": {"before": load_before, "after": load_after},
        "versions": versions(),
        "cacheState": "cold: sync; drop_caches before each measurement" if args.cold
        else "warm: sync, then the case's files (server objects / local checkpoint) read once before each measurement",
        "repeat": args.repeat,
        "size": args.size,
        "checkpoint": {"path": str(data.checkpoint), "safetensorsBytes": checkpoint_bytes, "tensorBytes": weights,
                       "tensors": tensor_count, "files": len(data.weight_files()), "config": data.config},
        "warmupModel": {"tensorBytes": warmup.weight_bytes(), "config": warmup.config},
        "objects": {"hf": f"s3://{BUCKET}/{data.hf_prefix}", "tensorized": f"s3://{BUCKET}/{data.tensorized_prefix}"},
        "runaiEnv": {**RUNAI_ENV, **{k: v for k, v in os.environ.items() if k.startswith("RUNAI_STREAMER_")}},
        "checked": expected_digest,
        "preload": args.preload,
        "cases": report_cases,
        "ratios": ratios,
    }
    print(markdown(report))
    print()
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        sys.exit(child_main(json.loads(sys.argv[2])))
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        log("interrupted; the S3 server and any child were stopped")
        sys.exit(130)


def drop_page_cache() -> None:
    _drop("measure warm (no --cold)")
