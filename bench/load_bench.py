#!/usr/bin/env python3
"""Benchmark: loading one tensor-parallel rank, on the same files in one run,
same cache state.

    .venv/bin/python bench/load_bench.py [--size 4Gi] [--tp 4] [--rank 0] [--repeat 3] [--warm]
                                         [--work /tmp/ferry-load-bench] [--out result.json] [--check]

Generates (once; reused while complete) a Llama-shaped BF16 checkpoint of at
least --size bytes of safetensors (random bytes, written by streaming) and its
`ferry shard --tensor-parallel-size TP` artifact, then times, alternating
within each repetition, for rank --rank:

  (a)  `ferry load --artifact ART --ranks R --no-report` (per-rank prefetch,
       every byte hashed: BLAKE3 blocks), and (a') the same with `--verify size`;
  (b)  `dd if=F of=/dev/null bs=16M` of the same files, one after another;
  (c)  vLLM's default path for the rank: every safetensors file of the
       ORIGINAL checkpoint, each tensor materialised, narrowed to the rank's
       slice and copied (DefaultModelLoader + weight_loader; bench/load_paths.py);
  (d)  the rank's sharded_state files read with plain safetensors (safe_open,
       every tensor; vLLM's ShardedStateLoader);
  (e)  the Run:ai streamer (runai-model-streamer SafetensorsStreamer) on the
       same files as (d).
  (c_lazy, opt-in with --cases): (c) without materialising: safetensors'
       get_tensor is a view of an mmap, so only the pages the rank's slice
       touches are read (plus readahead).

Cache state: cold by default: `sync; echo 3 > /proc/sys/vm/drop_caches`
before every single measurement (needs root); `--warm`: the case's files are
read once, untimed, before each measurement instead. (The Run:ai streamer,
0.17, reads local files with O_DIRECT: it reads from storage warm or cold,
which its "read from storage" column shows; RUNAI_STREAMER_* variables in the
environment reach it.)

(a) and (b) are child commands timed wall-clock; after the cache drop their
code (not the data) is read in by an untimed no-op run (`ferry load` of an
empty directory, `dd` of one block of /dev/zero), so neither pays for a cold
interpreter or binary; a second no-op run is timed and reported as the
command's start-up floor (included in its time). (c), (d), (e) run in a fresh
Python child each, which first runs its case on a tiny 1-layer model (so the
code it needs is paged in and stays mapped through the drop), then is timed
from after its imports (torch, safetensors, the streamer: a serving process
has them loaded) to the last tensor. Bytes read from storage come from the
kernel's per-process I/O accounting (read_bytes; getrusage ru_inblock for the
commands).

`--check`, instead of timing: for every rank, asserts that (c)'s narrowing
(with vLLM's q|k|v and gate|up fusion and vocabulary padding) gives the names,
shapes and bytes of the rank's sharded_state tensors (d), and that (e) yields
the same bytes as (d).

The data lives under --work, keyed by the size (about twice the checkpoint:
~9 GB at 4Gi); other datasets there are kept for reuse while everything fits
in 12 GB, and removed oldest first when it would not.

Reports per case the median seconds, the bytes of the rank's files, the
bytes read from storage, GB/s (1e9 bytes/s of the rank's files), and the
ratios: prefetch vs dd (dd s / ferry s; goal >= 0.9), (c)/(d) (goal >= 3.5 at
TP 4), (d)/(e). Prints a markdown table and JSON; writes the JSON to --out.
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
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "worker_image"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import load_paths  # noqa: E402
from cache_state import drop_page_cache as _drop, read_through  # noqa: E402

# Part of the data key: bump when the generated checkpoint or artifact changes (2: BLAKE3 block digests).
GENERATOR_VERSION = 2
DATA_MARKER = "bench-data.json"  # written last into a complete dataset directory
FILE_LIMIT = 2 << 30  # Hub checkpoints are split in files of a few GB
WRITE_CHUNK = 16 << 20
HEAD_DIM = 128
VOCAB = 32000  # Llama-2's; Llama-3's 128256 would be half of a 4 GiB checkpoint
DISK_BUDGET = 12 * 10**9
ALL_CASES = ("a", "a_size", "b", "c", "c_lazy", "d", "e")
DEFAULT_CASES = ("a", "a_size", "b", "c", "d", "e")
LABELS = {
    "a": "(a) `ferry load` per-rank prefetch (hashed)",
    "a_size": "(a') `ferry load --verify size`",
    "b": "(b) `dd bs=16M` of the same files, sequential",
    "c": "(c) vLLM default: original checkpoint, materialise + narrow",
    "c_lazy": "(c lazy) vLLM default, mmap get_tensor + narrow (no materialise)",
    "d": "(d) sharded_state rank files, safetensors safe_open",
    "e": "(e) sharded_state rank files, Run:ai streamer",
}


# ---------------------------------------------------------------- the data


def llama_config(size: int, hiddens: tuple[int, ...] = (4096, 2048, 1024, 512), vocab: int = VOCAB) -> dict:
    """A Llama-3-8B-shaped config (head_dim 128, 4 query heads per KV head,
    intermediate 3.5 x hidden, BF16) with the widest hidden size that still
    gives >= 4 decoder layers, and as many layers as make >= `size` bytes."""
    for hidden in hiddens:
        heads = hidden // HEAD_DIM
        kv_heads = max(1, heads // 4)
        inter = hidden * 7 // 2
        layer = 2 * (2 * hidden * hidden + 2 * kv_heads * HEAD_DIM * hidden + 3 * inter * hidden + 2 * hidden)
        fixed = 2 * (2 * vocab * hidden + hidden)
        layers = max(1, math.ceil((size - fixed) / layer))
        if layers >= 4 or hidden == hiddens[-1]:
            break
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "num_hidden_layers": layers, "vocab_size": vocab, "hidden_act": "silu", "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": False,
            "attention_bias": False, "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2,
            "torch_dtype": "bfloat16"}


def tensor_shapes(config: dict) -> dict[str, list[int]]:
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q, kv = config["num_attention_heads"] * HEAD_DIM, config["num_key_value_heads"] * HEAD_DIM
    shapes = {"model.embed_tokens.weight": [vocab, hidden]}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": [hidden],
                   p + "self_attn.q_proj.weight": [q, hidden], p + "self_attn.k_proj.weight": [kv, hidden],
                   p + "self_attn.v_proj.weight": [kv, hidden], p + "self_attn.o_proj.weight": [hidden, q],
                   p + "post_attention_layernorm.weight": [hidden],
                   p + "mlp.gate_proj.weight": [inter, hidden], p + "mlp.up_proj.weight": [inter, hidden],
                   p + "mlp.down_proj.weight": [hidden, inter]}
    return shapes | {"model.norm.weight": [hidden], "lm_head.weight": [vocab, hidden]}


def safetensors_header(tensors: list[tuple[str, list[int]]]) -> bytes:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in tensors:
        nbytes = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return len(body).to_bytes(8, "little") + body


def write_checkpoint(directory: Path, config: dict, seed: int = 0) -> None:
    """Safetensors files of at most FILE_LIMIT bytes (and at least 2 files),
    random bytes streamed in 16 MiB chunks, an index, config.json."""
    import numpy as np

    shapes = tensor_shapes(config)
    total = sum(2 * math.prod(s) for s in shapes.values())
    limit = min(FILE_LIMIT, -(-total // 2))
    groups: list[list[tuple[str, list[int]]]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = 2 * math.prod(shape)
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += nbytes
    directory.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    weight_map = {}
    for n, group in enumerate(groups):
        file_name = f"model-{n + 1:05d}-of-{len(groups):05d}.safetensors"
        with open(directory / file_name, "wb") as f:
            f.write(safetensors_header(group))
            left = sum(2 * math.prod(shape) for _, shape in group)
            while left:
                chunk = min(left, WRITE_CHUNK)
                f.write(rng.bytes(chunk))
                left -= chunk
        weight_map |= {name: file_name for name, _ in group}
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    (directory / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": 2}')


@dataclass(frozen=True)
class Dataset:
    root: Path
    config: dict

    @property
    def checkpoint(self) -> Path:
        return self.root / "checkpoint"

    def artifact(self, tp: int) -> Path:
        return self.root / f"artifact-tp{tp}"

    def checkpoint_files(self) -> list[Path]:
        index = json.loads((self.checkpoint / "model.safetensors.index.json").read_text())
        return [self.checkpoint / f for f in sorted(set(index["weight_map"].values()))]


def dataset_for(work: Path, name: str, size: int, config: dict) -> Dataset:
    key = hashlib.sha256(json.dumps([GENERATOR_VERSION, size, config], sort_keys=True).encode()).hexdigest()[:12]
    return Dataset(work / f"{name}-{key}", config)


def ensure_dataset(data: Dataset, tp: int, ferry: str, work: Path, keep: tuple[Path, ...] = ()) -> Dataset:
    """The checkpoint and its TP artifact, generated unless complete. Data of
    other sizes (or TP sizes) in `work` stays for reuse while it fits in the
    disk budget; the oldest goes first when it does not."""
    marker = data.checkpoint / DATA_MARKER
    artifact = data.artifact(tp)
    artifact_done = (artifact / "ferry-manifest.json").is_file()  # ferry shard writes its manifest last
    weights = 2 * sum(math.prod(s) for s in tensor_shapes(data.config).values())
    need = (0 if marker.is_file() else weights) + (0 if artifact_done else weights)
    if need:
        if 2 * weights > DISK_BUDGET:
            log(f"warning: checkpoint + artifact take about {2 * weights / 1e9:.1f} GB, over the "
                f"{DISK_BUDGET / 1e9:.0f} GB budget")
        make_room(work, {data.root, *keep}, artifact, need)
        if shutil.disk_usage(work).free < need * 1.05:
            raise SystemExit(f"{work}: needs {need * 1.05 / 1e9:.1f} GB free for the checkpoint and its artifact")
    if not marker.is_file():
        if data.root.exists():
            shutil.rmtree(data.root)
        log(f"writing a checkpoint ({data.config['num_hidden_layers']} layers, hidden {data.config['hidden_size']}) "
            f"to {data.checkpoint}")
        write_checkpoint(data.checkpoint, data.config)
        marker.write_text(json.dumps({"generator": GENERATOR_VERSION, "config": data.config}))
    if not artifact_done:
        if artifact.exists():
            shutil.rmtree(artifact)
        log(f"ferry shard --tensor-parallel-size {tp} -> {artifact}")
        subprocess.run([ferry, "shard", "--source", str(data.checkpoint), "--output", str(artifact),
                        "--tensor-parallel-size", str(tp)], check=True, stdout=subprocess.DEVNULL)
    return data


def make_room(work: Path, keep: set[Path], artifact: Path, need: int) -> None:
    """Remove other generated datasets in `work` (and other TP artifacts of
    this one), oldest first, until what is left plus `need` fits in DISK_BUDGET."""
    def du(path: Path) -> int:
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())

    roots = [r for r in work.iterdir() if (r / "checkpoint").is_dir()] if work.is_dir() else []
    used = sum(du(r) for r in roots)
    others = [a for a in artifact.parent.glob("artifact-tp*") if a != artifact] + [r for r in roots if r not in keep]
    for old in sorted(others, key=lambda d: d.stat().st_mtime):
        if used + need <= DISK_BUDGET:
            break
        log(f"removing {old} to stay within the {DISK_BUDGET / 1e9:.0f} GB disk budget")
        used -= du(old)
        shutil.rmtree(old)


def rank_files(artifact: Path, rank: int) -> tuple[list[Path], list[Path]]:
    """(every file `ferry load --ranks RANK` reads, the rank's safetensors files)."""
    from ferry_worker.manifest import Manifest
    from ferry_worker.load.selection import select

    manifest = Manifest.from_json((artifact / "ferry-manifest.json").read_bytes())
    selection = select(manifest, [rank])
    tp = int(manifest.extra.get("tensorParallelSize", 1))
    own = manifest.extra["rankFiles"][f"pp{rank // tp}-tp{rank % tp}"]
    return [artifact / e.path for e in selection.entries], [artifact / name for name in sorted(own)]


# ---------------------------------------------------------------- measuring


def log(message: str) -> None:
    print(f"[load_bench] {message}", file=sys.stderr, flush=True)


def children_read_bytes() -> int:
    # ru_inblock is the kernel's read_bytes / 512 of waited-for children (and theirs).
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock * 512


@dataclass
class Case:
    key: str
    files: list[Path]  # what the case reads (its bytes are "the rank's bytes")
    argv: list[str] | None = None  # a command timed wall-clock ...
    warmup: list[str] | None = None  # ... after this untimed run loads its code
    spec: dict | None = None  # ... or a load_paths child

    @property
    def nbytes(self) -> int:
        return sum(p.stat().st_size for p in self.files)


def prepare(case: Case, warm: bool) -> None:
    if warm:
        read_through(case.files)
    else:
        drop_page_cache()


def measure(case: Case, warm: bool, logs: Path) -> dict:
    if case.spec is not None:
        return measure_child(case, warm)
    prepare(case, warm)
    subprocess.run(case.warmup, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # reads the code in
    start = time.perf_counter()
    subprocess.run(case.warmup, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    startup = time.perf_counter() - start  # the same, code cached: the command's start-up floor
    out = logs / f"{case.key}.log"
    read0 = children_read_bytes()
    with open(out, "wb") as f:
        start = time.perf_counter()
        rc = subprocess.run(case.argv, stdout=f, stderr=subprocess.STDOUT).returncode
        seconds = time.perf_counter() - start
    if rc:
        raise SystemExit(f"{case.key}: {' '.join(case.argv[:4])}... exited {rc}:\n{out.read_text()[-2000:]}")
    return {"seconds": seconds, "readBytes": children_read_bytes() - read0, "noOpSeconds": startup}


def measure_child(case: Case, warm: bool) -> dict:
    child = subprocess.Popen([sys.executable, str(Path(load_paths.__file__)), json.dumps(case.spec)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        if child.stdout.readline().strip() != "ready":
            raise SystemExit(f"{case.key}: the child did not start (exit {child.wait()})")
        prepare(case, warm)
        child.stdin.write("go\n")
        child.stdin.flush()
        line = child.stdout.readline()
        if child.wait() or not line:
            raise SystemExit(f"{case.key}: the child failed (exit {child.returncode})")
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return json.loads(line)


def build_cases(keys: list[str], data: Dataset, warmup: Dataset, tp: int, rank: int, ferry: str,
                empty: Path) -> list[Case]:
    artifact = data.artifact(tp)
    load_files, own = rank_files(artifact, rank)
    checkpoint = data.checkpoint_files()
    warm_files = {"checkpoint": warmup.checkpoint_files(), "rank": rank_files(warmup.artifact(tp), rank)[1]}
    load_argv = [ferry, "load", "--artifact", str(artifact), "--ranks", str(rank), "--no-report"]
    ferry_warmup = [ferry, "load", "--artifact", str(empty), "--no-report"]  # imports it all, then fails
    dd = ["bash", "-c", 'for f; do dd if="$f" of=/dev/null bs=16M status=none || exit 1; done', "dd"]
    dd_warmup = ["bash", "-c", "dd if=/dev/zero of=/dev/null bs=16M count=1 status=none"]

    def child(key: str, files: list[Path], kind: str) -> Case:
        spec = {"case": key, "files": [str(p) for p in files], "config": data.config, "tp": tp, "rank": rank,
                "warmup": {"files": [str(p) for p in warm_files[kind]], "config": warmup.config}}
        return Case(key, files, spec=spec)

    make = {
        "a": lambda: Case("a", load_files, load_argv, ferry_warmup),
        "a_size": lambda: Case("a_size", load_files, [*load_argv, "--verify", "size"], ferry_warmup),
        "b": lambda: Case("b", load_files, [*dd, *map(str, load_files)], dd_warmup),
        "c": lambda: child("c", checkpoint, "checkpoint"),
        "c_lazy": lambda: child("c_lazy", checkpoint, "checkpoint"),
        "d": lambda: child("d", own, "rank"),
        "e": lambda: child("e", own, "rank"),
    }
    return [make[k]() for k in keys]


def ratio(results: dict, top: str, bottom: str) -> dict | None:
    if top not in results or bottom not in results:
        return None
    t, b = results[top]["seconds"], results[bottom]["seconds"]
    return {"ofMedians": statistics.median(t) / statistics.median(b),
            "medianOfRuns": statistics.median(x / y for x, y in zip(t, b))}


RATIOS = (  # (name, numerator seconds, denominator seconds, goal)
    ("prefetch (hashed) vs dd: dd s / ferry load s", "b", "a", 0.9),
    ("prefetch (--verify size) vs dd: dd s / ferry load s", "b", "a_size", 0.9),
    ("vLLM default path vs sharded_state, per rank: (c) s / (d) s", "c", "d", 3.5),
    ("vLLM default path (lazy mmap) vs sharded_state: (c lazy) s / (d) s", "c_lazy", "d", None),
    ("Run:ai streamer vs plain safetensors: (d) s / (e) s", "d", "e", None),
)


def markdown(report: dict) -> str:
    lines = ["| case | median s | rank's bytes | read from storage (median) | GB/s | runs (s) |",
             "|---|---:|---:|---:|---:|---|"]
    for key, r in report["cases"].items():
        lines.append(f"| {LABELS[key]} | {r['medianSeconds']:.2f} | {r['bytes'] / 1e9:.3f} GB | "
                     f"{r['medianReadBytes'] / 1e9:.3f} GB | {r['gbPerSecond']:.2f} | "
                     f"{', '.join(f'{s:.2f}' for s in r['seconds'])} |")
    for key in ("a", "a_size"):
        if key in report["cases"]:
            noop = statistics.median(report["cases"][key]["noOpSeconds"])
            lines += ["", f"`ferry load` start-up floor (a run that imports it all and fails on an empty directory, "
                          f"code cached, no weights): median {noop:.2f} s, included in (a) and (a')."]
            break
    lines += ["", "| ratio | of medians | median of runs | goal |", "|---|---:|---:|---:|"]
    for name, r in report["ratios"].items():
        goal = f">= {r['goal']}" if r["goal"] else ""
        lines.append(f"| {name} | {r['ofMedians']:.2f} | {r['medianOfRuns']:.2f} | {goal} |")
    return "\n".join(lines)


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("ferry", "safetensors", "torch", "runai-model-streamer"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def main() -> int:
    from ferry_worker.cli_args import parse_size, positive_int

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="4Gi", help="safetensors bytes of the generated checkpoint, at least "
                                                  "(default %(default)s)")
    ap.add_argument("--tp", type=positive_int, default=4, help="tensor-parallel size of the artifact (default 4)")
    ap.add_argument("--rank", type=int, default=0, help="the rank loaded (default 0)")
    ap.add_argument("--repeat", type=positive_int, default=3, help="repetitions; medians are quoted (default 3)")
    ap.add_argument("--warm", action="store_true", help="read each case's files once, untimed, before each "
                                                         "measurement instead of dropping the page cache")
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES),
                    help=f"comma-separated, of {','.join(ALL_CASES)} (default %(default)s)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/ferry-load-bench"),
                    help="generated data, reused across runs (default %(default)s)")
    ap.add_argument("--ferry", default=str(Path(sys.executable).parent / "ferry"),
                    help="the ferry command (default %(default)s)")
    ap.add_argument("--out", type=Path, help="write the JSON report here")
    ap.add_argument("--check", action="store_true",
                    help="instead of timing: assert that (c)'s narrowing gives every rank the tensors (names, "
                         "shapes, bytes) of its sharded_state files (d), and that (e) reads the same as (d)")
    args = ap.parse_args()
    size = parse_size(args.size)
    keys = [k for k in args.cases.split(",") if k]
    unknown = [k for k in keys if k not in ALL_CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}: choose from {', '.join(ALL_CASES)}")
    if not 0 <= args.rank < args.tp:
        ap.error(f"--rank must be in 0..{args.tp - 1}")
    if not Path(args.ferry).exists() and not shutil.which(args.ferry):
        ap.error(f"no ferry command at {args.ferry} (--ferry)")

    args.work.mkdir(parents=True, exist_ok=True)
    data = ensure_dataset(dataset_for(args.work, f"llama-{args.size}", size, llama_config(size)),
                          args.tp, args.ferry, args.work)
    checkpoint_bytes = sum(p.stat().st_size for p in data.checkpoint_files())
    if args.check:
        results = []
        for rank in range(args.tp):
            _, own = rank_files(data.artifact(args.tp), rank)
            try:
                results.append(load_paths.check([str(p) for p in data.checkpoint_files()], [str(p) for p in own],
                                                data.config, args.tp, rank))
            except AssertionError as e:
                print(f"check FAILED: {e}", file=sys.stderr)
                return 1
            log(f"rank {rank}: {results[-1]['tensorsCompared']} tensors identical in (c) and (d), and (e)")
        print(json.dumps({"check": "passed", "checkpointBytes": checkpoint_bytes, "config": data.config,
                          "ranks": results}, indent=2))
        return 0

    # A 1-layer model of the same shape family: each Python child runs its case on it before the
    # cache is dropped, so the code it needs is paged in and the timed run reads only weights.
    warmup = ensure_dataset(dataset_for(args.work, "warmup", 0, llama_config(0, (512,), 1024)),
                            args.tp, args.ferry, args.work, keep=(data.root,))
    empty = args.work / "empty"
    empty.mkdir(exist_ok=True)
    logs = args.work / "logs"
    logs.mkdir(exist_ok=True)
    cases = build_cases(keys, data, warmup, args.tp, args.rank, args.ferry, empty)
    samples: dict[str, list[dict]] = {c.key: [] for c in cases}
    for rep in range(args.repeat):
        shift = rep % len(cases)  # each repetition starts one case later: no case always follows the same one
        for case in cases[shift:] + cases[:shift]:
            sample = measure(case, args.warm, logs)
            samples[case.key].append(sample)
            log(f"repetition {rep + 1}/{args.repeat} {case.key}: {sample['seconds']:.2f} s, "
                f"{sample['readBytes'] / 1e9:.3f} GB from storage")

    report_cases = {}
    for case in cases:
        seconds = [s["seconds"] for s in samples[case.key]]
        median = statistics.median(seconds)
        report_cases[case.key] = {
            "label": LABELS[case.key], "files": [str(p) for p in case.files], "bytes": case.nbytes,
            "seconds": seconds, "medianSeconds": median, "gbPerSecond": case.nbytes / 1e9 / median,
            "readBytes": [s["readBytes"] for s in samples[case.key]],
            "medianReadBytes": statistics.median(s["readBytes"] for s in samples[case.key]),
            **({"peakRssBytes": max(s["peakRssBytes"] for s in samples[case.key]),
                "tensors": samples[case.key][0]["tensors"], "tensorBytes": samples[case.key][0]["tensorBytes"]}
               if case.spec else {}),
            **({"noOpSeconds": [s["noOpSeconds"] for s in samples[case.key]]} if not case.spec else {}),
        }
    ratios = {}
    for name, top, bottom, goal in RATIOS:
        r = ratio(report_cases, top, bottom)
        if r is not None:
            ratios[name] = {**r, "goal": goal, "meetsGoal": None if goal is None else r["ofMedians"] >= goal}
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release()},
        "versions": versions(),
        "cacheState": "warm: the case's files read once, untimed, before each measurement" if args.warm
        else "cold: sync; echo 3 > /proc/sys/vm/drop_caches before each measurement",
        "repeat": args.repeat,
        "size": args.size,
        "checkpoint": {"path": str(data.checkpoint), "safetensorsBytes": checkpoint_bytes,
                       "files": len(data.checkpoint_files()), "config": data.config},
        "artifact": {"path": str(data.artifact(args.tp)), "tensorParallelSize": args.tp},
        "rank": args.rank,
        "cases": report_cases,
        "ratios": ratios,
    }
    print(markdown(report))
    print()
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def drop_page_cache() -> None:
    _drop("measure with --warm")


if __name__ == "__main__":
    sys.exit(main())

