"""The node data daemon: one FUSE process per node serving each image as one read-only
file, the device its EROFS tree is mounted from (`mount -t erofs FILE DIR`).

    python -m lazyfs.tree.data_daemon MOUNTPOINT --cache DIR [--store URL] [--ready-fd N]

MOUNTPOINT (lazyfs.tree.image_mounts chooses RUN_DIR/data/<key>) holds one file per image,
named by its image id. The file is the image's EROFS device: blocks [0, meta_blocks) are
its EROFS metadata image, the rest is the data area, where each extent holds the bytes of
one regular file (chunker/erofs.py, docs/FORMATS.md). The kernel then answers lookups,
stats, opens and cached reads of the tree itself; only first reads of data reach this
process, as reads of the device (direct_io: one file's blocks, at most the tree's
512 KiB read-ahead), which the node cache answers (verified chunks, single-flight,
coalesced ranged GETs, 1 MiB of the data area read ahead; a chunk that fails
verification is EIO). The metadata image
is pushed into the kernel's page cache when a device is opened (_push_metadata).

A file appears on its first lookup once its two inputs are on local disk: the manifest
CACHE/manifests/<image id>.db and the metadata image CACHE/erofs/<id>, both fetched and
verified by the image-mount manager. The metadata is hashed again here when the image
is opened, so the kernel never sees bytes whose blake3 is not the id the manifest names.
Mounting one more image starts no process.

Each image gets its start-up trace (node_cache/prefetch.py): replayed in the background
when the store has one, recorded from the image's reads otherwise. Each new tree of an
image with a trace is warmed from it (lazyfs/tree/warmer.py): the traced files are read
through the new mount ahead of its readers, since its page cache starts empty.

Run by the image-mount manager, it is the worker of lazyfs/tree/fuse_supervisor.py, which owns
the FUSE connection and starts a new worker when this one dies, so a crash stalls the
node's trees instead of breaking them. The supervisor gives us /dev/fuse (`--device-fd`)
and a socket to it (`--socket-fd`): libfuse reads the kernel's INIT from the socket, then
serves /dev/fuse directly (take_device), and we report each open and release on the
socket. Run alone, it mounts MOUNTPOINT itself (auto_unmount) as before.

The daemon exits once no image file has been open for $LAZYFS_DAEMON_IDLE seconds and
no starter holds its lock (MOUNTPOINT.lock, shared while a starter mounts a tree). While
it stays up (a node agent keeps it), an image file no tree has had open for as long is
closed, descriptors and extents, and opened again on its next use (close_idle_devices);
once the kernel evicts its inode (FUSE forget), what the daemon kept of it goes too.
It also keeps the images' files in the node cache (manifests, metadata images) under
their share of $LAZYFS_CACHE_SIZE, removing those of the images it serves no more
(_sweep_image_files; the rules that make that safe: lazyfs/tree/image_files.py).

The cache directory it was started for is the only one it serves from. If that
directory is deleted, or deleted and made again at the same path, under it
(NodeCache.directory_state, looked at when a read fails and once a second), it does not
go on with the old one: with nothing open it exits, so the next user starts a daemon on
the cache it asks for; otherwise the worker puts its devices' manifests and metadata
images back on the path and exits with RESTART_STATUS, and the supervisor's next worker
opens the cache there afresh and answers the requests in flight (reopen_cache).

Holds: MOUNTPOINT/.hold (HOLD_NAME; never an image id, which is 64 hex digits) is an
empty file whose open handles count like open devices, so a long-lived user (the node
agent, through ImageMounts.hold_data_daemon) keeps the daemon up by keeping it open, and
lets go by closing it (or by dying: the kernel releases the handle). Its inode is fixed
(HOLD_INO), so the supervisor counts its handles like any other and a restarted worker
adopts them (--open-handles): a hold outlives worker crashes. The supervisor's death
ends the mount and with it every hold; the next starter starts a new daemon, and the
holder opens the hold again there (image_mounts.py).

Stats: per image, CACHE/mounts/<quoted device path>.json, as lazyfs.tree.fuse_mount writes them,
with "tree": "erofs" and "device" (the file the EROFS mounts read).
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import functools
import logging
import os
import stat
import struct
import sys
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import blake3

from chunker.errors import BadInputError, CorruptObjectError, LazyfsError, NotFoundError
from chunker.manifest import ErofsExtents, Manifest
from chunker.model import ChunkRef
from chunker.store.backends import open_store
from lazyfs.arguments import Parser
from lazyfs.errors import MountError, fuse_errno
from lazyfs.fds import raise_open_files_limit
from lazyfs.settings import Settings
from lazyfs.tree.chunk_reader import ChunkReader
from lazyfs.tree.daemon_log import LOG_KEEP, keep_log_bounded
from lazyfs.tree.daemon_loop import asyncio, in_thread, run_loop, serve_requests  # no ssl
from lazyfs.tree.fuse_daemon import raise_mount_read_ahead, reporting_failure, start_mount_watchdog
from lazyfs.tree.image_files import stamp_used, sweep_period
from lazyfs.tree.mount_watch import Ready, ready_reporter
from lazyfs.tree.node_files import (
    HOLD_NAME,
    NODE_STATS_EVERY,
    STATS_INTERVAL,
    check_mountpoint,
    manifest_path,
    state_path,
    sweep_image_files,
    write_json,
)
from lazyfs.tree.pyfuse3_asyncio import before_next_read, pyfuse3
from lazyfs.tree.warmer import TreeWarmer

log = logging.getLogger("lazyfs.tree.data_daemon")
T = TypeVar("T")

FSTYPE = "fuse.lazyfs-data"
BLOCK = 4096
ROOT = pyfuse3.ROOT_INODE
CACHE_TIMEOUT = 86400.0  # devices never change while they exist
IDLE_CHECK = 1.0  # seconds between idle checks
PUSH_PIECE = 1 << 20  # bytes of metadata per FUSE_NOTIFY_STORE message
REPLY_BUFFER = 1 << 20  # the kernel's largest read (max_pages 256); a bigger one grows it
RESTART_STATUS = 75  # EX_TEMPFAIL: asks the supervisor for a new worker (reopen_cache)
# linux/fuse.h: a fuse_out_header with unique 0 is a notification; its error field says
# which. FUSE_NOTIFY_RESEND (7, Linux 6.9) has no body.
NOTIFY_RESEND = struct.pack("<IiQ", 16, 7, 0)
_ZEROS = bytes(REPLY_BUFFER)


def _zeros(n: int) -> bytes | memoryview:
    return memoryview(_ZEROS)[:n] if n <= len(_ZEROS) else bytes(n)


def device_ino(image_id: str) -> int:
    """An image's inode number on this mount, the same in every daemon process: after a
    restart (lazyfs/tree/fuse_supervisor.py) the kernel still holds the old node ids and
    sends READs for them without a new lookup."""
    return int(image_id[:15], 16) + ROOT + 1  # 60 bits; never ROOT


HOLD_INO = (1 << 60) + ROOT + 1  # the hold's inode: above every device_ino


def _is_image_id(name: str) -> bool:
    return len(name) == 64 and all(c in "0123456789abcdef" for c in name)


def erofs_path(cache_dir: Path, object_id: str) -> Path:
    """Where the image-mount manager keeps a verified EROFS metadata image."""
    return cache_dir / "erofs" / object_id


class Device:
    """One image's EROFS device: its metadata image, then its data area.

    A plain class, not a dataclass: this module was the worker's only user of
    dataclasses, ~2.5 ms of a cold worker's start (session 33), which a node's first
    `lazyfs run` waits for."""

    def __init__(
        self,
        image_id: str,
        ino: int,
        manifest: Manifest,
        manifest_fd: int,  # the manifest file, kept open to put it back (put_back)
        meta_id: str,  # the EROFS metadata image's object id
        meta_fd: int,
        meta_end: int,  # bytes of metadata image at the start of the device
        size: int,  # bytes of the whole device
        extents: ErofsExtents,  # the data area's, by block
    ) -> None:
        self.image_id = image_id
        self.ino = ino
        self.manifest = manifest
        self.manifest_fd = manifest_fd
        self.meta_id = meta_id
        self.meta_fd = meta_fd
        self.meta_end = meta_end
        self.size = size
        self.extents = extents
        self.trace: Any = None  # node_cache.prefetch.StartupTrace, or None
        self.warmer: TreeWarmer | None = None  # the warm-up of its newest tree, if any
        self.opened = 0
        self.idle_since: float | None = time.monotonic()  # None while a tree has it open
        self.counters = {"reads": 0, "bytes_read": 0, "read_errors": 0}
        self.last_error = ""
        # Held while its descriptors are used off the loop (_store_metadata) and while
        # they are closed: a closed descriptor's number may be another file's by then.
        self.lock = threading.Lock()
        self.closed = False

    def close(self, cache_dir: Path) -> None:
        if self.trace is not None:
            self.trace.finish()
        with self.lock:
            self.closed = True
            os.close(self.meta_fd)
            os.close(self.manifest_fd)
            self.manifest.close()
        # Its last use: the sweep takes the least recently used images' files first.
        stamp_used(manifest_path(cache_dir, self.image_id))
        stamp_used(erofs_path(cache_dir, self.meta_id))

    def put_back(self, cache_dir: Path) -> None:
        """Write the device's manifest and metadata image into cache_dir from the files
        we hold open, where the cache directory at its path was replaced: a restarted
        worker opens the devices the kernel still holds from there (known())."""
        _put_back(self.manifest_fd, self.image_id, manifest_path(cache_dir, self.image_id))
        _put_back(self.meta_fd, self.meta_id, erofs_path(cache_dir, self.meta_id))


def open_device(cache_dir: Path, image_id: str, ino: int) -> Device:
    """The device of an image whose manifest and metadata image the manager fetched."""
    path = manifest_path(cache_dir, image_id)
    try:
        manifest_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:  # never fetched, or swept (the manager fetches it again)
        raise NotFoundError(f"image {image_id} has no manifest in {path.parent}") from None
    try:
        manifest = Manifest(path)
    except BaseException:
        os.close(manifest_fd)
        raise
    try:
        erofs = manifest.erofs
        if erofs is None:
            raise BadInputError(f"image {image_id} has no EROFS metadata image")
        object_id, meta_blocks, total_blocks = erofs
        meta = erofs_path(cache_dir, object_id)
        fd = os.open(meta, os.O_RDONLY | os.O_CLOEXEC)
        try:
            _verify(fd, object_id, meta_blocks)
            extents = manifest.erofs_extents()
        except BaseException:
            os.close(fd)
            raise
    except BaseException:
        manifest.close()
        os.close(manifest_fd)
        raise
    return Device(
        image_id,
        ino,
        manifest,
        manifest_fd,
        object_id,
        fd,
        meta_blocks * BLOCK,
        total_blocks * BLOCK,
        extents,
    )


def _put_back(fd: int, object_id: str, dest: Path) -> None:
    """The content-addressed file open as fd, at dest (unless a file is there already:
    the image-mount manager fetched it again, verified), checked against its id and
    renamed into place, so that no reader sees it half written."""
    if dest.exists():
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    digest = blake3.blake3()
    try:
        with open(tmp, "wb") as out:
            off = 0
            while piece := os.pread(fd, 1 << 20, off):
                digest.update(piece)
                out.write(piece)
                off += len(piece)
        if digest.hexdigest() != object_id:
            raise CorruptObjectError(f"{dest.name}: the copy held open is damaged")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def _verify(fd: int, object_id: str, meta_blocks: int) -> None:
    digest = blake3.blake3()
    size = 0
    while piece := os.read(fd, 1 << 20):
        digest.update(piece)
        size += len(piece)
    if digest.hexdigest() != object_id or size != meta_blocks * BLOCK:
        raise CorruptObjectError(f"EROFS metadata {object_id} on local disk is damaged")


def _handler(func: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Let FUSEError through; turn anything else into one (logged): a handler that raised
    anything else would end pyfuse3's main loop, and with it every image of the node."""

    @functools.wraps(func)
    async def wrapper(self: DataOperations, *args: Any) -> T:
        try:
            return await func(self, *args)
        except pyfuse3.FUSEError:
            raise
        except Exception as exc:  # noqa: BLE001 - the daemon must stay up
            if isinstance(exc, LazyfsError | OSError):
                log.error("%s%r failed: %s", func.__name__, args[:3], exc)
            else:
                log.exception("%s%r failed with an unexpected error", func.__name__, args[:3])
            raise pyfuse3.FUSEError(fuse_errno(exc)) from None

    return wrapper


