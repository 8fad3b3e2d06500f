"""The FUSE operations of one read-only image mount: a thin layer over Manifest and cache.

Metadata comes straight from the manifest (SQLite pages read on demand, no Python object
per entry). File bytes come from the node cache: chunks already on local disk are read in
the loop thread, misses in worker threads under a CapacityLimiter so the loop never waits
on the store. The FUSE inode number is the manifest's ino (root = 1 in both), so hard
links share st_ino and nothing needs lookup counting: `forget` has nothing to free.

Stats: `stats()` returns the mount's counters as a dict; the mount process
(lazyfs/tree/fuse_mount.py) writes them as JSON to CACHE/mounts/<mountpoint>.json once a second.
Keys: image, mountpoint, pid, uptime_s, reads, bytes_read, read_errors, errors,
last_error, hot_hits, plus the node cache's own counters (node_cache/stats.py: hits,
misses, chunks_fetched, staged_hits, bytes_fetched, store_requests, evictions, and its
errors as cache_errors).

Xattrs: an image without any extended attribute answers getxattr/listxattr with ENOSYS,
which makes the kernel stop asking for the rest of the mount (callers see EOPNOTSUPP).
Without that, `ls -l` costs one round trip to this process per entry (measured: 3x
slower `ls -lR`), and every exec one more (security.capability).

Errors: every handler goes through `_handler`, which turns any exception into
`pyfuse3.FUSEError` via `lazyfs.errors.fuse_errno` (one place), logs and counts it; a
handler that raised anything else would end pyfuse3's main loop and kill the mount.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from chunker.errors import LazyfsError
from chunker.manifest import Attr, Manifest
from chunker.model import Kind
from lazyfs.errors import fuse_errno
from lazyfs.tree.chunk_reader import ChunkReader, ChunkSource
from lazyfs.tree.pyfuse3_asyncio import pyfuse3

log = logging.getLogger("lazyfs.fuse")

# Image contents never change under a mount, so the kernel may keep entries and
# attributes for as long as it likes (timeouts of 0 made `ls -lR` ~50x slower here).
CACHE_TIMEOUT = 86400.0
BLOCK = 4096


T = TypeVar("T")
_S_IFMT = {kind: kind.s_ifmt for kind in Kind}  # file type bits, without a property call


def _handler(func: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Let FUSEError through; turn anything else into one (logged, counted)."""

    @functools.wraps(func)
    async def wrapper(self: Operations, *args: Any) -> T:
        try:
            return await func(self, *args)
        except pyfuse3.FUSEError:
            raise
        except Exception as exc:  # noqa: BLE001 - the mount must stay up whatever happens
            raise self._failed(func.__name__, args, exc) from None

    return wrapper


