"""The gateway's placement, pool spread and ids as plain functions (no servers): what
lazyfs/gateway/placement.py and pools.py promise."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from lazyfs.gateway.fleet import Node
from lazyfs.gateway.ids import UnknownGatewayId, gateway_id, split_id
from lazyfs.gateway.placement import Choice, NodeView, choose, rendezvous
from lazyfs.gateway.pools import merged_pools, spread
from lazyfs.gateway.upstream import NodeHttp

NODES = [f"10.0.0.{i}:7070" for i in range(1, 9)]


def views(**changes: dict) -> list[NodeView]:
    return [NodeView(name, load=0, capacity=100, **changes.get(name, {})) for name in NODES]


def test_rendezvous_is_stable_and_moves_only_what_a_lost_node_had() -> None:
    keys = [f"image-{i}" for i in range(2000)]
    before = {k: rendezvous(k, NODES)[0] for k in keys}
    assert before == {k: rendezvous(k, list(reversed(NODES)))[0] for k in keys}
    gone = NODES[3]
    after = {k: rendezvous(k, [n for n in NODES if n != gone])[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == gone for k in moved)
    assert all(after[k] == rendezvous(k, NODES)[1] for k in moved)  # to their 2nd choice
    spread_out = Counter(before.values())
    assert len(spread_out) == len(NODES) and max(spread_out.values()) < 2000 / 8 * 1.3


def test_cache_placement_order() -> None:
    key = "tasks/42"
    order = rendezvous(key, NODES)
    vs = views(
        **{
            order[5]: {"ready": 1},
            order[6]: {"ready": 3},
            order[4]: {"cached": True},
            order[3]: {"mounted": True},
            order[7]: {"cached": True, "generic_ready": 2},
        }
    )
    picked = choose(key, vs)
    assert [c.node for c in picked] == [
        order[6],  # most ready of the image's pool
        order[5],
        order[7],  # warm, with a generic sandbox ready
        order[3],  # mounted
        order[4],  # cached
        order[0],  # then the image's rendezvous order
        order[1],
        order[2],
    ]
    assert [c.reason for c in picked] == ["pool", "pool", "warm", "warm", "warm"] + ["hash"] * 3
    assert sorted(c.node for c in picked) == sorted(NODES)


def test_the_load_bound_skips_a_loaded_node_and_keeps_it_last() -> None:
    key = "tasks/7"
    first = rendezvous(key, NODES)[0]
    vs = [
        NodeView(n, load=10 if n == first else 1, capacity=100, mounted=n == first) for n in NODES
    ]
    # mean with the new one: (10 + 7 + 1) / 8 = 2.25; the bound ceil(1.25 x 2.25) = 3
    picked = choose(key, vs)
    assert picked[0].node != first and picked[0].reason == "hash"
    assert picked[-1].node == first and picked[-1].reason == "overflow"
    full = [NodeView(n, load=5, capacity=5) for n in NODES]  # every node at capacity
    assert {c.reason for c in choose(key, full)} == {"overflow"}
    floored = [
        NodeView(n, 10 if n == first else 1, 100, floor=12, mounted=n == first) for n in NODES
    ]
    assert choose(key, floored)[0] == Choice(first, "warm")  # under its floor: taken
    assert {c.reason for c in choose(key, full)} == {"overflow"}


def test_a_warm_node_may_go_further_over_the_mean() -> None:
    key = "tasks/9"
    first = rendezvous(key, NODES)[0]
    # mean with the new one: (4 + 7 x 2 + 1) / 8 = 2.375: bound 3, warm bound 4
    loads = {n: 4 if n == first else 2 for n in NODES}
    warm = [NodeView(n, loads[n], 100, mounted=n == first) for n in NODES]
    assert choose(key, warm)[0].node != first  # 5 > 4: skipped even warm
    loads[first] = 3
    warm = [NodeView(n, loads[n], 100, mounted=n == first) for n in NODES]
    # mean (3 + 14 + 1) / 8 = 2.25: bound 3 (4 > 3: a cold node would be skipped),
    # warm bound 4 (4 <= 4: taken)
    assert choose(key, warm)[0] == Choice(first, "warm")
    assert choose(key, [NodeView(n, loads[n], 100) for n in NODES])[0].node != first


def test_many_images_spread_within_the_bound() -> None:
    loads = dict.fromkeys(NODES, 0)
    for i in range(4000):
        vs = [NodeView(n, load=loads[n], capacity=10_000) for n in NODES]
        loads[choose(f"image-{i % 500}", vs)[0].node] += 1
    assert max(loads.values()) <= -(-1.25 * 4000 // 8)


def test_random_placement_tries_every_node_once() -> None:
    picked = choose("x", views(), "random", rng=random.Random(1))
    assert sorted(c.node for c in picked) == sorted(NODES)
    assert {c.reason for c in picked} == {"random"}
    with pytest.raises(ValueError):
        choose("x", views(), "nearest")


def test_spread() -> None:
    order = ["a", "b", "c"]
    assert spread(0, order) == {}
    assert spread(3, order, per_node=4) == {"a": 3}
    assert spread(5, order, per_node=4) == {"a": 3, "b": 2}
    assert spread(9, order, per_node=2) == {"a": 3, "b": 3, "c": 3}  # more than fits: even
    assert spread(2, [], per_node=1) == {}


def test_ids() -> None:
    assert gateway_id("lazyfs-abc", "10.0.0.1:7070") == "lazyfs-abc@10.0.0.1:7070"
    assert split_id("lazyfs-abc@10.0.0.1:7070") == ("lazyfs-abc", "10.0.0.1:7070")
    assert split_id("lazyfs-abc@[fd00::1]:7070") == ("lazyfs-abc", "[fd00::1]:7070")
    for bad in ("lazyfs-abc", "@node:1", "lazyfs-abc@", "a/b@n:1"):
        with pytest.raises(UnknownGatewayId):
            split_id(bad)


def test_merged_pools() -> None:
    fleet_a = {"size": 3, "at": 1.0, "image": "py"}
    fleet_b = {"size": 4, "at": 2.0, "image": "py"}
    pool = {"image": "py", "image_id": "i1", "generic": False, "failures": 0}
    merged = merged_pools(
        {
            "n1": [{**pool, "target": 2, "ready": 1, "creating": 1, "fleet": fleet_a}],
            "n2": [{**pool, "target": 2, "ready": 2, "creating": 0, "fleet": fleet_b}],
        }
    )
    assert len(merged) == 1
    (one,) = merged
    assert (one["target"], one["ready"], one["creating"]) == (4, 3, 1)
    assert one["fleet"] == fleet_b
    assert one["nodes"] == {"n1": {"target": 2, "ready": 1}, "n2": {"target": 2, "ready": 2}}


def test_a_nodes_load_counts_creates_until_they_are_answered_and_reported() -> None:
    """A create waits in a busy agent's queue before its report's `creating` counts it
    (seconds, in a burst): a report meanwhile must not make the node look idle."""
    node = Node("n:1", "http://n:1", NodeHttp("http://n:1", None, True))
    node.report = {"claimed": 3, "creating": 0}
    for _ in range(5):
        node.placed_here("img")
    assert node.view("img", None).load == 8
    node.report = {"claimed": 3, "creating": 1}  # a report: the agent has begun one
    node.made = 0
    assert node.view("img", None).load == 8  # the other four still count
    node.create_ended("img", made=True)
    assert node.view("img", None).mounted  # warm: a create of it was sent here
    node.create_ended("img", made=False)
    assert node.view("img", None).load == 3 + 1 + 3  # claimed, made since, in flight
    node.report, node.made = {"claimed": 4, "creating": 0}, 0  # the next report has it
    assert node.view("img", None).load == 4 + 3
