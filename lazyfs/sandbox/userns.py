"""A sandbox's own user namespace: root in it is an unprivileged range of the host's ids.

Without one, root in a sandbox is uid 0 of the host: the kernel counts what it holds
(pending signals, message-queue bytes, inotify instances, epoll watches, pipe pages,
processes) against the host's root, and whatever of the kernel it reaches past its
walls, it reaches as root (docs/security.md, finding 20 and "What is left"). With one
(`lazyfs run --userns`), each sandbox has a range of IDS host ids of its own, from
FIRST_ID on:

- The range: ids 0..65535 in the sandbox are host ids base..base+65535. A live sandbox
  holds its range by its writable layer (SANDBOX_DIR/<id>, a tmpfs), whose root the
  range's base owns: `allocate` looks at who owns each entry of SANDBOX_DIR, under a
  lock of it, and takes the first range no one holds. Deleting the sandbox unmounts its
  layer and so frees the range, with nothing else to clean up, whoever deletes it.
  FIRST_ID..LAST_ID is what systemd leaves to containers (systemd's UIDS-GIDS.md):
  28,664 ranges.
- The namespace's owner is the range's base, not root (`make_userns`: a child takes the
  base as its ids before it unshares). The kernel charges a namespace's counters to its
  owner in the parent namespace as well; with root as the owner (what runc makes from a
  spec's mappings) every sandbox's pending signals and inotify instances would still be
  counted against the host's root. runc joins this namespace by path.
- Its root: the image's trees are shared by every sandbox of the image and owned by the
  image's ids, so each sandbox stacks id-mapped clones of them (`idmapped`: open_tree
  and mount_setattr(MOUNT_ATTR_IDMAP); EROFS takes an idmap on this kernel, the FUSE
  trees do not). The overlay over the clones, its upper and work directories and the
  names layer (/etc/hosts, /etc/hostname) are owned by the range (`shift`), so the
  sandbox sees its files as without a user namespace and root in it can write them.
- The runtime's init walks to the root in the sandbox's layer (mode 0700) as the base,
  so SANDBOX_DIR and each directory above it must let other users through (search, not
  read: lazyfs/host_dirs.py makes SANDBOX_DIR 0711, as dockerd makes its root with user
  namespaces); `check_reachable` says which one does not.
- Resource limits: runc sets a spec's rlimits with prlimit(2) from outside the
  namespace, which the kernel allows a process without the sandbox's ids only with
  CAP_SYS_RESOURCE over it, and root lacks that on this machine (a CI runner's root may
  too). So the spec has none, and once the runtime has created the sandbox a child
  with the range's base as its ids sets them (`set_limits`). Such a child can lower a
  hard limit, not raise it: a sandbox with a user namespace of its own gets hard
  limits within the node's own (lazyfs/sandbox/ulimits.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import resource
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from chunker.errors import BadInputError
from lazyfs.libc import libc
from lazyfs.sandbox.ulimits import NAMES

FIRST_ID = 0x80000  # 524288
LAST_ID = 0x6FFFFFFF
IDS = 65536  # ids a sandbox has: 0..65535, as a container's /etc/subuid range
SLOTS = (LAST_ID + 1 - FIRST_ID) // IDS

CLONE_NEWUSER = 0x10000000
# The new mount API; the same syscall numbers on every architecture (424 on).
SYS_OPEN_TREE, SYS_MOUNT_SETATTR = 428, 442
OPEN_TREE_CLONE, OPEN_TREE_CLOEXEC = 1, os.O_CLOEXEC
AT_EMPTY_PATH, AT_FDCWD = 0x1000, -100
MOUNT_ATTR_IDMAP = 0x00100000
MS_BIND = 4096


class UserNamespace(NamedTuple):
    """A sandbox's user namespace, as its spec names it."""

    path: str  # where it is pinned (`pin`), for the runtime to join
    ids: IdRange


class IdRange(NamedTuple):
    """Host ids base..base+size-1, which are 0..size-1 in the sandbox."""

    base: int
    size: int = IDS

    def mappings(self) -> list[dict]:
        """The OCI spec's linux.uidMappings (and gidMappings)."""
        return [{"containerID": 0, "hostID": self.base, "size": self.size}]

    def to_host(self, sandbox_id: int) -> int:
        """A sandbox's uid or gid as the host sees it; unmapped ones stay as they are."""
        return self.base + sandbox_id if 0 <= sandbox_id < self.size else sandbox_id


def allocate(sandbox_dir: Path, take: Callable[[IdRange], None]) -> IdRange:
    """A range no live sandbox holds, given to `take` (which mounts the new sandbox's
    writable layer owned by it, and so holds it: see the top); the range."""
    fd = os.open(sandbox_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # one allocation at a time
        held = set()
        with os.scandir(sandbox_dir) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):  # a sandbox going meanwhile
                    held.add(entry.stat(follow_symlinks=False).st_uid)
        base = next((b for b in range(FIRST_ID, LAST_ID, IDS) if b not in held), None)
        if base is None:
            raise BadInputError(f"all {SLOTS} id ranges for user namespaces are taken")
        ids = IdRange(base)
        take(ids)
        return ids
    finally:
        os.close(fd)


