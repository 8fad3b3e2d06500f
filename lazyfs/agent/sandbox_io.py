"""Work on a sandbox's files, in threads of its own, apart from the agent's lifecycle.

What a sandbox's files do is up to its code, so a read or write of them may be slow or,
if something were missed, never end. The issue that led here: a FIFO read blocked a
thread of anyio's default pool for good; 41 of them took every thread that image
lookups, tree holds and the TTL loop need (creates hung for 52 s, TTLs stopped), and the
agent could not exit, since Python waits for every non-daemon thread at exit.

So this work has:
- its own CapacityLimiter (THREADS), not anyio's default one and not the agent's
  sandbox limiter: however it behaves, creates, deletes and TTLs still get threads;
- a timeout (TIMEOUT): the request then answers 504 while the thread is abandoned;
- daemon threads: one that never returns does not keep the agent from exiting.
A slot of the limiter is given back when its thread really ends, not when its request
gave up, so abandoned threads are bounded too (at most THREADS; then file requests 504
until they end, and nothing else waits).

A thread per call costs ~60 us to start here; a file request costs ~1 ms end to end.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel

from chunker.errors import LazyfsError

T = TypeVar("T")
THREADS = 16  # sandbox file operations at once, node-wide
TIMEOUT = 120.0  # seconds one may take (a cold 256 MiB read from the store takes a few)


class TooSlow(LazyfsError):
    """A sandbox file operation did not finish in time (504)."""


class SandboxIO:
    def __init__(self, threads: int = THREADS, timeout: float = TIMEOUT) -> None:
        self.limiter = anyio.CapacityLimiter(threads)
        self.timeout = timeout

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """fn(*args) in a daemon thread of this pool; TooSlow after the timeout."""
        outcome: list[tuple[bool, object]] = []
        done = anyio.Event()
        slot = object()
        loop = anyio.lowlevel.current_token()

        def finish() -> None:
            self.limiter.release_on_behalf_of(slot)
            done.set()

        def work() -> None:
            try:
                outcome.append((True, fn(*args)))
            except BaseException as exc:  # handed to the request, raised there
                outcome.append((False, exc))
            finally:
                with contextlib.suppress(RuntimeError):  # the agent's loop is gone
                    anyio.from_thread.run_sync(finish, token=loop)

        with anyio.move_on_after(self.timeout):
            await self.limiter.acquire_on_behalf_of(slot)
            try:
                threading.Thread(target=work, name="lazyfs sandbox I/O", daemon=True).start()
            except BaseException:
                self.limiter.release_on_behalf_of(slot)
                raise
            await done.wait()
        if not outcome:
            raise TooSlow(f"the sandbox's file did not answer in {self.timeout:g} s")
        ok, value = outcome[0]
        if ok:
            return value  # type: ignore[return-value]
        assert isinstance(value, BaseException)
        raise value
