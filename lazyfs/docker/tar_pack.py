"""GET and HEAD /containers/{id}/archive: Docker's stat of a sandbox path, and a tar of
it made as it is sent, as archive.py's docstring sets out (O_PATH and fstat first, only
regular files opened, links stored, not followed).

What a GET holds does not grow with the tree it packs (session 57's finding: 100 levels
of 250-byte names and 12,000 hard links of one 1-byte file, 4 kB of the sandbox's disk,
took the agent's peak RSS up 303 MiB for one GET): each header is written and let go
(_Tar, not tarfile.TarFile, which keeps every header it wrote in `members`), a
directory's names are held for sorting only within a budget shared by the walk (HELD),
and hard links are remembered only up to LINKED bytes.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import posixpath
import stat
import sys
import tarfile
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from chunker.errors import BadInputError
from lazyfs.agent.files import REGULAR, open_checked, openat2, opened_root
from lazyfs.agent.sandbox_io import Put
from lazyfs.docker.http import HttpError
from lazyfs.docker.tar_paths import CHUNK, ENTRY_ERRNOS, PathNotFound, clean_path, entry_errors

MAX_DEPTH = 256  # directory levels a GET descends
# Names of the directories being walked held at once to sort them (dockerd's walk sorts
# each directory): a few MB of 255-byte names at most. A directory that does not fit in
# what is left is written in the order its names are read, which tar does not mind.
HELD = 10_000
# Bytes of the first names of hard-linked files remembered to store their other names as
# links (dockerd remembers every one). Past it, a file met for the first time is not
# remembered, so each of its other names is stored as a file again, with its data: the
# tar still extracts to the same contents, only bigger, and a sandbox could make a tar
# as big with sparse files at no cost to it. 8 MiB is ~24,000 files with 100-byte names.
LINKED = 8 * 2**20
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
        tar = _Tar(out)
        with entry_errors(path):
            _Packer(tar).add(found.parent_fd, found.name, found.arcname, found.st, 0)
        tar.end()  # only for a whole tar: an error above breaks the answer off
        out.flush()


class _Tar:
    """A PAX tar, byte for byte as tarfile.TarFile(format=PAX_FORMAT) writes it (each
    header by TarInfo.tobuf, data padded to 512-byte blocks, two zero blocks and zeros
    to a whole 10 KiB record at the end), but keeping nothing of what it wrote: TarFile
    appends every header it adds to its `members`, for good."""

    def __init__(self, out: _Pieces) -> None:
        self.out = out
        self.offset = 0

    def add(self, info: tarfile.TarInfo, data: _Exactly | None = None) -> None:
        self._write(info.tobuf(tarfile.PAX_FORMAT, tarfile.ENCODING, "surrogateescape"))
        if data is None:
            return
        left = info.size
        while left:
            piece = data.read(min(CHUNK, left))
            self._write(piece)
            left -= len(piece)
        if info.size % tarfile.BLOCKSIZE:
            self._write(tarfile.NUL * (tarfile.BLOCKSIZE - info.size % tarfile.BLOCKSIZE))

    def end(self) -> None:
        self._write(tarfile.NUL * (2 * tarfile.BLOCKSIZE))
        if self.offset % tarfile.RECORDSIZE:
            self._write(tarfile.NUL * (tarfile.RECORDSIZE - self.offset % tarfile.RECORDSIZE))

    def _write(self, data: bytes) -> None:
        self.out.write(data)
        self.offset += len(data)


class _Pieces:
    """What _Tar writes, put CHUNK bytes at a time."""

    def __init__(self, put: Put[object]) -> None:
        self.put = put
        self.buffer = bytearray()

    def write(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) >= CHUNK:
            self.flush()

    def flush(self) -> None:
        if self.buffer:
            self.put(bytes(self.buffer))
            self.buffer.clear()


@contextlib.contextmanager
def _found(root: int, path: str) -> Iterator[_Found]:
    """What `path` names, as dockerd finds it: its parents are followed (in the root),
    its last part is not, unless the path ends in "/" or "/." (then it is, as `docker
    cp c:/dir/.` asks). Lexically cleaned first, as dockerd cleans it."""
    clean = clean_path(path)
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

    def __init__(self, tar: _Tar) -> None:
        self.tar = tar
        self.inodes: dict[tuple[int, int], str] = {}  # hard links: stored as such
        self.linked = 0  # bytes of `inodes`, up to LINKED
        self.held = 0  # names held to be sorted, up to HELD

    def add(self, dir_fd: int, name: str, arcname: str, st: os.stat_result, depth: int) -> None:
        if stat.S_ISREG(st.st_mode):
            self._file(dir_fd, name, arcname, st)
        elif stat.S_ISDIR(st.st_mode):
            self._dir(dir_fd, name, arcname, st, depth)
        elif not stat.S_ISSOCK(st.st_mode):  # a socket is not stored (nor by dockerd)
            info = _tarinfo(arcname, st)
            if stat.S_ISLNK(st.st_mode):
                info.type, info.linkname = tarfile.SYMTYPE, os.readlink(name, dir_fd=dir_fd)
            self.tar.add(info)

    def _file(self, dir_fd: int, name: str, arcname: str, st: os.stat_result) -> None:
        first = self.inodes.get((st.st_dev, st.st_ino)) if st.st_nlink > 1 else None
        if first is not None:
            info = _tarinfo(arcname, st)
            info.type, info.linkname, info.size = tarfile.LNKTYPE, first, 0
            self.tar.add(info)
            return
        try:
            fd = open_checked(dir_fd, name, os.O_RDONLY, REGULAR, arcname, follow=False)
        except (FileNotFoundError, BadInputError):
            return  # removed or replaced by the sandbox since it was listed
        try:
            st = os.fstat(fd)  # the inode opened: its size is what is stored
            self.tar.add(_tarinfo(arcname, st), _Exactly(fd, st.st_size))
        finally:
            os.close(fd)
        cost = sys.getsizeof(arcname) + 200  # with the key and the dict's slot
        if st.st_nlink > 1 and self.linked + cost <= LINKED:  # past it: see LINKED
            self.inodes[(st.st_dev, st.st_ino)] = arcname  # the inode opened, not listed
            self.linked += cost

    def _dir(self, dir_fd: int, name: str, arcname: str, st: os.stat_result, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise HttpError(400, f"{arcname}: more than {MAX_DEPTH} directory levels")
        self.tar.add(_tarinfo(arcname, st))
        try:
            fd = openat2(dir_fd, name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except (FileNotFoundError, NotADirectoryError):
            return  # replaced meanwhile
        try:
            with contextlib.closing(self._names(fd)) as names:
                for child in names:
                    try:  # fstatat opens nothing
                        child_st = os.stat(child, dir_fd=fd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    self.add(fd, child, f"{arcname}/{child}", child_st, depth + 1)
        finally:
            os.close(fd)

    def _names(self, fd: int) -> Generator[str, None, None]:
        """A directory's names as they are to be stored: sorted, as dockerd's walk
        sorts them, if they fit in what is left of HELD; else in the order they are
        read, a few at a time (a whole listing, held on every level of a deep walk, was
        what a sandbox could make the agent hold)."""
        entries = os.scandir(fd)
        try:
            names = (entry.name for entry in entries)
            room = HELD - self.held
            first = list(itertools.islice(names, room + 1))
            whole = len(first) <= room
            if whole:
                entries.close()  # read to its end: its fd and buffer go now
                first.sort(reverse=True)  # each name let go as it is popped
            else:
                first.reverse()
            self.held += len(first)
            try:
                while first:
                    self.held -= 1
                    yield first.pop()
            finally:
                self.held -= len(first)
            if not whole:
                yield from names
        finally:
            entries.close()


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
