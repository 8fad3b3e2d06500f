"""The life of a process that serves a FUSE tree (the data daemon, the per-image FUSE
daemon): started detached, reporting ready or its one-line error through a pipe, stopped
in order by SIGTERM or SIGINT inside its loop (lazyfs/tree/daemon_loop.py), its mount's
read-ahead raised and a watchdog that detaches the mount if the process dies. Its starter's
side is lazyfs/tree/daemon_start.py.
"""

from __future__ import annotations

from collections.abc import Callable

from chunker.errors import LazyfsError
from lazyfs.errors import MountError
from lazyfs.mount_table import mount_device
from lazyfs.tree.mount_watch import Ready, raise_read_ahead, start_watchdog


def reporting_failure(start: Callable[[], int], ready: Ready | None) -> int:
    """start(), whose failure is told to ready (the starter waiting for its report) as
    one line with an exit code, then raised as a LazyfsError."""
    try:
        return start()
    except OSError as exc:  # the local machine said no: permissions, a full disk
        where = f": {exc.filename}" if exc.filename else ""
        err: LazyfsError = MountError(f"{exc.strerror or exc}{where}")
    except LazyfsError as exc:
        err = exc
    if ready:
        ready(str(err), err.exit_code)
    raise err


def raise_mount_read_ahead(mountpoint: str) -> None:
    """1 MiB kernel read-ahead; must run after INIT, whose reply resets it."""
    raise_read_ahead(mount_device(mountpoint))


def start_mount_watchdog(mountpoint: str) -> None:
    """Detach the mount if this daemon dies and auto_unmount leaves it (mount_watch)."""
    start_watchdog(
        mountpoint, mount_device(mountpoint), ["fusermount3", "-u", "-z", "--", mountpoint]
    )
