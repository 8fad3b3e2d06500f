"""The kernel's mount table, read in one place: what is mounted where, and whether a
path is a lazyfs image tree. Standard library only, below everything that mounts: the
image-mount manager, the per-image FUSE daemon, the data daemon's supervisor and the
tree warmer all read it through here, and so do the tests and benchmarks (testbed/mounts.py).
"""

from __future__ import annotations

import os
from collections import namedtuple
from stat import S_ISLNK

# Only for annotations: `lazyfs run`'s finisher reads the table to unmount a tree, and
# typing and pathlib would be most of its imports (lazyfs/sandbox/run_finish.py).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

FUSE_TREE_FSTYPE = "fuse.lazyfs"  # a per-image FUSE tree (lazyfs/tree/fuse_mount.py)
DATA_FSTYPE = "fuse.lazyfs-data"  # the node data daemon's mount of its devices


_FIELDS = ("point", "device", "fstype", "source", "mount_id", "options", "super_options")


class Mount(namedtuple("Mount", _FIELDS)):  # not typing.NamedTuple: see above
    """One line of /proc/self/mountinfo (proc(5)); paths unescaped, options as written."""

    __slots__ = ()
    point: str
    device: str  # major:minor
    fstype: str
    source: str
    mount_id: str  # unique while mounted (the kernel reuses it once the mount is gone)
    options: str  # the mount's own, comma-separated: "rw,nosuid,nodev,relatime"
    super_options: str  # the filesystem's, comma-separated: "rw,size=8192k"


def escape(path: str) -> str:
    """A path as /proc/mounts and mountinfo write it (space, tab, newline, backslash
    as \\ooo)."""
    return "".join(c if c not in " \t\n\\" else f"\\{ord(c):03o}" for c in path)


def unescape(field: bytes) -> str:
    """The path of a /proc/mounts or mountinfo field."""
    if b"\\" not in field:
        return os.fsdecode(field)
    import re  # rarely needed: a path with a space, tab, newline or backslash

    return os.fsdecode(re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]), field))


def parse(line: bytes) -> Mount:
    """One mountinfo line: ID PARENT MAJ:MIN ROOT POINT OPTIONS [OPTIONAL...] - FSTYPE
    SOURCE SUPER_OPTIONS (the optional fields, such as `shared:1`, vary in number)."""
    fields = line.split()
    sep = fields.index(b"-")
    return Mount(
        unescape(fields[4]),
        fields[2].decode(),
        fields[sep + 1].decode(),
        unescape(fields[sep + 2]),
        fields[0].decode(),
        os.fsdecode(fields[5]),
        os.fsdecode(fields[sep + 3]) if len(fields) > sep + 3 else "",
    )


def entries() -> Iterator[Mount]:
    """Every mount of this process's namespace, oldest first (/proc/self/mountinfo)."""
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            yield parse(line)


def newest() -> dict[str, Mount]:
    """Mount point -> the newest mount there, from one read of the table (a caller that
    asks several questions passes it on: the table has lines for every sandbox's
    mounts, so a node with many reads it in milliseconds)."""
    return {m.point: m for m in entries()}


def mounts() -> dict[str, tuple[str, str]]:
    """Mount point -> (fstype, source) for every mount (the newest at each point)."""
    return {m.point: (m.fstype, m.source) for m in entries()}


def is_mount_point(path: str | os.PathLike[str]) -> bool:
    """os.path.ismount(path), without its realpath(): that walks every component of the
    parent with an lstat each, ~37 us against ~6 here, and a claim asks this of each of
    its image's trees (a burst: hundreds of times a second). A symlink is not a mount
    point; the parent is stat()ed through its symlinks, as realpath would have it."""
    try:
        st = os.lstat(path)
        if S_ISLNK(st.st_mode):
            return False
        parent = os.stat(os.path.dirname(os.path.abspath(path)))
    except (OSError, ValueError):
        return False
    return st.st_dev != parent.st_dev or st.st_ino == parent.st_ino


def mount_device(mountpoint: str, table: dict[str, Mount] | None = None) -> str:
    """major:minor of the newest mount at mountpoint ('' if none)."""
    found = (newest() if table is None else table).get(mountpoint)
    return found.device if found else ""


def tree_kind(mountpoint: Path, table: dict[str, Mount] | None = None) -> str | None:
    """ "erofs" or "fuse" if a lazyfs image tree is mounted there, else None."""
    table = newest() if table is None else table
    found = table.get(os.path.abspath(mountpoint))
    if found is None:
        return None
    if found.fstype == FUSE_TREE_FSTYPE:
        return "fuse"
    data = table.get(os.path.dirname(found.source))
    if found.fstype == "erofs" and data is not None and data.fstype == DATA_FSTYPE:
        return "erofs"
    return None
