"""The mounts a test or benchmark made: found in the mount table (read through
lazyfs/mount_table.py, the product's one reader), and removed with whatever daemon serves
them (unmount, lazy unmount, signals, a FUSE abort)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

from lazyfs.mount_table import entries
from testbed.processes import pid_alive


@contextmanager
def stacked(lowers: Sequence[Path], target: Path) -> Iterator[None]:
    """A read-only overlay of `lowers` (top first) at target, as a node stacks an
    image's layer trees; unmounted afterwards, even if the caller fails."""
    options = "lowerdir=" + ":".join(map(str, lowers))
    subprocess.run(
        ["mount", "-t", "overlay", "-o", f"ro,{options}", "overlay", str(target)], check=True
    )
    try:
        yield
    finally:
        subprocess.run(["umount", str(target)], check=False)


def mounts_below(*prefixes: Path | str) -> list[str]:
    """Mount points at or below any of `prefixes`, in mount order (a point mounted twice
    shows twice)."""
    roots = [str(p).rstrip("/") for p in prefixes]
    return [
        m.point
        for m in entries()
        if any(m.point == r or m.point.startswith(r + "/") for r in roots)
    ]


def wait_no_mounts_below(path: Path | str, timeout: float = 10.0) -> list[str]:
    """Wait up to `timeout` seconds for nothing to be mounted at or below path (a data
    daemon exits LAZYFS_DAEMON_IDLE seconds after its last tree, and unmounts then);
    returns what is still there."""
    deadline = time.monotonic() + timeout
    while (left := mounts_below(path)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def mount_points() -> list[str]:
    """Every mount point, in mount order."""
    return [m.point for m in entries()]


def fuse_mounts() -> list[str]:
    """The mount points of FUSE mounts (fstype fuse or fuse.SUBTYPE), in mount order."""
    return [m.point for m in entries() if m.fstype.startswith("fuse")]


def erofs_sources() -> list[str]:
    """The sources (device files) of the EROFS mounts."""
    return [m.source for m in entries() if m.fstype == "erofs"]


def mount_ids() -> dict[str, tuple[str, str]]:
    """Mount point -> (fstype, mount id) of the newest mount there: the same id before
    and after means not remounted."""
    return {m.point: (m.fstype, m.mount_id) for m in entries()}


def fuse_connection(mountpoint: str) -> str:
    """The FUSE connection id (device minor) of the mount at mountpoint, or ''."""
    conn = ""
    for m in entries():
        if m.point == mountpoint and m.device.startswith("0:"):
            conn = m.device.split(":")[1]
    return conn


def detach_mounts_below(path: Path) -> list[str]:
    """Unmount (lazily, newest first) everything below path; returns what was there."""
    left = mounts_below(path)
    for point in reversed(left):
        if subprocess.run(["umount", point], capture_output=True).returncode != 0:
            subprocess.run(["fusermount3", "-u", "-z", point], capture_output=True)
            subprocess.run(["umount", "-l", point], capture_output=True)
    return left


def unmount_all(mountpoint: Path, proc: subprocess.Popen | None = None, pid: int = 0) -> None:
    """Leave no mount and no daemon behind: -u, -u -z, SIGTERM, SIGKILL, then abort.

    The abort (fusectl) is for a daemon stuck in a request to its own mount: it cannot
    die until its FUSE connection is aborted.
    """
    point = str(mountpoint)
    conn = fuse_connection(point)
    if point in fuse_mounts():
        subprocess.run(["fusermount3", "-u", point], capture_output=True, timeout=30)
    if point in fuse_mounts():
        subprocess.run(["fusermount3", "-u", "-z", point], capture_output=True, timeout=30)
    pid = proc.pid if proc is not None else pid
    if not pid or not wait_gone(pid, proc, 0):
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with suppress(ProcessLookupError):
            os.kill(pid, sig)
        if not wait_gone(pid, proc, 5):
            return
    abort_connection(conn)
    if wait_gone(pid, proc, 5):
        raise AssertionError(f"mount daemon {pid} would not die")


def wait_gone(pid: int, proc: subprocess.Popen | None, timeout: float) -> bool:
    """True if pid is still alive after timeout seconds (reaping it if it is our child)."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None:
            with suppress(subprocess.TimeoutExpired):
                proc.wait(0.05)
                return False
        elif not pid_alive(pid):
            return False
        else:
            time.sleep(0.05)
        if time.monotonic() > deadline:
            return True


def abort_connection(conn: str) -> None:
    if not conn:
        return
    base = "/sys/fs/fuse/connections"
    mounted = False
    if not os.path.exists(f"{base}/{conn}"):
        mounted = subprocess.run(["mount", "-t", "fusectl", "none", base]).returncode == 0
    try:
        with suppress(OSError), open(f"{base}/{conn}/abort", "w") as f:
            f.write("1")
    finally:
        if mounted:
            subprocess.run(["umount", base])
