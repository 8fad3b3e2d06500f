"""A sandbox's files, read and written from the host through its rootfs (the overlay).

The rootfs is the sandbox's: anything in it, symlinks included, was possibly made by the
code the sandbox runs, and this process is root on the host. Every path is therefore
opened with openat2(RESOLVE_IN_ROOT) relative to the rootfs: the kernel resolves "..",
absolute symlinks and relative ones as if the rootfs were "/", so no path or link can
reach outside it (a link to a host path means that path inside the sandbox, which
usually does not exist). RESOLVE_NO_MAGICLINKS refuses /proc-style magic links.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from chunker.errors import BadInputError, NotFoundError
from lazyfs.libc import libc

SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437}.get(os.uname().machine, 437)
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10
MAX_FILE = 256 * 2**20  # one read or write; bigger files want a streaming endpoint


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


class FileNotInSandbox(NotFoundError):
    """No such file or directory in the sandbox."""


def _openat2(dir_fd: int, path: str, flags: int, mode: int = 0) -> int:
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
def _root(rootfs: Path) -> Iterator[int]:
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
    return exc


def read_file(rootfs: Path, path: str) -> bytes:
    _check_path(path)
    with _root(rootfs) as root:
        try:
            fd = _openat2(root, path, os.O_RDONLY)
        except OSError as exc:
            raise _errors(path, exc) from None
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise BadInputError(f"{path}: is a directory")
            if not stat.S_ISREG(st.st_mode):
                raise BadInputError(f"{path}: not a regular file")
            if st.st_size > MAX_FILE:
                raise BadInputError(f"{path}: {st.st_size} bytes is more than {MAX_FILE}")
            chunks = []
            while chunk := os.read(fd, 2**20):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)


def write_file(
    rootfs: Path, path: str, data: bytes, mode: int = 0o644, owner: tuple[int, int] = (0, 0)
) -> None:
    """Create or replace a file; missing parent directories are made (0755). What is
    made belongs to `owner` (the sandbox's user), so that its code can change it."""
    _check_path(path)
    parent, _, name = path.rstrip("/").rpartition("/")
    if not name or name in (".", ".."):
        raise BadInputError(f"path {path!r} names no file")
    with _root(rootfs) as root:
        try:
            dir_fd = _make_dirs(root, parent or "/", owner)
        except OSError as exc:
            raise _errors(path, exc) from None
        try:
            try:
                # O_NOFOLLOW: the last component is never followed (a link there would be
                # replaced in a shell's `>`; here it is refused, which is safer still).
                flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                fd = _openat2(dir_fd, name, flags, mode)
            except OSError as exc:
                raise _errors(path, exc) from None
            try:
                os.fchown(fd, *owner)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
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


def _make_dirs(root: int, path: str, owner: tuple[int, int]) -> int:
    """An fd of directory `path` in the root, each missing component made inside it.
    Every prefix is resolved from the root again, so that a symlink met on the way means
    what it would mean in the sandbox."""
    fd = os.dup(root)
    prefix = ""
    try:
        for part in [p for p in path.split("/") if p]:
            prefix += "/" + part
            try:
                nxt = _openat2(root, prefix, os.O_PATH | os.O_DIRECTORY)
            except FileNotFoundError:
                os.mkdir(part, 0o755, dir_fd=fd)
                nxt = _openat2(root, prefix, os.O_RDONLY | os.O_DIRECTORY)
                os.fchown(nxt, *owner)  # the new one only: never an existing directory
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


def list_dir(rootfs: Path, path: str) -> list[dict]:
    """The directory's entries: name, type (file, dir, symlink, other), size, mode."""
    _check_path(path)
    with _root(rootfs) as root:
        try:
            fd = _openat2(root, path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise _errors(path, exc) from None
        try:
            entries = []
            for name in sorted(os.listdir(fd)):
                try:
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
