"""The warm pools' policy (lazyfs/agent/pools.py) against a fake maker: no runc, no
mounts, no root; each test runs in milliseconds (the deferral's ones in a few tenths of
a second). What the agent does with a real sandbox is tests/lazyfs/test_agent_node.py's.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import pytest

from chunker.errors import BadInputError
from lazyfs.agent.boxes import AgentBox, BoxState, exec_target
from lazyfs.agent.errors import AtCapacity
from lazyfs.agent.images import ImageInfo
from lazyfs.agent.pools import Pool, Pools, check_pool_request
from lazyfs.agent.records import BoxRecord
from lazyfs.sandbox.runtime import RuntimeFailed, Sandbox, SandboxHost

NOWHERE = SandboxHost(Path("/nonexistent"), Path("/nonexistent"), "lazyfs-test")  # never used
A = ImageInfo("a", "a" * 64, {})
B = ImageInfo("b", "b" * 64, {})
_ids = itertools.count(1)


def fake_box(image: ImageInfo) -> AgentBox:
    """A real AgentBox on a Sandbox that was never made (no pid: poll() finds it alive)."""
    box_id = f"lazyfs-{next(_ids):012x}"
    sandbox = Sandbox(box_id, "runc", NOWHERE)
    record = BoxRecord(box_id, image.name, image.image_id, "ready", "runc", created=0.0)
    return AgentBox(sandbox, record, exec_target(sandbox, record), BoxState.READY)


def die(box: AgentBox, status: int = 137) -> None:
    """What AgentBox.poll() does when the sandbox's PID 1 ended."""
    box.sandbox.exit_status = status
    box.move(BoxState.EXITED)


class FakeMaker:
    """pools.Maker without I/O: it records what it was asked for."""

    def __init__(self) -> None:
        self.pools: Pools | None = None
        self.boxes: dict[str, AgentBox] = {}
        self.creating = 0
        self.events: list[str] = []  # "make a", "warm-up a", "remove <id>"
        self.failures = 0  # the next this many makes fail
        self.warm_up_exit = 0
        self.gate: anyio.Event | None = None  # makes wait for it when set

    def total(self) -> int:
        return len(self.boxes) + self.creating

    async def make_pooled(self, pool: Pool) -> AgentBox:
        self.creating += 1
        try:
            await anyio.sleep(0)  # the runtime's thread: others run meanwhile
            if self.gate is not None:
                await self.gate.wait()
            if self.failures:
                self.failures -= 1
                raise RuntimeFailed("runc create: no space left on device")
        finally:
            self.creating -= 1
        box = fake_box(pool.image)
        self.boxes[box.id] = box
        self.events.append(f"make {pool.image.name}")
        return box

    async def run_warm_up(self, pool: Pool) -> int:
        await anyio.sleep(0)
        self.events.append(f"warm-up {pool.image.name}")
        return self.warm_up_exit

    async def remove(self, box: AgentBox) -> None:
        box.move(BoxState.DELETING)
        self.boxes.pop(box.id, None)
        self.events.append(f"remove {box.id}")
        assert self.pools is not None
        self.pools.poke()  # as the agent does: a slot is free

    def made(self) -> list[str]:
        return [e.split()[1] for e in self.events if e.startswith("make ")]


Test = Callable[[Pools, FakeMaker], Awaitable[None]]


def run(test: Test, capacity: int = 100, defer: float = 0.0, refill: bool = True) -> None:
    """test(pools, maker) with the refill task running (unless `refill` is False)."""

    async def main() -> None:
        maker = FakeMaker()
        pools = maker.pools = Pools(maker, capacity, defer, backoff=0.01)
        async with anyio.create_task_group() as tasks:
            if refill:
                tasks.start_soon(pools.run)
            with anyio.fail_after(5):
                await test(pools, maker)
            tasks.cancel_scope.cancel()

    anyio.run(main)


