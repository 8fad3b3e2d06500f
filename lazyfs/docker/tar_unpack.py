"""PUT /containers/{id}/archive: a tar unpacked into a directory of a sandbox, as
archive.py's docstring sets out (every path resolved in the sandbox's root, the whole
tar checked before anything is written)."""

from __future__ import annotations

import bz2
import contextlib
import errno
import gzip
import io
import lzma
import os
import posixpath
import stat
import tarfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from lazyfs.agent.files import make_dirs, openat2, opened_root, write_all
from lazyfs.docker.http import HttpError
from lazyfs.docker.tar_paths import CHUNK, GiB, MiB, PathNotFound, clean_path, entry_errors

MAX_HEADER = 1 * MiB  # one tar header read whole (Go's archive/tar allows 1 MiB too)
MAX_UNPACKED = 1 * GiB  # the files of one PUT, all told
MAX_STREAM = 2 * GiB  # the body of one PUT, and its tar decompressed: files, headers, padding
MAX_ENTRIES = 250_000  # entries in one PUT (tarfile keeps every header in memory)
NOT_MADE = {
    tarfile.CHRTYPE: "a character device",
    tarfile.BLKTYPE: "a block device",
    tarfile.FIFOTYPE: "a FIFO",
}
# Compressions by their magic bytes; Docker's own list (zstd is not in Python 3.11).
COMPRESSIONS: list[tuple[bytes, Callable[[IO[bytes]], IO[bytes]] | None]] = [
    (b"\x1f\x8b", lambda raw: gzip.GzipFile(fileobj=raw, mode="rb")),
    (b"BZh", bz2.BZ2File),
    (b"\xfd7zXZ\x00", lzma.LZMAFile),
    (b"\x28\xb5\x2f\xfd", None),  # zstd
]


@dataclass
class _Entry:
    member: tarfile.TarInfo
    rel: str  # its path inside the destination, normalized: "a/b", never ".." nor "/"
    link: str = ""  # a hard link's target, normalized the same way


@dataclass
class _Plan:
    entries: list[_Entry] = field(default_factory=list)
    files: set[str] = field(default_factory=set)  # regular files made, by rel
    size: int = 0


def unpack(rootfs: Path, dest: str, body: IO[bytes], owner: tuple[int, int]) -> None:
    """Unpack the tar `body` (a file, at its start) into directory `dest` of the rootfs.
    `owner`: the sandbox's user, who owns what is made unless the tar names root."""
    dest = clean_path(dest)
    with opened_root(rootfs) as root:
        dest_fd = _destination(root, dest)
        try:
            if not body.read(1):
                return  # Go's tar reader takes an empty body as an empty archive
            body.seek(0)
            with _open_tar(body) as tar:
                with _tar_errors():
                    plan = _plan(tar, dest)
                _extract(root, dest_fd, dest, tar, plan, owner)
        finally:
            os.close(dest_fd)


def _destination(root: int, dest: str) -> int:
    """An fd of directory `dest` in the root (a symlink to one is followed, in the root)."""
    try:
        fd = openat2(root, dest, os.O_PATH)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EXDEV):
            raise PathNotFound(dest) from None
        raise
    if not stat.S_ISDIR(os.fstat(fd).st_mode):
        os.close(fd)
        raise HttpError(400, "extraction point is not a directory")
    return fd


def _open_tar(body: IO[bytes]) -> tarfile.TarFile:
    with _tar_errors():
        return tarfile.open(fileobj=_Capped(_decompressed(body)), mode="r:")


@contextlib.contextmanager
def _tar_errors() -> Iterator[None]:
    """A body that is not a tar, or not what its compression says, as a 400. Only the
    archive is read meanwhile (no file of the sandbox), so an OSError is the
    decompressor's (gzip's BadGzipFile is one)."""
    try:
        yield
    except (tarfile.TarError, EOFError, OSError, lzma.LZMAError, zlib.error) as exc:
        raise HttpError(400, f"the body is not a valid tar archive: {exc}") from None


def _decompressed(body: IO[bytes]) -> IO[bytes]:
    """The body, decompressed as its first bytes say."""
    head = body.read(8)
    body.seek(0)
    for magic, opener in COMPRESSIONS:
        if head.startswith(magic):
            if opener is None:
                raise HttpError(400, "a zstd-compressed archive is not supported")
            return opener(body)
    return body


