"""A container's files as tar archives: `docker cp`, docker-py's put_archive and
get_archive, over the sandbox's rootfs.

- PUT /containers/{id}/archive?path=DIR unpacks the body (a tar: plain, gzip, bzip2 or
  xz, told by its first bytes) into DIR, which must be a directory.
- GET /containers/{id}/archive?path=P answers a tar of P (a directory recursively),
  with P's stat in the X-Docker-Container-Path-Stat header (base64 of JSON, as dockerd
  sends it); HEAD answers that header alone (`docker cp` asks it of its destination).

Security. This process is root on the host, and everything in the rootfs, symlinks
included, may have been made by the code the sandbox runs; the tar is the client's. So
no host path is ever joined with the rootfs. Every path is opened with the agent's file
helpers (lazyfs/agent/files.py): openat2(RESOLVE_IN_ROOT) from an fd of the rootfs, so
that "..", absolute links and relative ones resolve as if the rootfs were "/", and
nothing, a link the tar made a moment ago included, can lead out of it. What the tar
adds:
- Entry names: an absolute name is taken inside DIR (as dockerd does); one whose ".."
  leads out of DIR is refused (400), as are NUL bytes.
- Symlinks are made as symlinks: their target is only text, and a later entry that goes
  through one (`link -> /etc`, then `link/evil`) has its parents resolved in the root
  again, so it lands in the sandbox's /etc, never the host's (dockerd, chrooted into the
  container, does the same).
- Hard links: only to a regular file made by an earlier entry of the same tar, and that
  file is looked up with DIR as the root of the resolution, so a link cannot reach any
  other file (a link to /etc/passwd is refused).
- Device nodes and FIFOs are refused (a sandbox has no mknod; a host-made device node in
  a rootfs is a way out), and so are types tarfile does not know.
- Modes keep their permission and sticky bits; setuid and setgid are dropped. What is
  made belongs to the sandbox's user, or to root where the tar names root (uid/gid 0).
- Sizes: the body is read as it comes into a spool (memory up to SPOOL_MEMORY, then an
  unlinked file in the node's sandbox directory), at most MAX_STREAM bytes (413 beyond);
  decompressed, no header read over MAX_HEADER (a PAX or GNU long-name header is read
  whole), no more than MAX_UNPACKED of files, MAX_ENTRIES entries and MAX_STREAM of tar
  in all: a gzip bomb stops there (413).
- The whole tar is checked (names, types, links, sizes) before anything is written, so
  a hostile archive is refused without a trace.
A GET reads the same way: O_PATH first, fstat, and only a regular file is opened for
I/O (a FIFO or a device node in the sandbox is stored as a header, never opened);
symlinks are stored, not followed. The tar is streamed as it is made, CHUNK bytes at a
time (SandboxIO.stream): what a sandbox holds does not become the agent's memory. It
was held whole once, up to 1 GiB: a 1000 MB sparse file, 28 kB of the sandbox's disk,
took the agent to 1.07 GB, 3.1 GB with three GETs at once, none of it the sandbox's.
Once the headers are sent, an error (a file the sandbox made unreadable, a tree deeper
than MAX_DEPTH) breaks the answer off: its client sees a body cut short, never a tar
that ends as if whole. A GET's length is bounded by its time (TIMEOUT), as dockerd's
is by nothing.

The file work is blocking, so it runs in threads (a SandboxIO pool of its own: daemon
threads with a timeout, for the reason sandbox_io.py gives: a sandbox's files may block).
"""

from __future__ import annotations

import base64
import bz2
import contextlib
import errno
import gzip
import io
import json
import lzma
import os
import posixpath
import stat
import tarfile
import tempfile
import zlib
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import IO

import anyio
import anyio.to_thread

from chunker.errors import BadInputError
from lazyfs.agent.errors import ReadOnlyRoot
from lazyfs.agent.files import (
    REGULAR,
    SANDBOX_ERRNOS,
    make_dirs,
    open_checked,
    openat2,
    opened_root,
)
from lazyfs.agent.node import Agent
from lazyfs.agent.sandbox_io import Produced, Put, SandboxIO, TooSlow
from lazyfs.docker.container_api import Containers
from lazyfs.docker.errors import docker_errors
from lazyfs.docker.http import Answer, HttpError, Reply, Request, Streamed

