"""Single flight: at most one fetch of a chunk at a time on the whole node.

Two levels, because the waits they cause differ:

- Within a process, chunk ids are spread over 65,536 stripes by their first two bytes,
  each a `threading.Lock` (other threads wake as soon as it is released). A start-up
  trace's replay fetches spans of hundreds of chunks (16 MiB) and holds their stripes
  until they are indexed: with 256 stripes such a span held nearly all of them, so a
  reader's miss in the same daemon waited for the whole span's GET although it wanted
  none of its chunks (over S3 behind 1 Gbit/s + 4 ms, an agent's claim waited ~0.2 s
  to read /etc/passwd; docs/design-changes.md, session 41).
- Between processes, a lock on byte `id[0]` (256 of them) of cache_dir/locks/stripes:
  an open file description lock (F_OFD_SETLK), which the kernel drops when its holder
  dies, even by kill -9. One description per process, so its byte locks never conflict
  with each other; a process takes a byte when the first of its fetches under it starts
  and gives it back when the last one ends (a count per byte). Other processes that
  fetch at the same time as a node's data daemon are rare (an export, a CLI), so the
  coarse bytes cost little there.

A fetch holds the stripes of all the chunks it fetches, taken in sorted order (a byte
in the order of the first stripe under it) so that two fetches never wait on each other
in a cycle. The byte lock is tried with F_OFD_SETLK and polled with a short back-off,
which bounds the wait by a deadline.

One file for all bytes, not a file per stripe: a fresh cache created its 256 lock files
on its first fetches, and a new inode costs ~0.11 ms on this node's ext4 (28 ms for the
256, inside a cold start's first GETs). Processes of a lazyfs from before (locks/xx,
flock) do not exclude these: on a cache shared with one, a chunk may be fetched twice at
once, which costs a GET and never wrong bytes (admission is idempotent, files come
through tmp/).
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

STRIPES = 1 << 16  # in-process: a chunk id's first two bytes
BYTES = 256  # between processes: its first byte (STRIPES >> 8 stripes each)
LOCK_FILE = "stripes"  # in cache_dir/locks/
FLOCK = struct.Struct("hhqqi")  # struct flock: type, whence, start, len, pid (0: OFD)
_POLL_FIRST = 0.0005  # seconds; doubles up to _POLL_MAX while another process holds it
_POLL_MAX = 0.005


class LockTimeout(Exception):
    """The stripes could not be taken before the deadline."""


def stripe(cid: bytes) -> int:
    """A chunk id's stripe within a process (< STRIPES); its byte between processes is
    stripe >> 8, the id's first byte."""
    return (cid[0] << 8) | cid[1]


class StripeLocks:
    def __init__(self, lock_dir: Path) -> None:
        self._path = lock_dir / LOCK_FILE
        # Made on first use (at most STRIPES); setdefault keeps two racing threads on one.
        self._tlocks: dict[int, threading.Lock] = {}
        # How many of this process's held stripes lie under each byte; a byte is locked
        # in the file while its count is above 0. Counts and the file's locks and unlocks
        # change under _bytes_lock, so an unlock never lands after another thread's lock.
        self._held = [0] * BYTES
        self._bytes_lock = threading.Lock()
        self._fd: int | None = None
        self._fd_lock = threading.Lock()

    def close(self) -> None:
        with self._fd_lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    @staticmethod
    def stripes(ids: Iterable[bytes]) -> list[int]:
        return sorted({stripe(cid) for cid in ids})

    @contextmanager
    def hold(self, ids: Iterable[bytes], deadline: float) -> Iterator[None]:
        """Hold every stripe of `ids`; raises LockTimeout at `deadline` (monotonic)."""
        stripes: list[int] = []  # taken, in order
        held: list[int] = []  # bytes counted for this hold (once each)
        try:
            for s in self.stripes(ids):
                if not self._take(s, stripes, held, deadline):
                    raise LockTimeout
            yield
        finally:
            self._unhold(stripes, held)

    @contextmanager
    def hold_if_free(self, ids: Iterable[bytes]) -> Iterator[bool]:
        """Hold every stripe of `ids` if none is held now (never waits); yields whether
        it holds them."""
        stripes: list[int] = []
        held: list[int] = []
        try:
            yield all(self._take(s, stripes, held) for s in self.stripes(ids))
        finally:
            self._unhold(stripes, held)

    def try_hold(self, cid: bytes) -> bool:
        """Take a chunk's stripe only if nobody holds it (never waits)."""
        stripes: list[int] = []
        held: list[int] = []
        if self._take(stripe(cid), stripes, held):
            return True
        self._unhold(stripes, held)
        return False

    def release(self, cid: bytes) -> None:
        s = stripe(cid)
        self._unhold([s], [s >> 8])

    def _take(self, s: int, stripes: list[int], held: list[int], deadline: float = 0.0) -> bool:
        """Take stripe `s`, then its byte unless `held` (this hold's bytes, in order)
        already has it; what was taken is appended to `stripes` and `held`, for _unhold.
        Waits until `deadline` (monotonic); the default, 0, never waits. Taken in
        ascending order within a hold, so no two holds wait on each other in a cycle."""
        lock = self._tlock(s)
        if not lock.acquire(False) and not lock.acquire(
            timeout=max(0.0, deadline - time.monotonic())
        ):
            return False
        stripes.append(s)
        if held and held[-1] == s >> 8:
            return True
        if not self._byte_until(s >> 8, deadline):
            return False
        held.append(s >> 8)
        return True

    def _tlock(self, s: int) -> threading.Lock:
        lock = self._tlocks.get(s)
        if lock is None:
            lock = self._tlocks.setdefault(s, threading.Lock())
        return lock

    def _unhold(self, stripes: list[int], held: list[int]) -> None:
        with self._bytes_lock:
            for b in held:
                self._held[b] -= 1
                if self._held[b] == 0:
                    self._set(b, fcntl.F_UNLCK)
        for s in reversed(stripes):
            self._tlocks[s].release()

    def _try_byte(self, b: int) -> bool:
        """Count one more holder of byte `b`, locking it in the file if it is our first;
        False (nothing counted) if another process holds it. Never waits."""
        with self._bytes_lock:
            if self._held[b] == 0:
                try:
                    self._set(b, fcntl.F_WRLCK)
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EACCES):
                        raise
                    return False
            self._held[b] += 1
            return True

    def _byte_until(self, b: int, deadline: float) -> bool:
        """_try_byte, polled until `deadline`; False if it was not taken by then."""
        delay = _POLL_FIRST
        while not self._try_byte(b):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(delay, left))
            delay = min(delay * 2, _POLL_MAX)
        return True

    def _set(self, b: int, kind: int) -> None:
        """Lock (F_WRLCK) or unlock (F_UNLCK) byte `b` of the lock file; never waits."""
        fcntl.fcntl(self._file(), fcntl.F_OFD_SETLK, FLOCK.pack(kind, os.SEEK_SET, b, 1, 0))

    def _file(self) -> int:
        fd = self._fd
        if fd is None:
            with self._fd_lock:
                fd = self._fd
                if fd is None:
                    fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
                    self._fd = fd
        return fd
