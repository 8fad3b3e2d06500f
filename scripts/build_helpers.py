"""Build lazyfs's C helpers into a directory, where the settings look for them.

    python scripts/build_helpers.py DIR

- lazyfs-exec-server (lazyfs/agent/exec_server.c): every agent sandbox's PID 1;
- lazyfs-run-wait (lazyfs/sandbox/run_wait.c): what a `lazyfs run` is while its command
  runs;
- lazyfs-attach-root (lazyfs/sandbox/attach_root.c): how a warm generic sandbox takes an
  image's root.

All are static, so that they run in any image and start in microseconds. A helper is
rebuilt only when its source is newer than the binary. Used by the packaging (setup.py,
so that any install of the project has them, in its scripts directory) and by
scripts/setup.sh (the development venv). Standard library only.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HELPERS = {
    "lazyfs-exec-server": "lazyfs/agent/exec_server.c",
    "lazyfs-run-wait": "lazyfs/sandbox/run_wait.c",
    "lazyfs-attach-root": "lazyfs/sandbox/attach_root.c",
}
CFLAGS = ["-O2", "-static", "-Wall", "-Wextra", "-Werror"]


def build(dest: Path, root: Path = ROOT) -> list[Path]:
    """Each helper built into dest if missing or older than its source; their paths."""
    dest.mkdir(parents=True, exist_ok=True)
    built = []
    for name, source in HELPERS.items():
        src, out = root / source, dest / name
        if not out.exists() or src.stat().st_mtime > out.stat().st_mtime:
            print(f"building {out}", file=sys.stderr)
            tmp = out.with_name(f".{name}.tmp")
            cc = os.environ.get("CC", "cc")
            subprocess.run([cc, *CFLAGS, "-o", str(tmp), str(src)], check=True)
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
