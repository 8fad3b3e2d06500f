"""The life of a process that serves a FUSE tree (the data daemon, the per-image FUSE
daemon): started detached, reporting ready or its one-line error through a pipe, stopped
in order by SIGTERM or SIGINT inside its loop (lazyfs/tree/daemon_loop.py), its mount's
read-ahead raised and a watchdog that detaches the mount if the process dies. The starter
(`lazyfs run`, the agent) imports this module too, so the loop's imports are not here.
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

from chunker.errors import BadInputError, LazyfsError
from lazyfs.errors import MountError
from lazyfs.mount_table import mount_device
from lazyfs.tree.mount_watch import Ready, raise_read_ahead, read_report, start_watchdog

log = logging.getLogger("lazyfs.tree")

START_TIMEOUT = 600.0  # seconds for a daemon to fetch the manifest and mount


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


def spawn_daemon(argv: list[str], logfile: Path, what: str) -> int:
    """Start `argv --ready-fd N` detached, logging to logfile; return its pid once it
    reports ready on fd N, or raise MountError with the one-line error it reported."""
    try:
        logfile.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BadInputError(f"cannot use directory {logfile.parent}: {exc.strerror}") from None
    r, w = os.pipe()
    try:
        with open(logfile, "ab") as out:
            proc = subprocess.Popen(
                [*argv, "--ready-fd", str(w)],
                pass_fds=(w,),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                cwd="/",  # never keep the caller's directory busy
                start_new_session=True,  # the terminal's ^C must not reach the daemon
            )
    finally:
        os.close(w)
    try:
        report = read_report(r, START_TIMEOUT)
    except TimeoutError:
        proc.kill()
        proc.wait()
        timeout = f"{what} did not start within {START_TIMEOUT:.0f} s; see {logfile}"
        raise MountError(timeout) from None
    finally:
        os.close(r)
    if report is None:
        report = {"error": f"{what} exited with status {proc.wait()} before it was ready"}
    if report.get("error") is not None:
        proc.wait()
        raise MountError(report["error"], int(report.get("exit_code", 1)))
    proc.returncode = 0  # detached on purpose: no "still running" warning from Popen
    return proc.pid