class _Capped:
    """The decompressed tar, as tarfile reads it, with limits. tarfile reads a PAX or
    GNU long-name header whole, in one read of the size the header gives: a read over
    MAX_HEADER is such a header (file data is read CHUNK at a time), and is refused
    before the bytes are asked for. Nothing past MAX_STREAM is read or skipped to."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0 or size > MAX_HEADER:
            raise HttpError(400, f"a tar header over {MAX_HEADER} bytes")
        self._check(self.raw.tell() + size)
        return self.raw.read(size)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            self._check(offset)
        return self.raw.seek(offset, whence)

    def tell(self) -> int:
        return self.raw.tell()

    @staticmethod
    def _check(end: int) -> None:
        if end > MAX_STREAM:
            raise HttpError(413, f"the archive unpacks to more than {MAX_STREAM} bytes")


def _plan(tar: tarfile.TarFile, dest: str) -> _Plan:
    """Every entry checked before anything is written."""
    plan = _Plan()
    for member in tar:  # each header is read here; file data is only skipped
        if len(plan.entries) >= MAX_ENTRIES:
            raise HttpError(413, f"the archive has more than {MAX_ENTRIES} entries")
        entry = _Entry(member, _inside(member.name, dest))
        _check_type(member)
        if member.islnk():
            entry.link = _inside(member.linkname, dest)
            if entry.link not in plan.files:
                raise HttpError(
                    400,
                    f"hard link {member.name!r} to {member.linkname!r}: only a file"
                    " earlier in the same archive can be linked to",
                )
        if member.issym() and (not member.linkname or "\0" in member.linkname):
            raise HttpError(400, f"symlink {member.name!r} has no valid target")
        if member.isreg():
            plan.size += member.size
            if plan.size > MAX_UNPACKED:
                raise HttpError(413, f"the archive's files come to more than {MAX_UNPACKED} bytes")
            plan.files.add(entry.rel)
        elif entry.rel in plan.files:
            plan.files.discard(entry.rel)  # replaced by a non-file: no longer linkable
        plan.entries.append(entry)
    return plan


def _inside(name: str, dest: str) -> str:
    """`name` as a path inside the destination: an absolute name is taken from the
    destination (as dockerd does); one whose ".." leads out is refused. "." is the
    destination itself."""
    if "\0" in name:
        raise HttpError(400, f"tar entry {name!r} has a NUL byte in its name")
    if name.startswith("/"):
        return posixpath.normpath("/" + name.lstrip("/")).lstrip("/") or "."
    rel = posixpath.normpath(name) if name else "."
    if rel == ".." or rel.startswith("../"):
        raise HttpError(400, f'invalid tar entry "{name}": it is outside of "{dest}"')
    return rel


def _check_type(member: tarfile.TarInfo) -> None:
    if member.type in NOT_MADE:
        raise HttpError(
            400,
            f"tar entry {member.name!r} is {NOT_MADE[member.type]}:"
            " device nodes and FIFOs cannot be made in a sandbox",
        )
    if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
        raise HttpError(400, f"tar entry {member.name!r} has an unsupported type {member.type!r}")


def _extract(
    root: int, dest_fd: int, dest: str, tar: tarfile.TarFile, plan: _Plan, owner: tuple[int, int]
) -> None:
    dirs: list[tuple[str, float]] = []  # directories' mtimes, set last (entries change them)
    for entry in plan.entries:
        if entry.rel == ".":
            continue  # the destination itself: dockerd leaves it as it is
        full = posixpath.join(dest, entry.rel)
        with entry_errors(f"tar entry {entry.member.name!r}"):
            parent_fd = make_dirs(root, posixpath.dirname(full), owner)
            try:
                _make(root, dest_fd, parent_fd, full, entry, tar, _owner(entry.member, owner))
            finally:
                os.close(parent_fd)
        if entry.member.isdir():
            dirs.append((full, entry.member.mtime))
    for full, mtime in dirs:
        _dir_mtime(root, full, mtime)


def _owner(member: tarfile.TarInfo, owner: tuple[int, int]) -> tuple[int, int]:
    """The sandbox's user, but root where the tar names root."""
    return (0 if member.uid == 0 else owner[0], 0 if member.gid == 0 else owner[1])


def _mode(member: tarfile.TarInfo) -> int:
    """The tar's permission and sticky bits; never setuid or setgid."""
    return member.mode & 0o7777 & ~(stat.S_ISUID | stat.S_ISGID)


