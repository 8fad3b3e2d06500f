"""Warm pools: per image a target number of sandboxes prepared up to just before their
first command (BoxState.READY): overlay mounted, container created and started (its exec
server's socket listens from before the start: a first command waits in its backlog
until the server accepts, so nothing is waited for at the claim). A claim without
--network takes one (`Pools.take`), so it is bookkeeping (and cgroup writes if it sets
limits; env is given to each exec), and its first command is one exec-server round
trip. Otherwise, or when the pool is empty, the agent makes a sandbox cold.

This module is the policy, as plain code: which pool to refill next, one sandbox at a
time (so that cold claims still get threads); how many (up to each target, within the
node's capacity, a ready one given up for a claim at capacity); when to prune (a pooled
sandbox whose PID 1, the exec server, ended is dropped, never handed out); when to wait
(backoff after a failure, and the deferral below); and a pool's warm-up, run once per
image before its first sandbox is ready. The I/O (making a sandbox, running the warm-up
in one, deleting one) is the agent's, behind `Maker`, so that the policy is tested
against a fake maker in milliseconds, without runc (tests/lazyfs/test_agent_pools.py).

The deferral: a refill does not start while a sandbox just handed out runs its first
command, for up to Settings.refill_defer (LAZYFS_REFILL_DEFER, 0.1 s) after the claim.
Niceness (node.py, BACKGROUND_NICE) does not keep a refill's `runc create` from slowing
that command: measured on 2 cores, claim + `python3 -c print` took 31-47 ms with the
refill right after the claim and 21-27 ms with the refill's `runc create` 0.1 s later,
while nice 10, a low cgroup CPU weight for the pooled sandbox, or the runtime's process
in a low-weight cgroup changed nothing (docs/design-changes.md, 2026-12-01). A claim's
first command is often short (a python3 or shell start-up); a longer one overlaps the
refill after that, where its few ms matter less.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import anyio

from chunker.errors import BadInputError, LazyfsError
from lazyfs.agent.boxes import AgentBox, BoxState
from lazyfs.agent.errors import AtCapacity
from lazyfs.agent.images import ImageInfo

log = logging.getLogger("lazyfs.agent")
REFILL_BACKOFF = 2.0  # seconds before retrying a pool whose sandbox failed to make
# What a failed make or warm-up raises (a runtime's error, a mount's, a stuck command's):
# the pool counts it and tries again after the backoff. Anything else is a bug.
MAKE_FAILURES = (LazyfsError, OSError, subprocess.SubprocessError)


@dataclass
class Pool:
    image: ImageInfo
    target: int
    ready: deque[AgentBox] = field(default_factory=deque)
    creating: int = 0  # 1 while the refill makes one for it (or warms it up, or backs off)
    failures: int = 0
    last_error: str | None = None
    warmup: list[str] = field(default_factory=list)  # argv; [] for none
    warmed: dict | None = None  # the warm-up's {"exit_code", "seconds"} once it ran
    # A gateway's whole-fleet target this node's size is a share of: {"size", "at",
    # "image"} (the name it was set for), kept here and shown in the views and the
    # placement report, so that any gateway replica can spread it again.
    fleet: dict | None = None

    def wants_warm_up(self) -> bool:
        return bool(self.target and self.warmup and self.warmed is None)

    def view(self) -> dict:
        generic = not self.image.image_id  # the generic pool: for any image (issue 23)
        return {
            "image": None if generic else self.image.name,
            "image_id": self.image.image_id or None,
            "generic": generic,
            "target": self.target,
            "ready": len(self.ready),
            "creating": self.creating,
            "failures": self.failures,
            "last_error": self.last_error,
            "warmup": self.warmup,
            "warmed": self.warmed,
            **({"fleet": self.fleet} if self.fleet is not None else {}),
        }


class Maker(Protocol):
    """The I/O the pools need (the agent, node.py; a fake in the tests)."""

    def total(self) -> int:
        """Sandboxes held or being made on the node, against the capacity."""

    async def make_pooled(self, pool: Pool) -> AgentBox:
        """A started sandbox of the pool's image, READY; on a failure, raises and leaves
        nothing behind."""

    async def run_warm_up(self, pool: Pool) -> int:
        """Run pool.warmup in a throw-away sandbox of the image; its exit code."""

    async def remove(self, box: AgentBox) -> None:
        """Delete a sandbox (and poke the pools: a slot is free)."""


def check_pool_request(size: object, warmup: object, fleet: object = None) -> None:
    """BadInputError unless `size`, `warmup` and `fleet` make a pool (see Pools.set)."""
    if fleet is not None and not (
        isinstance(fleet, dict)
        and set(fleet) == {"size", "at", "image"}
        and isinstance(fleet["size"], int)
        and not isinstance(fleet["size"], bool)
        and fleet["size"] >= 0
        and isinstance(fleet["at"], (int, float))
        and not isinstance(fleet["at"], bool)
        and isinstance(fleet["image"], str)
    ):
        raise BadInputError('a pool\'s fleet must be {"size": N >= 0, "at": TIME, "image": NAME}')
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise BadInputError(f"pool size {size!r} must be a whole number, 0 or more")
    if warmup is not None and not (
        isinstance(warmup, list) and all(isinstance(a, str) for a in warmup)
    ):
        raise BadInputError("a pool's warmup must be a list of strings (an argv)")
    if warmup and not warmup[0]:
        raise BadInputError("a pool's warmup must start with a command")


class Pools:
    def __init__(
        self,
        maker: Maker,
        capacity: int,
        refill_defer: float,
        backoff: float = REFILL_BACKOFF,
    ) -> None:
        self.maker = maker
        self.capacity = capacity  # --max-sandboxes
        self.refill_defer = refill_defer
        self.backoff = backoff
        self._pools: dict[str, Pool] = {}  # by image id, in the order they were set
        self._wake = anyio.Event()
        # Sandboxes handed out whose first command has not ended: id -> until when (the
        # event loop's clock) refills wait for it; _first_done is set when one ends or goes.
        self._first_commands: dict[str, float] = {}
        self._first_done = anyio.Event()

    def values(self) -> Iterable[Pool]:
        return self._pools.values()

    def get(self, image_id: str) -> Pool | None:
        return self._pools.get(image_id)

    def poke(self) -> None:
        """Something changed (a slot freed, a sandbox taken, a target set): look again."""
        self._wake.set()

    # ------------------------------------------------------------------ targets

    async def set(
        self, image: ImageInfo, size: int, warmup: list[str] | None, fleet: dict | None = None
    ) -> Pool:
        """The pool's target size; `warmup` (an argv; [] for none, None: unchanged) is
        run once, before the pool's first sandbox is ready, and again if it changes. A
        smaller target deletes the newest ready sandboxes now. `fleet`: the gateway's
        whole-fleet target this size is a share of (None: unchanged)."""
        pool = self._pools.get(image.image_id)
        if pool is None:
            pool = self._pools[image.image_id] = Pool(image, size)
        pool.target = size
        if fleet is not None:
            pool.fleet = dict(fleet)
        if warmup is not None and warmup != pool.warmup:
            pool.warmup, pool.warmed = list(warmup), None
        while len(pool.ready) > size:
            await self.maker.remove(pool.ready.pop())
        self.poke()
        return pool

    def stop(self) -> None:
        """Every target 0: nothing more is made (the agent stops)."""
        for pool in self._pools.values():
            pool.target = 0

    # ------------------------------------------------------------------ refilling

    def next_refill(self) -> Pool | None:
        """The pool the refill serves next, in the order the pools were set: a pending
        warm-up first (even for a full pool), else the first below its target; None at
        capacity or when every pool is full or already being served."""
        if self.maker.total() >= self.capacity:
            return None
        for pool in self._pools.values():
            if pool.creating:
                continue
            if pool.wants_warm_up():
                return pool  # a new warm-up, even for a full pool
            if len(pool.ready) < pool.target:
                return pool
        return None

    async def run(self) -> None:
        """The refill task: one sandbox (or warm-up) at a time, for as long as the agent
        runs."""
        while True:
            pool = self.next_refill()
            if pool is None:
                await self._wake.wait()
                self._wake = anyio.Event()
                continue
            if self._first_commands:
                await self._let_first_commands_run()
                pool = self.next_refill()  # claims or pool changes meanwhile
                if pool is None:
                    continue
            pool.creating += 1
            try:
                if pool.warmup and pool.warmed is None:
                    await self._warm_up(pool)
                    continue  # the pool may be full already: look again
                box = await self.maker.make_pooled(pool)
            except MAKE_FAILURES as exc:
                pool.failures += 1
                pool.last_error = str(exc)
                log.warning("pool %s: %s", pool.image.name, exc)
                await anyio.sleep(self.backoff)  # still `creating`: see make_room
                continue
            finally:
                pool.creating -= 1
            if len(pool.ready) < pool.target and self.maker.total() <= self.capacity:
                pool.ready.append(box)
            else:  # the pool shrank meanwhile, or a claim took the slot
                await self.maker.remove(box)

    async def _warm_up(self, pool: Pool) -> None:
        """Run the pool's warm-up command once, in a throw-away sandbox of the image.

        What it reads lands in the node cache and in the page cache of the image's tree,
        which every sandbox of the image shares (one lower tree, read-only), so one run
        warms the whole pool, at the cost of one extra sandbox per image. Running it in
        each pooled sandbox instead would pay it N times and leave its writes (.pyc
        files, caches, temporary files) in the sandboxes handed out, which would then not
        all start from the image's state. A warm-up that fails (non-zero exit, timeout)
        is reported in the pool's `warmed` and `last_error`; the pool fills anyway."""
        t0 = time.perf_counter()
        exit_code = await self.maker.run_warm_up(pool)
        pool.warmed = {"exit_code": exit_code, "seconds": time.perf_counter() - t0}
        if exit_code != 0:
            pool.last_error = f"warm-up {pool.warmup[0]!r} exited {exit_code}"
            log.warning("pool %s: %s", pool.image.name, pool.last_error)
        else:
            log.info("pool %s: warm-up done in %.2f s", pool.image.name, pool.warmed["seconds"])

    # ------------------------------------------------------------------ claims

    async def take(self, image_id: str, network: bool) -> AgentBox | None:
        """A ready sandbox of the image whose PID 1 still runs. Any env and limits fit
        (env is given to each command; limits are written to its cgroups); network does
        not (a pooled sandbox has its own namespace already)."""
        pool = self._pools.get(image_id)
        if pool is None or network:
            return None
        while pool.ready:
            box = pool.ready.popleft()
            box.poll()
            if box.state is BoxState.READY:  # PID 1, the server, runs: its socket listens
                # The refill waits for the rest of the claim too (a generic one gives the
                # sandbox its root: milliseconds a refill's runtime would slow).
                self.claimed(box.id)
                self.poke()
                return box
            self.poke()  # refill
            await self._drop(pool, box)
        return None

    def forget(self, box: AgentBox) -> None:
        """Take the sandbox out of its pool (it is being deleted)."""
        for pool in self._pools.values():
            if box in pool.ready:
                pool.ready.remove(box)

    async def make_room(self) -> None:
        """At capacity: give up a ready pooled sandbox (of the fullest pool) for a cold
        claim, or refuse it (AtCapacity)."""
        total = self.maker.total()
        if total < self.capacity:
            return
        if any(p.creating for p in self._pools.values()):
            return  # a refill is taking the last slot: it gives way when it is made
        for pool in sorted(self._pools.values(), key=lambda p: -len(p.ready)):
            if pool.ready:
                await self.maker.remove(pool.ready.pop())
                return
        raise AtCapacity(
            f"the node holds {total} sandboxes, its limit (--max-sandboxes"
            f" {self.capacity}); delete some or retry later"
        )

    async def prune(self) -> None:
        """Drop ready sandboxes whose PID 1 (the exec server) ended, so that the refill
        replaces them before a claim comes."""
        for pool in list(self._pools.values()):
            for box in list(pool.ready):
                box.poll()
                if box.state is not BoxState.READY and box in pool.ready:
                    pool.ready.remove(box)
                    await self._drop(pool, box)

    async def _drop(self, pool: Pool, box: AgentBox) -> None:
        """A pooled sandbox that can no longer serve (its PID 1, the exec server, ended)."""
        why = f"its PID 1 exited (status {box.sandbox.exit_status})"
        log.warning("pool %s: sandbox %s %s; replaced", pool.image.name, box.id, why)
        pool.failures += 1
        pool.last_error = f"sandbox {box.id}: {why}"
        with contextlib.suppress(LazyfsError):
            await self.maker.remove(box)

    # ------------------------------------------------------------------ the deferral

    def claimed(self, box_id: str) -> None:
        """A sandbox was handed out: refills wait for its first command (see the top)."""
        if self.refill_defer > 0:
            self._first_commands[box_id] = anyio.current_time() + self.refill_defer

    def first_command_ended(self, box_id: str) -> None:
        """Its first command ended, or it is being deleted."""
        if self._first_commands.pop(box_id, None) is not None:
            self._first_done.set()

    async def _let_first_commands_run(self) -> None:
        """Wait until no sandbox just handed out runs its first command, each for at most
        refill_defer after its claim, and in all at most refill_defer (so that a stream
        of claims does not stop refills)."""
        until = anyio.current_time() + self.refill_defer
        while (now := anyio.current_time()) < until:
            self._first_commands = {i: t for i, t in self._first_commands.items() if t > now}
            if not self._first_commands:
                return
            self._first_done = anyio.Event()
            with anyio.CancelScope(deadline=min(until, max(self._first_commands.values()))):
                await self._first_done.wait()
