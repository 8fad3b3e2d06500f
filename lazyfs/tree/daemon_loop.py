"""The event loop of a process that serves a FUSE tree (the data daemon, the per-image
FUSE daemon): asyncio, where pyfuse3 runs (lazyfs/tree/pyfuse3_asyncio.py), with an
orderly stop on SIGTERM or SIGINT and work handed to threads.

The loop is asyncio's own, not anyio's as the node agent's is: anyio's import was ~17 ms
of a daemon's warm start and ~22 ms of a cold one, and a node's first `lazyfs run` waits
for that start (docs/design-changes.md, session 25). The daemons use little of it: a
task group, sleeps, threads and signals, which asyncio has.

And asyncio's default loop, not uvloop's (the agent's): a daemon's requests are few and
large (the kernel reads ahead), so the loop's speed does not show (a whole image read
through a fresh tree over a warm node cache took the same time on either, session 26),
while uvloop's import (a 13 MB library) added ~4 ms to a warm start and ~10 ms to a cold
one.

asyncio is imported here without ssl, and the daemons take it from here. asyncio imports
ssl only to offer TLS, which no daemon uses (a store's HTTP runs in threads and imports
ssl itself when it needs it), and ssl with its OpenSSL was ~7 ms of a daemon's warm start
(session 26). While asyncio imports, `import ssl` fails, as on a Python built without it,
and asyncio then goes without TLS; afterwards ssl imports as usual.
"""

from __future__ import annotations

import sys

from lazyfs.tree.stand_ins import standing_in

if "asyncio" not in sys.modules:
    with standing_in({"ssl": None}):
        import asyncio

import asyncio
import logging
import signal
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor
from typing import Any, TypeVar

from lazyfs.tree.mount_watch import Ready

log = logging.getLogger("lazyfs.tree")
T = TypeVar("T")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def run_loop(main: Callable[..., Coroutine[Any, Any, None]], *args: Any) -> None:
    """Run the daemon's loop: main(*args) on asyncio, where pyfuse3 runs
    (lazyfs/tree/pyfuse3_asyncio.py).

    SIGTERM and SIGINT are ignored outside the loop: inside, stop_on_signal turns them
    into an orderly stop, and once the loop has returned (unmounted) the daemon is
    already stopping, so a signal then must not cut its last writes short (the start-up
    trace, the final stats). A stop signal sent just after an unmount, while the daemon
    finished, once killed it before those writes."""
    _ignore_stop_signals()
    try:
        # Closing the runner waits for the default pool's threads (in_thread's without an
        # executor); a daemon shuts its own pools down itself (ChunkReader.close).
        with asyncio.Runner() as runner:
            runner.run(main(*args))
    finally:
        _ignore_stop_signals()


def _ignore_stop_signals() -> None:
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


async def serve_requests(ready: Ready | None, *beside: Coroutine[Any, Any, None]) -> None:
    """pyfuse3's request loop until it returns (on terminate(), or when the kernel unmounts
    us), with stop_on_signal and the `beside` tasks running until then.

    `ready` is told once the loop runs: the kernel's INIT will be answered, so callers may
    use the mount. (Never stat our own mount from this process to find out: a thread
    blocked in a request the loop no longer answers, at shutdown, keeps the process and
    its FUSE fd alive forever.)"""
    from lazyfs.tree.pyfuse3_asyncio import pyfuse3

    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(work) for work in (stop_on_signal(), *beside)]
        if ready:
            ready(None, 0)
        await pyfuse3.main()
        for task in tasks:
            task.cancel()


async def stop_on_signal() -> None:
    """In the loop's task group: SIGTERM or SIGINT ends pyfuse3's main loop (unmounts).

    With signal.signal, not the loop's add_signal_handler: removing that handler sets the
    default action first (which kills) and only then could we ignore the signal, and a
    cleaner that sends SIGTERM in a loop while the daemon finishes hit that gap ~1 time in
    3 (tests/lazyfs/test_mount.py). From our handler straight to ignored leaves none."""
    from lazyfs.tree.pyfuse3_asyncio import pyfuse3

    loop = asyncio.get_running_loop()
    received: asyncio.Queue[int] = asyncio.Queue()

    def note(signum: int, _frame: object) -> None:  # on the main thread, between bytecodes
        loop.call_soon_threadsafe(received.put_nowait, signum)

    try:
        for signum in STOP_SIGNALS:
            signal.signal(signum, note)
        log.info("signal %d: unmounting", await received.get())
        pyfuse3.terminate()
    finally:
        _ignore_stop_signals()


async def in_thread(func: Callable[..., T], *args: Any, executor: Executor | None = None) -> T:
    """func(*args) in a worker thread: `executor`'s, else the loop's default pool. A task
    cancelled meanwhile still waits for the thread before it ends, as anyio's threads
    made it do: a thread cannot be stopped, and what comes after the cancel (closing the
    node cache at the daemon's exit) must not run under it."""
    done = asyncio.get_running_loop().run_in_executor(executor, func, *args)
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:
        await asyncio.wait([done])
        if not done.cancelled():
            done.exception()  # retrieved: the cancel is what this task reports
        raise
