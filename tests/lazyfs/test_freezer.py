"""lazyfs/sandbox/freezer.py on a real cgroup, and teardown's thaw: a dead agent's
sandbox left paused must still end (its processes take SIGKILL only once thawed)."""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lazyfs.sandbox.freezer import is_frozen, set_frozen
from lazyfs.sandbox.teardown import cgroup_dirs, remove_cgroups

FREEZER = Path("/sys/fs/cgroup/freezer")


@pytest.fixture
def frozen_box() -> Iterator[tuple[str, str, subprocess.Popen]]:
    """A `sleep` in a freezer cgroup of its own, frozen: (parent, id, the process)."""
    parent, box_id = f"lazyfs-test-{secrets.token_hex(4)}", "lazyfs-freezer0"
    where = FREEZER / parent / box_id
    where.mkdir(parents=True)
    proc = subprocess.Popen(["sleep", "60"])
    try:
        (where / "cgroup.procs").write_text(str(proc.pid))
        set_frozen(parent, box_id, True)
        yield parent, box_id, proc
    finally:
        if where.exists():
            set_frozen(parent, box_id, False)
        proc.kill()
        proc.wait()
        for d in (where, where.parent):
            if d.exists():
                d.rmdir()


def test_a_frozen_sandbox_is_thawed_then_ended_by_teardown(
    frozen_box: tuple[str, str, subprocess.Popen],
) -> None:
    parent, box_id, proc = frozen_box
    assert is_frozen(parent, box_id)
    state = (FREEZER / parent / box_id / "freezer.state").read_text().strip()
    assert state == "FROZEN" and proc.poll() is None
    os.kill(proc.pid, 9)
    time.sleep(0.2)
    assert proc.poll() is None  # frozen: the kill waits
    t0 = time.monotonic()
    remove_cgroups(parent, box_id)
    assert proc.wait(timeout=5) == -9 and time.monotonic() - t0 < 1
    assert cgroup_dirs(parent, box_id) == []
