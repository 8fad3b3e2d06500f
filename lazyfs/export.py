"""`lazyfs export`: materialize an image's whole tree from the store into a directory.

The full-pull fallback, and the way to check a conversion without FUSE. Every path is
created relative to an open directory fd with O_NOFOLLOW, so nothing in the image (a
symlink, a name) can make us write outside DIR.

File contents come from a `ChunkFeed`: the chunks of every file, in the order the export
writes them, fetched ahead of it in coalesced ranged GETs on a thread pool. One GET per
chunk, as the export did first, cost a store round trip per small file: the python
image from SeaweedFS on loopback took 23 s.
"""

from __future__ import annotations

import errno
import os
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from chunker.errors import BadInputError
from chunker.manifest import ROOT_INO, Attr, Manifest
from chunker.model import ChunkRef, Kind
from chunker.packs import PACK_PREFIX, decompress_chunk, read_chunk
from chunker.store.interface import ObjectStore
from node_cache.fetch import Span, coalesce

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
JOBS = 8  # GETs (and their decompression) at once
SEGMENT = 8 << 20  # bytes of file data whose chunks are coalesced into GETs together
AHEAD = 64 << 20  # bytes of file data fetched ahead of the writer, at most
GAP = 1 << 20  # bytes of other chunks a GET may read through (thrown away)
SPAN = 16 << 20  # bytes of one GET, at most


def prepare_dir(dest: Path) -> int:
    """Create dest (or accept it if empty) and return an fd on it."""
    try:
        dest.mkdir(parents=True, exist_ok=True)
        fd = os.open(dest, _DIR_FLAGS)
    except OSError as exc:
        raise BadInputError(f"cannot use {dest} as the export directory: {exc.strerror}") from None
    if os.listdir(fd):
        os.close(fd)
        raise BadInputError(f"export directory {dest} is not empty")
    return fd


class ChunkFeed:
    """The chunks of files in a planned order, fetched ahead of their reader.

    The chunks of the next SEGMENT bytes of files are grouped into ranged GETs
    (node_cache.fetch.coalesce), each run on the pool with its chunks' decompression and
    check; up to AHEAD bytes are in flight or waiting. A file asked for out of the plan's
    order is read chunk by chunk instead: slower, never wrong."""

    def __init__(
        self, store: ObjectStore, manifest: Manifest, plan: Iterable[int], pool: ThreadPoolExecutor
    ) -> None:
        self._store = store
        self._manifest = manifest
        self._pool = pool
        self._next = ((ino, off, ref) for ino in plan for off, ref in manifest.chunks(ino))
        # (ino, file offset, chunk, the future of its GET's chunks by id), in plan order
        self._queued: deque[tuple[int, int, ChunkRef, Future[dict[bytes, bytes]]]] = deque()
        self._queued_bytes = 0
        self._fill()

    def chunks(self, ino: int) -> Iterator[tuple[int, bytes]]:
        """(file offset, data) of every chunk of file `ino`."""
        if not self._queued or self._queued[0][0] != ino:  # not planned (or no chunks)
            refs = self._manifest.chunks(ino)
            data = self._pool.map(lambda c: read_chunk(self._store, c[1]), refs)
            yield from ((off, d) for (off, _), d in zip(refs, data, strict=True))
            return
        while self._queued and self._queued[0][0] == ino:
            _, off, ref, got = self._queued.popleft()
            self._queued_bytes -= ref.size
            self._fill()
            yield off, got.result()[ref.id]

    def _fill(self) -> None:
        while self._queued_bytes < AHEAD:
            segment: list[tuple[int, int, ChunkRef]] = []
            size = 0
            for item in self._next:
                segment.append(item)
                size += item[2].size
                if size >= SEGMENT:
                    break
            if not segment:
                return
            gets = {}
            for span in coalesce([ref for _, _, ref in segment], GAP, SPAN):
                got = self._pool.submit(self._get, span)
                gets.update((ref.id, got) for ref in span.refs)
            self._queued.extend((ino, off, ref, gets[ref.id]) for ino, off, ref in segment)
            self._queued_bytes += size

    def _get(self, span: Span) -> dict[bytes, bytes]:
        blob = self._store.get(PACK_PREFIX + span.pack, span.start, span.end - span.start)
        return {
            ref.id: decompress_chunk(
                blob[ref.offset - span.start : ref.offset - span.start + ref.clen], ref.size, ref.id
            )
            for ref in span.refs
        }


