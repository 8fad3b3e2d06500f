"""Single flight: at most one fetch of a chunk at a time on the whole node.

Chunk ids are spread over 256 stripes by their first byte. A stripe is held with a
`threading.Lock` (other threads of this process wake as soon as it is released) and then
an flock on cache_dir/locks/xx (other processes; the kernel drops it when a holder dies,
even by kill -9). A fetch holds the stripes of all the chunks it fetches, taken in sorted
order so that two fetches never wait on each other in a cycle. flock has no timeout, so a
waiter polls it with LOCK_NB and a short back-off, which bounds the wait by a deadline.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

STRIPES = 256
_POLL_FIRST = 0.0005  # seconds; doubles up to _POLL_MAX while another process holds it
_POLL_MAX = 0.005


class LockTimeout(Exception):
    """The stripes could not be taken before the deadline."""


class StripeLocks:
    def __init__(self, lock_dir: Path) -> None:
        self._dir = lock_dir
        self._tlocks = [threading.Lock() for _ in range(STRIPES)]
        # One open file per stripe, opened on first use. Only the thread holding the
        # stripe's threading.Lock touches its flock, so sharing the fd is safe.
        self._fds: list[int | None] = [None] * STRIPES
        self._fd_lock = threading.Lock()

    def close(self) -> None:
        with self._fd_lock:
            for i, fd in enumerate(self._fds):
                if fd is not None:
                    os.close(fd)
                    self._fds[i] = None

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

    def try_hold(self, cid: bytes) -> bool:
        """Take a chunk's stripe only if nobody holds it (never waits)."""
        s = cid[0]
        if not self._tlocks[s].acquire(blocking=False):
            return False
        try:
            fcntl.flock(self._fd(s), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._tlocks[s].release()
            return False
        return True

    def release(self, cid: bytes) -> None:
        self._release(cid[0])

    def _acquire(self, s: int, deadline: float) -> None:
        if not self._tlocks[s].acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise LockTimeout
        try:
            self._flock_until(self._fd(s), deadline)
        except BaseException:
            self._tlocks[s].release()
            raise

    def _release(self, s: int) -> None:
        fcntl.flock(self._fd(s), fcntl.LOCK_UN)
        self._tlocks[s].release()

    def _flock_until(self, fd: int, deadline: float) -> None:
        delay = _POLL_FIRST
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
            left = deadline - time.monotonic()
            if left <= 0:
                raise LockTimeout
            time.sleep(min(delay, left))
            delay = min(delay * 2, _POLL_MAX)

    def _fd(self, s: int) -> int:
        fd = self._fds[s]
        if fd is None:
            with self._fd_lock:
                fd = self._fds[s]
                if fd is None:
                    path = self._dir / f"{s:02x}"
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
                    self._fds[s] = fd
        return fd
