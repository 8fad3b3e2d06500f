"""Warm a new EROFS tree's page cache from its image's start-up trace.

EROFS keeps a tree's file pages in its own page cache, which belongs to the mount: a new
mount of an image this node has served before starts with none of it, even though every
chunk is in the node cache. Its device is opened direct_io (data_daemon.py), so that the
node holds those pages once, and each first read of a file is then a FUSE request to the
data daemon, made while the reader waits: sympy's tests under pytest read 767 files, and
waited ~0.3 s for them on a new mount against a tree still mounted.

So when an image's device is opened by a new mount, the data daemon starts a `TreeWarmer`
thread. Once the image's trace is known (a stored one as soon as it is loaded, while its
replay may still be fetching; or the one this daemon recorded), it reads what that trace
touched through the new tree, the traced chunks' ranges of each file (a small file's
whole), in the order the trace has them, one read at a time:
the readers that follow find their pages in the tree's page cache, and a reader that
overtakes the warmer waits for at most one of its requests. A cold start is warmed too:
the warmer follows the replay (a read of a chunk being fetched waits for that GET), so
the reader's own ~900 FUSE round trips happen on the daemon's side, beside the reader
(sympy's tests through the agent, cold, 4 rounds interleaved: 1.39 s median without the
warm-up, 1.17 s following the replay, 1.18 s waiting for the replay's end first). Nothing
is cached twice; the warmer only reads earlier what the start-up reads anyway. It stops
when the tree's last mount goes away, after twice the trace's own bytes (at most
MAX_BYTES), and at the first error: it is a hint, never a failure.

Only the traced ranges, and within that budget: a trace is recorded from whatever a
sandbox's code read first, and it is replayed on every node. Reading each traced file
whole, a sandbox that read 4 KiB at 20 places of each of four 48 MiB files (an 8 MB
trace) made every later new tree of its image, on any node, read 201 MB through the
daemon (215 MB fetched from the store) for a command that read none of it; files of a
GiB would have made it MAX_BYTES per tree. The budget is for chunks that other files
hold too (identical files, runs of zeros), which are warmed in each of them: one such
chunk can be in thousands of places (docs/security.md, finding 21).

A trace of fewer than MIN_TRACE_CHUNKS chunks gets no warm-up: its readers' few round
trips cost less than the warm-up's own start (MIN_TRACE_CHUNKS says how much).

The tree is found in /proc/self/mountinfo as the erofs mount whose source is the device
file, and read through a detached copy of that mount, so that the warmer never makes the
tree's unmount fail (EBUSY). The files' paths come from the image's manifest (its chunks
and dirents tables).
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from chunker.manifest import ROOT_INO, Manifest
from chunker.model import ChunkRef
from lazyfs.libc import libc
from lazyfs.mount_table import mounts

if TYPE_CHECKING:
    from node_cache.prefetch import StartupTrace

log = logging.getLogger("lazyfs.tree.warmer")

FIND_TREE_TIMEOUT = 5.0  # seconds from the device's open to its mount in mountinfo
TRACE_TIMEOUT = 30.0  # seconds to wait for the trace's replay (or recording) to end
MAX_BYTES = 1 << 30  # a trace holds at most 20k chunks; this bounds a hostile one
DUPLICATES = 2  # the warm-up's bytes, at most, per byte of the trace's chunks (see the top)
READ_SIZE = 256 << 10  # per read(2); EROFS's read-ahead sizes the FUSE requests
# A warm-up costs the data daemon ~8-10 ms of CPU before its first read: the traced
# files' paths from the manifest (a scan of its chunks, a walk up its dirents) and the
# new tree found in the mount table. A start-up of fewer chunks than this makes at most
# as many FUSE round trips (~0.1-0.3 ms each), so warming it costs more than it hides.
# In a burst of 200 generic claims over 50 new images whose traces held 15-31 chunks
# (`cat` of a file), skipping those warm-ups halved the daemon's CPU and took the create
# p50 down by 0.19 s (docs/design-changes.md, session 35); python3's own start-up is ~130
# chunks, sympy's tests ~1,000.
MIN_TRACE_CHUNKS = 64
CHECK_EVERY = 32  # reads (8 MiB) between looks at whether the tree is still mounted
SYS_OPEN_TREE = 428  # on x86-64 and arm64 alike (the shared syscall table, Linux 5.2+)
OPEN_TREE_CLONE = 1
AT_FDCWD = -100


def traced_ranges(
    manifest: Manifest, refs: Iterable[ChunkRef]
) -> list[tuple[bytes, list[tuple[int, int]]]]:
    """The regular files holding the traced chunks, in the order of each file's first
    traced chunk: (its path, relative, one per inode; the (offset, length) of its traced
    chunks, neighbours merged, in file order).

    All in SQLite, and only the traced files' paths: a Python pass over the chunks table
    and a walk down the whole tree took 20-60 ms per image (7,800 chunks, 8,200 names),
    so the warm-up began after a generic sandbox's first command had read its files
    itself (issue 23); this takes 2-4 ms. The trace's chunks go into a temporary table
    of this manifest's connection (the warmer's own), and the walk goes up from the
    files to the root."""
    db = manifest.db
    db.execute(
        "CREATE TEMP TABLE IF NOT EXISTS traced"
        " (chunk BLOB PRIMARY KEY, pos INTEGER NOT NULL) WITHOUT ROWID"
    )
    try:
        db.executemany(
            "INSERT OR IGNORE INTO temp.traced VALUES (?, ?)",
            ((ref.id, pos) for pos, ref in enumerate(refs)),
        )
        first: dict[int, int] = {}  # ino -> position of its first traced chunk
        pieces: dict[int, list[tuple[int, int]]] = {}
        for ino, offset, size, pos in db.execute(TRACED_PIECES):
            first[ino] = min(pos, first.get(ino, pos))
            pieces.setdefault(ino, []).append((offset, size))
    finally:
        db.execute("DELETE FROM temp.traced")
    if not first:
        return []
    paths: dict[int, bytes] = {}
    for ino, path in db.execute(PATHS_UP, (ROOT_INO, json.dumps(list(first)))):
        paths.setdefault(ino, path)  # a hard link's first name will do
    return [(paths[ino], _merged(pieces[ino])) for ino in sorted(paths, key=first.__getitem__)]


def _merged(pieces: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(offset, length) pieces of a file in file order, touching ones made one."""
    out: list[tuple[int, int]] = []
    for offset, size in sorted(pieces):
        if out and out[-1][0] + out[-1][1] >= offset:
            start, length = out[-1]
            out[-1] = (start, max(length, offset + size - start))
        else:
            out.append((offset, size))
    return out


