"""Taking a sandbox off the host once its processes are gone or going: its cgroups, its
runtime state, its mounts, its directories and its lock file.

The one complete implementation, for `Sandbox.delete()` (lazyfs/sandbox/runtime.py)
and for `lazyfs run`'s Python finisher (lazyfs/sandbox/run_finish.py). lazyfs-run-wait
does the plain case of `oom_kills` and `remove_sandbox` in C, step for step
(lazyfs/sandbox/run_teardown.c): a change of a step here is one there too. The finisher
is a new Python process on the user's clock, so this module imports nothing Python has
not loaded at start-up but ctypes (for umount2): not pathlib, contextlib, shutil,
signal, subprocess or json (docs/design-changes.md has the figures). Paths are plain
strings for the same reason.
"""

from __future__ import annotations

import os
import time

from lazyfs.libc import MNT_DETACH, libc
from lazyfs.mount_table import is_mount_point
from lazyfs.sandbox.freezer import thaw

CGROUP_FS = "/sys/fs/cgroup"
SIGKILL = 9  # signal.SIGKILL, without the signal module's enum classes (~5 ms to import)


def oom_kills(cgroup_parent: str, box_id: str) -> int:
    """How many processes the sandbox's memory cgroup's OOM killer killed (read it before
    remove_sandbox(): the count goes with the cgroup)."""
    for path in (
        f"{CGROUP_FS}/memory/{cgroup_parent}/{box_id}/memory.oom_control",  # v1
        f"{CGROUP_FS}/{cgroup_parent}/{box_id}/memory.events",  # v2
    ):
        try:
            with open(path) as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for line in lines:
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    return 0


def cgroup_dirs(cgroup_parent: str, box_id: str) -> list[str]:
    """The sandbox's cgroup directory in every hierarchy (v1 controllers and v2)."""
    try:
        hierarchies = [CGROUP_FS] + [e.path for e in os.scandir(CGROUP_FS)]
    except OSError:
        return []
    found = (os.path.join(h, cgroup_parent, box_id) for h in hierarchies)
    return [path for path in found if os.path.isdir(path)]


def remove_cgroups(cgroup_parent: str, box_id: str) -> None:
    """Kill whatever still runs in the sandbox's cgroups, then remove them. A paused
    agent sandbox (one a dead agent left) is thawed first, or its processes would not
    die; `lazyfs run`'s are never paused, so run_teardown.c has no such step."""
    thaw(cgroup_parent, box_id)
    for path in cgroup_dirs(cgroup_parent, box_id):
        for _ in range(100):
            try:
                with open(os.path.join(path, "cgroup.procs")) as f:
                    pids = f.read().split()
            except OSError:
                pids = []
            for pid in pids:
                try:  # noqa: SIM105 - contextlib is one import more for the finisher
                    os.kill(int(pid), SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                os.rmdir(path)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.01)  # processes still exiting


def unmount(target: str) -> None:
    """Unmount what is mounted at target, if anything; detach it if it is busy (the
    kernel frees it when its last user goes)."""
    point = os.fsencode(target)
    if is_mount_point(target) and libc.umount2(point, 0) != 0:
        libc.umount2(point, MNT_DETACH)


def remove_sandbox(
    box_dir: str, state_dir: str, lock_path: str, cgroup_parent: str, box_id: str
) -> None:
    """Remove what a sandbox leaves on the host (runtime.py's top lists it): its cgroups
    (killing what still runs in them), the runtime's state directory, the overlay and the
    writable layer under box_dir, box_dir itself and the lock file. Idempotent. The
    caller closes its descriptor on the lock file after this."""
    remove_cgroups(cgroup_parent, box_id)
    remove_dir(state_dir)
    unmount(os.path.join(box_dir, "rootfs"))
    unmount(box_dir)  # the writable layer: its files go with it
    remove_dir(box_dir)
    try:  # noqa: SIM105 - as above
        os.unlink(lock_path)
    except FileNotFoundError:
        pass


def remove_dir(path: str) -> None:
    """Remove a directory and what is in it. The usual case, a directory of plain files
    (the runtime's state) or an empty one (a sandbox's, its layer unmounted), takes a
    few system calls; anything deeper goes to shutil.rmtree, imported only then."""
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    raise IsADirectoryError(entry.path)
                os.unlink(entry.path)
        os.rmdir(path)
    except OSError:
        if os.path.lexists(path):
            import shutil

            shutil.rmtree(path, ignore_errors=True)
