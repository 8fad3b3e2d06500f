"""Compare two directory trees entry by entry: the check behind every end-to-end test.

A lazyfs mount must look exactly like an independent extraction of the same image, so
this records everything an image defines: type, permission bits (setuid/setgid/sticky
included), owner, size, content hash, symlink target, device number, mtime in ns,
xattrs and hard-link groups. It never follows symlinks and works on bytes paths so names
that are not UTF-8 survive. Directory sizes, link counts of directories, atime and ctime
are filesystem-specific and not part of an image, so they are not compared.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from pathlib import Path

import blake3

_KINDS = {
    stat.S_IFREG: "file",
    stat.S_IFDIR: "dir",
    stat.S_IFLNK: "symlink",
    stat.S_IFCHR: "char-device",
    stat.S_IFBLK: "block-device",
    stat.S_IFIFO: "fifo",
    stat.S_IFSOCK: "socket",
}


@dataclass(frozen=True)
class EntryInfo:
    kind: str  # one of _KINDS' values
    mode: int  # stat.S_IMODE: permission bits with setuid, setgid, sticky
    uid: int
    gid: int
    size: int | None  # files and symlinks only
    blake3: str | None  # hex digest of a regular file's content
    target: bytes | None  # symlink target
    rdev: int | None  # devices only
    mtime_ns: int
    xattrs: tuple[tuple[str, bytes], ...]  # sorted by name
    nlink: int | None  # not for directories
    links: tuple[bytes, ...] | None  # regular files with nlink > 1: every path of the inode


def snapshot(root: Path, *, ignore_xattrs: Iterable[str] = ()) -> dict[bytes, EntryInfo]:
    """Every entry below `root` (itself as b"."), by relative bytes path."""
    ignored = set(ignore_xattrs)
    base = os.fsencode(root)
    entries: dict[bytes, EntryInfo] = {}
    inodes: dict[tuple[int, int], list[bytes]] = {}

    def record(rel: bytes, path: bytes) -> os.stat_result:
        st = os.lstat(path)
        fmt = stat.S_IFMT(st.st_mode)
        kind = _KINDS.get(fmt, f"unknown-{fmt:o}")
        is_file = fmt == stat.S_IFREG
        if is_file and st.st_nlink > 1:
            inodes.setdefault((st.st_dev, st.st_ino), []).append(rel)
        entries[rel] = EntryInfo(
            kind=kind,
            mode=stat.S_IMODE(st.st_mode),
            uid=st.st_uid,
            gid=st.st_gid,
            size=st.st_size if fmt in (stat.S_IFREG, stat.S_IFLNK) else None,
            blake3=_hash_file(path) if is_file else None,
            target=os.readlink(path) if fmt == stat.S_IFLNK else None,
            rdev=st.st_rdev if fmt in (stat.S_IFCHR, stat.S_IFBLK) else None,
            mtime_ns=st.st_mtime_ns,
            xattrs=_xattrs(path, ignored),
            nlink=None if fmt == stat.S_IFDIR else st.st_nlink,
            links=None,
        )
        return st

    record(b".", base)
    stack = [b""]
    while stack:
        rel_dir = stack.pop()
        with os.scandir(os.path.join(base, rel_dir) if rel_dir else base) as it:
            for dirent in it:
                rel = os.path.join(rel_dir, dirent.name) if rel_dir else dirent.name
                st = record(rel, dirent.path)
                if stat.S_ISDIR(st.st_mode):
                    stack.append(rel)

    for paths in inodes.values():
        group = tuple(sorted(paths))
        for rel in paths:
            entries[rel] = replace(entries[rel], links=group)
    return entries


def diff_trees(
    a: Path, b: Path, *, check_root_mtime: bool = True, ignore_xattrs: Iterable[str] = ()
) -> list[str]:
    """Human-readable differences between trees `a` and `b`; empty means identical."""
    ignore_xattrs = tuple(ignore_xattrs)
    return diff_snapshots(
        snapshot(a, ignore_xattrs=ignore_xattrs),
        snapshot(b, ignore_xattrs=ignore_xattrs),
        check_root_mtime=check_root_mtime,
    )


def diff_snapshots(
    sa: dict[bytes, EntryInfo], sb: dict[bytes, EntryInfo], *, check_root_mtime: bool = True
) -> list[str]:
    out = []
    for rel in sorted(sa.keys() | sb.keys()):
        name = show(rel)
        if rel not in sb:
            out.append(f"{name}: only in a ({sa[rel].kind})")
            continue
        if rel not in sa:
            out.append(f"{name}: only in b ({sb[rel].kind})")
            continue
        ea, eb = sa[rel], sb[rel]
        for f in fields(EntryInfo):
            va, vb = getattr(ea, f.name), getattr(eb, f.name)
            if va == vb or (f.name == "mtime_ns" and rel == b"." and not check_root_mtime):
                continue
            out.append(f"{name}: {f.name} {_fmt(f.name, va)} != {_fmt(f.name, vb)}")
    return out


def assert_trees_equal(
    a: Path,
    b: Path,
    *,
    check_root_mtime: bool = True,
    ignore_xattrs: Iterable[str] = (),
    limit: int = 30,
) -> None:
    diffs = diff_trees(a, b, check_root_mtime=check_root_mtime, ignore_xattrs=ignore_xattrs)
    if diffs:
        shown = "\n  ".join(diffs[:limit])
        more = f"\n  ... and {len(diffs) - limit} more" if len(diffs) > limit else ""
        raise AssertionError(f"{len(diffs)} differences between {a} and {b}:\n  {shown}{more}")


def show(rel: bytes) -> str:
    """A path for messages: undecodable bytes shown as \\xNN."""
    return rel.decode("utf-8", "backslashreplace")


def _fmt(field: str, value: object) -> str:
    if field == "mode" and isinstance(value, int):
        return f"{value:#o}"
    if field == "links" and value is not None:
        return "(" + ", ".join(show(p) for p in value) + ")"  # type: ignore[union-attr]
    if field == "rdev" and isinstance(value, int):
        return f"{os.major(value)}:{os.minor(value)}"
    return repr(value)


def _hash_file(path: bytes) -> str:
    h = blake3.blake3()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _xattrs(path: bytes, ignored: set[str]) -> tuple[tuple[str, bytes], ...]:
    try:
        listed = os.listxattr(path, follow_symlinks=False)
    except OSError as exc:
        if exc.errno != errno.ENOTSUP:  # a filesystem without xattrs has none to compare
            raise
        return ()
    names = sorted(n for n in listed if n not in ignored)
    return tuple((n, os.getxattr(path, n, follow_symlinks=False)) for n in names)
