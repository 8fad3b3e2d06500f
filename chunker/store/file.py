"""The local-directory backend: one file per object under a root directory.

Writes are atomic and durable the way a careful database does them: write a temporary file
in the target directory, fsync it, rename it over the key, fsync the directory. A reader
therefore sees the old object or the whole new one, never a torn write, and a crash leaves at
worst a `.tmp-*` file, which list() never reports (gc may sweep it).
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from urllib.parse import unquote, urlsplit

from chunker.errors import BadInputError, ObjectNotFound, StoreError
from chunker.store.interface import TEMP_PREFIX, ObjectInfo, ObjectStore, check_key, check_range

__all__ = ["FileStore"]


class FileStore(ObjectStore):
    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        path = unquote(parts.path)
        if parts.scheme != "file" or parts.netloc not in ("", "localhost") or not path:
            raise BadInputError(f"invalid file store URL {url!r}: use file:///ABSOLUTE/PATH")
        if not os.path.isabs(path):
            raise BadInputError(f"invalid file store URL {url!r}: the path must be absolute")
        self.url = url
        self.root = os.path.normpath(path)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *check_key(key).split("/"))

    def _fail(self, op: str, key: str, exc: OSError) -> StoreError:
        reason = exc.strerror or type(exc).__name__
        return StoreError(f"{self.url}: {op} {key!r}: {reason}")

    # -- reads ---------------------------------------------------------------------------

    def get(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        path = self._path(key)
        check_range(key, offset, length)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectNotFound(f"{self.url}: get {key!r}: not found") from None
        except OSError as exc:
            raise self._fail("get", key, exc) from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # a directory of other keys is not an object
                raise ObjectNotFound(f"{self.url}: get {key!r}: not found")
            end = st.st_size if length is None else min(st.st_size, offset + length)
            chunks: list[bytes] = []
            pos = offset
            # pread may return short reads (Linux caps one call near 2 GiB), so loop.
            while pos < end:
                piece = os.pread(fd, end - pos, pos)
                if not piece:  # the file shrank under us; objects are immutable, so rare
                    break
                chunks.append(piece)
                pos += len(piece)
            return b"".join(chunks)
        except OSError as exc:
            raise self._fail("get", key, exc) from exc
        finally:
            os.close(fd)

    def exists(self, key: str) -> bool:
        return os.path.isfile(self._path(key))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        # Walk only the directory the prefix's complete components name, when that is a
        # safe relative path; the startswith filter below keeps the result exact either way.
        start = self.root
        head = prefix.rpartition("/")[0]
        if head:
            try:
                start = self._path(head)
            except BadInputError:
                return
        for dirpath, dirnames, filenames in os.walk(start):
            dirnames[:] = [d for d in dirnames if not d.startswith(TEMP_PREFIX)]
            rel = os.path.relpath(dirpath, self.root)
            base = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            for name in filenames:
                if name.startswith(TEMP_PREFIX):
                    continue
                key = base + name
                if not key.startswith(prefix):
                    continue
                try:
                    st = os.stat(os.path.join(dirpath, name), follow_symlinks=False)
                except FileNotFoundError:  # deleted while we walked
                    continue
                if stat.S_ISREG(st.st_mode):
                    yield ObjectInfo(key=key, size=st.st_size, mtime=st.st_mtime)

    # -- writes --------------------------------------------------------------------------

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        parent = os.path.dirname(path)
        try:
            self._make_dirs(parent)
            # os.urandom, not secrets: secrets imports hashlib, whose OpenSSL costs every
            # process that opens a store ~10 ms (lazyfs run, the data daemon; session 26)
            tmp = os.path.join(parent, f"{TEMP_PREFIX}{os.urandom(8).hex()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            except BaseException:
                os.close(fd)
                _unlink_quietly(tmp)
                raise
            os.close(fd)
            try:
                os.replace(tmp, path)
            except BaseException:
                _unlink_quietly(tmp)
                raise
            _fsync_dir(parent)
        except IsADirectoryError as exc:
            raise StoreError(f"{self.url}: put {key!r}: keys exist below it") from exc
        except (NotADirectoryError, FileExistsError) as exc:
            raise StoreError(f"{self.url}: put {key!r}: a parent is an object") from exc
        except OSError as exc:
            raise self._fail("put", key, exc) from exc

    def _make_dirs(self, path: str) -> None:
        """mkdir -p, fsyncing each new directory's parent so the new entry is durable."""
        if os.path.isdir(path):
            return
        if path == self.root:  # the root and its parents are the user's: just make them
            os.makedirs(path, exist_ok=True)
            return
        self._make_dirs(os.path.dirname(path))
        try:
            os.mkdir(path)
        except FileExistsError:
            if not os.path.isdir(path):
                raise
            return  # a concurrent put made it; it fsyncs the parent itself
        _fsync_dir(os.path.dirname(path))

    def delete(self, key: str) -> None:
        # Empty directories are left in place: removing them would race with a put that
        # just created them.
        try:
            os.unlink(self._path(key))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            pass  # missing (a directory of other keys is not an object either)
        except OSError as exc:
            raise self._fail("delete", key, exc) from exc


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