async def until(cond: Callable[[], bool]) -> None:
    while not cond():
        await anyio.sleep(0.001)


async def idle() -> None:
    """Let the refill task run until it waits (a few rounds of the event loop)."""
    for _ in range(50):
        await anyio.sleep(0)


def ready(pools: Pools, image: ImageInfo) -> int:
    pool = pools.get(image.image_id)
    return 0 if pool is None else len(pool.ready)


# ---------------------------------------------------------------------- which pool next


def test_refills_pools_in_the_order_they_were_set_one_sandbox_at_a_time() -> None:
    async def test(pools: Pools, maker: FakeMaker) -> None:
        await pools.set(A, 2, None)
        await pools.set(B, 1, None)
        await until(lambda: ready(pools, A) == 2 and ready(pools, B) == 1)
        await idle()
        assert maker.made() == ["a", "a", "b"]
        assert [p.creating for p in pools.values()] == [0, 0]
        assert pools.next_refill() is None

    run(test)


def test_next_refill_skips_a_pool_being_served_and_puts_a_pending_warm_up_first() -> None:
    async def test(pools: Pools, maker: FakeMaker) -> None:
        a = await pools.set(A, 1, None)
        b = await pools.set(B, 1, ["true"])
        assert pools.next_refill() is a
        a.creating = 1
        assert pools.next_refill() is b  # its warm-up, then its sandbox
        a.creating = 0
        a.ready.append(fake_box(A))
        b.ready.append(fake_box(B))  # full, but its warm-up has not run
        assert pools.next_refill() is b
        b.warmed = {"exit_code": 0, "seconds": 0.0}
        assert pools.next_refill() is None

    run(test, refill=False)


# ---------------------------------------------------------------------- how many


def test_a_raised_target_fills_and_a_lowered_one_deletes_the_newest_at_once() -> None:
    async def test(pools: Pools, maker: FakeMaker) -> None:
        pool = await pools.set(A, 1, None)
        await until(lambda: ready(pools, A) == 1)
        first = pool.ready[0]
        await pools.set(A, 3, None)
        await until(lambda: ready(pools, A) == 3)
        newest = list(pool.ready)[1:]
        await pools.set(A, 1, None)
        assert list(pool.ready) == [first]  # at once: not left to the refill
        assert [b.state for b in newest] == [BoxState.DELETING] * 2
        assert maker.events[-2:] == [f"remove {b.id}" for b in reversed(newest)]
        await idle()
        assert maker.made() == ["a"] * 3  # nothing made for the lowered target
        await pools.set(A, 0, None)
        assert not pool.ready and maker.total() == 0

    run(test)


def test_a_sandbox_made_for_a_pool_that_shrank_meanwhile_is_deleted() -> None:
    async def test(pools: Pools, maker: FakeMaker) -> None:
        maker.gate = anyio.Event()
        await pools.set(A, 1, None)
        await until(lambda: maker.creating == 1)  # the refill is making it
        await pools.set(A, 0, None)
        maker.gate.set()
        await until(lambda: len(maker.events) == 2)
        assert maker.events[0] == "make a" and maker.events[1].startswith("remove ")
        assert ready(pools, A) == 0 and maker.total() == 0

    run(test)


def test_the_refill_stops_at_capacity_and_resumes_when_a_slot_frees() -> None:
    async def test(pools: Pools, maker: FakeMaker) -> None:
        await pools.set(A, 2, None)
        await pools.set(B, 2, None)
        await until(lambda: maker.total() == 3)
        await idle()
        assert maker.made() == ["a", "a", "b"] and pools.next_refill() is None
        claimed = await pools.take(A.image_id, network=False)  # still held: no slot
        assert claimed is not None
        await idle()
        assert maker.made() == ["a", "a", "b"]
        await maker.remove(claimed)  # its client deleted it
        await until(lambda: len(maker.made()) == 4)
        assert maker.made()[3] == "a" and maker.total() == 3

    run(test, capacity=3)