# (ino, file offset, size, position in temp.traced) of every traced chunk in every file.
TRACED_PIECES = """
SELECT c.ino, c.file_offset, c.size, t.pos FROM chunks c JOIN temp.traced t ON t.chunk = c.chunk_id
"""

# (ino, path) of the inodes in the JSON list ?2, for every name they have below ?1: each
# name walked up to the root (SQLite indexes dirents by ino for the query). Paths stop at
# PATH_MAX (no open could take a longer one), which also ends the walk if a damaged
# manifest's dirents had a cycle.
PATHS_UP = """
WITH RECURSIVE up(target, ino, path) AS (
    SELECT ino, parent, name FROM dirents WHERE ino IN (SELECT value FROM json_each(?2))
    UNION ALL
    SELECT up.target, d.parent, CAST(d.name || X'2F' || up.path AS BLOB)
    FROM up JOIN dirents d ON d.ino = up.ino
    WHERE up.ino != ?1 AND length(up.path) < 4096
)
SELECT target, path FROM up WHERE ino = ?1
"""


def find_tree(device: str) -> Path | None:
    """Where an erofs mount of `device` (a file path) is mounted, if anywhere."""
    for point, (fstype, source) in mounts().items():
        if fstype == "erofs" and source == device:
            return Path(point)
    return None


