"""Images new to the node are brought up a few at a time, in arrival order
(lazyfs/agent/arrivals.py): a burst's first images are ready while the last ones wait,
each image is brought up once whatever number of its creates came, and an image already
on the node never waits in the line."""

from __future__ import annotations

import anyio
import pytest

from lazyfs.agent.arrivals import Arrivals

BRING_UP = 0.02  # seconds a bring-up takes here (a real one: ~10-20 ms)


class Node:
    """The images on a node, as the line sees them: brought up by `bring_up`, which
    records when, and how many ran at once."""

    def __init__(self) -> None:
        self.present: set[str] = set()
        self.started: list[str] = []
        self.running = 0
        self.most = 0
        self.fail: set[str] = set()
        # "start X", "up X" (its bring-up ended), "answered X" (a create of X returned), in
        # the order the event loop ran them: the tests check order, not wall time, which a
        # loaded CI machine stretches.
        self.log: list[str] = []

    def on_node(self, name: str) -> bool:
        return name in self.present

    async def bring_up(self, name: str) -> None:
        self.started.append(name)
        self.log.append(f"start {name}")
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await anyio.sleep(BRING_UP)
            if name in self.fail:
                raise OSError(f"cannot mount {name}")
            self.present.add(name)
            self.log.append(f"up {name}")
        finally:
            self.running -= 1


async def create(arrivals: Arrivals, node: Node, name: str) -> None:
    await arrivals.bring(name, lambda: node.on_node(name), lambda: node.bring_up(name))
    assert node.on_node(name)
    node.log.append(f"answered {name}")


def test_a_burst_of_new_images_is_brought_up_in_arrival_order_a_few_at_a_time() -> None:
    images = [f"image-{i}" for i in range(6)]
    burst = images * 3  # round-robin, as a burst's creates arrive: each image 3 times
    node = Node()

    async def main() -> None:
        arrivals = Arrivals(at_once=2)

        async with anyio.create_task_group() as tasks:
            for name in burst:
                tasks.start_soon(create, arrivals, node, name)
                await anyio.sleep(0)  # arrival order is start order

    anyio.run(main)
    assert node.started == images  # each once, in the order they first arrived
    assert node.most == 2
    log = node.log
    for name in images:
        assert log.count(f"answered {name}") == 3
        # its creates are answered as soon as it is up: before any image whose bring-up
        # started after it was up is up too (not once every image is)
        last_answer = max(i for i, e in enumerate(log) if e == f"answered {name}")
        for later in images:
            if log.index(f"start {later}") > log.index(f"up {name}"):
                assert last_answer < log.index(f"up {later}"), (name, later, log)
    assert log.index(f"start {images[-1]}") > log.index(f"up {images[0]}")  # 3 rounds


def test_an_image_on_the_node_never_waits_in_the_line() -> None:
    node = Node()
    node.present.add("mounted")

    async def main() -> None:
        arrivals = Arrivals(at_once=1)
        async with anyio.create_task_group() as tasks:
            for name in ("new-1", "new-2", "new-3"):
                tasks.start_soon(create, arrivals, node, name)
            while not node.running:  # the line is busy now
                await anyio.sleep(0)
            await create(arrivals, node, "mounted")

    anyio.run(main)
    # answered while the first new image was still coming up, the others behind it
    assert node.log.index("answered mounted") < node.log.index("up new-1"), node.log
    assert "mounted" not in node.started


def test_a_failed_bring_up_fails_its_create_and_the_next_create_tries_again() -> None:
    node = Node()
    node.fail.add("broken")
    outcomes: list[str] = []

    async def main() -> None:
        arrivals = Arrivals(at_once=2)

        async def one() -> None:
            try:
                await create(arrivals, node, "broken")
                outcomes.append("made")
            except OSError as exc:
                outcomes.append(str(exc))

        async with anyio.create_task_group() as tasks:
            for _ in range(3):
                tasks.start_soon(one)
        # the image is fixed (converted again): the next create brings it up
        node.fail.clear()
        await create(arrivals, node, "broken")

    anyio.run(main)
    assert outcomes == ["cannot mount broken"] * 3
    assert node.started == ["broken"] * 4  # one at a time: the waiters tried in turn
    assert node.on_node("broken")


def test_a_cancelled_bring_up_leaves_the_line_free() -> None:
    """A create whose client left (cancelled) mid bring-up: the creates that waited for
    it bring the image up themselves, and the line's place is given back."""
    node = Node()

    async def main() -> None:
        arrivals = Arrivals(at_once=1)
        with anyio.move_on_after(BRING_UP / 2):
            await create(arrivals, node, "left")
        with anyio.fail_after(5):
            await create(arrivals, node, "left")
            await create(arrivals, node, "other")

    anyio.run(main)
    assert node.started == ["left", "left", "other"]


@pytest.mark.parametrize("at_once", [1, 3])
def test_never_more_bring_ups_at_once_than_the_line_allows(at_once: int) -> None:
    node = Node()

    async def main() -> None:
        arrivals = Arrivals(at_once=at_once)
        async with anyio.create_task_group() as tasks:
            for i in range(8):
                tasks.start_soon(create, arrivals, node, f"image-{i}")

    anyio.run(main)
    assert node.most == at_once
    assert len(node.present) == 8


def test_a_bring_up_that_waits_on_the_store_leaves_its_place_after_the_patience() -> None:
    """A store that does not answer holds one bring-up (until its own timeout), not the
    line: the next image is brought up once the patience has passed."""
    node = Node()
    stuck = anyio.Event()

    async def hung() -> None:
        node.started.append("hung")
        await stuck.wait()
        node.present.add("hung")

    async def main() -> None:
        arrivals = Arrivals(at_once=1, patience=BRING_UP)
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(arrivals.bring, "hung", lambda: node.on_node("hung"), hung)
            await anyio.sleep(0)
            with anyio.fail_after(5):
                await create(arrivals, node, "next")
            assert not node.on_node("hung")
            stuck.set()

    anyio.run(main)
    assert node.started == ["hung", "next"]
    assert node.on_node("hung")
