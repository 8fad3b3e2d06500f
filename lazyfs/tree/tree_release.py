"""The end of a hold on an image's shared tree: the last user out unmounts it, at once or
after `linger` seconds through a detached reaper (lazyfs/tree/image_mounts.py's top has
the protocol and its lock files).

Apart from the manager because `lazyfs run`'s finisher (lazyfs/sandbox/run_finish.py)
releases the tree of a run on the user's clock, and the reaper is a process of its
own: both import only this, which needs nothing but the modules Python starts with,
fcntl, and the mount table for an unmount (docs/design-changes.md has the figures).
`unmount` is here for the same reason; it is also `lazyfs umount`. lazyfs-run-wait
releases an EROFS tree and starts its reaper in C, step for step as `release_tree`
(lazyfs/sandbox/run_teardown.c): a change of a step here is one there too.

The last user out also removes the tree's files once it is unmounted (`forget_tree`): its
mount point, its device record, its mount lock and, last, its lock file. Each image a
node ever mounted left those four behind, for good: a node that runs thousands of task
images a day gathered them by the ten thousand in RUN_DIR/images/<key>/. Removing a lock
file that others may have opened is safe because every taker of it checks, once it holds
the lock, that the file it locked is still the one at the path (`same_file`), and opens
it again if not: whoever locked the removed file then knows that the tree's last user
came and went, and nothing it would do there is its to do.
"""

from __future__ import annotations

import fcntl
import os
import sys
import time

# Beside a tree (RUN_DIR/images/<key>/<id>): its files, image_mounts.py's top says what each is.
LOCK_SUFFIX = ".lock"
MOUNT_LOCK_SUFFIX = ".mount.lock"
DEVICE_SUFFIX = ".device"


def release_tree(lock_fd: int, lock_path: str, tree: str, linger: float) -> None:
    """Stop using the tree at `tree`, whose lock file `lock_path` this process holds
    shared as `lock_fd`: the last user out unmounts it (after `linger` seconds). The
    caller closes lock_fd afterwards, whatever this raised: that ends the hold."""
    try:
        # Not atomic: the shared lock may go first. Harmless: we are leaving.
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return  # another user still has the tree
    if not same_file(lock_fd, lock_path):
        return  # between our shared lock and this one, another last user came and went
    if linger > 0:
        start_reaper(lock_path, tree, linger)
    else:
        unmount_if_tree(tree, dead_too=True)
        forget_tree(lock_path, tree)


def same_file(fd: int, path: str) -> bool:
    """Whether the open file `fd` is still the file at `path`: not removed by a tree's
    last user (forget_tree) since it was opened, nor made again after that."""
    try:
        at_path = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (own.st_dev, own.st_ino) == (at_path.st_dev, at_path.st_ino)


def forget_tree(lock_path: str, tree: str) -> None:
    """Remove the files of the tree at `tree`, now unmounted: its mount point, device
    record and mount lock, then its lock file `lock_path`. Only by its last user, who
    holds that lock file exclusively, and has checked it is the one at the path: nobody
    else holds it, and so nobody mounts the tree or takes its mount lock meanwhile. If
    the mount point cannot be removed (something is still mounted there), everything
    stays: a tree mounted without its lock file would be left mounted for good."""
    try:
        os.rmdir(tree)
    except FileNotFoundError:
        pass
    except OSError:
        return
    for path in (tree + DEVICE_SUFFIX, tree + MOUNT_LOCK_SUFFIX, lock_path):
        try:  # noqa: SIM105 - contextlib is one import more for the finisher
            os.unlink(path)
        except FileNotFoundError:
            pass


def unmount_if_tree(tree: str, dead_too: bool = False) -> None:
    """Unmount the image tree at `tree` if one is mounted there; with dead_too, detach
    a dead one (an EROFS tree whose data daemon is gone) as well."""
    from lazyfs.mount_table import tree_kind

    point = os.path.abspath(tree)
    kind = tree_kind(point)  # one read of the mount table: see _unmount_kind
    if kind is not None:
        _unmount_kind(point, kind)
    elif dead_too and os.path.ismount(point):
        detach(point)


def unmount(mountpoint: str | os.PathLike[str]) -> None:
    """Unmount an image tree of either kind (`lazyfs umount`); BadInputError if what is
    there is not one."""
    from chunker.errors import BadInputError
    from lazyfs.mount_table import mounts, tree_kind

    point = os.path.abspath(mountpoint)
    kind = tree_kind(point)
    if kind is None:
        fstype = mounts().get(point, ("",))[0]
        if fstype:
            raise BadInputError(f"{point} is a {fstype} mount, not a lazyfs mount")
        raise BadInputError(f"{point} is not a lazyfs mount")
    _unmount_kind(point, kind)


