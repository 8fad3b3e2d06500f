"""The LMDB index of a node cache: which chunks are on local disk, and how recently used.

Schema (four named databases in cache_dir/index/):

- ``chunks``: chunk id (32 bytes) -> ``<QQ`` (uncompressed size, last access ns)
- ``lru``: last access ns (8 bytes big-endian) + chunk id -> b"" (oldest first)
- ``meta``: b"total" -> ``<Q`` the disk charge of every indexed chunk
- ``inline``: chunk id -> the chunk's uncompressed bytes, for chunks of at most INLINE_MAX
  bytes. A chunk with a value here lives in the index only; one without lives in its
  file (node_cache/files.py). Where a chunk lives is told by this database, never by its
  size, so a cache filled under another INLINE_MAX (or before inline chunks) stays right.
  The reverse does not hold: code from before this database sees inline chunks as misses
  and charges them as files (never wrong bytes, but ``total`` drifts), so a node going
  back to it must start on an empty cache directory.

Every change to these runs in one write transaction, so ``total`` always equals the sum of
the charges of the ``chunks`` entries, and an inline value is written and deleted with its
entry (an indexed inline chunk is always whole), whichever process writes and whenever it
dies. Transactions are short and never span a store request.

The environment is opened with sync=False: commits cost ~8 us instead of ~140 us
(measured here). A process killed with -9 loses nothing the kernel accepted; only a
kernel crash can lose or tear recent commits, and node_cache/files.py wipes the whole
cache when the boot id changes.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

import lmdb

# Virtual size only: without writemap the data file grows as used. It holds the inline
# chunks too (at most the cache size: each is charged at least what it takes) and ~5
# billion entries, so 1 TiB fits any cache size of a node.
MAP_SIZE = 2**40
MAX_READERS = 4096  # concurrent read transactions over all processes on the node
BLOCK = 4096  # a chunk file occupies whole filesystem blocks: charge it so

# Chunks up to this size are kept in the ``inline`` database instead of a file of their
# own: every chunk lazyfs's chunker makes (its MAX_SIZE, chunker/chunking.py). Creating a
# file is what costs: on ext4 without a journal (this node's root) the inode allocator
# walks over every inode deleted in the last minute, and a burst of 32 sandboxes spent
# ~50 % of the data daemon's CPU in ext4_create. Up to session 33 the bound was 16 KiB
# (every single-chunk file and every short tail); a cold sympy run without a trace still
# wrote 1,325 chunk files then, and with every chunk inline it took 178 ms less (per
# pair, 6 interleaved pairs, -215 to -120 ms; docs/design-changes.md, session 33). Large
# values take pages of their own (below); under churn LMDB reuses freed runs of them: a
# 256 MiB cache admitting 10x its size held its data file at 1.07x its size, each admit
# of 30 chunks steady at ~1.2 ms. Chunks over the bound (another chunker's) are files.
INLINE_MAX = 256 * 1024

# What an inline value costs in the LMDB data file (measured here, 4000 random values
# admitted 20 per transaction, LMDB 0.9.36, 4 KiB pages):
# - up to _LEAF_MAX bytes it shares leaf pages with other keys: random keys fill them to
#   ~60 %, so a value costs ~1.67 x (its size + its node: 8-byte header, 32-byte key, 2-byte
#   slot, rounding): 973 bytes per value of 100-1000 bytes, 2601 per 1000-1998;
# - above, it takes ceil((size + 16) / 4096) pages of its own (16: the page header) plus a
#   48-byte node in a leaf page (~70 bytes each at that fill).
# A file costs whole 4 KiB blocks, at least one; so an inline chunk is cheaper up to
# 2 KiB, costs the same up to 4080 bytes, and a page more than a file only when its size
# is within 16 bytes under a multiple of 4 KiB. Checked on the burst's 5422 inline
# chunks: charged 21.2 MB, the inline database's pages 21.1 MB (as files: 25.9 MB).
PAGE = 4096
_LEAF_MAX = 1998  # the largest value LMDB keeps in a leaf page with a 32-byte key
_LEAF_NODE = 48
_OVERFLOW_NODE = 72
_PAGE_HEADER = 16

INLINE_DB = b"inline"
_ENTRY = struct.Struct("<QQ")
_TOTAL = struct.Struct("<Q")
_TOTAL_KEY = b"total"


def charge(size: int, inline: bool) -> int:
    """Disk bytes a chunk of `size` bytes is counted as, in its file or inline."""
    if not inline:
        return max(BLOCK, -(-size // BLOCK) * BLOCK)
    if size <= _LEAF_MAX:
        return (size + _LEAF_NODE) * 5 // 3
    return -(-(size + _PAGE_HEADER) // PAGE) * PAGE + _OVERFLOW_NODE


class Located(NamedTuple):
    """An indexed chunk, and its bytes if the index holds them (None: in its file)."""

    size: int
    atime_ns: int
    inline: bytes | None


def _lru_key(atime_ns: int, cid: bytes) -> bytes:
    return atime_ns.to_bytes(8, "big") + cid


# LMDB must not be opened twice in one process (closing either breaks its locks), so
# every CacheIndex on one directory in this process shares one Environment.
_envs: dict[str, tuple[lmdb.Environment, int]] = {}
_envs_lock = threading.Lock()


def _open_env(path: Path) -> lmdb.Environment:
    key = os.path.realpath(path)
    with _envs_lock:
        if key in _envs:
            env, refs = _envs[key]
            _envs[key] = (env, refs + 1)
            return env
        env = lmdb.open(
            key,
            map_size=MAP_SIZE,
            max_dbs=4,  # chunks, lru, meta, inline
            max_readers=MAX_READERS,
            lock=True,
            sync=False,
            metasync=False,
            readahead=False,
        )
        env.reader_check()  # free reader slots of processes that died holding one
        _envs[key] = (env, 1)
        return env


def _close_env(path: Path) -> None:
    key = os.path.realpath(path)
    with _envs_lock:
        env, refs = _envs[key]
        if refs > 1:
            _envs[key] = (env, refs - 1)
        else:
            del _envs[key]
            env.close()


class CacheIndex:
    """Chunk id -> (size, last access); LRU order; total charge. Thread- and process-safe."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._env = _open_env(path)
        self._chunks = self._env.open_db(b"chunks")
        self._lru = self._env.open_db(b"lru")
        self._meta = self._env.open_db(b"meta")
        self._inline = self._env.open_db(INLINE_DB)

    def close(self) -> None:
        if self._env is not None:
            self._env = None
            _close_env(self._path)

    def lookup(self, ids: Iterable[bytes]) -> dict[bytes, tuple[int, int]]:
        """(size, atime_ns) of every id that is indexed, in one read transaction."""
        out = {}
        with self._env.begin(db=self._chunks, buffers=False) as txn:
            for cid in ids:
                raw = txn.get(cid)
                if raw is not None:
                    out[cid] = _ENTRY.unpack(raw)
        return out

    def locate(self, ids: Iterable[bytes]) -> dict[bytes, Located]:
        """Every indexed id, with its inline bytes if it has any: one read transaction."""
        out = {}
        with self._env.begin(buffers=False) as txn:
            for cid in ids:
                raw = txn.get(cid, db=self._chunks)
                if raw is not None:
                    size, atime = _ENTRY.unpack(raw)
                    out[cid] = Located(size, atime, txn.get(cid, db=self._inline))
        return out

    def touch(self, ids: Iterable[bytes], now_ns: int) -> None:
        """Mark chunks as used now (moves them to the young end of the LRU order)."""
        with self._env.begin(write=True) as txn:
            for cid in ids:
                raw = txn.get(cid, db=self._chunks)
                if raw is None:
                    continue  # evicted meanwhile
                size, atime = _ENTRY.unpack(raw)
                txn.delete(_lru_key(atime, cid), db=self._lru)
                txn.put(_lru_key(now_ns, cid), b"", db=self._lru)
                txn.put(cid, _ENTRY.pack(size, now_ns), db=self._chunks)

    def admit(self, items: Iterable[tuple[bytes, int, bytes | None]], now_ns: int) -> int:
        """Index chunks: (id, size, their bytes to keep inline, or None if their file is
        in place). Returns the new total charge.

        Re-admitting an indexed chunk (its file or value was lost or damaged and fetched
        again) refreshes its access time and replaces its value: it is counted once, at
        the charge of where it lives now.
        """
        with self._env.begin(write=True) as txn:
            total = self._total(txn)
            for cid, size, data in items:
                raw = txn.get(cid, db=self._chunks)
                if raw is not None:
                    old_size, atime = _ENTRY.unpack(raw)
                    was_inline = txn.get(cid, db=self._inline) is not None
                    total -= charge(old_size, was_inline)
                    txn.delete(_lru_key(atime, cid), db=self._lru)
                if data is None:
                    txn.delete(cid, db=self._inline)
                else:
                    txn.put(cid, data, db=self._inline)
                total += charge(size, data is not None)
                txn.put(cid, _ENTRY.pack(size, now_ns), db=self._chunks)
                txn.put(_lru_key(now_ns, cid), b"", db=self._lru)
            txn.put(_TOTAL_KEY, _TOTAL.pack(total), db=self._meta)
        return total

    def evict(self, target: int, remove: Callable[[bytes], bool]) -> int:
        """Drop least recently used chunks until the total is <= target.

        An inline chunk goes with its entry, in this transaction. For a chunk in a file,
        `remove(cid)` deletes the file and returns True, or returns False to skip a chunk
        that is busy (another fetch holds its stripe). It runs inside the write
        transaction, so no other process can index that chunk between the file going
        and its entry going. Returns how many chunks were evicted.
        """
        with self._env.begin(write=True) as txn:
            total = self._total(txn)
            victims: list[tuple[bytes, bytes]] = []
            evicted = 0
            for key in txn.cursor(db=self._lru).iternext(keys=True, values=False):
                if total <= target:
                    break
                cid = key[8:]
                raw = txn.get(cid, db=self._chunks)
                if raw is not None:  # else a stray LRU key: drop it too
                    inline = txn.get(cid, db=self._inline) is not None
                    if not inline and not remove(cid):
                        continue
                    total -= charge(_ENTRY.unpack(raw)[0], inline)
                    evicted += 1
                victims.append((key, cid))
            for key, cid in victims:
                txn.delete(key, db=self._lru)
                txn.delete(cid, db=self._chunks)
                txn.delete(cid, db=self._inline)
            txn.put(_TOTAL_KEY, _TOTAL.pack(total), db=self._meta)
        return evicted

    def usage(self) -> tuple[int, int]:
        """(number of indexed chunks, their total charge in bytes)."""
        with self._env.begin() as txn:
            return txn.stat(self._chunks)["entries"], self._total(txn)

    def entries(self) -> list[tuple[bytes, int, bytes | None]]:
        """Every indexed (chunk id, size, inline bytes or None): for checks and tests, not
        the read path."""
        with self._env.begin(buffers=False) as txn:
            return [
                (k, _ENTRY.unpack(v)[0], txn.get(k, db=self._inline))
                for k, v in txn.cursor(db=self._chunks)
            ]

    def _total(self, txn: lmdb.Transaction) -> int:
        raw = txn.get(_TOTAL_KEY, db=self._meta)
        return _TOTAL.unpack(raw)[0] if raw is not None else 0
