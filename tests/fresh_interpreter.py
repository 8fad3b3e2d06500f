"""Code run in a new interpreter of this environment, for the tests of what a start-up
path imports: a module already imported by the test process would hide it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable


def run_fresh(code: str, unloaded: Iterable[str] = ()) -> subprocess.CompletedProcess[str]:
    """Run code with `python -c`; it must exit 0 and, after it, none of the `unloaded`
    modules may be loaded (the failure names those that are). The finished process."""
    names = sorted(unloaded)
    check = f"\nimport sys\nloaded = set({names!r}) & set(sys.modules)\nassert not loaded, loaded\n"
    done = subprocess.run(
        [sys.executable, "-c", code + (check if names else "")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done