def _unmount_kind(point: str, kind: str) -> None:
    """Unmount the tree of this kind ("erofs" or "fuse") at the absolute path `point`,
    which the caller just found in the mount table (not read again here: on a busy node
    each read waits for the mount namespace's lock)."""
    from lazyfs.errors import MountError
    from lazyfs.libc import libc

    if kind == "fuse":
        from lazyfs.tree.fuse_mount import umount as fuse_umount

        fuse_umount(point)
        return
    if libc.umount2(os.fsencode(point), 0) != 0:
        import ctypes

        raise MountError(f"cannot unmount {point}: {os.strerror(ctypes.get_errno())}")


def detach(mountpoint: str | os.PathLike[str]) -> None:
    """Detach what is mounted there (MNT_DETACH: its users keep it until they leave)."""
    from lazyfs.libc import MNT_DETACH, libc

    libc.umount2(os.fsencode(mountpoint), MNT_DETACH)


def stamp(lock_path: str) -> int:
    """Set the lock file's mtime to a value it never had (the clock's ticks are coarse,
    so two stamps in a row could otherwise be equal); returns it."""
    value = max(time.time_ns(), os.stat(lock_path).st_mtime_ns + 1)
    os.utime(lock_path, ns=(value, value))
    return value


def start_reaper(lock_path: str, tree: str, linger: float) -> None:
    """Unmount `linger` seconds from now unless the tree was used meanwhile (see
    image_mounts.py's top)."""
    value = stamp(lock_path)
    reaper = [sys.executable, "-m", "lazyfs.tree.tree_release", "reap", lock_path, tree]
    _spawn_detached(
        ["/bin/sh", "-c", 'cd / && sleep "$0" && exec "$@"', str(linger), *reaper, str(value)]
    )


def _spawn_detached(argv: list[str]) -> None:
    """Start argv in a session of its own (it outlives this process and its process
    group) on /dev/null, with none of this process's descriptors but 0-2; never waited
    for. None: a reaper that inherited a descriptor of the tree's lock (the finisher's is
    inheritable, for its exec) would hold the lock for good, and one of a slot of
    lazyfs/sandbox/run_wait.py would hold the slot.

    posix_spawn, not subprocess: the finisher of every `lazyfs run --linger` starts one,
    and importing subprocess (with re, locale, signal, threading, selectors) was ~10 ms of
    the finisher's ~30 (docs/design-changes.md, session 29). Not fork: the snapshotter,
    which releases trees too, has threads. Python opens its own descriptors
    non-inheritable (PEP 446), so only those made inheritable need closing."""
    # Here, not at the top: image_mounts imports this module, and `lazyfs run` imports
    # that before it starts the data daemon, when ctypes would delay a cold start.
    from lazyfs.fds import inheritable_fds
    from lazyfs.spawn import spawn

    opens = [(fd, os.devnull, os.O_RDWR, 0) for fd in (0, 1, 2)]
    spawn(argv, os.environ, opens=opens, closes=inheritable_fds(), setsid=True)


def reap(lock_path: str, tree: str, value: int) -> None:
    """The reaper's last step: unmount if the tree is idle and was not used since."""
    fd = lock_unused(lock_path)
    if fd is None:
        return  # in use (its last user will start a reaper), or gone with its tree
    try:
        if os.fstat(fd).st_mtime_ns == value:  # not stamped since: not used since
            from chunker.errors import LazyfsError

            try:
                unmount_if_tree(tree)
            except LazyfsError:
                return
            forget_tree(lock_path, tree)
    finally:
        os.close(fd)


def lock_unused(lock_path: str) -> int | None:
    """A descriptor of the tree's lock file, locked exclusively, if nobody uses the tree
    and the file is the one at the path (a last user without linger may have removed it,
    and a new user made it again, since the reaper was started); else None. The caller
    closes it."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if same_file(fd, lock_path):
            return fd
    except BlockingIOError:
        pass
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None


if __name__ == "__main__":  # python -m lazyfs.tree.tree_release reap LOCK TREE STAMP
    if len(sys.argv) != 5 or sys.argv[1] != "reap":
        sys.exit("usage: python -m lazyfs.tree.tree_release reap LOCK TREE STAMP")
    reap(sys.argv[2], sys.argv[3], int(sys.argv[4]))
