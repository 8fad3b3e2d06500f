"""pyfuse3 on asyncio, imported without trio. Import pyfuse3 from here, never directly.

pyfuse3 runs on trio unless switched to its own asyncio layer (pyfuse3.asyncio), and
imports trio when it is imported either way. trio's import was the largest part of a
FUSE daemon's start: 0.15-0.2 s of CPU on this project's 2-core VMs (attrs building its
classes, ssl, importlib.metadata), and more from a cold page cache, where a fresh node's
first `lazyfs run` waits for the node data daemon (docs/design-changes.md, session 21).
So pyfuse3 is imported here with an empty module in trio's place, which it only keeps as
a global and does not use at import, and is switched at once to the layer below: every
use pyfuse3 makes of "trio" then goes there. Its import also looks up its own version
with importlib.metadata, which imports email, zipfile, csv and more, and scans
site-packages: ~8 ms of a warm start and 15-20 ms of a cold one (session 25). Nothing
reads that version, so importlib.metadata is a stand-in for that import too, and
pyfuse3.__version__ says "unknown". The daemons run their loop on asyncio:
lazyfs/tree/daemon_loop.py.

The layer is pyfuse3.asyncio's, with two changes:
- its nursery only logs a task's failure (when the task is collected) and then returns
  as if all went well, so pyfuse3.main() would return normally after its request loop
  failed, and the data daemon would exit 0, which its supervisor takes for an idle exit
  (it unmounts every tree). Here the nursery raises the first failure, as trio's does:
  the daemon fails, and is restarted.
- its notify_closing (what pyfuse3.terminate() calls after setting the session's exit
  flag) set an exception on every pending read of the FUSE fd, also on one whose fd had
  turned readable already (its future done, its task not resumed yet): InvalidStateError
  out of terminate(), and a daemon stopped by SIGTERM just as a request came in exited 1
  (a fresh-clone suite run, session 29). Here such a read is left to finish: its task
  finds the exit flag on its next turn.

And two additions for the data daemon's worker, which moves libfuse from its
supervisor's socket onto /dev/fuse after INIT (lazyfs/tree/fuse_supervision.py):
- `before_next_read(hook)` runs hook() once, just before pyfuse3 next waits for its FUSE
  fd: with nothing in flight on the old fd and no reader registered on it.
- its /dev/fuse is non-blocking, so a request withdrawn between the loop's poll and its
  read (its reader killed meanwhile) gives EAGAIN, which pyfuse3 raises out of its request
  loop (a blocking read would instead hold the loop, and every reply it owes, until the
  next request). That loop is then run again, and says so in the log: it waits for the
  fd as before. (pyfuse3's 1 MiB request buffer of the loop that raised is not freed:
  it is once per such race.)
"""

from __future__ import annotations

import asyncio
import logging
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lazyfs.tree.stand_ins import standing_in

log = logging.getLogger("lazyfs.tree")


class _Nursery:
    """pyfuse3.asyncio's nursery, failing as trio's does (see the top), and holding only
    the tasks still running.

    pyfuse3 starts a request loop whenever a request comes in and none is waiting for the
    next one, and a loop ends when too many wait: each burst of concurrent reads starts
    and ends tasks. Kept until the nursery's end, as upstream's nursery keeps them, the
    ended ones piled up for the daemon's life (20 after one cold sympy start)."""

    async def __aenter__(self) -> _Nursery:
        self.tasks: set[asyncio.Task] = set()
        self.failure: BaseException | None = None
        self._all_ended: asyncio.Event | None = None
        return self

    def start_soon(self, func: Callable[..., Any], *args: Any, name: str | None = None) -> None:
        task = asyncio.create_task(_again_after_eagain(func, args))
        task.name = name  # type: ignore[attr-defined]  # pyfuse3 reads it
        self.tasks.add(task)
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if self.failure is None and not task.cancelled() and task.exception() is not None:
            self.failure = task.exception()
            for other in self.tasks:  # the first failure ends the rest, as on trio
                other.cancel()
        if not self.tasks and self._all_ended is not None:
            self._all_ended.set()

    async def __aexit__(self, *exc_info: object) -> None:
        if self.tasks:
            self._all_ended = asyncio.Event()
            await self._all_ended.wait()
        if self.failure is not None:
            raise self.failure


async def _again_after_eagain(func: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """pyfuse3's request loop, run again when its read of /dev/fuse found nothing (see the
    top): its counts of tasks and readers stay right, as it raised after a whole read."""
    while True:
        try:
            return await func(*args)
        except BlockingIOError:
            log.info("a FUSE request went away before our read")


_hooks: list[Callable[[], None]] = []


def before_next_read(hook: Callable[[], None]) -> None:
    """Run hook() once, before pyfuse3 next waits for its FUSE fd (see the top)."""
    _hooks.append(hook)


async def _wait_readable(fd: int) -> None:
    """pyfuse3.asyncio's wait_readable, after the hooks of before_next_read."""
    import pyfuse3.asyncio as upstream

    while _hooks:
        _hooks.pop(0)()
    await upstream.wait_readable(fd)


def _notify_closing(fd: int) -> None:
    """pyfuse3.asyncio's notify_closing, leaving reads that are done alone (see the top)."""
    import pyfuse3.asyncio as upstream

    for future in list(upstream._read_futures.get(fd, ())):
        if not future.done():
            future.set_exception(upstream.ClosedResourceError())


class _NoMetadata(Exception):
    """The stand-in importlib.metadata's PackageNotFoundError."""


def _no_version(name: str) -> str:
    raise _NoMetadata(name)


def _stand_ins() -> dict[str, types.ModuleType]:
    """Empty modules for what pyfuse3 imports but does not need (see the top)."""
    metadata = types.ModuleType("importlib.metadata")
    metadata.PackageNotFoundError = _NoMetadata  # type: ignore[attr-defined]
    metadata.version = _no_version  # type: ignore[attr-defined]
    return {"trio": types.ModuleType("trio"), "importlib.metadata": metadata}


def _import_on_asyncio() -> types.ModuleType:
    with standing_in(_stand_ins()):
        import pyfuse3
        import pyfuse3.asyncio
    layer = types.ModuleType("lazyfs.tree.pyfuse3_asyncio.layer")
    layer.__dict__.update(vars(pyfuse3.asyncio))
    layer.open_nursery = _Nursery  # type: ignore[attr-defined]
    layer.notify_closing = _notify_closing  # type: ignore[attr-defined]
    layer.wait_readable = _wait_readable  # type: ignore[attr-defined]
    layer.lowlevel = layer.from_thread = layer  # type: ignore[attr-defined]  # as enable() does
    pyfuse3.trio = layer  # type: ignore[attr-defined]
    return pyfuse3


if TYPE_CHECKING:
    import pyfuse3
else:
    pyfuse3 = _import_on_asyncio()
