"""Single flight: at most one fetch of a chunk at a time on the whole node.

Chunk ids are spread over 256 stripes by their first byte. A stripe is held with a
`threading.Lock` (other threads of this process wake as soon as it is released) and then
a lock on byte `stripe` of cache_dir/locks/stripes (other processes): an open file
description lock (F_OFD_SETLK), which the kernel drops when its holder dies, even by kill
-9. A fetch holds the stripes of all the chunks it fetches, taken in sorted order so that
two fetches never wait on each other in a cycle. The lock is tried with F_OFD_SETLK and
polled with a short back-off, which bounds the wait by a deadline.

One file for all stripes, not a file per stripe: a fresh cache created its 256 lock
files on its first fetches, and a new inode costs ~0.11 ms on this node's ext4 (28 ms
for the 256, inside a cold start's first GETs). Processes of a lazyfs from before
(locks/xx, flock) do not exclude these: on a cache shared with one, a chunk may be
fetched twice at once, which costs a GET and never wrong bytes (admission is idempotent,
files come through tmp/).
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

STRIPES = 256
LOCK_FILE = "stripes"  # in cache_dir/locks/
FLOCK = struct.Struct("hhqqi")  # struct flock: type, whence, start, len, pid (0: OFD)
_POLL_FIRST = 0.0005  # seconds; doubles up to _POLL_MAX while another process holds it
_POLL_MAX = 0.005


class LockTimeout(Exception):
    """The stripes could not be taken before the deadline."""


class StripeLocks:
    def __init__(self, lock_dir: Path) -> None:
        self._path = lock_dir / LOCK_FILE
        self._tlocks = [threading.Lock() for _ in range(STRIPES)]
        # One open file description, opened on first use; its byte locks are ours alone
        # (F_OFD locks of one description never conflict with each other), so each
        # stripe's threading.Lock is what keeps our own threads apart.
        self._fd: int | None = None
        self._fd_lock = threading.Lock()

    def close(self) -> None:
        with self._fd_lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    @staticmethod
    def stripes(ids: Iterable[bytes]) -> list[int]:
        return sorted({cid[0] for cid in ids})

    @contextmanager
    def hold(self, ids: Iterable[bytes], deadline: float) -> Iterator[None]:
        """Hold every stripe of `ids`; raises LockTimeout at `deadline` (monotonic)."""
        taken: list[int] = []
        try:
            for s in self.stripes(ids):
                self._acquire(s, deadline)
                taken.append(s)
            yield
        finally:
            for s in reversed(taken):
                self._release(s)

    @contextmanager
    def hold_if_free(self, ids: Iterable[bytes]) -> Iterator[bool]:
        """Hold every stripe of `ids` if none is held now (never waits); yields whether
        it holds them."""
        wanted = self.stripes(ids)
        taken: list[int] = []
        try:
            for s in wanted:
                if not self._try_acquire(s):
                    break
                taken.append(s)
            yield len(taken) == len(wanted)
        finally:
            for s in reversed(taken):
                self._release(s)

    def try_hold(self, cid: bytes) -> bool:
        """Take a chunk's stripe only if nobody holds it (never waits)."""
        return self._try_acquire(cid[0])

    def _try_acquire(self, s: int) -> bool:
        if not self._tlocks[s].acquire(blocking=False):
            return False
        if not self._try_lock(s):
            self._tlocks[s].release()
            return False
        return True

    def release(self, cid: bytes) -> None:
        self._release(cid[0])

    def _acquire(self, s: int, deadline: float) -> None:
        if not self._tlocks[s].acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise LockTimeout
        try:
            self._lock_until(s, deadline)
        except BaseException:
            self._tlocks[s].release()
            raise

    def _release(self, s: int) -> None:
        self._set(s, fcntl.F_UNLCK)
        self._tlocks[s].release()

    def _set(self, s: int, kind: int) -> None:
        """Lock (F_WRLCK) or unlock (F_UNLCK) byte `s` of the lock file; never waits."""
        fcntl.fcntl(self._file(), fcntl.F_OFD_SETLK, FLOCK.pack(kind, os.SEEK_SET, s, 1, 0))

    def _try_lock(self, s: int) -> bool:
        try:
            self._set(s, fcntl.F_WRLCK)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            return False
        return True

    def _lock_until(self, s: int, deadline: float) -> None:
        delay = _POLL_FIRST
        while not self._try_lock(s):
            left = deadline - time.monotonic()
            if left <= 0:
                raise LockTimeout
            time.sleep(min(delay, left))
            delay = min(delay * 2, _POLL_MAX)

    def _file(self) -> int:
        fd = self._fd
        if fd is None:
            with self._fd_lock:
                fd = self._fd
                if fd is None:
                    fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
                    self._fd = fd
        return fd
