#!/usr/bin/env bash
# The main job from nothing, on the embedded default store (a local directory):
# set up, build a real Debian bookworm + python3 image (OCI layout, cached), convert it,
# and show what was stored. This is the README's first Quick start command.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"

echo "== building the demo image (debootstrap + python3, cached after the first run)" >&2
layout=$(python -c 'from tests.fixtures.images import demo_layout; print(demo_layout())')

echo "== lazyfs convert oci:$layout:python --name demo/python:3.11" >&2
lazyfs convert "oci:$layout:python" --name demo/python:3.11
echo "== lazyfs images" >&2
lazyfs images
echo "== lazyfs inspect demo/python:3.11" >&2
lazyfs inspect demo/python:3.11
