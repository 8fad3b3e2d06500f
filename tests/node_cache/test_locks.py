"""Single flight (node_cache/locks.py): fine stripes within a process, a byte per first id
byte between processes (each StripeLocks opens its own file description, so two of them
conflict as two processes do)."""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
from pathlib import Path

import pytest

from node_cache.locks import FLOCK, LOCK_FILE, LockTimeout, StripeLocks


def chunk_id(first: int, second: int) -> bytes:
    return bytes([first, second]) + os.urandom(30)


def byte_is_free(lock_dir: Path, b: int) -> bool:
    """Whether another open file description could lock byte `b` now (it is left free)."""
    fd = os.open(lock_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, b, 1, 0))
    except OSError as exc:
        assert exc.errno in (errno.EAGAIN, errno.EACCES)
        return False
    finally:
        os.close(fd)  # drops the lock, if it was taken
    return True


def test_a_fetch_waits_only_for_the_chunks_it_wants(tmp_path: Path) -> None:
    """A replay's span holds the stripes of hundreds of chunks, under nearly every first
    byte. A reader in the same process that wants none of them goes on at once; one that
    wants one of them waits for it. With 256 stripes (one per first byte) the first
    reader waited for the whole span too."""
    locks = StripeLocks(tmp_path)
    span = [chunk_id(b, 0) for b in range(256)]  # every first byte, second byte 0
    held, done = threading.Event(), threading.Event()

    def replay() -> None:
        with locks.hold(span, time.monotonic() + 5):
            held.set()
            done.wait(10)

    t = threading.Thread(target=replay)
    t.start()
    try:
        assert held.wait(5)
        start = time.monotonic()
        with locks.hold([chunk_id(7, 1)], time.monotonic() + 2):  # not in the span
            pass
        assert time.monotonic() - start < 1.0  # no wait: 2 s would be a LockTimeout
        # the span's own chunk: wait for the span
        with pytest.raises(LockTimeout), locks.hold([chunk_id(7, 0)], time.monotonic() + 0.2):
            pass
        with locks.hold_if_free([chunk_id(9, 0)]) as free:
            assert not free
        with locks.hold_if_free([chunk_id(9, 5)]) as free:
            assert free
    finally:
        done.set()
        t.join()
    with locks.hold([chunk_id(7, 0)], time.monotonic() + 1):
        pass
    locks.close()


def test_another_process_waits_until_the_last_holder_of_its_byte_ends(tmp_path: Path) -> None:
    """Two fetches of one process under one first byte: the byte stays locked in the file
    until both have ended, so another process never fetches their chunks meanwhile."""
    locks = StripeLocks(tmp_path)
    x, y = chunk_id(42, 1), chunk_id(42, 2)
    assert x[:2] != y[:2] and byte_is_free(tmp_path, 42)
    assert locks.try_hold(x)
    with locks.hold([y], time.monotonic() + 1):
        assert not byte_is_free(tmp_path, 42)
        locks.release(x)
        assert not byte_is_free(tmp_path, 42)  # y's fetch still under way
        assert byte_is_free(tmp_path, 43)
    assert byte_is_free(tmp_path, 42)
    locks.close()


def test_two_processes_exclude_each_other_by_first_byte(tmp_path: Path) -> None:
    """Another process (its own file description) waits for a byte this one holds, up to
    its deadline, and takes it once this one is done."""
    ours, theirs = StripeLocks(tmp_path), StripeLocks(tmp_path)
    with ours.hold([chunk_id(5, 1)], time.monotonic() + 1):
        start = time.monotonic()
        with pytest.raises(LockTimeout), theirs.hold([chunk_id(5, 200)], time.monotonic() + 0.3):
            pass
        assert time.monotonic() - start >= 0.25
        assert not theirs.try_hold(chunk_id(5, 9))
        with theirs.hold([chunk_id(6, 1)], time.monotonic() + 1):  # another byte
            pass
    with theirs.hold([chunk_id(5, 200)], time.monotonic() + 1):
        assert not byte_is_free(tmp_path, 5)
    assert byte_is_free(tmp_path, 5)
    ours.close()
    theirs.close()