MiB, GiB = 2**20, 2**30
MAX_HEADER = 1 * MiB  # one tar header read whole (Go's archive/tar allows 1 MiB too)
MAX_UNPACKED = 1 * GiB  # the files of one PUT, all told
MAX_STREAM = 2 * GiB  # the body of one PUT, and its tar decompressed: files, headers, padding
SPOOL_MEMORY = 8 * MiB  # of a PUT's body held in memory; past it, spooled to disk
MAX_ENTRIES = 250_000  # entries in one PUT (tarfile keeps every header in memory)
MAX_DEPTH = 256  # directory levels a GET descends
CHUNK = 256 * 2**10  # bytes copied, and a GET's bytes sent, at a time (< MAX_HEADER: _Capped)
THREADS = 4  # archive operations at once, node-wide
TIMEOUT = 600.0  # seconds one may take (a cold 1 GiB read from the image's store)
STAT_HEADER = "X-Docker-Container-Path-Stat"
TAR = "application/x-tar"
# Go's os.FileMode type bits, which Docker's path stat carries.
GO_DIR, GO_SYMLINK, GO_DEVICE, GO_PIPE, GO_SOCKET = 1 << 31, 1 << 27, 1 << 26, 1 << 25, 1 << 24
GO_SETUID, GO_SETGID, GO_CHARDEV, GO_STICKY = 1 << 23, 1 << 22, 1 << 21, 1 << 20
GO_TYPES = {
    stat.S_IFDIR: GO_DIR,
    stat.S_IFLNK: GO_SYMLINK,
    stat.S_IFBLK: GO_DEVICE,
    stat.S_IFCHR: GO_DEVICE | GO_CHARDEV,
    stat.S_IFIFO: GO_PIPE,
    stat.S_IFSOCK: GO_SOCKET,
}
# Errors the sandbox's own files cause (a name that is a file, not a directory): 400.
ENTRY_ERRNOS = SANDBOX_ERRNOS | {errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EXDEV}
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


class PathNotFound(Exception):
    """The path a request names is not in the sandbox (404, Docker's words)."""


class Archive:
    """The archive endpoints of Docker's API."""

    def __init__(self, agent: Agent, containers: Containers) -> None:
        self.agent = agent
        self.containers = containers
        self.io = SandboxIO(THREADS, TIMEOUT)
        self.spool_dir = agent.settings.sandbox_dir  # a disk the node keeps for sandboxes

    def _rootfs(self, ref: str, write: bool = False) -> tuple[Path, tuple[int, int]]:
        """The container's rootfs and its user (uid, gid); to `write` into, a 403 for a
        container with ReadonlyRootfs (dockerd's answer and words)."""
        container = self.containers.find(ref)
        box = self.agent.boxes.get(container.box_id)
        if box is None:  # deleted meanwhile (its TTL, the agent's own API)
            raise HttpError(404, f"No such container: {ref}")
        if write:
            try:
                box.check_writable()
            except ReadOnlyRoot:
                raise HttpError(403, "container rootfs is marked read-only") from None
        return box.sandbox.rootfs, (box.record.uid, box.record.gid)

    async def _run(self, ref: str, path: str, fn: partial) -> object:
        with _errors(ref, path):
            return await self.io.run(fn)

    @docker_errors
    async def put_archive(self, request: Request) -> Answer:
        ref = request.params["id"]
        rootfs, owner = self._rootfs(ref, write=True)
        path = _path_arg(request)
        assert request.pieces is not None  # a streamed route (api.py)
        if int(request.headers.get("content-length") or 0) > MAX_STREAM:
            raise HttpError(413, f"an archive over {MAX_STREAM} bytes")
        with tempfile.SpooledTemporaryFile(SPOOL_MEMORY, dir=self.spool_dir) as body:
            await _spool(request.pieces(), body)
            await self._run(ref, path, partial(unpack, rootfs, path, body, owner))
        return Reply(200, b"")

    @docker_errors
    async def head_archive(self, request: Request) -> Answer:
        ref = request.params["id"]
        rootfs, _ = self._rootfs(ref)
        path = _path_arg(request)
        found = await self._run(ref, path, partial(stat_path, rootfs, path))
        assert isinstance(found, dict)
        return Reply(200, b"", TAR, [(STAT_HEADER, _stat_header(found))])

    @docker_errors
    async def get_archive(self, request: Request) -> Answer:
        ref = request.params["id"]
        rootfs, _ = self._rootfs(ref)
        path = _path_arg(request)
        with _errors(ref, path):
            produced = await self.io.stream(partial(pack, rootfs, path))
            try:
                doc = await anext(produced)  # the path's stat, or why it has none
            except BaseException:
                await produced.aclose()
                raise
        assert isinstance(doc, dict)
        return Streamed(
            _pieces(ref, path, produced), TAR, headers=[(STAT_HEADER, _stat_header(doc))]
        )


