#!/usr/bin/env bash
# Regenerates the Python bindings of csi.proto and pluginregistration.proto
# (`make protos`). The generated files are committed: the worker image needs
# only the grpcio and protobuf runtimes, not the compiler.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
tools="${FERRY_CACHE:-$HOME/.cache/ferry}/grpcio-tools-1.85.1"
[ -x "$tools/bin/python" ] || { python3 -m venv "$tools" && "$tools/bin/pip" install --quiet grpcio-tools==1.85.1; }
cd "$here"
"$tools/bin/python" -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. csi.proto pluginregistration.proto
# protoc writes absolute imports (`import csi_pb2`); the bindings live in a package.
sed -i -E 's/^import (csi|pluginregistration)_pb2 as/from . import \1_pb2 as/' ./*_pb2_grpc.py
