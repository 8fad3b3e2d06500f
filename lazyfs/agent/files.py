"""A sandbox's files, read and written from the host through its rootfs (the overlay).

The rootfs is the sandbox's: anything in it, symlinks included, was possibly made by the
code the sandbox runs, and this process is root on the host. Every path is therefore
opened with openat2(RESOLVE_IN_ROOT) relative to the rootfs: the kernel resolves "..",
absolute symlinks and relative ones as if the rootfs were "/", so no path or link can
reach outside it (a link to a host path means that path inside the sandbox, which
usually does not exist). RESOLVE_NO_MAGICLINKS refuses /proc-style magic links.

Nor is anything opened for I/O before its type is known. A sandbox may mknod (runc's
default device rules allow it; only the sandbox's own devices cgroup stops it opening
them) and make FIFOs: opened by this process, outside that cgroup, a block device node
wrote to the host's disk, and a FIFO blocked a thread for good. So a path is first
opened O_PATH (no open of the node itself: no device driver, no FIFO wait), fstat'ed,
and anything but a regular file (a directory, to list) is refused with a BadInputError
that names its type. Only then is that same inode, whatever the path names by now,
opened for I/O through /proc/self/fd/N, non-blocking. A new file is made with
O_CREAT|O_EXCL|O_NOFOLLOW, which only ever makes a regular file. A read or a list
follows a symlink at the end of the path (inside the root, as the sandbox would:
Debian's /etc/os-release is one) and checks what it leads to; a write does not follow
one (a shell's `>` would replace the link; here it is refused, which is safer still).

A read stops at the limit (Settings.max_file) even while the sandbox grows the file: at
most limit + 1 bytes are read. The API's reads stream (stream_file), so a piece at a
time is in this process's memory; read_file joins the pieces, for the small files the
agent reads for itself (a sandbox's /etc/passwd).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from chunker.errors import BadInputError, LazyfsError, NotFoundError
from lazyfs.libc import libc
from lazyfs.sandbox.process import MAX_DB, db_text

SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437}.get(os.uname().machine, 437)
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10
# A write finds the file there (EEXIST), then gone (ENOENT) when it opens it: the sandbox
# removed it between the two opens. It is made anew, a few times at most.
WRITE_TRIES = 3
# Errors that the sandbox's own files cause (its names, modes, links, a running binary):
# the caller's request is at fault, not the agent (400, not 500).
SANDBOX_ERRNOS = frozenset(
    {
        errno.EACCES,
        errno.EPERM,
        errno.EEXIST,
        errno.ENOTEMPTY,
        errno.ENAMETOOLONG,
        errno.ETXTBSY,
        errno.EMLINK,
        errno.EFBIG,
        errno.EROFS,
        errno.EOVERFLOW,
    }
)
REGULAR, DIRECTORY = "is a regular file", "is a directory"
_TYPES = [
    (stat.S_ISREG, REGULAR),
    (stat.S_ISDIR, DIRECTORY),
    (stat.S_ISLNK, "is a symbolic link"),
    (stat.S_ISFIFO, "is a FIFO"),
    (stat.S_ISBLK, "is a block device"),
    (stat.S_ISCHR, "is a character device"),
    (stat.S_ISSOCK, "is a socket"),
]


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


class FileNotInSandbox(NotFoundError):
    """No such file or directory in the sandbox."""


def openat2(dir_fd: int, path: str, flags: int, mode: int = 0) -> int:
    how = _OpenHow(flags | os.O_CLOEXEC, mode, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
    fd = libc.syscall(SYS_OPENAT2, dir_fd, os.fsencode(path), ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return fd


def _check_path(path: str) -> str:
    if not path.startswith("/") or "\0" in path:
        raise BadInputError(f"path {path!r} must be absolute")
    return path


@contextmanager
def opened_root(rootfs: Path) -> Iterator[int]:
    fd = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


def _errors(path: str, exc: OSError) -> Exception:
    """The domain error for an OSError on a sandbox path."""
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return FileNotInSandbox(f"{path}: no such file or directory in the sandbox")
    if exc.errno == errno.EISDIR:
        return BadInputError(f"{path}: is a directory")
    if exc.errno in (errno.ELOOP, errno.EXDEV):
        return BadInputError(f"{path}: too many symlinks, or a link that is not allowed")
    if exc.errno in SANDBOX_ERRNOS:
        return BadInputError(f"{path}: {exc.strerror}")
    return exc  # ENOSPC and EDQUOT are 507; EIO (the image's store) stays a 500


@contextmanager
def _sandbox_errors(path: str) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        raise _errors(path, exc) from None


def _what(mode: int) -> str:
    """The type of a file, as the errors below name it: "is a FIFO"."""
    return next((text for test, text in _TYPES if test(mode)), "is not a regular file")


def open_checked(
    dir_fd: int, path: str, flags: int, want: str, shown: str, follow: bool = True
) -> int:
    """An fd open for I/O (flags) on what `path` names, once that is known to be what
    `want` says (REGULAR or DIRECTORY); a BadInputError naming its type otherwise. The
    O_PATH open does not open the node itself (no device driver, no wait for a FIFO's
    other end); the second open is of that very inode, through /proc/self/fd, whatever
    the path names by now."""
    path_fd = openat2(dir_fd, path, os.O_PATH | (0 if follow else os.O_NOFOLLOW))
    try:
        what = _what(os.fstat(path_fd).st_mode)
        if what != want:
            raise BadInputError(
                f"{shown}: {what}" if want == REGULAR else f"{shown}: {what}, not a directory"
            )
        return os.open(f"/proc/self/fd/{path_fd}", flags | os.O_NONBLOCK | os.O_CLOEXEC)
    finally:
        os.close(path_fd)


MAX_LISTED = 100_000  # names list_dir answers (a directory of more is a 400)
PIECE = 256 * 2**10  # what a streamed read hands on at a time


def sandbox_db(rootfs: Path, path: str) -> str:
    """A running sandbox's /etc/passwd or /etc/group as text for process.db_entry and the
    other db_ lookups, read as read_file reads (in the root, a regular file, at most
    MAX_DB bytes: 1 MiB); "" if it cannot be. Never process.read_db on a sandbox whose
    code has run: that follows what the sandbox put at the path on the host's side, a
    link to a host file, a FIFO that holds the reading thread for good, a sparse file of
    any size."""
    try:
        return db_text(read_file(rootfs, path, MAX_DB))
    except (LazyfsError, OSError):  # none, not a regular file, too big
        return ""


def read_file(rootfs: Path, path: str, limit: int) -> bytes:
    """The file's bytes, stream_file's pieces joined: for the small files the agent
    reads for itself (at most MAX_DB). Errors as stream_file's."""
    pieces: list[bytes] = []
    stream_file(rootfs, path, limit, pieces.append)
    return b"".join(pieces)