class DataOperations(pyfuse3.Operations):
    """The FUSE side: a flat directory of devices. Errors go through fuse_errno."""

    supports_dot_lookup = False

    def __init__(self, cache_dir: Path, cache: Any, store: Any, mountpoint: str) -> None:
        super().__init__()
        self.cache_dir = cache_dir
        self.cache = cache
        self.store = store
        self.mountpoint = mountpoint
        self.reader = ChunkReader(cache)
        self.by_id: dict[str, Device] = {}  # the devices open now (by a tree, or soon)
        self.by_ino: dict[int, Device] = {}
        # Devices closed after their last tree went (close_idle_devices): inode -> (image
        # id, counts, last error), to open them again on their next use with their counts.
        self.forgotten: dict[int, tuple[str, dict[str, int], str]] = {}
        # The kernel's lookups of each device's inode, less its forgets: once none are
        # left it no longer knows the inode (it evicted it, with its pages), and the
        # device's record in `forgotten` and `pushed` go (forget). A lookup of an inode by
        # the worker before a restart is not counted: its forget drops the inode early,
        # and a request for it then opens the device from the manifest (known).
        self.lookups: Counter[int] = Counter()
        self.holds = 0  # open handles of HOLD_NAME
        self.image_files_removed = 0  # by _sweep_image_files, over this process's life
        self.idle_since = time.monotonic()
        self.after_init: Callable[[], None] | None = None
        # Devices whose metadata image is to be pushed into the kernel's page cache
        # (_push_metadata, in the main loop, takes them).
        self.to_push: asyncio.Queue[Device] = asyncio.Queue(256)
        self.pushed: set[int] = set()
        # One stats file write at a time, each of the stats as they are when it starts:
        # the periodic pass writes from a worker thread, an open or release from the
        # loop, and the last to write must never be the older figures (write_json's
        # temporary file is named by process, so it is one writer's at a time too).
        self._publishing = threading.Lock()
        self._reply = memoryview(bytearray(REPLY_BUFFER))  # see _read
        self.restartable = False  # a worker of lazyfs/tree/fuse_supervisor.py (reopen_cache)
        # Called by pyfuse3 once the kernel's INIT is processed (a worker moves onto
        # /dev/fuse then: take_device), and with (b"+" or b"-", inode) on each open and
        # release (a worker reports them to its supervisor: fuse_supervision.py).
        self.on_init: Callable[[], None] | None = None
        self.report: Callable[[bytes, int], None] | None = None

    def init(self) -> None:
        if self.on_init is not None:
            self.on_init()

    def _reported(self, sign: bytes, ino: int) -> None:
        if self.report is not None:
            self.report(sign, ino)

    def reopen_cache(self) -> None:
        """If the cache directory at our path is no longer the one we opened (deleted, or
        deleted and made again: NodeCache.directory_state), stop serving from it: put
        every device's manifest and metadata image back there and exit with
        RESTART_STATUS. The supervisor keeps the FUSE connection and the requests in
        flight, and starts a new worker: it opens the cache on the path afresh (prepared
        again; made again if it was deleted), reopens the devices the kernel holds from
        what we put back, and answers those requests. Readers stall for the restart
        (155-271 ms here) and never see the EIO the old cache would give (its stripe lock
        files and chunk directories are gone). Returns if the cache is ours, or if we
        run alone (no supervisor to restart us)."""
        state = self.cache.directory_state()
        if state == "same" or not self.restartable:
            return
        log.warning("cache directory %s %s: restarting to reopen it", self.cache_dir, state)
        for dev in list(self.by_ino.values()):
            try:
                dev.put_back(self.cache_dir)
            except (OSError, LazyfsError) as exc:  # its tree's uncached reads will fail
                log.error("image %s: cannot put its metadata back: %s", dev.image_id, exc)
        logging.shutdown()  # flush the log: os._exit does not
        # Not a clean exit: status 0 would make the supervisor unmount the node's trees;
        # and no stats file says "unmounted" (the trees stay). Like a kill -9 for the
        # cache: LMDB and the chunk files are safe against it (node_cache/files.py).
        os._exit(RESTART_STATUS)

    # ------------------------------------------------------------------ devices

    def _device(self, name: bytes, adopted: bool = False) -> Device | None:
        """The device of image `name`, opened on first use. `adopted`: the kernel
        opened it from the worker before us, whose recording of its start-up trace died
        with it: we would note only the rest of that start-up, so we record none."""
        try:
            image_id = name.decode("ascii")
        except UnicodeDecodeError:
            return None
        dev = self.by_id.get(image_id)
        if dev is not None:
            return dev
        if not _is_image_id(image_id):
            return None
        ino = device_ino(image_id)
        if ino in self.by_ino:  # two ids sharing 60 bits: refuse the second
            raise BadInputError(f"image {image_id}: inode {ino} is taken")
        dev = open_device(self.cache_dir, image_id, ino)
        if self.cache.policy.prefetch:
            from node_cache.prefetch import StartupTrace

            dev.trace = StartupTrace(self.cache, self.store, image_id, record=not adopted)
            dev.trace.start(hook_cache=False)
        if (before := self.forgotten.pop(ino, None)) is not None:
            _, counters, dev.last_error = before
            dev.counters.update(counters)
        self.by_id[image_id] = dev
        self.by_ino[dev.ino] = dev
        log.info(
            "serving image %s (%d bytes, %d extents)", image_id, dev.size, len(dev.extents.starts)
        )
        return dev

    def known(self, ino: int) -> Device | None:
        """The device with this inode, opened on first use: a restarted daemon gets
        requests for devices the kernel looked up from the one before."""
        dev = self.by_ino.get(ino)
        if dev is not None or ino == ROOT:
            return dev
        if ino in self.forgotten:  # closed after its last tree; the kernel still knows it
            return self._device(self.forgotten[ino][0].encode())
        for path in (self.cache_dir / "manifests").glob("*.db"):
            if _is_image_id(path.stem) and device_ino(path.stem) == ino:
                return self._device(path.stem.encode(), adopted=True)
        return None

    def _entry(self, ino: int) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = ino
        e.entry_timeout = e.attr_timeout = CACHE_TIMEOUT
        if ino == ROOT:
            e.st_mode = stat.S_IFDIR | 0o555
            e.st_nlink = 2
        else:
            e.st_mode = stat.S_IFREG | 0o444
            e.st_nlink = 1
            e.st_size = 0 if ino == HOLD_INO else self.by_ino[ino].size
        e.st_blksize = BLOCK
        e.st_blocks = (e.st_size + 511) // 512
        return e

    def _first_request(self) -> None:
        if self.after_init is not None:
            hook, self.after_init = self.after_init, None
            hook()

    @_handler
    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext | None = None
    ) -> pyfuse3.EntryAttributes:
        self._first_request()
        if parent_inode == ROOT and name == HOLD_NAME.encode():
            return self._entry(HOLD_INO)
        dev = self._device(name) if parent_inode == ROOT else None
        if dev is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        entry = self._entry(dev.ino)
        self.lookups[dev.ino] += 1
        return entry

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        """The kernel drops `nlookup` lookups of each inode. A device's inode with none
        left is one the kernel evicted: what this process kept of it after its last tree
        (its counts in `forgotten`, its push) goes, so that neither grows with every
        image the node ever ran (~0.5 kB each). Its next lookup opens it again, and its
        next open pushes its metadata again: the kernel's pages went with the inode."""
        for ino, nlookup in inode_list:
            left = self.lookups.pop(ino, 0) - nlookup
            if left > 0:
                self.lookups[ino] = left
            else:
                before = self.forgotten.pop(ino, None)
                self.pushed.discard(ino)
                if before is not None:
                    log.info("image %s: device forgotten by the kernel", before[0])

    @_handler
    async def getattr(
        self, inode: int, ctx: pyfuse3.RequestContext | None = None
    ) -> pyfuse3.EntryAttributes:
        self._first_request()
        if inode not in (ROOT, HOLD_INO) and self.known(inode) is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._entry(inode)

    @_handler
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        if inode != ROOT:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return ROOT

    @_handler
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        devices = sorted(self.by_ino.values(), key=lambda d: d.ino)
        for n, dev in enumerate(devices[start_id:], start_id + 1):
            if not pyfuse3.readdir_reply(token, dev.image_id.encode(), self._entry(dev.ino), n):
                return
            self.lookups[dev.ino] += 1  # one more (see forget)

    async def releasedir(self, fh: int) -> None:
        pass

    @_handler
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if inode == HOLD_INO:
            if flags & os.O_ACCMODE != os.O_RDONLY:
                raise pyfuse3.FUSEError(errno.EROFS)
            self.holds += 1
            log.info("held (%d holds)", self.holds)
            self._reported(b"+", HOLD_INO)
            return pyfuse3.FileInfo(fh=HOLD_INO, direct_io=True)
        dev = self.known(inode)
        if dev is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise pyfuse3.FUSEError(errno.EROFS)
        dev.opened += 1
        dev.idle_since = None
        if dev.opened == 1:
            if dev.trace is not None:  # a new tree: fill its page cache ahead of its readers
                dev.warmer = TreeWarmer(
                    os.path.join(self.mountpoint, dev.image_id),
                    dev.manifest.path,
                    dev.trace,
                    lambda: dev.opened > 0,
                    lambda: self.cache.directory_state() == "same",
                )
                dev.warmer.start()
            self.publish(dev)  # a tree is up: say so before the next stats interval
        if dev.ino not in self.pushed:
            self.pushed.add(dev.ino)
            self.to_push.put_nowait(dev)
        self._reported(b"+", inode)  # before the reply (fuse_supervision.py says why)
        # direct_io: EROFS keeps the tree's pages in its own page cache; without it the
        # device's pages were cached a second time (27.8 MB of device pages after reading
        # 25 MB of /usr/lib/python3.11 cold, by fincore). The kernel then asks for exactly
        # the blocks EROFS reads, and _ahead does the read-ahead.
        return pyfuse3.FileInfo(fh=inode, keep_cache=True, direct_io=True)

    @_handler
    async def release(self, fh: int) -> None:
        try:
            await self._release(fh)
        finally:  # after the reply, which pyfuse3 sends as this returns (see fuse_supervision)
            asyncio.get_running_loop().call_soon(self._reported, b"-", fh)

    async def _release(self, fh: int) -> None:
        if fh == HOLD_INO:
            self.holds -= 1
            log.info("hold released (%d holds)", self.holds)
            if not self.open_devices():
                self.idle_since = time.monotonic()
            return
        try:
            dev = self.known(fh)
        except (LazyfsError, OSError) as exc:
            log.error("release(%d): %s", fh, exc)
            return
        if dev is None:
            return
        dev.opened -= 1
        if dev.opened == 0:
            if dev.trace is not None:
                # The image's last tree is gone: its start-up is over, so a trace still
                # being recorded is written now (not at the daemon's exit, days away).
                await in_thread(dev.trace.finish)
            # The stats of a tree that lived less than a stats interval, at once.
            self.publish(dev)
            if dev.opened == 0:  # (and not opened again while its trace was written)
                dev.idle_since = time.monotonic()
        if not self.open_devices():
            self.idle_since = time.monotonic()

    def close_idle_devices(self, idle: float) -> None:
        """Close each device no tree has had open for `idle` seconds. The node data
        daemon outlives thousands of images (the agent keeps it up), and an open device
        holds three descriptors (its manifest, SQLite's, its metadata image) and its
        extents: kept for the daemon's life, they stopped it opening images after ~300
        under the usual 1,024 descriptors. Its next use opens it again (known), its
        counts going on."""
        now = time.monotonic()
        for dev in list(self.by_ino.values()):
            if dev.opened == 0 and dev.idle_since is not None and now - dev.idle_since >= idle:
                del self.by_ino[dev.ino], self.by_id[dev.image_id]
                self.forgotten[dev.ino] = (dev.image_id, dict(dev.counters), dev.last_error)
                dev.close(self.cache_dir)
                log.info("image %s: closed, no tree has had it open for %g s", dev.image_id, idle)

    def open_devices(self) -> int:
        """What keeps the daemon up: devices open, plus one if anybody holds it."""
        return sum(1 for dev in self.by_ino.values() if dev.opened > 0) + (self.holds > 0)

    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        if fh == HOLD_INO:
            return b""  # an empty file
        dev = await self._read_device(fh)
        dev.counters["reads"] += 1
        try:
            out = await self._read(dev, off, size)
        except Exception as exc:  # noqa: BLE001 - the daemon serves every image: stay up
            self.reopen_cache()  # a replaced cache: a new worker answers this read
            code = fuse_errno(exc)
            dev.counters["read_errors"] += 1
            dev.last_error = f"read: {exc}"
            if isinstance(exc, LazyfsError | OSError):
                log.error("image %s: read(%d, %d) failed: %s", dev.image_id, off, size, exc)
            else:
                log.exception("image %s: read(%d, %d) failed", dev.image_id, off, size)
            raise pyfuse3.FUSEError(code) from None
        dev.counters["bytes_read"] += len(out)
        return out

    @_handler
    async def _read_device(self, fh: int) -> Device:
        dev = self.known(fh)
        if dev is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        return dev

    async def _read(self, dev: Device, off: int, size: int) -> bytes | memoryview:
        """Device bytes [off, off + size): metadata, then extents' file bytes and zeros.

        Every chunk the read needs is asked for in one call, so the node cache can fetch
        the misses of many small files (readahead spans them) in one ranged GET.
        """
        end = min(off + size, dev.size)
        parts: list[Any] = []  # bytes, an int (that many zeros) or a (pieces, off, len) read
        pos = off
        if pos < dev.meta_end:
            stop = min(end, dev.meta_end)
            parts.append(os.pread(dev.meta_fd, stop - pos, pos))
            pos = stop
        manifest = dev.manifest
        starts, ends, inos, sizes = dev.extents
        i = bisect.bisect_right(starts, pos // BLOCK) - 1
        while pos < end:
            if i >= 0 and pos < ends[i] * BLOCK:  # inside extent i
                first = starts[i] * BLOCK
                stop = min(end, ends[i] * BLOCK)
                ino, file_size = inos[i], sizes[i]
                lo, hi = pos - first, min(stop - first, file_size)
                if lo < hi:
                    parts.append((manifest.chunks(ino, lo, hi - lo), lo, hi - lo))
                    lo = hi
                parts.append(stop - first - lo)
                pos = stop
            else:  # a gap before the next extent (or the device's end)
                i += 1
                nxt = starts[i] * BLOCK if i < len(starts) else end
                parts.append(min(nxt, end) - pos)
                pos = min(nxt, end)
        refs = [ref for part in parts if isinstance(part, tuple) for _, ref in part[0]]
        if not refs:
            return b"".join(bytes(p) if isinstance(p, int) else p for p in parts)
        if dev.trace is not None:
            dev.trace.note(refs)
        ahead = functools.partial(self._ahead, dev, end)
        datas = dict(zip((r.id for r in refs), await self.reader.chunks(refs, ahead), strict=True))
        # No await from here until pyfuse3 has sent the reply (it does so as soon as read()
        # returns), so one reply buffer serves every read: each byte is copied once, into
        # memory that stays mapped (a new 1 MiB bytes object per read was two copies and
        # fresh pages: page faults and zeroing, ~15 % of the daemon's CPU per GiB).
        out = self._reply_buffer(end - off)
        at = 0
        for part in parts:
            if isinstance(part, int):
                out[at : at + part] = _zeros(part)
                at += part
            elif isinstance(part, tuple):
                pieces, lo, length = part
                for start, ref in pieces:
                    piece = memoryview(datas[ref.id])[max(lo - start, 0) : lo + length - start]
                    out[at : at + len(piece)] = piece
                    at += len(piece)
            else:
                out[at : at + len(part)] = part
                at += len(part)
        return out

    def _reply_buffer(self, size: int) -> memoryview:
        if len(self._reply) < size:
            self._reply = memoryview(bytearray(size))
        return self._reply[:size]

    def _ahead(self, dev: Device, start: int) -> list[ChunkRef]:
        """The chunks of the data area's next `readahead` bytes (the cache policy's) after
        `start`.

        The device is opened with direct_io, so the kernel asks for exactly what EROFS
        reads: one file's blocks. Reading ahead here instead turns a directory's small
        files (laid out together) into one ranged GET, and a corrupt chunk among them
        fails only the file that holds it.
        """
        stop = start + self.cache.policy.readahead
        refs: list[ChunkRef] = []
        whole: list[int] = []  # files the window holds entirely: one query for them all
        starts, _, inos, sizes = dev.extents
        i = max(bisect.bisect_right(starts, start // BLOCK) - 1, 0)
        while i < len(starts) and starts[i] * BLOCK < stop:
            first = starts[i] * BLOCK
            ino, size = inos[i], sizes[i]
            lo, hi = max(start - first, 0), min(stop - first, size)
            if lo == 0 and hi == size:
                whole.append(ino)
            elif lo < hi:
                refs.extend(ref for _, ref in dev.manifest.chunks(ino, lo, hi - lo))
            i += 1
        refs.extend(dev.manifest.whole_file_chunks(whole))
        return refs

    @_handler
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = BLOCK
        s.f_blocks = sum(dev.size for dev in self.by_ino.values()) // BLOCK
        s.f_files = len(self.by_ino)
        s.f_namemax = 255
        return s

    # ------------------------------------------------------------------ stats

    def publish(self, dev: Device) -> None:
        """Write the device's stats file (lazyfs.tree.fuse_mount's format, see the top)."""
        path = state_path(self.cache_dir, Path(self.mountpoint) / dev.image_id, ".json")
        with self._publishing:
            write_json(path, {**self.device_stats(dev), "mounted": dev.opened > 0})

    def device_stats(self, dev: Device) -> dict[str, Any]:
        return {**self.own_stats(dev), **self.node_stats()}

    def own_stats(self, dev: Device) -> dict[str, Any]:
        """The part of a device's stats that is its own."""
        trace = dev.trace.status() if dev.trace is not None else {"trace": "off"}
        warm = dev.warmer.status() if dev.warmer is not None else {"warm": "none"}
        return {
            "image": dev.image_id,
            "tree": "erofs",
            "device": os.path.join(self.mountpoint, dev.image_id),
            "pid": os.getpid(),
            "open": dev.opened,
            **dev.counters,
            "errors": dev.counters["read_errors"],
            "last_error": dev.last_error,
            **trace,
            **warm,
        }

    def node_stats(self) -> dict[str, Any]:
        """The part every device's stats share: the cache is the node's, shared by every
        image of this daemon."""
        cache_stats = dict(self.cache.stats())
        if "errors" in cache_stats:
            cache_stats["cache_errors"] = cache_stats.pop("errors")
        return {
            "hot_hits": self.reader.hot_hits,
            "image_files_removed": self.image_files_removed,
            **cache_stats,
        }


# ---------------------------------------------------------------- the process


class Supervised(NamedTuple):
    """How a worker under lazyfs/tree/fuse_supervisor.py reaches the kernel: the supervisor
    mounted MOUNTPOINT, gives us its /dev/fuse (`device_fd`) and a socket to it
    (`socket_fd`), shares the idle lock's open file `lock_fd`, and tells a restarted
    worker how many handles the kernel holds open per inode (`handles`, the hold's
    HOLD_INO among them)."""

    socket_fd: int
    device_fd: int
    lock_fd: int
    handles: dict[int, int]
    resend: bool  # a worker before us died after the kernel's INIT: take_device


def serve(
    mountpoint: Path,
    cache_dir: Path,
    store_url: str | None,
    ready: Ready | None,
    supervised: Supervised | None = None,
) -> int:
    start = functools.partial(_serve, mountpoint, cache_dir, store_url, ready, supervised)
    return reporting_failure(start, ready)


def _serve(
    mountpoint: Path,
    cache_dir: Path,
    store_url: str | None,
    ready: Ready | None,
    sup: Supervised | None,
) -> int:
    settings = Settings.from_env()
    if sup is None:
        point = check_mountpoint(mountpoint)
        lock = os.open(f"{point}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    else:  # mounted already, by the supervisor
        point = Path(os.path.abspath(mountpoint))
        lock = sup.lock_fd
    from node_cache.cache import NodeCache

    store = open_store(store_url or settings.store_url)
    cache = NodeCache(cache_dir, store, settings.cache)
    # The stats files' directory; made again here after the cache directory was (reopen_cache)
    (cache_dir / "mounts").mkdir(exist_ok=True)
    ops = DataOperations(cache_dir, cache, store, str(point))
    ops.restartable = sup is not None
    options = {"fsname=lazyfs-data", "subtype=lazyfs-data", "ro", "allow_other"}
    if sup is None:
        ops.after_init = functools.partial(raise_mount_read_ahead, str(point))
        options.add("auto_unmount")
        target = str(point)
    else:
        # libfuse: a mountpoint "/dev/fd/N" is an open FUSE fd, mounted by the caller; no
        # auto_unmount (our death must not unmount: the supervisor starts another one).
        # N is a copy of our socket to the supervisor until INIT, then /dev/fuse.
        session_fd = os.dup(sup.socket_fd)
        target = f"/dev/fd/{session_fd}"
        take = functools.partial(take_device, sup, session_fd)
        ops.on_init = functools.partial(before_next_read, take)
        ops.report = functools.partial(_report, sup.socket_fd)
        _adopt_handles(ops, sup.handles)
    try:
        try:
            pyfuse3.init(ops, target, options)
        except RuntimeError as exc:
            raise MountError(f"cannot mount {point}: {exc}") from None
        log.info("data daemon serving %s (pid %d)", point, os.getpid())
        if sup is None:
            start_mount_watchdog(str(point))
        try:
            run_loop(_main_loop, ops, lock, settings.daemon_idle, ready)
        finally:
            pyfuse3.close(unmount=sup is None)
            for dev in ops.by_ino.values():
                dev.opened = 0
                ops.publish(dev)
                dev.close(ops.cache_dir)
    finally:
        ops.reader.close()  # its fetches first: they use the cache
        cache.close()
        store.close()
        if sup is None:
            os.close(lock)  # a worker's lock stays held by the supervisor's copy
    return 0


def take_device(sup: Supervised, session_fd: int) -> None:
    """Once libfuse has answered the INIT it read from the supervisor's socket: make its
    descriptor /dev/fuse itself, and if a worker died before us, ask the kernel to send
    again what that worker had read and not answered (FUSE_NOTIFY_RESEND). From here on
    the supervisor hears from us only on open and release, and we leave when it is gone
    (its socket's EOF)."""
    os.dup2(sup.device_fd, session_fd, inheritable=False)
    os.close(sup.device_fd)
    if sup.resend:
        try:
            os.write(session_fd, NOTIFY_RESEND)
        except OSError as exc:  # before Linux 6.9 (the supervisor knows: its INIT flags)
            log.warning("the kernel did not take FUSE_NOTIFY_RESEND: %s", exc)
    asyncio.get_running_loop().add_reader(sup.socket_fd, _supervisor_gone, sup.socket_fd)


def _supervisor_gone(socket_fd: int) -> None:
    """The supervisor never writes after the INIT: readable means its end closed."""
    asyncio.get_running_loop().remove_reader(socket_fd)
    log.warning("the supervisor is gone: stopping")
    pyfuse3.terminate()


def _report(socket_fd: int, sign: bytes, ino: int) -> None:
    try:
        os.write(socket_fd, b"%s%d" % (sign, ino))
    except OSError as exc:  # the supervisor is gone; _supervisor_gone stops us
        log.warning("cannot report a handle to the supervisor: %s", exc)


def _adopt_handles(ops: DataOperations, handles: dict[int, int]) -> None:
    """A restarted worker: the handles its predecessor had open stay open (the kernel
    holds them for the EROFS mounts), so the idle exit must still see them."""
    for ino, count in handles.items():
        if ino == HOLD_INO:
            ops.holds = count
            continue
        try:
            dev = ops.known(ino)
        except (LazyfsError, OSError) as exc:
            log.error("cannot reopen the device of inode %d: %s", ino, exc)
            continue
        if dev is not None:
            dev.opened = count
    if handles:
        log.info("adopted %d open handles of %d devices", sum(handles.values()), len(handles))


async def _main_loop(ops: DataOperations, lock: int, idle: float, ready: Ready | None) -> None:
    await serve_requests(
        ready,
        _publish_stats(ops),
        _exit_when_idle(ops, lock, idle),
        _push_metadata(ops),
        _sweep_image_files(ops, idle),
        _bound_log(idle),
    )


async def _bound_log(idle: float) -> None:
    """Keep this daemon's log file bounded (lazyfs/tree/daemon_log.py), as often as the
    image files are swept."""
    while True:
        await asyncio.sleep(sweep_period(idle))
        try:
            if await in_thread(keep_log_bounded):
                log.info("log file over %d bytes: the lines before are in its .1", LOG_KEEP)
        except OSError as exc:
            log.warning("cannot bound the log file: %s", exc)


async def _sweep_image_files(ops: DataOperations, idle: float) -> None:
    """Keep the images' files in the node cache under their share of it, removing those
    of images no tree has used for `idle` seconds, least recently used first
    (lazyfs/tree/image_files.py), and the stats files of their devices (one per image
    ever served, read by `lazyfs` commands that list mounts). Off the loop: a sweep
    stats every image's files."""
    while True:
        await asyncio.sleep(sweep_period(idle))
        serving = {*ops.by_id, *(dev.meta_id for dev in ops.by_id.values())}  # on the loop
        try:
            swept = await in_thread(
                sweep_image_files, ops.cache_dir, ops.cache.policy, idle, serving
            )
        except OSError as exc:
            log.warning("cannot sweep the image files of %s: %s", ops.cache_dir, exc)
            continue
        ops.image_files_removed += swept.removed


async def _push_metadata(ops: DataOperations) -> None:
    """Store each opened device's metadata image in the kernel's page cache of the device
    (FUSE_NOTIFY_STORE), so that EROFS finds every inode and directory block there.

    EROFS reads its metadata one 4 KiB block at a time through the device's page cache,
    each miss a round trip to this process: a `find` over 100k files on a fresh tree
    made thousands of them. The metadata image is small (about 100 bytes per entry) and
    the tree needs all of it sooner or later. In a thread: the kernel may take a while.
    """
    while True:
        dev = await ops.to_push.get()
        try:
            if await in_thread(_store_metadata, dev):
                log.debug("image %s: metadata pushed (%d bytes)", dev.image_id, dev.meta_end)
            else:
                ops.pushed.discard(dev.ino)  # its next open pushes it, whole
        except OSError as exc:  # only a hint: reads fetch the blocks themselves
            log.warning("image %s: metadata not pushed to the kernel: %s", dev.image_id, exc)


def _store_metadata(dev: Device) -> bool:
    """Whether the whole metadata image was stored (not if the device closed first)."""
    for off in range(0, dev.meta_end, PUSH_PIECE):
        with dev.lock:
            if dev.closed:  # its tree came and went before this push: nothing to do now
                return False
            piece = os.pread(dev.meta_fd, PUSH_PIECE, off)
        pyfuse3.notify_store(dev.ino, off, piece)
    return True


async def _publish_stats(ops: DataOperations) -> None:
    """Rewrite a device's stats file once a second while its own part changes. While only
    the node-wide part does (it changes with any image's reads), rewrite one device's a
    second, the one whose node-wide part is oldest, and every device's at least every
    NODE_STATS_EVERY seconds: the newest node-wide figures are then always in some file
    (`mount_stats` gives them to all). Rewriting every device's file each second (a new
    inode each, ~1 ms on ext4) was a quarter of this process's work with 50 images
    mounted. The files are written in a worker thread: on this loop every read of every
    tree waited behind them."""
    own: dict[str, dict] = {}  # image id -> its own part as last written
    written: dict[str, tuple[float, dict]] = {}  # image id -> (when, node-wide part)
    while True:
        node = ops.node_stats()
        now = time.monotonic()
        due: list[Device] = []
        behind: list[tuple[float, Device]] = []  # devices whose node-wide part is not `node`
        for dev in list(ops.by_ino.values()):
            mine = ops.own_stats(dev)
            when, node_then = written.get(dev.image_id, (0.0, {}))
            if mine != own.get(dev.image_id) or (
                node != node_then and now - when >= NODE_STATS_EVERY
            ):
                due.append(dev)
                own[dev.image_id], written[dev.image_id] = mine, (now, node)
            elif node != node_then:
                behind.append((when, dev))
        if behind and not due:
            _, dev = min(behind, key=lambda b: b[0])
            due.append(dev)
            own[dev.image_id], written[dev.image_id] = ops.own_stats(dev), (now, node)
        if due:
            await in_thread(_publish_each, ops, due)
        for gone in own.keys() - ops.by_id.keys():  # closed (close_idle_devices)
            del own[gone], written[gone]
        await asyncio.sleep(STATS_INTERVAL)


def _publish_each(ops: DataOperations, devices: list[Device]) -> None:
    for dev in devices:
        ops.publish(dev)


async def _exit_when_idle(ops: DataOperations, lock: int, idle: float) -> None:
    """Unmount once nothing has been open for `idle` seconds and no starter is between
    starting us and opening a device (it holds the lock shared meanwhile).

    Also the once-a-second look at the cache directory (the warm read path never looks):
    with nothing open and the directory gone or replaced, exit at once, so that the
    next user starts a daemon on the cache it asks for; with a device open and the
    directory replaced, restart to reopen it (reopen_cache). A directory that is only
    gone is left gone while nothing needs it: a lingering tree nobody reads must not
    make a deleted directory (and its parents) again; a read that fails does. And the
    devices no tree has used for `idle` seconds are closed (close_idle_devices)."""
    while True:
        await asyncio.sleep(min(IDLE_CHECK, max(idle, 0.05)))
        ops.close_idle_devices(idle)
        state = ops.cache.directory_state()
        if ops.open_devices():
            if state == "replaced":
                ops.reopen_cache()
            continue
        if state == "same" and time.monotonic() - ops.idle_since < idle:
            continue
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue
        if ops.open_devices():  # opened while we took the lock
            fcntl.flock(lock, fcntl.LOCK_UN)
            continue
        if state == "same":
            log.info("idle for %.1f s: exiting", idle)
        else:
            log.info("cache directory %s %s, nothing open: exiting", ops.cache_dir, state)
        pyfuse3.terminate()  # the lock stays ours until the process exits
        return


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m lazyfs.tree.data_daemon")
    p.add_argument("mountpoint", type=Path)
    p.add_argument("--cache", type=Path, required=True)
    p.add_argument("--store", default=None)
    p.add_argument("--ready-fd", type=int, default=None)
    # Set by lazyfs/tree/fuse_supervisor.py, which owns the FUSE connection:
    p.add_argument("--socket-fd", type=int, default=None, help="a socket to the supervisor")
    p.add_argument("--device-fd", type=int, default=None, help="its /dev/fuse")
    p.add_argument("--lock-fd", type=int, default=None, help="the idle lock, shared")
    p.add_argument("--open-handles", default="", help="INO:COUNT,... held open by the kernel")
    p.add_argument("--resend", action="store_true", help="ask for a dead worker's requests")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"
    )
    ready = None
    if args.ready_fd is not None:
        os.set_inheritable(args.ready_fd, False)
        ready = ready_reporter(args.ready_fd)
    raise_open_files_limit()  # 3 per image in use (close_idle_devices)
    supervised = None
    if args.socket_fd is not None and args.device_fd is not None:
        lock_fd = args.lock_fd
        if lock_fd is None:
            path = f"{os.path.abspath(args.mountpoint)}.lock"
            lock_fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        handles = {}
        for item in args.open_handles.split(","):
            if ":" in item:
                ino, count = item.split(":")
                handles[int(ino)] = int(count)
        for fd in (args.socket_fd, args.device_fd, lock_fd):
            os.set_inheritable(fd, False)
        supervised = Supervised(args.socket_fd, args.device_fd, lock_fd, handles, args.resend)
    try:
        return serve(args.mountpoint, args.cache, args.store, ready, supervised)
    except LazyfsError as exc:
        log.error("%s", exc)
        return exc.exit_code
    except BaseException as exc:
        if ready:
            ready(f"data daemon failed: {exc!r}", 1)
        raise


if __name__ == "__main__":
    sys.exit(main())
