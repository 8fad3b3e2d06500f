"""A fleet on this machine behind `lazyfs gateway` (issue 25): four real agents, each in
its own network namespace with its own address, run dir and node cache, over HTTPS; one
SeaweedFS behind a 1 Gbit/s + 4 ms link; the gateway on the host (testbed/fleet.py).

A burst through the gateway keeps each image's sandboxes on few nodes, and a node lost
mid-way fails only the calls about its own sandboxes, fast and by name, while creates go
on elsewhere; when it is back, the gateway places on it again.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest

from lazyfs.client import AgentError
from testbed.agent_images import TASK_FILE
from testbed.fleet import fleet
from testbed.gateway import running_gateway

IMAGES = 6
PER_IMAGE = 4


def test_a_fleet_behind_the_gateway(tmp_path: Path) -> None:
    with fleet(tmp_path, nodes=4, store="s3", start=False) as f:
        expected = f.convert_agent_images(IMAGES)
        f.start()
        nodes = [n.url.removeprefix("https://") for n in f.nodes]
        with running_gateway(
            tmp_path / "gw.sock", [n.url for n in f.nodes], f.root / "token", f.ca
        ) as gw:
            gw.start()
            gw.wait_healthy(4)
            c = gw.client(timeout=60)

            # A burst of every image's sandboxes at once: all right, each image on few nodes.
            placed: dict[str, set[str]] = defaultdict(set)
            boxes: list = []
            failures: list[str] = []
            lock = threading.Lock()

            def one(image: str) -> None:
                try:
                    sb = c.create(image)
                    out = sb.exec(["cat", TASK_FILE]).stdout.decode()
                    assert out.strip() == expected[image].strip(), out
                    with lock:
                        placed[image].add(sb.id.partition("@")[2])
                        boxes.append(sb)
                except (AgentError, AssertionError) as exc:
                    with lock:
                        failures.append(f"{image}: {exc}")

            threads = [
                threading.Thread(target=one, args=(image,))
                for _ in range(PER_IMAGE)
                for image in sorted(expected)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert failures == []
            assert len(boxes) == IMAGES * PER_IMAGE
            pairs = sum(len(on) for on in placed.values())
            # Random placement would start each image on ~2.7 of 4 nodes (16 pairs).
            assert pairs <= IMAGES * 2, dict(placed)

            # A node lost: its sandboxes' calls fail fast, naming it; creates go on.
            victim = boxes[0]
            lost = victim.id.partition("@")[2]
            f.nodes[nodes.index(lost)].kill9()
            t0 = time.monotonic()
            with pytest.raises(AgentError) as down:
                victim.exec(["true"])
            assert time.monotonic() - t0 < 10
            assert down.value.status == 503 and lost in str(down.value)
            health = gw.wait_healthy(3)
            assert [n["name"] for n in health["nodes"] if not n["healthy"]] == [lost]
            for image in sorted(expected):
                again = c.create(image)
                assert again.id.partition("@")[2] != lost
                assert (
                    again.exec(["cat", TASK_FILE]).stdout.decode().strip()
                    == expected[image].strip()
                )
                again.delete()

            # Back: healthy again and placed on; its sandboxes' trees died with its data
            # daemon, so they are gone (410), not half-working.
            f.nodes[nodes.index(lost)].start()
            gw.wait_healthy(4)
            with pytest.raises(AgentError) as gone:
                victim.exec(["true"])
            assert gone.value.status == 410
            for box in c.list():
                c.request("DELETE", f"/sandboxes/{box['id']}")
            gw.stop()
    assert f.scrubbed == {} and f.leftovers() == {}
