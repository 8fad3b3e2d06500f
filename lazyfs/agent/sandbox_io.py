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

An answer too big to hold (a `docker cp` of a directory) is streamed: `stream` runs a
producer in the same kind of thread and hands its items over one at a time, each put
waiting until the reader has room (BUFFERED items), so the producer holds at most that
much in memory whatever the sandbox's files hold; a reader that goes away stops it at
its next put. The timeout then bounds the whole stream, the reader's time included.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
from anyio.streams.memory import MemoryObjectReceiveStream

from chunker.errors import LazyfsError

T = TypeVar("T")
THREADS = 16  # sandbox file operations at once, node-wide
TIMEOUT = 120.0  # seconds one may take (a cold 256 MiB read from the store takes a few)
BUFFERED = 2  # items of a stream waiting for its reader, at most


class TooSlow(LazyfsError):
    """A sandbox file operation did not finish in time (504)."""


class Gone(Exception):
    """The reader of a stream went away: its producer stops here."""


Put = Callable[[T], None]  # a producer's way to hand over an item (raises Gone)


class Produced(Generic[T]):
    """The items of a producer thread, as an async iterator. Its reader closes it
    (aclose), also when it stops early: the producer then stops at its next put. An
    exception of the producer is raised here; TooSlow once the stream's time is up."""

    def __init__(self, items: MemoryObjectReceiveStream, deadline: float, timeout: float) -> None:
        self.items = items
        self.deadline = deadline
        self.timeout = timeout

    def __aiter__(self) -> Produced[T]:
        return self

    async def __anext__(self) -> T:
        with anyio.move_on_after(self.deadline - anyio.current_time()):
            kind, value = await self.items.receive()
            if kind == "item":
                return value  # type: ignore[no-any-return]
            if kind == "end":
                raise StopAsyncIteration
            assert isinstance(value, BaseException)
            raise value
        raise TooSlow(f"the sandbox's files did not stream in {self.timeout:g} s")

    async def aclose(self) -> None:
        self.items.close()


class SandboxIO:
    def __init__(self, threads: int = THREADS, timeout: float = TIMEOUT) -> None:
        self.limiter = anyio.CapacityLimiter(threads)
        self.timeout = timeout

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """fn(*args) in a daemon thread of this pool; TooSlow after the timeout."""
        outcome: list[tuple[bool, object]] = []
        done = anyio.Event()

        def work() -> None:
            try:
                outcome.append((True, fn(*args)))
            except BaseException as exc:  # handed to the request, raised there
                outcome.append((False, exc))

        with anyio.move_on_after(self.timeout):
            await self._start(work, done.set)
            await done.wait()
        if not outcome:
            raise TooSlow(f"the sandbox's file did not answer in {self.timeout:g} s")
        ok, value = outcome[0]
        if ok:
            return value  # type: ignore[return-value]
        assert isinstance(value, BaseException)
        raise value

    async def stream(self, produce: Callable[[Put[T]], None]) -> Produced[T]:
        """produce(put) in a daemon thread of this pool; what it puts, as a Produced
        (which its caller must aclose). TooSlow if no thread is free in time."""
        send, receive = anyio.create_memory_object_stream[tuple[str, object]](BUFFERED)
        loop = anyio.lowlevel.current_token()

        def handed(frame: tuple[str, object]) -> None:
            try:
                anyio.from_thread.run(send.send, frame, token=loop)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, RuntimeError):
                raise Gone from None  # RuntimeError: the agent's loop is gone

        def work() -> None:
            try:
                produce(lambda item: handed(("item", item)))
                last: tuple[str, object] = ("end", None)
            except Gone:
                return
            except BaseException as exc:  # handed to the reader, raised there
                last = ("error", exc)
            with contextlib.suppress(Gone):
                handed(last)

        deadline = anyio.current_time() + self.timeout
        with anyio.move_on_after(self.timeout):
            await self._start(work, lambda: None)
            return Produced(receive, deadline, self.timeout)
        receive.close()
        raise TooSlow(f"no thread for the sandbox's files in {self.timeout:g} s")

    async def _start(self, work: Callable[[], None], done: Callable[[], None]) -> None:
        """work() in a new daemon thread once a slot is free; the slot is given back, and
        done() called in the agent's loop, when the thread really ends."""
        slot = object()
        loop = anyio.lowlevel.current_token()

        def finish() -> None:
            self.limiter.release_on_behalf_of(slot)
            done()

        def thread() -> None:
            try:
                work()
            finally:
                with contextlib.suppress(RuntimeError):  # the agent's loop is gone
                    anyio.from_thread.run_sync(finish, token=loop)

        await self.limiter.acquire_on_behalf_of(slot)
        try:
            threading.Thread(target=thread, name="lazyfs sandbox I/O", daemon=True).start()
        except BaseException:
            self.limiter.release_on_behalf_of(slot)
            raise