class Operations(pyfuse3.Operations):
    # '..' would need a reverse lookup the manifest has no index for; only NFS export
    # needs it, and the kernel resolves '.' and '..' itself otherwise.
    supports_dot_lookup = False

    def __init__(
        self,
        manifest: Manifest,
        cache: ChunkSource,
        *,
        image_id: str = "",
        mountpoint: str = "",
        after_init: Callable[[], None] | None = None,
    ) -> None:
        """after_init runs once, at the first request after the kernel's INIT: the kernel
        has applied the INIT reply by then (it resets the read-ahead, for one)."""
        super().__init__()
        self._after_init = after_init
        self.manifest = manifest
        self.cache = cache
        self.reader = ChunkReader(cache)
        self.image_id = image_id
        self.mountpoint = mountpoint
        self._started = time.monotonic()
        self.counters = {"reads": 0, "bytes_read": 0, "read_errors": 0, "errors": 0}
        self.last_error = ""
        meta = manifest.meta
        self._statfs = (int(meta.get("bytes", 0)), int(meta.get("inodes", 0)))
        db = manifest.db
        self._has_xattrs = db.execute("SELECT 1 FROM xattrs LIMIT 1").fetchone() is not None

    # ------------------------------------------------------------------ errors, stats

    def _failed(self, op: str, args: tuple, exc: Exception) -> pyfuse3.FUSEError:
        code = fuse_errno(exc)
        self.counters["errors"] += 1
        if op == "read":
            self.counters["read_errors"] += 1
        self.last_error = f"{op}: {exc}"
        if isinstance(exc, LazyfsError | OSError):
            log.error("%s%r failed (%s): %s", op, args[:3], errno.errorcode.get(code, code), exc)
        else:  # a bug: keep the traceback
            log.exception("%s%r failed with an unexpected error", op, args[:3])
        return pyfuse3.FUSEError(code)

    def stats(self) -> dict[str, Any]:
        cache_stats = dict(self.cache.stats())
        if "errors" in cache_stats:
            cache_stats["cache_errors"] = cache_stats.pop("errors")
        return {
            "image": self.image_id,
            "mountpoint": self.mountpoint,
            "pid": os.getpid(),
            "uptime_s": round(time.monotonic() - self._started, 3),
            **self.counters,
            "hot_hits": self.reader.hot_hits,
            "last_error": self.last_error,
            **cache_stats,
        }

    # ------------------------------------------------------------------ metadata

    def _first_request(self) -> None:
        if self._after_init is not None:
            hook, self._after_init = self._after_init, None
            try:
                hook()
            except Exception:  # noqa: BLE001 - a tuning step must not fail a request
                log.exception("after-init hook failed")

    def _attr(self, ino: int) -> Attr:
        attr = self.manifest.getattr(ino)
        if attr is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return attr

    @staticmethod
    def _entry(attr: Attr) -> pyfuse3.EntryAttributes:
        # Runs once per entry of every listing (readdirplus): kept to plain assignments.
        e = pyfuse3.EntryAttributes()  # generation is 0 already
        e.st_ino = attr.ino
        e.entry_timeout = CACHE_TIMEOUT
        e.attr_timeout = CACHE_TIMEOUT
        e.st_mode = _S_IFMT[attr.kind] | attr.mode
        e.st_nlink = attr.nlink
        e.st_uid = attr.uid
        e.st_gid = attr.gid
        e.st_rdev = attr.rdev
        size = len(attr.target) if attr.kind == Kind.SYMLINK else attr.size
        e.st_size = size
        e.st_blksize = BLOCK
        e.st_blocks = (size + 511) // 512
        # An image records one time per entry; ctime and atime cannot be kept anyway.
        e.st_atime_ns = e.st_mtime_ns = e.st_ctime_ns = attr.mtime_ns
        return e

    @_handler
    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext | None = None
    ) -> pyfuse3.EntryAttributes:
        self._first_request()
        ino = self.manifest.lookup(parent_inode, name)
        if ino is None:
            # st_ino 0: the kernel caches the miss too (PATH and sys.path searches).
            e = pyfuse3.EntryAttributes()
            e.st_ino = 0
            e.entry_timeout = CACHE_TIMEOUT
            return e
        return self._entry(self._attr(ino))

    @_handler
    async def getattr(
        self, inode: int, ctx: pyfuse3.RequestContext | None = None
    ) -> pyfuse3.EntryAttributes:
        self._first_request()
        return self._entry(self._attr(inode))

    @_handler
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        attr = self._attr(inode)
        if attr.kind != Kind.SYMLINK:
            raise pyfuse3.FUSEError(errno.EINVAL)
        return attr.target

    @_handler
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        self._first_request()
        if self._attr(inode).kind != Kind.DIR:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    @_handler
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        # Offsets are positions in the manifest's listing of the directory, with each
        # name's attributes (readdirplus): `ls -l` then needs no lookup per entry. No
        # '.'/'..': POSIX allows it, and the kernel answers them itself.
        # One EntryAttributes for the whole reply: readdir_reply copies it into the
        # buffer, and this loop runs once per entry of every listing.
        e = pyfuse3.EntryAttributes()
        e.entry_timeout = e.attr_timeout = CACHE_TIMEOUT
        e.st_blksize = BLOCK
        reply = pyfuse3.readdir_reply
        for pos, name, record in self.manifest.listing(fh, start_id):
            ino, size, rdev, mtime_ns, mode, nlink, uid, gid, _, _ = record
            e.st_ino = ino
            e.st_mode = mode
            e.st_nlink = nlink
            e.st_uid = uid
            e.st_gid = gid
            e.st_rdev = rdev
            e.st_size = size
            e.st_blocks = (size + 511) // 512
            e.st_atime_ns = e.st_mtime_ns = e.st_ctime_ns = mtime_ns
            if not reply(token, name, e, pos):
                return  # the buffer is full: the kernel's next call starts at `pos`

    async def releasedir(self, fh: int) -> None:
        pass

    @_handler
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        self._first_request()
        n_bytes, n_inodes = self._statfs
        s = pyfuse3.StatvfsData()
        s.f_bsize = BLOCK
        s.f_frsize = BLOCK
        s.f_blocks = (n_bytes + BLOCK - 1) // BLOCK
        s.f_bfree = s.f_bavail = 0
        s.f_files = n_inodes
        s.f_ffree = s.f_favail = 0
        s.f_namemax = 255
        return s

    @_handler
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        if not self._has_xattrs:
            raise pyfuse3.FUSEError(errno.ENOSYS)  # the kernel stops asking (see top)
        value = self.manifest.xattrs(inode).get(name)
        if value is None:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        return value

    @_handler
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        if not self._has_xattrs:
            raise pyfuse3.FUSEError(errno.ENOSYS)
        return list(self.manifest.xattrs(inode))

    # ------------------------------------------------------------------ file contents

    @_handler
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & (os.O_TRUNC | os.O_CREAT):
            raise pyfuse3.FUSEError(errno.EROFS)
        if self._attr(inode).kind != Kind.REG:
            raise pyfuse3.FUSEError(errno.EINVAL)
        # keep_cache: the bytes never change, so pages survive close/open; never
        # direct_io (it breaks shared mmap, which a root filesystem needs).
        return pyfuse3.FileInfo(fh=inode, keep_cache=True, direct_io=False)

    @_handler
    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        self.counters["reads"] += 1
        out = await self.reader.range(self.manifest.chunks(fh, off, size), off, size)
        self.counters["bytes_read"] += len(out)
        return out

    async def release(self, fh: int) -> None:
        pass
