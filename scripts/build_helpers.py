"""Build lazyfs's C helpers into a directory, where the settings look for them.

    python scripts/build_helpers.py DIR

- lazyfs-exec-server (lazyfs/agent/exec_server.c): every agent sandbox's PID 1;
- lazyfs-run-wait (lazyfs/sandbox/run_wait.c, run_teardown.c): what a `lazyfs run` is
  while its command runs, and its teardown after;
- lazyfs-attach-root (lazyfs/sandbox/attach_root.c): how a warm generic sandbox takes an
  image's root.

All are static, so that they run in any image and start in microseconds. A helper is
rebuilt only when one of its sources is newer than the binary. Used by the packaging (setup.py,
so that any install of the project has them, in its scripts directory) and by
scripts/setup.sh (the development venv). Standard library only.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HELPERS = {  # each helper's C sources (a .h beside one is a source too)
    "lazyfs-exec-server": ["lazyfs/agent/exec_server.c"],
    "lazyfs-run-wait": [
        "lazyfs/sandbox/run_wait.c",
        "lazyfs/sandbox/run_teardown.c",
        "lazyfs/sandbox/run_teardown.h",
    ],
    "lazyfs-attach-root": ["lazyfs/sandbox/attach_root.c"],
}
CFLAGS = ["-O2", "-static", "-Wall", "-Wextra", "-Werror"]


def build(dest: Path, root: Path = ROOT) -> list[Path]:
    """Each helper built into dest if missing or older than a source; their paths."""
    dest.mkdir(parents=True, exist_ok=True)
    built = []
    for name, sources in HELPERS.items():
        srcs, out = [root / s for s in sources], dest / name
        newest = max(src.stat().st_mtime for src in srcs)
        if not out.exists() or newest > out.stat().st_mtime:
            print(f"building {out}", file=sys.stderr)
            tmp = out.with_name(f".{name}.tmp")
            cc = os.environ.get("CC", "cc")
            units = [str(src) for src in srcs if src.suffix == ".c"]
            subprocess.run([cc, *CFLAGS, "-o", str(tmp), *units], check=True)
            tmp.replace(out)
        built.append(out)
    return built


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/build_helpers.py DIR")
    try:
        build(Path(sys.argv[1]))
    except (OSError, subprocess.CalledProcessError) as exc:
        sys.exit(f"build_helpers: {exc}")
