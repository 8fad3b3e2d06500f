"""Packs: many separately compressed chunks in one immutable store object.

A pack is the concatenation of zstd frames, one per chunk, so any chunk can be read with
one ranged GET of (offset, clen) and decompressed alone. Each pack has an index object
listing its chunks; the set of all index objects is the store's chunk index. The pack is
written before its index, so an index entry always points at bytes that exist.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import blake3
import msgpack
import zstandard

from chunker.errors import CorruptObjectError
from chunker.model import ChunkRef
from chunker.store.interface import ObjectNotFound, ObjectStore

PACK_PREFIX = "packs/"
INDEX_PREFIX = "index/"
PACK_TARGET_SIZE = 16 * 1024 * 1024  # compressed bytes per pack before it is sealed
# bench/convert_speed.py, "zstd level": level 3 costs 20-28 % more time for 1.4 % fewer
# bytes; level 1 saves 12-17 % of zstd time (4-6 % of a convert) for 2.4 % more bytes that
# every node fetches; negative levels cost 18-29 % more bytes (docs/FORMATS.md).
ZSTD_LEVEL = 2

_local = threading.local()


def compress_chunk(data: bytes | memoryview) -> bytes:
    """zstd-compress one chunk (one compressor per thread: they are not thread-safe)."""
    c = getattr(_local, "cctx", None)
    if c is None:
        c = _local.cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)
    return c.compress(data)


def decompress_chunk(blob: bytes, size: int, cid: bytes) -> bytes:
    """Inflate one chunk and check it is the chunk it claims to be."""
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    try:
        data = d.decompress(blob, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise CorruptObjectError(f"chunk {cid.hex()}: cannot decompress: {exc}") from None
    if len(data) != size or blake3.blake3(data).digest() != cid:
        raise CorruptObjectError(f"chunk {cid.hex()}: content does not match its id")
    return data


@dataclass(frozen=True, slots=True)
class Location:
    pack: str
    offset: int
    clen: int
    size: int


def read_chunk(store: ObjectStore, ref: ChunkRef) -> bytes:
    """Fetch and verify one chunk with a ranged GET (the simple path: no cache)."""
    blob = store.get(PACK_PREFIX + ref.pack, ref.offset, ref.clen)
    return decompress_chunk(blob, ref.size, ref.id)


class ChunkIndex:
    """Which chunks the store already holds, and where. Thread-safe.

    Loaded from every `index/` object; new packs add themselves when sealed.
    """

    def __init__(self) -> None:
        self._where: dict[bytes, Location] = {}
        self._lock = threading.Lock()

    @classmethod
    def load(cls, store: ObjectStore) -> ChunkIndex:
        index = cls()
        for info in store.list(INDEX_PREFIX):
            pack = info.key[len(INDEX_PREFIX) :]
            try:
                index.add_pack(pack, store.get(info.key))
            except ObjectNotFound:
                continue  # removed by gc between list and get
        return index

    def add_pack(self, pack: str, index_blob: bytes) -> None:
        entries = msgpack.unpackb(index_blob)
        with self._lock:
            for cid, offset, clen, size in entries:
                self._where.setdefault(cid, Location(pack, offset, clen, size))

    def get(self, cid: bytes) -> Location | None:
        return self._where.get(cid)

    def __contains__(self, cid: bytes) -> bool:
        return cid in self._where

    def __len__(self) -> int:
        return len(self._where)

    def ref(self, cid: bytes) -> ChunkRef:
        loc = self._where[cid]
        return ChunkRef(cid, loc.size, loc.pack, loc.offset, loc.clen)


class PackWriter:
    """Collects new chunks into packs and uploads each pack when it is full.

    `add` skips chunks the index already knows (or that this writer already holds), so
    each chunk is stored once. Full packs are uploaded by background threads, several at
    once (an S3 PUT is latency-bound), while the caller goes on; at most MAX_UPLOADS sealed
    packs are in flight, so memory stays bounded. Pack contents are fixed when a pack is
    sealed, in add order, so upload order never changes a pack (or an image id);
    an upload error is raised by a later `add` or by `flush`. Call `flush` at the end:
    only then are all the chunks in the store and in the index.
    """

    MAX_UPLOADS = 4  # sealed packs uploading or queued; the next add waits for a slot

    def __init__(self, store: ObjectStore, index: ChunkIndex) -> None:
        self.store = store
        self.index = index
        self._lock = threading.Lock()
        self._parts: list[bytes] = []
        self._entries: list[tuple[bytes, int, int, int]] = []
        self._pending: set[bytes] = set()
        self._size = 0
        self._upload_lock = threading.Lock()
        self._uploader: ThreadPoolExecutor | None = None
        self._uploads: deque[Future[None]] = deque()
        self.new_chunks = 0
        self.new_bytes = 0  # compressed bytes uploaded
        self.known_chunks = 0

    def is_known(self, cid: bytes) -> bool:
        return cid in self.index or cid in self._pending

    def add(self, cid: bytes, compressed: bytes, size: int) -> bool:
        """Add one compressed chunk; returns False if it was already stored."""
        with self._lock:
            if cid in self.index or cid in self._pending:
                self.known_chunks += 1
                return False
            self._pending.add(cid)
            self._entries.append((cid, self._size, len(compressed), size))
            self._parts.append(compressed)
            self._size += len(compressed)
            self.new_chunks += 1
            self.new_bytes += len(compressed)
            if self._size < PACK_TARGET_SIZE:
                return True
            parts, entries = self._take()
        self._upload_later(parts, entries)
        return True

    def flush(self) -> None:
        """Upload what is left and wait for every upload; raises the first upload error."""
        with self._lock:
            parts, entries = self._take()
        if entries:
            self._upload_later(parts, entries)
        with self._upload_lock:
            uploads, self._uploads = self._uploads, deque()
            uploader, self._uploader = self._uploader, None
        if uploader is not None:
            uploader.shutdown()  # waits for the uploads
        for upload in uploads:
            upload.result()

    def _take(self) -> tuple[list[bytes], list[tuple[bytes, int, int, int]]]:
        parts, entries = self._parts, self._entries
        self._parts, self._entries, self._size = [], [], 0
        return parts, entries

    def _upload_later(self, parts: list[bytes], entries: list[tuple[bytes, int, int, int]]) -> None:
        with self._upload_lock:
            while len(self._uploads) >= self.MAX_UPLOADS:
                self._uploads.popleft().result()
            if self._uploader is None:
                self._uploader = ThreadPoolExecutor(
                    self.MAX_UPLOADS, thread_name_prefix="pack-upload"
                )
            self._uploads.append(self._uploader.submit(self._upload, parts, entries))

    def _upload(self, parts: list[bytes], entries: list[tuple[bytes, int, int, int]]) -> None:
        body = b"".join(parts)
        name = blake3.blake3(body).hexdigest()
        index_blob = msgpack.packb([list(e) for e in entries])
        self.store.put(PACK_PREFIX + name, body)  # the pack before its index
        self.store.put(INDEX_PREFIX + name, index_blob)
        self.index.add_pack(name, index_blob)
        with self._lock:
            self._pending.difference_update(e[0] for e in entries)