def test_make_room_gives_up_a_ready_sandbox_of_the_fullest_pool() -> None:
    async def test(pools: Pools, maker: FakeMaker) -> None:
        a = await pools.set(A, 2, None)
        b = await pools.set(B, 1, None)
        for pool, image in ((a, A), (a, A), (b, B)):
            box = fake_box(image)
            maker.boxes[box.id] = box
            pool.ready.append(box)
        newest = a.ready[-1]
        await pools.make_room()
        assert newest.state is BoxState.DELETING and len(a.ready) == 1 and len(b.ready) == 1
        await pools.make_room()  # below capacity now: nothing more is given up
        assert len(a.ready) == 1 and len(b.ready) == 1

    run(test, capacity=3, refill=False)


def test_make_room_refuses_at_capacity_unless_a_refill_gives_way() -> None:
    async def test(pools: Pools, maker: FakeMaker) -> None:
        held = fake_box(A)  # a running sandbox, not pooled
        maker.boxes[held.id] = held
        with pytest.raises(AtCapacity, match="--max-sandboxes 1"):
            await pools.make_room()
        pool = await pools.set(A, 1, None)
        pool.creating = 1  # the refill takes the last slot: it gives way when it is made
        await pools.make_room()

    run(test, capacity=1, refill=False)


# ---------------------------------------------------------------------- failures


def test_a_failing_maker_is_counted_and_the_pool_retried_after_the_backoff() -> None:
    async def test(pools: Pools, maker: FakeMaker) -> None:
        maker.failures = 2
        pool = await pools.set(A, 1, None)
        await until(lambda: pool.failures == 1)
        assert pool.creating == 1  # during the backoff: the slot stays the refill's
        assert pool.last_error == "runc create: no space left on device"
        await until(lambda: ready(pools, A) == 1)
        assert pool.failures == 2 and maker.made() == ["a"] and pool.creating == 0

    run(test)


def test_prune_drops_pooled_sandboxes_that_are_no_longer_ready_and_refills() -> None:
    async def test(pools: Pools, maker: FakeMaker) -> None:
        pool = await pools.set(A, 2, None)
        await until(lambda: ready(pools, A) == 2)
        dead, alive = pool.ready
        die(dead)
        await pools.prune()
        assert list(pool.ready) == [alive] and dead.state is BoxState.DELETING
        assert f"remove {dead.id}" in maker.events
        assert pool.failures == 1
        assert pool.last_error == f"sandbox {dead.id}: its PID 1 exited (status 137)"
        await until(lambda: ready(pools, A) == 2)  # replaced before a claim comes
        assert len(maker.made()) == 3

    run(test)


# ---------------------------------------------------------------------- claims


def test_take_hands_out_the_oldest_ready_one_and_never_a_dead_one() -> None:
    async def test(pools: Pools, maker: FakeMaker) -> None:
        pool = await pools.set(A, 3, None)
        await until(lambda: ready(pools, A) == 3)
        first, second, third = pool.ready
        assert await pools.take(A.image_id, network=True) is None  # its own namespace
        assert await pools.take(B.image_id, network=False) is None  # no pool
        die(first)
        assert await pools.take(A.image_id, network=False) is second
        assert first.state is BoxState.DELETING and pool.failures == 1
        assert list(pool.ready)[0] is third
        await until(lambda: ready(pools, A) == 3)  # the take poked the refill

    run(test)


def test_forget_takes_a_sandbox_out_of_its_pool() -> None:
    async def test(pools: Pools, maker: FakeMaker) -> None:
        pool = await pools.set(A, 2, None)
        await until(lambda: ready(pools, A) == 2)
        box = pool.ready[0]
        pools.forget(box)
        assert box not in pool.ready and len(pool.ready) == 1

    run(test)


# ---------------------------------------------------------------------- warm-ups