def stream_file(rootfs: Path, path: str, limit: int, put: Callable[[bytes], None]) -> None:
    """The file's bytes to put, a PIECE at a time, after an empty piece that says it is
    open and not over the limit: what fails before that (no such file, not a regular
    one, too big) is the caller's error answer; a file the sandbox grows past the limit
    while it is read is a BadInputError after its pieces have gone (the answer is cut).
    So a read costs PIECE-sized buffers, whatever the file's size."""
    _check_path(path)
    with opened_root(rootfs) as root, _sandbox_errors(path):
        fd = open_checked(root, path, os.O_RDONLY, REGULAR, path)
        try:
            size = os.fstat(fd).st_size
            if size > limit:
                raise BadInputError(f"{path}: {size} bytes is more than {limit}")
            put(b"")
            got = 0
            while piece := os.read(fd, min(PIECE, limit + 1 - got)):
                got += len(piece)
                if got > limit:
                    raise BadInputError(f"{path}: grew past {limit} bytes while it was read")
                put(piece)
        finally:
            os.close(fd)


def write_file(
    rootfs: Path,
    path: str,
    data: bytes | bytearray | memoryview,
    mode: int = 0o644,
    owner: tuple[int, int] = (0, 0),
) -> None:
    """Create or replace a regular file; missing parent directories are made (0755). What
    is made belongs to `owner` (the sandbox's user), so that its code can change it."""
    _check_path(path)
    parent, _, name = path.rstrip("/").rpartition("/")
    if not name or name in (".", ".."):
        raise BadInputError(f"path {path!r} names no file")
    with opened_root(rootfs) as root, _sandbox_errors(path):
        dir_fd = make_dirs(root, parent or "/", owner)
        try:
            fd = _open_for_write(dir_fd, name, mode, path)
            try:
                os.fchown(fd, *owner)
                write_all(fd, data)
            except OSError:
                # A write that failed half-way (ENOSPC, EDQUOT) must not leave its part
                # behind: on a full disk that part is what keeps the sandbox full.
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=dir_fd)
                raise
            finally:
                os.close(fd)
        finally:
            os.close(dir_fd)


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """All of data, however many writes the kernel takes for it."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _open_for_write(dir_fd: int, name: str, mode: int, path: str) -> int:
    """`name` in the directory, open to write from its start: made new (O_EXCL makes
    only a regular file, and follows no link), or, if it exists, emptied once it is
    known to be a regular file (O_NOFOLLOW: a link there is refused, not followed)."""
    for _ in range(WRITE_TRIES):
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK
            return openat2(dir_fd, name, flags, mode)
        except FileExistsError:
            pass
        try:
            flags = os.O_WRONLY | os.O_TRUNC
            return open_checked(dir_fd, name, flags, REGULAR, path, follow=False)
        except FileNotFoundError:
            continue
    raise BadInputError(f"{path}: the sandbox kept replacing it while it was written")


def make_dirs(root: int, path: str, owner: tuple[int, int]) -> int:
    """An fd of directory `path` in the root, each missing component made inside it.
    Every prefix is resolved from the root again, so that a symlink met on the way means
    what it would mean in the sandbox."""
    fd = os.dup(root)
    prefix = ""
    try:
        for part in [p for p in path.split("/") if p]:
            prefix += "/" + part
            nxt = _directory(root, fd, prefix, part, owner)
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def _directory(root: int, parent: int, prefix: str, part: str, owner: tuple[int, int]) -> int:
    """An fd of directory `prefix` (`part` in `parent`), made if it is missing."""
    try:
        return openat2(root, prefix, os.O_PATH | os.O_DIRECTORY)
    except FileNotFoundError:
        pass
    try:
        os.mkdir(part, 0o755, dir_fd=parent)
    except FileExistsError:
        # Something is there that the open above could not follow: a symlink that leads
        # nowhere in the sandbox (or a directory the sandbox made just now).
        with contextlib.suppress(FileNotFoundError):
            return openat2(root, prefix, os.O_PATH | os.O_DIRECTORY)
        what = _what(os.stat(part, dir_fd=parent, follow_symlinks=False).st_mode)
        raise BadInputError(f"{prefix}: {what} that leads to no directory") from None
    # The new one only (never an existing directory) is given to the sandbox's user;
    # O_NOFOLLOW|O_DIRECTORY: what is opened is a directory, whatever replaced it.
    made = openat2(parent, part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchown(made, *owner)
    except BaseException:
        os.close(made)
        raise
    return made


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


def list_dir(rootfs: Path, path: str) -> list[dict]:
    """The directory's entries: name, type (file, dir, symlink, other), size, mode. A
    directory of more than MAX_LISTED names is a BadInputError, found as the names are
    read (the sandbox may make 600,000 links in one, 10 MB of its disk)."""
    _check_path(path)
    with opened_root(rootfs) as root, _sandbox_errors(path):
        fd = open_checked(root, path, os.O_RDONLY | os.O_DIRECTORY, DIRECTORY, path)
        try:
            names = []
            with os.scandir(fd) as it:
                for entry in it:
                    if len(names) == MAX_LISTED:
                        raise BadInputError(f"{path}: more than {MAX_LISTED} entries to list")
                    names.append(entry.name)
            entries = []
            for name in sorted(names):
                try:  # fstatat opens nothing
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed meanwhile
                entries.append(
                    {
                        "name": name,
                        "type": _kind(st.st_mode),
                        "size": st.st_size,
                        "mode": stat.S_IMODE(st.st_mode),
                    }
                )
            return entries
        finally:
            os.close(fd)