def check_reachable(directory: Path, setting: str) -> None:
    """BadInputError unless `directory` and every one above it let other users through:
    the runtime's init reaches a sandbox's root in it as the range's base, not as root."""
    for d in (directory, *directory.parents):
        mode = os.stat(d).st_mode
        if not mode & 0o001:
            raise BadInputError(
                f"{setting}={directory}: {d} does not let other users through (mode"
                f" {mode & 0o777:o}); a sandbox with its own user namespace reaches its"
                " root as an unprivileged id"
            )


def make_userns(ids: IdRange) -> int:
    """A new user namespace mapping ids, owned by ids.base (see the top); a descriptor of
    it. A child takes the base as its ids and unshares; this process, root, writes the
    maps (a namespace's owner may not map ids it does not have) and opens the namespace,
    which lives on as long as the descriptor, after the child has gone."""
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # only system calls from here on: the parent may have threads
        try:
            os.close(ready_r)
            os.close(done_w)
            _become(ids)
            if libc.unshare(CLONE_NEWUSER) == 0:
                os.write(ready_w, b"1")
                os.read(done_r, 1)
        finally:
            os._exit(0)
    os.close(ready_w)
    os.close(done_r)
    try:
        if os.read(ready_r, 1) != b"1":
            raise OSError("the user namespace's child could not unshare")
        mapping = f"0 {ids.base} {ids.size}\n"
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{pid}/{name}", "w") as f:
                f.write(mapping)
        return os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(done_w)  # the child ends
        os.close(ready_r)
        os.waitpid(pid, 0)


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def idmapped(tree: Path, userns: int) -> int:
    """A detached clone of the mount at `tree`, its ids mapped as the namespace `userns`
    maps them; its descriptor (a path to it: /proc/self/fd/N). OSError if the
    filesystem takes no idmap."""
    flags = OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC
    fd = libc.syscall(ctypes.c_long(SYS_OPEN_TREE), AT_FDCWD, os.fsencode(tree), flags)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"clone the mount at {tree}: {os.strerror(err)}")
    attr = _MountAttr(MOUNT_ATTR_IDMAP, 0, 0, userns)
    setattr_ = ctypes.c_long(SYS_MOUNT_SETATTR)
    if libc.syscall(setattr_, fd, b"", AT_EMPTY_PATH, ctypes.byref(attr), ctypes.sizeof(attr)):
        err = ctypes.get_errno()
        os.close(fd)
        why = os.strerror(err)
        if err == errno.EINVAL:  # the filesystem takes no idmap
            why = "its filesystem cannot map ids (a user namespace needs EROFS trees)"
        raise OSError(err, f"map the ids of {tree}: {why}")
    return fd


def shift(path: Path, ids: IdRange) -> None:
    """Give path and what is under it (a few files the host wrote for the sandbox) the
    range's ids for the ones they have."""
    for top, dirs, files in os.walk(path):
        for name in [top, *(os.path.join(top, n) for n in dirs + files)]:
            st = os.lstat(name)
            os.lchown(name, ids.to_host(st.st_uid), ids.to_host(st.st_gid))


def set_limits(pid: int, ids: IdRange, rlimits: list[dict]) -> None:
    """Give the created sandbox whose init is `pid` a spec's process.rlimits, from a
    child that has the range's base as its ids (see the top): the kernel lets a process
    set the limits of one with its ids, and only lower a hard limit (the callers keep
    them within this process's own: lazyfs/sandbox/ulimits.py). OSError if one fails."""
    errors_r, errors_w = os.pipe()
    child = os.fork()
    if child == 0:
        code = 1
        try:
            os.close(errors_r)
            _become(ids)
            for limit in rlimits:
                number = NAMES[limit["type"].removeprefix("RLIMIT_").lower()]
                values = tuple(_rlim(limit[k]) for k in ("soft", "hard"))
                resource.prlimit(pid, number, values)
            code = 0
        except BaseException as exc:  # noqa: BLE001 - said to the parent, whatever it is
            os.write(errors_w, str(exc).encode()[:512])
        finally:
            os._exit(code)
    os.close(errors_w)
    try:
        said = os.read(errors_r, 512).decode(errors="replace")
    finally:
        os.close(errors_r)
        _, status = os.waitpid(child, 0)
    if status:
        raise OSError(f"setting the sandbox's resource limits: {said or status}")


def _become(ids: IdRange) -> None:
    """Take the range's base as every id of this (forked) process, groups dropped."""
    os.setgroups([])
    os.setresgid(ids.base, ids.base, ids.base)
    os.setresuid(ids.base, ids.base, ids.base)


def _rlim(value: int) -> int:
    """The spec's uint64 infinity as resource.prlimit takes it."""
    return resource.RLIM_INFINITY if value >= 2**64 - 1 else value


def pin(userns: int, path: Path) -> str:
    """Keep the namespace `userns` alive at path (a new file), as `ip netns` keeps a
    network namespace: the runtime joins it by that path. It goes when the mount does
    (with the sandbox's writable layer, which holds path)."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
    if libc.mount(f"/proc/self/fd/{userns}".encode(), os.fsencode(path), None, MS_BIND, None):
        err = ctypes.get_errno()
        raise OSError(err, f"pin the user namespace at {path}: {os.strerror(err)}")
    return str(path)