class Exporter:
    def __init__(self, store: ObjectStore, manifest: Manifest, jobs: int = JOBS) -> None:
        self.store = store
        self.manifest = manifest
        self.pool = ThreadPoolExecutor(jobs)
        self.feed: ChunkFeed | None = None  # made once DIR is found fit: it starts GETs
        self.first_path: dict[int, tuple[int, bytes]] = {}  # hard links: ino -> (dir fd, name)
        self.dir_times: list[tuple[bytes, Attr]] = []

    def _inodes_in_order(self) -> Iterator[int]:
        """Every inode once, in the order the export meets it (a hard link at its first
        path: the others are links to it). Only regular files have chunks, so the feed
        plans those alone, without a lookup of each entry's kind."""
        seen: set[int] = set()
        for _, ino in self.manifest.walk():
            if ino not in seen:
                seen.add(ino)
                yield ino

    def run(self, dest: Path) -> None:
        root_fd = prepare_dir(dest)
        try:
            self.feed = ChunkFeed(self.store, self.manifest, self._inodes_in_order(), self.pool)
            root = self.manifest.getattr(ROOT_INO)
            assert root is not None
            self._export_dir(root_fd, ROOT_INO, b"")
            self._finish_dir(root_fd, b".", root)
            # Directory mtimes last, deepest first: creating children changes them. The
            # paths only cross directories this export created, so no symlink is followed.
            for path, attr in reversed(self.dir_times):
                os.utime(
                    path, ns=(attr.mtime_ns, attr.mtime_ns), dir_fd=root_fd, follow_symlinks=False
                )
        finally:
            os.close(root_fd)
            self.pool.shutdown()

    def _export_dir(self, dir_fd: int, ino: int, path: bytes) -> None:
        after = 0
        while batch := self.manifest.readdir(ino, after):
            after = batch[-1][0]
            for _, name, attr in batch:
                if b"/" in name or name in (b"", b".", b".."):
                    raise BadInputError(f"manifest has an invalid name {name!r}")
                self._export_entry(dir_fd, name, attr, path + b"/" + name if path else name)

    def _export_entry(self, dir_fd: int, name: bytes, attr: Attr, path: bytes) -> None:
        if attr.nlink > 1 and attr.kind != Kind.DIR:
            first = self.first_path.get(attr.ino)
            if first is not None:
                os.link(
                    first[1], name, src_dir_fd=first[0], dst_dir_fd=dir_fd, follow_symlinks=False
                )
                return
            self.first_path[attr.ino] = (dir_fd, name)
        kind = attr.kind
        if kind == Kind.DIR:
            os.mkdir(name, 0o700, dir_fd=dir_fd)
            fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
            try:
                self._export_dir(fd, attr.ino, path)
                self._finish_dir(fd, path, attr)
            finally:
                os.close(fd)
            return
        if kind == Kind.REG:
            self._write_file(dir_fd, name, attr)
        elif kind == Kind.SYMLINK:
            os.symlink(attr.target, name, dir_fd=dir_fd)
        elif kind in (Kind.CHR, Kind.BLK, Kind.FIFO, Kind.SOCK):
            os.mknod(name, attr.st_mode & ~0o7777 | 0o600, attr.rdev, dir_fd=dir_fd)
        self._finish(dir_fd, name, attr)

    def _write_file(self, dir_fd: int, name: bytes, attr: Attr) -> None:
        fd = os.open(
            name,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
            dir_fd=dir_fd,
        )
        try:
            assert self.feed is not None
            for offset, data in self.feed.chunks(attr.ino):
                os.pwrite(fd, data, offset)
            os.ftruncate(fd, attr.size)
        finally:
            os.close(fd)

    def _finish(self, dir_fd: int, name: bytes, attr: Attr) -> None:
        """Owner, then mode (chown clears setuid), xattrs, then mtime; never follow links."""
        os.chown(name, attr.uid, attr.gid, dir_fd=dir_fd, follow_symlinks=False)
        if attr.kind != Kind.SYMLINK:
            os.chmod(name, attr.mode, dir_fd=dir_fd)
        self._set_xattrs(f"/proc/self/fd/{dir_fd}/".encode() + name, attr)
        os.utime(name, ns=(attr.mtime_ns, attr.mtime_ns), dir_fd=dir_fd, follow_symlinks=False)

    def _finish_dir(self, fd: int, path: bytes, attr: Attr) -> None:
        os.chown(fd, attr.uid, attr.gid)
        os.chmod(fd, attr.mode)
        self._set_xattrs(fd, attr)
        self.dir_times.append((path, attr))

    def _set_xattrs(self, target: int | bytes, attr: Attr) -> None:
        for key, value in self.manifest.xattrs(attr.ino).items():
            try:
                os.setxattr(target, key, value, follow_symlinks=False)
            except OSError as exc:
                # The kernel refuses user.* xattrs on symlinks; anything else is an error.
                if not (attr.kind == Kind.SYMLINK and exc.errno == errno.EPERM):
                    raise


def export_image(store: ObjectStore, manifest: Manifest, dest: Path) -> None:
    Exporter(store, manifest).run(dest)
