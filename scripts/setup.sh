#!/usr/bin/env bash
# Installs everything lazyfs and its tests need on Debian 12: system packages, a venv in
# .venv, and the project (editable). Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."

DEBS=(fuse3 libfuse3-dev pkg-config gcc libc6-dev python3-dev python3-venv
      skopeo umoci debootstrap casync docker-registry apache2-utils iproute2 zstd
      containerd runc crun tini erofs-utils util-linux-extra docker.io openssl)
missing=()
for p in "${DEBS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    echo "setup: installing Debian packages: ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq || true
    # docker.io is here for its CLI (the Docker API's tests): its daemon must not start.
    # Where no policy says so, one that denies every service start lasts the install.
    deny=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
        deny=/usr/sbin/policy-rc.d
    fi
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    [ -z "$deny" ] || rm -f "$deny"
fi

# The venv is Debian's own Python (python3-venv above), not whatever `python3` comes
# first on PATH (here a pyenv build): Debian links its interpreter with libpython
# statically, and a start took 8.7 ms against 10.7 ms, the imports of a `lazyfs run`
# 27.6 ms against 32.8 ms, on every CLI, daemon and agent (docs/design-changes.md,
# session 37). A venv made from another interpreter is made again.
PYTHON=/usr/bin/python3
if [ -x .venv/bin/python ] && [ "$(readlink -f .venv/bin/python)" != "$(readlink -f "$PYTHON")" ]; then
    echo "setup: .venv is not on $PYTHON: making it again" >&2
    rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
# Reinstall only when the project's dependency list changed.
# compat: the project's directory on sys.path through a plain .pth line. The default
# editable mode imports a finder (importlib.metadata, pathlib...) at every interpreter
# start: 40 ms more for each CLI, data daemon and supervisor on a cold sandbox start.
stamp=.venv/.lazyfs-installed-compat
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "setup: installing the project into .venv" >&2
    .venv/bin/pip install -q --upgrade pip >/dev/null
    # (setuptools warns that compat is transitional: the log is shown only on failure)
    if ! .venv/bin/pip install -q -e '.[fuse,test]' --config-settings editable_mode=compat \
        >.venv/pip-install.log 2>&1; then
        cat .venv/pip-install.log >&2
        exit 1
    fi
    touch "$stamp"
fi

# Byte-compile lazyfs's own modules (an editable install does not): every `lazyfs run`, its
# data daemon and its finisher would otherwise compile them again at each start where
# PYTHONDONTWRITEBYTECODE is set (20-50 ms per process measured here). Stale ones are
# ignored by Python (it checks each source's mtime), so this only has to run on setup.
.venv/bin/python -m compileall -q chunker registry_bridge node_cache lazyfs >/dev/null

# The C helpers (the agent's exec server, `lazyfs run`'s waiter): the install above builds
# them too (setup.py); this rebuilds one whose source changed since.
.venv/bin/python scripts/build_helpers.py .venv/bin
