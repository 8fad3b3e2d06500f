"""An image mounted as a tree for a test or benchmark, the two ways a node serves one
(TREES: erofs, the kernel's EROFS over the node data daemon; fuse, a FUSE daemon per
image), the daemons behind it, and a run dir left with nothing running.

`running_mount` starts the FUSE daemon as a subprocess, waits for the mount to answer, and
always cleans up, even when the caller fails: `fusermount3 -u`, then `-u -z`, then
SIGTERM, then SIGKILL (by the daemon's pid only), then a FUSE abort.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from testbed.mounts import (
    erofs_sources,
    fuse_mounts,
    mount_ids,
    mount_points,
    unmount_all,
    wait_gone,
)
from testbed.processes import daemon_pids, pid_alive, proc_argvs, subprocess_env, wait_until

MOUNT_TIMEOUT = 30.0
TREES = ("erofs", "fuse")  # the two ways a node serves an image (lazyfs/tree/image_mounts.py)
DATA_DAEMON_IDLE = "0.2"  # seconds: a test's data daemon exits soon after its last tree


@contextmanager
def mounted_tree(
    tree: str, image: str, mountpoint: Path, store_url: str, cache_dir: Path
) -> Iterator[None]:
    """The image mounted at mountpoint the `tree` way; everything it started is gone
    afterwards. erofs: `lazyfs mount` with a private run dir (cache_dir's sibling `run`),
    so the node data daemon is this test's own."""
    if tree == "fuse":
        with running_mount(image, mountpoint, store_url, cache_dir):
            yield
        return
    run_dir = cache_dir.parent / "run"
    env = {
        **subprocess_env(),
        "LAZYFS_TREE": "erofs",
        "LAZYFS_RUN_DIR": str(run_dir),
        "LAZYFS_DAEMON_IDLE": DATA_DAEMON_IDLE,
    }
    done = subprocess.run(
        [sys.executable, "-m", "lazyfs.cli", "mount", image, str(mountpoint)]
        + ["--store", store_url, "--cache", str(cache_dir)],
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=MOUNT_TIMEOUT,
    )
    try:
        assert done.returncode == 0, done.stderr
        yield
    finally:
        stop_erofs_tree(mountpoint, run_dir)


def stop_erofs_tree(mountpoint: Path, run_dir: Path) -> None:
    """Unmount an EROFS tree; once no tree uses the run dir's data daemon, make sure it
    exited (it does by itself, DATA_DAEMON_IDLE after its last device closed)."""
    if (
        os.path.ismount(mountpoint)
        and subprocess.run(["umount", str(mountpoint)], capture_output=True).returncode
    ):
        subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True)
    data = run_dir / "data"
    if any(source.startswith(f"{data}/") for source in erofs_sources()):
        return  # another tree of this test still reads from the daemon
    for point in [p for p in fuse_mounts() if p.startswith(f"{data}/")]:
        pids = data_daemons(point, "lazyfs.tree.fuse_supervisor") + data_daemons(point)
        try:
            wait_until(lambda point=point: point not in fuse_mounts(), 10, "data daemon exit")
        except AssertionError:
            unmount_all(Path(point), pid=pids[0] if pids else 0)
        for pid in pids:
            if wait_gone(pid, None, 10):
                unmount_all(Path(point), pid=pid)


@contextmanager
def running_mount(
    image: str, mountpoint: Path, store_url: str, cache_dir: Path
) -> Iterator[subprocess.Popen]:
    """The real daemon in the foreground of a subprocess, mounted at mountpoint."""
    log = open(cache_dir.parent / f"mount-{mountpoint.name}.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "lazyfs.tree.fuse_mount", image, str(mountpoint)]
        + ["--store", store_url, "--cache", str(cache_dir)],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd="/",
        env=subprocess_env(),
    )
    try:
        deadline = time.monotonic() + MOUNT_TIMEOUT
        while not os.path.ismount(mountpoint):
            if proc.poll() is not None:
                raise AssertionError(f"mount daemon exited with {proc.returncode}; see {log.name}")
            if time.monotonic() > deadline:
                raise AssertionError("mount did not appear")
            time.sleep(0.02)
        yield proc
    finally:
        unmount_all(mountpoint, proc)
        log.close()


