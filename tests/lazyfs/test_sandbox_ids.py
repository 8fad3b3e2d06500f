"""A sandbox id's lock file (lazyfs/sandbox/runtime.py, Sandbox._allocate): an
allocator killed before its id had a name leaves a `.new-*.lock` nobody holds, which
the next cleanup removes at once (a restarted agent's node is then clean); one held by
a live allocator stays."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from lazyfs.sandbox.runtime import Sandbox, SandboxHost, cleanup_stale


def test_a_dead_allocators_file_goes_at_once_and_a_live_ones_stays(tmp_path: Path) -> None:
    host = SandboxHost(tmp_path / "sandboxes", tmp_path / "oci", "lazyfs-test-ids")
    box = Sandbox._allocate("runc", host)  # a live one: its lock file is held
    dead = host.sandbox_dir / ".new-0123456789abcdef.lock"
    dead.write_text("")  # as a kill -9 between its open and its rename leaves it
    held = host.sandbox_dir / ".new-fedcba9876543210.lock"
    fd = os.open(held, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert cleanup_stale(host) == []
        names = sorted(p.name for p in host.sandbox_dir.iterdir())
        assert names == sorted([held.name, f"{box.id}.lock", box.id]), names
    finally:
        os.close(fd)
        box.delete()