@contextlib.contextmanager
def _errors(ref: str, path: str) -> Iterator[None]:
    """The pool's and the walk's own errors as Docker's answers."""
    try:
        yield
    except PathNotFound:
        raise HttpError(404, f"Could not find the file {path} in container {ref}") from None
    except TooSlow as exc:
        raise HttpError(504, str(exc)) from None


async def _pieces(ref: str, path: str, produced: Produced[object]) -> AsyncGenerator[bytes, None]:
    """A GET's tar after its stat; the stream is closed however its answer ends."""
    try:
        with _errors(ref, path):
            async for piece in produced:
                assert isinstance(piece, bytes)
                yield piece
    finally:
        await produced.aclose()


async def _spool(pieces: AsyncGenerator[bytes, None], spool: IO[bytes]) -> None:
    """The body into the spool, at most MAX_STREAM bytes; writes past the memory part
    go to disk, so they are made in a thread, a MiB at a time."""
    size, pending = 0, bytearray()
    async with contextlib.aclosing(pieces):
        async for piece in pieces:
            size += len(piece)
            if size > MAX_STREAM:
                raise HttpError(413, f"an archive over {MAX_STREAM} bytes")
            pending += piece
            if len(pending) >= MiB:
                await anyio.to_thread.run_sync(spool.write, bytes(pending))
                pending.clear()
    await anyio.to_thread.run_sync(spool.write, bytes(pending))
    spool.seek(0)


def _path_arg(request: Request) -> str:
    """The path query parameter, absolute (dockerd takes a relative one from "/")."""
    path = request.arg("path") or ""
    if not path:
        raise HttpError(400, "Path cannot be empty")
    if "\0" in path:
        raise HttpError(400, "Path cannot contain a NUL byte")
    return path if path.startswith("/") else "/" + path


def _stat_header(doc: dict) -> str:
    return base64.b64encode(json.dumps(doc).encode()).decode()


# PUT: unpack a tar into a directory of the sandbox.


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
    dest = _clean(dest)
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
        with _entry_errors(f"tar entry {entry.member.name!r}"):
            parent_fd = make_dirs(root, posixpath.dirname(full), owner)
            try:
                _make(root, dest_fd, parent_fd, full, entry, tar, _owner(entry.member, owner))
            finally:
                os.close(parent_fd)
        if entry.member.isdir():
            dirs.append((full, entry.member.mtime))
    for full, mtime in dirs:
        _dir_mtime(root, full, mtime)


@contextlib.contextmanager
def _entry_errors(what: str) -> Iterator[None]:
    """An OSError the sandbox's files cause, as the 400 it is (ENOSPC and the like stay
    500s); BadInputError (files.py's) is made a 400 by docker_errors. A tar that breaks
    off in an entry's data is a 400 too."""
    try:
        yield
    except OSError as exc:
        if exc.errno in ENTRY_ERRNOS:
            raise HttpError(400, f"{what}: {exc.strerror}") from None
        raise
    except (tarfile.TarError, EOFError, lzma.LZMAError, zlib.error) as exc:
        raise HttpError(400, f"{what}: {exc}") from None


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
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view) :]
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


# GET and HEAD: a path's stat, and a tar of it.


@dataclass
class _Found:
    """The path a GET names: `name` in directory `parent_fd` (the root: ".")."""

    parent_fd: int
    name: str
    arcname: str  # the tar's name for it: its base name, as dockerd names it
    st: os.stat_result
    doc: dict  # Docker's path stat


def stat_path(rootfs: Path, path: str) -> dict:
    """Docker's stat of `path` in the rootfs (PathNotFound if it is not there)."""
    with opened_root(rootfs) as root, _found(root, path) as found:
        return found.doc