def _make(
    root: int,
    dest_fd: int,
    parent_fd: int,
    full: str,
    entry: _Entry,
    tar: tarfile.TarFile,
    owner: tuple[int, int],
) -> None:
    name, member = posixpath.basename(full), entry.member
    if member.isdir():
        _make_dir(root, parent_fd, name, full, member, owner)
    elif member.issym():
        _make_room(parent_fd, name, full)
        os.symlink(member.linkname, name, dir_fd=parent_fd)
        os.chown(name, *owner, dir_fd=parent_fd, follow_symlinks=False)
        with contextlib.suppress(OverflowError, ValueError):
            times = (member.mtime, member.mtime)
            os.utime(name, times, dir_fd=parent_fd, follow_symlinks=False)
    elif member.islnk():
        _make_link(dest_fd, parent_fd, name, full, entry.link)
    else:
        _make_file(parent_fd, name, full, member, tar, owner)


def _make_room(parent_fd: int, name: str, full: str) -> None:
    """Remove what is at `name` for a non-directory entry: a file or a link is replaced,
    as dockerd replaces it; a directory is not (`docker cp` asks dockerd the same)."""
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        raise HttpError(400, f"cannot overwrite directory {full!r} with non-directory")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=parent_fd)


def _make_file(
    parent_fd: int,
    name: str,
    full: str,
    member: tarfile.TarInfo,
    tar: tarfile.TarFile,
    owner: tuple[int, int],
) -> None:
    # O_EXCL|O_NOFOLLOW makes only a new regular file, through no link; if the sandbox
    # put something back at the name meanwhile, this fails (EEXIST: a 400).
    _make_room(parent_fd, name, full)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(name, flags, 0o600, dir_fd=parent_fd)
    try:
        source = tar.extractfile(member)
        assert source is not None  # a regular member
        while chunk := source.read(CHUNK):
            write_all(fd, chunk)
        os.fchown(fd, *owner)
        os.fchmod(fd, _mode(member))  # after the chown, which would clear setuid anyway
        with contextlib.suppress(OverflowError, ValueError):
            os.utime(fd, (member.mtime, member.mtime))
    except BaseException:
        # Half a file (ENOSPC, a truncated body) is not left behind.
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=parent_fd)
        raise
    finally:
        os.close(fd)


def _make_dir(
    root: int, parent_fd: int, name: str, full: str, member: tarfile.TarInfo, owner: tuple[int, int]
) -> None:
    """A directory entry: made if missing; its mode and owner set on a directory that is
    at the name itself. A link there that leads to a directory in the sandbox is left
    as it is (merged /usr: lib -> usr/lib); anything else is refused."""
    try:
        os.mkdir(name, 0o700, dir_fd=parent_fd)  # 0o700 until its own mode is set
    except FileExistsError:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            os.close(openat2(root, full, os.O_PATH | os.O_DIRECTORY))  # a dir, in the root
            return
        if not stat.S_ISDIR(st.st_mode):
            raise HttpError(
                400, f"cannot overwrite non-directory {full!r} with directory"
            ) from None
    fd = openat2(parent_fd, name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchown(fd, *owner)
        os.fchmod(fd, _mode(member))
    finally:
        os.close(fd)


def _make_link(dest_fd: int, parent_fd: int, name: str, full: str, target: str) -> None:
    """A hard link to `target`, a file an earlier entry made: looked up with the
    destination as the root (RESOLVE_IN_ROOT from dest_fd), so whatever the sandbox or
    the tar put on the way, it is a file under the destination."""
    fd = openat2(dest_fd, target, os.O_PATH | os.O_NOFOLLOW)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise HttpError(400, f"hard link {full!r}: {target!r} is no longer a regular file")
        _make_room(parent_fd, name, full)
        # linkat of the very inode the fd holds, not of a path looked up again.
        os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=parent_fd, follow_symlinks=True)
    finally:
        os.close(fd)


def _dir_mtime(root: int, full: str, mtime: float) -> None:
    """A directory's mtime from the tar, once its entries are in. Best effort: the
    sandbox may have changed it meanwhile."""
    with contextlib.suppress(OSError, OverflowError, ValueError):
        fd = openat2(root, full, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.utime(fd, (mtime, mtime))
        finally:
            os.close(fd)
