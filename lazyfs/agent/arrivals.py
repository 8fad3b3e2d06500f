"""Images new to the node are brought onto it a few at a time, first come first served.

An image's first create on a node does its image's work once: the lookup (its manifest
fetched, inflated and hashed) and its tree's mount. That is ~11 ms of the agent's CPU
and ~9 ms of the data daemon's (docs/design-changes.md, session 38), where a claim on a
mounted tree costs ~3 ms. A burst from many new images (an RL step: thousands of tasks,
one image each) started all of that work at once, in as many threads, so every image
advanced at the pace of all of them and none was ready until nearly all were: on 2
cores, 200 generic claims over 50 new images had a create p50 of 0.74-1.28 s, against
0.37 s for the same burst on mounted trees.

Here an image's first create takes a place in one line (AT_ONCE bring-ups at a time,
in arrival order), and every other create of that image meanwhile waits for it rather
than queue again: the first images are ready, and their sandboxes handed out, while
the last ones still wait. The total work is the same; the median create comes sooner.
A create of an image already on the node never waits here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio

# Bring-ups at once: one runs Python while the other waits for the store, the mount or
# the data daemon; more only share the agent's one core (its GIL) again (4 measured the
# same as 2, 8 as no line at all).
AT_ONCE = 2
# Seconds a bring-up keeps its place. One that takes longer waits on the store (a slow
# link, a store that does not answer until LAZYFS_FETCH_TIMEOUT), not on this node's
# CPU: it goes on outside the line, and the next image takes the place, so that a stuck
# store does not make the line's last image wait for every timeout before it.
PATIENCE = 0.25


class Arrivals:
    def __init__(self, at_once: int = AT_ONCE, patience: float = PATIENCE) -> None:
        self._line = anyio.Semaphore(at_once)  # FIFO: asyncio's backend wakes in order
        self._patience = patience
        self._coming: dict[str, anyio.Event] = {}  # name -> set once its bring-up ended

    async def bring(
        self,
        name: str,
        on_node: Callable[[], bool],
        bring_up: Callable[[], Awaitable[object]],
    ) -> None:
        """Return once `on_node()` is true for the image `name`, after `bring_up()` in the
        line if it was not. A bring-up that fails raises in its own create; the creates
        that waited for it then try in turn (and usually fail the same way)."""
        while (coming := self._coming.get(name)) is not None:
            await coming.wait()
        if on_node():
            return
        done = self._coming[name] = anyio.Event()
        try:
            await self._in_line(bring_up)
        finally:
            del self._coming[name]
            done.set()

    async def _in_line(self, bring_up: Callable[[], Awaitable[object]]) -> None:
        """bring_up(), holding a place in the line until it ends or for the patience."""
        ended = anyio.Event()
        failed: list[BaseException] = []

        async def run() -> None:
            try:
                await bring_up()
            except Exception as exc:  # raised below, not as a task group's group
                failed.append(exc)
            finally:
                ended.set()

        # The place is given back (the inner context's exit) before the task group waits
        # for run(), at the patience or at the end, and when the create is cancelled.
        async with anyio.create_task_group() as tasks, self._line:
            tasks.start_soon(run)
            with anyio.move_on_after(self._patience):
                await ended.wait()
        if failed:
            raise failed[0]