def test_a_warm_up_runs_once_before_the_first_sandbox_and_again_when_it_changes() -> None:
    async def test(pools: Pools, maker: FakeMaker) -> None:
        pool = await pools.set(A, 1, ["python3", "-c", "import json"])
        await until(lambda: ready(pools, A) == 1)
        assert maker.events == ["warm-up a", "make a"]
        assert pool.warmed is not None and pool.warmed["exit_code"] == 0
        await pools.set(A, 1, ["python3", "-c", "import json"])  # the same: not again
        await pools.set(A, 1, None)  # None: unchanged
        await idle()
        assert maker.events == ["warm-up a", "make a"]
        await pools.set(A, 1, ["python3", "-c", "import email"])  # a full pool: runs
        await until(lambda: pool.warmed is not None)
        assert maker.events == ["warm-up a", "make a", "warm-up a"]

    run(test)


def test_a_failed_warm_up_is_reported_and_the_pool_fills_anyway() -> None:
    async def test(pools: Pools, maker: FakeMaker) -> None:
        maker.warm_up_exit = 3
        pool = await pools.set(A, 1, ["sh", "-c", "exit 3"])
        await until(lambda: ready(pools, A) == 1)
        assert pool.warmed is not None and pool.warmed["exit_code"] == 3
        assert pool.last_error == "warm-up 'sh' exited 3"

    run(test)


def test_no_warm_up_for_a_pool_of_size_zero() -> None:
    async def test(pools: Pools, maker: FakeMaker) -> None:
        await pools.set(A, 0, ["true"])
        await idle()
        assert maker.events == [] and pools.next_refill() is None

    run(test)


# ---------------------------------------------------------------------- the deferral


def test_a_refill_waits_for_a_claims_first_command_to_end() -> None:
    async def test(pools: Pools, maker: FakeMaker) -> None:
        await pools.set(A, 1, None)
        await until(lambda: ready(pools, A) == 1)
        box = await pools.take(A.image_id, network=False)
        assert box is not None
        pools.claimed(box.id)
        await anyio.sleep(0.05)
        assert maker.made() == ["a"]  # deferred
        pools.first_command_ended(box.id)
        with anyio.fail_after(0.5):  # well before the deferral's 5 s
            await until(lambda: ready(pools, A) == 1)

    run(test, defer=5.0)


def test_a_refill_waits_no_longer_than_the_deferral() -> None:
    async def test(pools: Pools, maker: FakeMaker) -> None:
        await pools.set(A, 1, None)
        await until(lambda: ready(pools, A) == 1)
        box = await pools.take(A.image_id, network=False)
        assert box is not None
        t0 = anyio.current_time()
        pools.claimed(box.id)  # its first command never ends
        await until(lambda: ready(pools, A) == 1)
        assert 0.15 <= anyio.current_time() - t0 < 1.0

    run(test, defer=0.2)


def test_no_deferral_when_it_is_off() -> None:
    async def test(pools: Pools, maker: FakeMaker) -> None:
        await pools.set(A, 1, None)
        await until(lambda: ready(pools, A) == 1)
        box = await pools.take(A.image_id, network=False)
        assert box is not None
        pools.claimed(box.id)
        with anyio.fail_after(0.5):
            await until(lambda: ready(pools, A) == 1)

    run(test, defer=0.0)


# ---------------------------------------------------------------------- requests


@pytest.mark.parametrize(
    ("size", "warmup"),
    [(-1, None), (1.5, None), (True, None), ("2", None), (1, "python3"), (1, [1]), (1, [""])],
)
def test_a_bad_pool_request_is_refused(size: object, warmup: object) -> None:
    with pytest.raises(BadInputError):
        check_pool_request(size, warmup)


def test_a_good_pool_request_passes() -> None:
    for size, warmup in ((0, None), (3, []), (1, ["python3", "-c", "pass"])):
        check_pool_request(size, warmup)
