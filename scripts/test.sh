#!/usr/bin/env bash
# The whole test suite, from nothing: installs what it needs, then runs ruff and pytest.
# This is the README's test command; .ci/run runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/pytest -q -p no:cacheprovider "$@"
