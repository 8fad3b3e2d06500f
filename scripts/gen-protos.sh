#!/usr/bin/env bash
# Regenerates the Python gRPC code from the .proto files (committed, so that installing
# lazyfs needs no protoc). Run from anywhere after scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
for proto in lazyfs/snapshotter/snapshots.proto testbed/cri/api.proto; do
    [ -f "$proto" ] || continue
    # From the repository root, so the generated modules import each other by package.
    .venv/bin/python -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. "$proto"
done