def data_daemons(mountpoint: str, module: str = "lazyfs.tree.data_daemon") -> list[int]:
    """Pids of data daemons (workers) serving this mount point; with
    module="lazyfs.tree.fuse_supervisor", of their supervisors."""
    return daemon_pids(module, mountpoint)


def data_mount(run_dir: Path) -> str:
    """The data daemon's mount point under run_dir (exactly one)."""
    points = [p for p, (kind, _) in mount_ids().items() if kind == "fuse.lazyfs-data"]
    (point,) = [p for p in points if p.startswith(f"{run_dir}/data/")]
    return point


def supervisors(run_dir: Path) -> list[int]:
    """Pids of the live supervisors (lazyfs/tree/fuse_supervisor.py) of run_dir's node
    data daemon."""
    return _of_run_dir(run_dir, b"lazyfs.tree.fuse_supervisor")


def workers(run_dir: Path) -> list[int]:
    """Pids of the live workers (lazyfs/tree/data_daemon.py) of run_dir's node data
    daemon: with supervisors(), what a `kill -9` of the node's data daemon ends."""
    return _of_run_dir(run_dir, b"lazyfs.tree.data_daemon")


def _of_run_dir(run_dir: Path, module: bytes) -> list[int]:
    data = os.fsencode(f"{run_dir}/data/")
    found = [
        pid
        for pid, argv in proc_argvs()
        if module in argv and any(a.startswith(data) for a in argv)
    ]
    return [p for p in found if pid_alive(p)]


def one_worker(
    point: str,
    not_in: set[int] = frozenset(),
    timeout: float = 10.0,
    module: str = "lazyfs.tree.data_daemon",
) -> int:
    """The pid of the data daemon (run as `module`) serving point, once it is a new one."""
    found: list[int] = []

    def new_one() -> bool:
        found[:] = [p for p in data_daemons(point, module) if p not in not_in]
        return len(found) == 1

    wait_until(new_one, timeout, "a new data daemon")
    return found[0]


def clean_run_dir(run_dir: Path) -> None:
    """Leave nothing of a run dir running: linger reapers, shared image trees (and their
    FUSE daemons), the node data daemon. By pid only, and only this run dir's."""
    for pid in reapers(run_dir):
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    images = f"{run_dir}/images/"
    for point in reversed([p for p in mount_points() if p.startswith(images)]):
        if point in fuse_mounts():
            pids = daemon_pids("lazyfs.tree.fuse_mount", point)
            unmount_all(Path(point), pid=pids[0] if pids else 0)
        elif subprocess.run(["umount", point], capture_output=True).returncode:
            subprocess.run(["umount", "-l", point], capture_output=True)
    for point in [p for p in fuse_mounts() if p.startswith(f"{run_dir}/data/")]:
        for pid in data_daemons(point, "lazyfs.tree.fuse_supervisor") + data_daemons(point):
            unmount_all(Path(point), pid=pid)
        unmount_all(Path(point))


def reapers(run_dir: Path) -> list[int]:
    """Pids of linger reapers (lazyfs/tree/tree_release.py) of trees in this run dir, and of
    the sleeps they wait in."""
    found = []
    for pid, argv in proc_argvs():
        if b"reap" in argv and any(a.startswith(os.fsencode(f"{run_dir}/images/")) for a in argv):
            found.append(pid)
            with suppress(OSError), open(f"/proc/{pid}/task/{pid}/children") as f:
                found += [int(c) for c in f.read().split()]
    return found


def stats_of(cache: Path) -> dict:
    """The stats of the one mount that used this cache directory (its daemon's file)."""
    (path,) = (cache / "mounts").glob("*.json")
    return json.loads(path.read_text())
