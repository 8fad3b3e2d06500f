"""Small, standard-library-only helpers for the processes that own a FUSE mount: the
per-image FUSE daemon (lazyfs/tree/fuse_mount.py) and the data daemon's supervisor
(lazyfs/tree/fuse_supervisor.py, kept free of lazyfs's heavier imports).

- the kernel's read-ahead of a mount (1 MiB reads: +15-25 % sequential throughput here;
  it must be set after FUSE_INIT, whose reply resets it), and of an EROFS tree;
- a watchdog that detaches the mount once its owner is really gone;
- the ready line: a starting daemon tells its starter, on a pipe, in one JSON line,
  that it serves or why it cannot (`ready_reporter` writes it; its starter reads it:
  lazyfs/tree/daemon_start.py).
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable

from lazyfs import lazy_logging
from lazyfs.mount_table import escape

# logging and subprocess are imported where they are used: a cold `lazyfs run` mounts an
# EROFS tree with raise_read_ahead and erofs_bdi alone, and the two were ~6 ms of its
# imports (read from a cold disk); the daemons that start watchdogs import both anyway.
LOGGER = "lazyfs.tree.fuse_mount"

READ_AHEAD_KB = 1024  # 1 MiB kernel reads: +15-25 % sequential throughput here

# A killed owner leaves its mount behind in two ways: a per-image daemon's auto_unmount
# helper races the kernel at exit (it may find the mount still answering, ECONNABORTED,
# and leave it: seen under load, ~1 kill in 20); the supervisor's death aborts the
# connection of every tree on it. The watchdog (a shell, ~1 MB) waits for its pipe's EOF
# and for the owner to be gone (zombie or reaped: all its fds released). Then, while a
# mount of the same device is at the mountpoint, it runs the detach command once that
# mount no longer answers (statfs fails: ENOTCONN). "Same device" alone is not that very
# mount: the kernel gives a new FUSE mount the lowest free device number, often the dead
# one's, and a new owner may have mounted there already (seen: a data daemon's starter
# replaced the dead mount within the 50 ms poll, and the watchdog detached the new one).
# A dead owner's helper (the supervisor's worker) may answer for a moment after it: the
# watchdog waits for that up to 10 s. A statfs that no one answers in 5 s (a helper stuck,
# holding the connection open) counts as dead too.
_WATCHDOG = r"""
read -r _
while s=$(sed -n 's/.*) \(.\).*/\1/p' "/proc/$1/stat" 2>/dev/null) && [ -n "$s" ] \
    && [ "$s" != Z ]; do sleep 0.05; done
n=0
while [ $n -lt 200 ] \
    && awk -v d="$2" -v m="$3" '$3 == d && $5 == m { f = 1 } END { exit !f }' /proc/self/mountinfo
do
    if ! timeout -s KILL 5 stat -f -- "$4" >/dev/null 2>&1; then shift 4; exec "$@"; fi
    n=$((n + 1)); sleep 0.05
done
"""
Ready = Callable[[str | None, int], None]  # (error message or None, exit code)

_watchdog_fds: list[int] = []  # write ends; they close only when this process exits


# FS_IOC_GETFSSYSFSPATH (linux/fs.h, 6.8+): _IOR(0x15, 1, struct fs_sysfs_path), 129 bytes.
_GETFSSYSFSPATH = (2 << 30) | (129 << 16) | (0x15 << 8) | 1


def raise_read_ahead(device: str, kb: int = READ_AHEAD_KB) -> None:
    """1 MiB kernel read-ahead for the mount with this major:minor (or the bdi of that
    name: an EROFS tree's, see erofs_bdi)."""
    bdi = f"/sys/class/bdi/{device}/read_ahead_kb"
    try:
        with open(bdi, "w") as f:
            f.write(str(kb))
    except OSError as exc:  # not root: keep the kernel's default read-ahead
        lazy_logging.info(LOGGER, "cannot raise read-ahead (%s): %s", bdi, exc)


def erofs_bdi(mountpoint: str) -> str:
    """The name of a file-backed EROFS mount's own backing_dev_info ("erofs-N"; '' if the
    kernel does not say). Its read-ahead, not the device file's, sizes the reads EROFS
    sends the data daemon: 128 KiB by default, one FUSE request each."""
    buf = bytearray(129)  # struct fs_sysfs_path: u8 len, u8 name[128] ("erofs/erofs-N")
    try:
        fd = os.open(mountpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, _GETFSSYSFSPATH, buf)
        finally:
            os.close(fd)
    except OSError as exc:
        lazy_logging.info(LOGGER, "cannot find the bdi of %s: %s", mountpoint, exc)
        return ""
    return bytes(buf[1 : 1 + buf[0]]).decode().rpartition("/")[2]


def start_watchdog(mountpoint: str, device: str, detach: list[str]) -> None:
    """Run `detach` once this process is gone, if the mount `device` is still at
    mountpoint and no longer answers (see _WATCHDOG)."""
    import subprocess

    r, w = os.pipe2(os.O_CLOEXEC)
    subprocess.Popen(
        ["sh", "-c", _WATCHDOG, "lazyfs-watchdog", str(os.getpid()), device]
        + [escape(mountpoint), mountpoint, *detach],
        stdin=r,
        stdout=subprocess.DEVNULL,
        cwd="/",
        start_new_session=True,  # a signal to our process group must not end it
    ).returncode = 0  # never waited for: it must outlive us
    os.close(r)
    _watchdog_fds.append(w)


def ready_reporter(fd: int) -> Ready:
    """Writes the ready line once on fd (then closes it); later calls do nothing."""

    def ready(error: str | None, exit_code: int) -> None:
        nonlocal fd
        if fd < 0:
            return
        line = json.dumps({"error": error, "exit_code": exit_code}) + "\n"
        try:
            os.write(fd, line.encode())
            os.close(fd)
        except OSError:
            pass  # the starter went away; nothing to tell
        fd = -1

    return ready