def pack(rootfs: Path, path: str, put: Put[object]) -> None:
    """Docker's stat of `path`, then a tar of it in pieces of CHUNK bytes, each put as it
    is made."""
    with opened_root(rootfs) as root, _found(root, path) as found:
        put(found.doc)
        out = _Pieces(put)
        with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
            packer = _Packer(tar)
            with _entry_errors(path):
                packer.add(found.parent_fd, found.name, found.arcname, found.st, 0)
        out.flush()


class _Pieces:
    """The file tarfile writes to: what it writes, put CHUNK bytes at a time."""

    def __init__(self, put: Put[object]) -> None:
        self.put = put
        self.buffer = bytearray()
        self.offset = 0

    def write(self, data: bytes) -> int:
        self.buffer += data
        self.offset += len(data)
        if len(self.buffer) >= CHUNK:
            self.flush()
        return len(data)

    def tell(self) -> int:  # tarfile asks where it starts
        return self.offset

    def flush(self) -> None:
        if self.buffer:
            self.put(bytes(self.buffer))
            self.buffer.clear()


@contextlib.contextmanager
def _found(root: int, path: str) -> Iterator[_Found]:
    """What `path` names, as dockerd finds it: its parents are followed (in the root),
    its last part is not, unless the path ends in "/" or "/." (then it is, as `docker
    cp c:/dir/.` asks). Lexically cleaned first, as dockerd cleans it."""
    clean = _clean(path)
    arcname = "." if clean == "/" or path.endswith("/.") else posixpath.basename(clean)
    if clean != "/" and path.endswith(("/", "/.")):
        real = _real_path(root, clean + "/")  # the "/": only a directory will do
        if real is None:
            raise PathNotFound(path)
        clean = real
    parent, base = posixpath.split(clean)
    name = base or "."  # the root itself: "." in itself
    try:
        parent_fd = openat2(root, parent, os.O_PATH | os.O_DIRECTORY)
    except OSError as exc:
        if exc.errno in ENTRY_ERRNOS:
            raise PathNotFound(path) from None
        raise
    try:
        try:
            st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            raise PathNotFound(path) from None
        doc = _path_stat(root, parent_fd, name, clean, st)
        doc["name"] = "/" if clean == "/" else arcname
        yield _Found(parent_fd, name, arcname, st, doc)
    finally:
        os.close(parent_fd)


def _clean(path: str) -> str:
    """An absolute path without "." or ".." parts (normpath keeps a leading "//")."""
    return posixpath.normpath("/" + path.lstrip("/"))


def _real_path(root: int, path: str) -> str | None:
    """`path` with every link resolved, in the root; None when it leads nowhere."""
    try:
        fd = openat2(root, path, os.O_PATH)
    except OSError:
        return None
    try:
        top = os.readlink(f"/proc/self/fd/{root}").rstrip("/")
        here = os.readlink(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)
    if here == top or here == top + "/":
        return "/"
    return here[len(top) :] if here.startswith(top + "/") else None


def _path_stat(root: int, parent_fd: int, name: str, path: str, st: os.stat_result) -> dict:
    """Docker's container.PathStat: name, size, Go file mode, mtime, and for a link the
    path it leads to in the container."""
    link = ""
    if stat.S_ISLNK(st.st_mode):
        link = _real_path(root, path) or posixpath.normpath(
            posixpath.join(posixpath.dirname(path), os.readlink(name, dir_fd=parent_fd))
        )
    return {
        "name": name,
        "size": st.st_size,
        "mode": _go_mode(st.st_mode),
        "mtime": _rfc3339(st.st_mtime_ns),
        "linkTarget": link,
    }


def _go_mode(mode: int) -> int:
    """A stat mode as Go's os.FileMode: type bits high, then setuid/setgid/sticky."""
    bits = (mode & 0o777) | GO_TYPES.get(stat.S_IFMT(mode), 0)
    for flag, go in ((stat.S_ISUID, GO_SETUID), (stat.S_ISGID, GO_SETGID)):
        if mode & flag:
            bits |= go
    return bits | (GO_STICKY if mode & stat.S_ISVTX else 0)


