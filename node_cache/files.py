"""The cache directory on disk, and the chunk files in it.

Layout (one directory per node, shared by every mount process)::

    boot_id         the kernel boot id the cache was last opened under
    setup.lock      flock'd while a process prepares the directory
    index/          the LMDB environment (node_cache/index.py); it also holds the bytes
                    of every chunk of at most INLINE_MAX bytes (its ``inline`` database)
    locks/stripes   the single-flight locks: one byte per stripe (node_cache/locks.py)
    chunks/xx/HEX   one file per larger chunk: its uncompressed bytes, so a hit is a
                    plain read (xx made by the first chunk it holds)
    tmp/            chunk files being written

Chunks lazyfs's chunker makes (at most 256 KiB) all get no file, because creating files
is what costs on this node's ext4 (see INLINE_MAX); files hold the chunks of another
chunker's larger bounds, and those of a cache filled under a smaller INLINE_MAX.

Crash safety without fsync: a chunk file is written under tmp/, renamed into chunks/
(same filesystem, so the rename is atomic), and only then entered in the index; an inline
chunk is written in the same LMDB transaction as its index entry. `kill -9` loses
nothing the kernel already accepted, so after it every indexed chunk is whole. Only
a kernel crash or power loss can drop unsynced data, and that changes the boot id: a
cache opened under a new boot id is wiped. fsync per chunk would cost ~0.2-0.5 ms per
admission here (measured) for no gain under that rule. Hits are also re-verified
(blake3) by default, which catches anything else that damages a file or a value.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
STALE_TMP_SECONDS = 600  # a chunk write takes milliseconds; older temp files are debris


def current_boot_id() -> str:
    with open(BOOT_ID_PATH) as f:
        return f.read().strip()


def prepare(cache_dir: Path) -> None:
    """Create the layout; wipe it if it was last used before a reboot. Idempotent.

    Runs under an exclusive flock so two processes starting at once agree. Any process
    that used the cache in this boot has already written this boot's id, so a mismatch
    means no live process can be using the old contents.
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(cache_dir / "setup.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        boot = current_boot_id()
        marker = cache_dir / "boot_id"
        try:
            last = marker.read_text().strip()
        except FileNotFoundError:
            last = None
        # Leftovers of a wipe whose process died mid-delete are removed too.
        trash = list(cache_dir.glob("trash-*"))
        if last != boot:
            if last is not None:
                log.warning("node cache %s: machine rebooted since last use, wiping", cache_dir)
            trash += _move_to_trash(cache_dir)
            tmp_marker = cache_dir / f"boot_id.{os.getpid()}"
            tmp_marker.write_text(boot + "\n")
            os.rename(tmp_marker, marker)
        for sub in ("chunks", "tmp", "locks", "index"):
            (cache_dir / sub).mkdir(exist_ok=True)
    finally:
        os.close(fd)  # releases the flock
    # Deleting a big old cache takes seconds; other processes need not wait for it.
    if trash:
        import shutil  # here only: with zlib, bz2 and lzma, ~10 ms of a cold daemon start

        for path in trash:
            shutil.rmtree(path, ignore_errors=True)
    _remove_stale_tmp(cache_dir / "tmp")


def _move_to_trash(cache_dir: Path) -> list[Path]:
    """Rename the old index and chunks aside: instant, whatever their size."""
    out = []
    for sub in ("index", "chunks", "tmp"):
        path = cache_dir / sub
        if path.exists():
            dest = cache_dir / f"trash-{sub}-{os.getpid()}-{time.time_ns()}"
            os.rename(path, dest)
            out.append(dest)
    return out


def _remove_stale_tmp(tmp_dir: Path) -> None:
    cutoff = time.time() - STALE_TMP_SECONDS
    with os.scandir(tmp_dir) as it:
        for entry in it:
            with contextlib.suppress(FileNotFoundError):
                if entry.stat().st_mtime < cutoff:
                    os.unlink(entry.path)


class Identity:
    """The cache directory and its index directory as a NodeCache opened them, held open
    so that their inode numbers cannot be given to new directories: `state()` compares
    them with what the paths name now, two stat calls (~2 us here).

    A process that outlives its cache directory (rm -rf, or deleted and made again at
    the same path) would otherwise go on with an index nobody else sees and fail on the
    first stripe lock or chunk file it opens by path (measured: a mounted tree's next
    uncached reads all got EIO, ENOENT on cache_dir/locks/XX)."""

    def __init__(self, cache_dir: Path) -> None:
        self._paths = (str(cache_dir), str(cache_dir / "index"))
        self._fds: list[int] = []
        try:
            for path in self._paths:
                self._fds.append(os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
        except OSError:
            self.close()
            raise
        self._ids = [_ident(os.fstat(fd)) for fd in self._fds]

    def state(self) -> str:
        """What the path names now: "same", "gone" (no directory there) or "replaced"
        (another directory, or ours with its index removed or replaced)."""
        try:
            top = os.stat(self._paths[0])
        except OSError:
            return "gone"
        try:
            index = os.stat(self._paths[1])
        except OSError:
            return "replaced"
        if [_ident(top), _ident(index)] != self._ids:
            return "replaced"
        return "same"

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []


def _ident(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


class ChunkFiles:
    """Reads and writes chunk files under cache_dir/chunks (chunks over INLINE_MAX)."""

    def __init__(self, cache_dir: Path) -> None:
        self._chunks = str(cache_dir / "chunks")
        self._tmp = str(cache_dir / "tmp")

    def path(self, cid: bytes) -> str:
        h = cid.hex()
        return f"{self._chunks}/{h[:2]}/{h}"

    def load(self, cid: bytes, size: int) -> bytes | None:
        """The file's bytes, or None if it is missing or not `size` bytes long.

        The hit path: fstat first, then one read of exactly `size` bytes (no read past
        the end to detect a long file, no resizing of an oversized buffer).
        """
        try:
            fd = os.open(self.path(cid), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            if os.fstat(fd).st_size != size:
                return None
            data = os.read(fd, size)
            while len(data) < size:  # a short read: rare, but be exact
                more = os.read(fd, size - len(data))
                if not more:
                    return None
                data += more
        finally:
            os.close(fd)
        return data

    def store(self, cid: bytes, data: bytes) -> bool:
        """Write a verified chunk (temp file, then rename). False if the disk refused."""
        tmp = f"{self._tmp}/{cid.hex()}.{os.getpid()}.{threading.get_ident()}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            path = self.path(cid)
            try:
                os.rename(tmp, path)
            except FileNotFoundError:
                # chunks/xx is made by its first chunk, not all 256 by prepare(): on a new
                # node's empty cache those mkdirs were ~15 ms of the data daemon's start,
                # which a node's first `lazyfs run` waits for (session 26)
                with contextlib.suppress(FileExistsError):
                    os.mkdir(os.path.dirname(path))
                os.rename(tmp, path)
            return True
        except OSError as exc:  # ENOSPC, EIO, a wiped directory: serve, do not cache
            log.warning("node cache: cannot write chunk %s: %s", cid.hex(), exc)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return False

    def remove(self, cid: bytes) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(cid))
