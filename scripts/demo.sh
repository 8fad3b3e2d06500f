#!/usr/bin/env bash
# The main job from nothing, on the embedded default store (a local directory):
# set up, build a real Debian bookworm + python3 image (OCI layout, cached), convert it,
# show what was stored, and run python3 from it lazily. This is the README's first Quick start command.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"

echo "== building the demo image (debootstrap + python3, cached after the first run)" >&2
layout=$(python -c 'from testbed.images import demo_layout; print(demo_layout())')

echo "== lazyfs convert oci:$layout:python --name demo/python:3.11" >&2
lazyfs convert "oci:$layout:python" --name demo/python:3.11
echo "== lazyfs images" >&2
lazyfs images
echo "== lazyfs inspect demo/python:3.11" >&2
lazyfs inspect demo/python:3.11
# An empty node cache of its own, so every demo run shows a cold, lazy start.
cache=$(mktemp -d /tmp/lazyfs-demo-cache.XXXXXX)
trap 'rm -rf "$cache"' EXIT
echo "== lazyfs run demo/python:3.11 --cache $cache -- python3 -c ...   (lazy mount + private overlay sandbox)" >&2
lazyfs run demo/python:3.11 --cache "$cache" -- python3 -c 'import sys; print("hello from python", sys.version.split()[0], "in a lazy sandbox")'
echo "== what the mount fetched (from lazyfs inspect --json: the mount's statistics)" >&2
lazyfs inspect demo/python:3.11 --cache "$cache" --json | python3 -c '
import json, sys
info = json.load(sys.stdin)
m = info["mounts"][0]  # a tree this run used (stats kept after unmount; node-wide figures)
f, s = m["bytes_fetched"], info["stored_bytes"]
print("fetched %.1f MB of %.1f MB stored (%.1f%%), %d store requests, %d cache hits"
      % (f / 1e6, s / 1e6, 100 * f / s, m["store_requests"], m["hits"]))'