def _rfc3339(ns: int) -> str:
    """RFC 3339 in UTC with Go's RFC3339Nano fraction (trailing zeros dropped)."""
    seconds, frac = divmod(ns, 10**9)
    text = datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    return text + (f".{frac:09d}".rstrip("0") if frac else "") + "Z"


class _Packer:
    """Entries into the tar, read through fds: a directory is opened O_NOFOLLOW, a
    file only once it is known to be a regular file, nothing else is opened at all."""

    def __init__(self, tar: tarfile.TarFile) -> None:
        self.tar = tar
        self.inodes: dict[tuple[int, int], str] = {}  # hard links: stored as such

    def add(self, dir_fd: int, name: str, arcname: str, st: os.stat_result, depth: int) -> None:
        if stat.S_ISREG(st.st_mode):
            self._file(dir_fd, name, arcname, st)
        elif stat.S_ISDIR(st.st_mode):
            self._dir(dir_fd, name, arcname, st, depth)
        elif not stat.S_ISSOCK(st.st_mode):  # a socket is not stored (nor by dockerd)
            info = _tarinfo(arcname, st)
            if stat.S_ISLNK(st.st_mode):
                info.type, info.linkname = tarfile.SYMTYPE, os.readlink(name, dir_fd=dir_fd)
            self.tar.addfile(info)

    def _file(self, dir_fd: int, name: str, arcname: str, st: os.stat_result) -> None:
        key = (st.st_dev, st.st_ino)
        if st.st_nlink > 1 and key in self.inodes:
            info = _tarinfo(arcname, st)
            info.type, info.linkname, info.size = tarfile.LNKTYPE, self.inodes[key], 0
            self.tar.addfile(info)
            return
        try:
            fd = open_checked(dir_fd, name, os.O_RDONLY, REGULAR, arcname, follow=False)
        except (FileNotFoundError, BadInputError):
            return  # removed or replaced by the sandbox since it was listed
        try:
            st = os.fstat(fd)  # the inode opened: its size is what is stored
            self.tar.addfile(_tarinfo(arcname, st), _Exactly(fd, st.st_size))
        finally:
            os.close(fd)
        if st.st_nlink > 1:
            self.inodes[key] = arcname

    def _dir(self, dir_fd: int, name: str, arcname: str, st: os.stat_result, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise HttpError(400, f"{arcname}: more than {MAX_DEPTH} directory levels")
        self.tar.addfile(_tarinfo(arcname, st))
        try:
            fd = openat2(dir_fd, name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except (FileNotFoundError, NotADirectoryError):
            return  # replaced meanwhile
        try:
            for child in sorted(os.listdir(fd)):
                try:  # fstatat opens nothing
                    child_st = os.stat(child, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                self.add(fd, child, f"{arcname}/{child}", child_st, depth + 1)
        finally:
            os.close(fd)


def _tarinfo(arcname: str, st: os.stat_result) -> tarfile.TarInfo:
    info = tarfile.TarInfo(arcname)
    info.mode = stat.S_IMODE(st.st_mode)
    info.uid, info.gid = st.st_uid, st.st_gid
    info.mtime = int(st.st_mtime)  # an int: a float costs a PAX header per entry
    fmt = stat.S_IFMT(st.st_mode)
    if fmt == stat.S_IFDIR:
        info.type = tarfile.DIRTYPE
    elif fmt in (stat.S_IFCHR, stat.S_IFBLK, stat.S_IFIFO):
        info.type = {stat.S_IFCHR: tarfile.CHRTYPE, stat.S_IFBLK: tarfile.BLKTYPE}.get(
            fmt, tarfile.FIFOTYPE
        )
        info.devmajor, info.devminor = os.major(st.st_rdev), os.minor(st.st_rdev)
    elif fmt == stat.S_IFREG:
        info.size = st.st_size
    return info


class _Exactly:
    """A file's first `size` bytes, as tarfile copies them (it wants exactly the size
    its header says): a file the sandbox shortened meanwhile is padded with zeros."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.left = size

    def read(self, size: int = -1) -> bytes:
        want = self.left if size < 0 else min(size, self.left)
        data = os.read(self.fd, want) if want else b""
        while 0 < len(data) < want:
            more = os.read(self.fd, want - len(data))
            if not more:
                break
            data += more
        data += b"\0" * (want - len(data))
        self.left -= want
        return data