class TreeWarmer:
    """One warm-up of one new tree; `status()` goes into the image's stats."""

    def __init__(
        self,
        device: str,
        manifest_path: Path,
        trace: StartupTrace,
        mounted: Callable[[], bool],
        cache_ours: Callable[[], bool],
    ) -> None:
        self.device = device  # the device file the tree is mounted from
        self.manifest_path = manifest_path
        self.trace = trace
        self.mounted = mounted  # False once the device's last mount is gone
        # False once the node cache directory is gone or replaced: a warm-up read that
        # misses would then make a deleted cache again (the daemon's reopen_cache),
        # for a tree whose user may have moved to another cache.
        self.cache_ours = cache_ours
        self.state = "starting"  # -> warming -> warmed | stopped | none | small | failed
        self.files = 0
        self.bytes = 0
        self.seconds = 0.0

    def start(self) -> None:
        threading.Thread(target=self._run, name="tree-warmer", daemon=True).start()

    def status(self) -> dict[str, object]:
        return {
            "warm": self.state,
            "warm_files": self.files,
            "warm_bytes": self.bytes,
            "warm_seconds": round(self.seconds, 3),
        }

    def _run(self) -> None:
        try:
            self._warm()
        except Exception as exc:  # noqa: BLE001 - a hint must never hurt the tree
            if not self.mounted():  # unmounted under it: nothing went wrong
                self.state = "stopped"
                return
            self.state = "failed"
            log.warning("warming the tree of %s failed: %s", self.device, exc)

    def _warm(self) -> None:
        refs = self.trace.startup_refs(TRACE_TIMEOUT)
        if not refs:
            self.state = "none"
            return
        if len(refs) < MIN_TRACE_CHUNKS:
            self.state = "small"
            return
        manifest = Manifest(self.manifest_path)  # the daemon's own is not for this thread
        try:
            files = traced_ranges(manifest, refs)
        finally:
            manifest.close()
        tree = self._find_tree()
        if tree is None or not files:
            self.state = "none"
            return
        traced = sum({ref.id: ref.size for ref in refs}.values())
        budget = min(MAX_BYTES, DUPLICATES * traced)
        self.state = "warming"
        started = time.monotonic()
        clone = _clone_mount(tree)
        try:
            still_mounted = functools.partial(_same_mount, tree, os.fstat(clone).st_dev)
            buf = bytearray(READ_SIZE)
            for path, ranges in files:
                if not still_mounted() or self.bytes >= budget or not self.cache_ours():
                    self.state = "stopped"
                    break
                read, whole = _read_ranges(
                    clone, path, ranges, buf, budget - self.bytes, still_mounted
                )
                self.bytes += read
                if not whole:  # unmounted in the middle of a file, or the budget spent
                    self.state = "stopped"
                    break
                self.files += 1
            else:
                self.state = "warmed"
        finally:
            os.close(clone)
        self.seconds = time.monotonic() - started
        log.info(
            "warmed %d files (%d bytes) of %s in %.3f s", self.files, self.bytes, tree, self.seconds
        )

    def _find_tree(self) -> Path | None:
        """The device's open comes from inside mount(2): wait for the mount to show."""
        deadline = time.monotonic() + FIND_TREE_TIMEOUT
        pause = 0.001  # doubling to 10 ms: a generic claim's first command comes ~10 ms
        while self.mounted():  # after the open, and should find the warm-up under way
            tree = find_tree(self.device)
            if tree is not None or time.monotonic() > deadline:
                return tree
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
        return None


def _clone_mount(tree: Path) -> int:
    """A detached copy of the tree's mount (open_tree(2), OPEN_TREE_CLONE), as an O_PATH
    descriptor. Files opened through it hold the copy, not the tree's mount, so they never
    make its unmount fail with EBUSY; the superblock (and the device) lives until the
    copy's descriptor is closed."""
    fd = libc.syscall(SYS_OPEN_TREE, AT_FDCWD, os.fsencode(tree), OPEN_TREE_CLONE | os.O_CLOEXEC)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"open_tree {tree}: {os.strerror(err)}")
    return fd


def _same_mount(tree: Path, dev: int) -> bool:
    """Whether the tree is still mounted at its place (its st_dev is the clone's)."""
    try:
        return os.stat(tree).st_dev == dev
    except OSError:
        return False


def _read_ranges(
    root: int,
    path: bytes,
    ranges: list[tuple[int, int]],
    buf: bytearray,
    budget: int,
    still_mounted: Callable[[], bool],
) -> tuple[int, bool]:
    """Read these (offset, length) ranges of a file below the directory `root`, unless
    the tree is unmounted meanwhile (looked at every CHECK_EVERY reads: a big file is not
    read on for a tree nobody uses any more) or `budget` bytes are read first; the bytes
    read, and whether that was all of them. Every component but the last is a directory
    of the (verified) manifest's tree, and the last is never followed: the warmer reads
    only the image's own regular files."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root)
    view = memoryview(buf)
    try:
        total = reads = 0
        for offset, length in ranges:
            end = offset + length
            while offset < end:
                if total >= budget:
                    return total, False
                n = os.preadv(fd, [view[: min(len(view), end - offset, budget - total)]], offset)
                if n == 0:
                    break
                total += n
                offset += n
                reads += 1
                if reads % CHECK_EVERY == 0 and not still_mounted():
                    return total, False
        return total, True
    finally:
        os.close(fd)
