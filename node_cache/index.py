"""The LMDB index of a node cache: which chunks are on local disk, and how recently used.

Schema (three named databases in cache_dir/index/):

- ``chunks``: chunk id (32 bytes) -> ``<QQ`` (uncompressed size, last access ns)
- ``lru``: last access ns (8 bytes big-endian) + chunk id -> b"" (oldest first)
- ``meta``: b"total" -> ``<Q`` the disk charge of every indexed chunk

Every change to these runs in one write transaction, so ``total`` always equals the sum of
the charges of the ``chunks`` entries, whichever process writes and whenever it dies.
Transactions are short and never span a store request.

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

import lmdb

# Virtual size only: without writemap the data file grows as used. 64 GiB holds
# ~300 million entries, more than any cache size divided by BLOCK.
MAP_SIZE = 64 * 2**30
MAX_READERS = 4096  # concurrent read transactions over all processes on the node
BLOCK = 4096  # a chunk file occupies whole filesystem blocks: charge it so

_ENTRY = struct.Struct("<QQ")
_TOTAL = struct.Struct("<Q")
_TOTAL_KEY = b"total"


def charge(size: int) -> int:
    """Disk bytes a chunk of `size` bytes is counted as."""
    return max(BLOCK, -(-size // BLOCK) * BLOCK)


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
            max_dbs=4,
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

    def admit(self, items: Iterable[tuple[bytes, int]], now_ns: int) -> int:
        """Index chunks whose files are in place; returns the new total charge.

        Re-admitting an indexed chunk (its file was lost and fetched again) only
        refreshes its access time: it is counted once.
        """
        with self._env.begin(write=True) as txn:
            total = self._total(txn)
            for cid, size in items:
                raw = txn.get(cid, db=self._chunks)
                if raw is None:
                    total += charge(size)
                else:
                    txn.delete(_lru_key(_ENTRY.unpack(raw)[1], cid), db=self._lru)
                txn.put(cid, _ENTRY.pack(size, now_ns), db=self._chunks)
                txn.put(_lru_key(now_ns, cid), b"", db=self._lru)
            txn.put(_TOTAL_KEY, _TOTAL.pack(total), db=self._meta)
        return total

    def evict(self, target: int, remove: Callable[[bytes], bool]) -> int:
        """Drop least recently used chunks until the total is <= target.

        `remove(cid)` deletes the chunk's file and returns True, or returns False to skip
        a chunk that is busy (another fetch holds its stripe). It runs inside the write
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
                if raw is not None and not remove(cid):
                    continue
                if raw is not None:  # else a stray LRU key: drop it too
                    total -= charge(_ENTRY.unpack(raw)[0])
                    evicted += 1
                victims.append((key, cid))
            for key, cid in victims:
                txn.delete(key, db=self._lru)
                txn.delete(cid, db=self._chunks)
            txn.put(_TOTAL_KEY, _TOTAL.pack(total), db=self._meta)
        return evicted

    def usage(self) -> tuple[int, int]:
        """(number of indexed chunks, their total charge in bytes)."""
        with self._env.begin() as txn:
            return txn.stat(self._chunks)["entries"], self._total(txn)

    def entries(self) -> list[tuple[bytes, int]]:
        """Every indexed (chunk id, size): for checks and tests, not the read path."""
        with self._env.begin(db=self._chunks) as txn:
            return [(bytes(k), _ENTRY.unpack(v)[0]) for k, v in txn.cursor()]

    def _total(self, txn: lmdb.Transaction) -> int:
        raw = txn.get(_TOTAL_KEY, db=self._meta)
        return _TOTAL.unpack(raw)[0] if raw is not None else 0
