"""Where a create goes: an ordered list of nodes to try, from the nodes' reports.

`cache` (the default), in this order:
1. nodes with a ready sandbox of the image's pool (most ready first);
2. nodes where the image is warm: its tree mounted, or its manifest (and so some of its
   chunks) in the node cache; those with a ready generic sandbox first;
3. the image's rendezvous order (highest random weight) over all nodes.
Tiers 2 and 3 skip a node whose load is above (1 + epsilon) times the mean: consistent
hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with
Bounded Loads", SODA 2018). That keeps an image's sandboxes on few nodes, so each image
is fetched by few nodes, without overloading any. The nodes skipped come last, so a
create still finds a place while any node has room; a 429 moves it to the next one.

Where the image is warm (tier 2), a node may go to (1 + 2 epsilon) times the mean: a
sandbox there costs no store reads, one placed elsewhere a cold start of the image on
that node. Measured with bench/fleet.py (4 nodes, 200 sandboxes of 50 images at once),
one bound for all tiers split 16 of the 50 images over two nodes, each a second cold
start, and fetched 0.53-0.54x random placement's bytes.

A node below its floor (FLOOR_PER_CPU sandboxes per CPU) is never skipped: at the start
of a burst the mean is near 0, and the bound alone would scatter an image's first
sandboxes over as many nodes, each fetching the image (bench/fleet_model.py's
simulation: 15,033 cold starts for 10^4 images that way, against ~12,600).

`random`: every node in a random order (the baseline, for side-by-side runs).

Load is a node's claimed sandboxes plus those being made, plus what this gateway sent it
since its last report (so that a burst between two polls does not all land on one node).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass

POLICIES = ("cache", "random")
EPSILON = 0.25  # the load bound's slack: no node above 1.25x the mean in tiers 2 and 3
FLOOR_PER_CPU = 2  # sandboxes per CPU a node takes whatever the mean (see the top)


@dataclass(frozen=True)
class NodeView:
    """What placement needs of one healthy node, for one image."""

    name: str
    load: int  # claimed, made since its report, creating (fleet.Node.view)
    capacity: int  # its --max-sandboxes
    floor: int = 0  # load it takes whatever the mean (FLOOR_PER_CPU x its CPUs)
    ready: int = 0  # ready sandboxes of the image's pool
    mounted: bool = False  # the image's tree is mounted there
    cached: bool = False  # the image's manifest is in its node cache
    generic_ready: int = 0  # ready generic sandboxes (any image)


@dataclass(frozen=True)
class Choice:
    node: str
    reason: str  # "pool", "warm", "hash", "overflow" or "random"


def weight(key: str, node: str) -> int:
    """The node's rendezvous weight for key (64 bits of BLAKE2b: stable across replicas,
    processes and Python versions, unlike hash())."""
    digest = hashlib.blake2b(f"{key}\0{node}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous(key: str, nodes: Iterable[str]) -> list[str]:
    """The nodes in key's rendezvous order: the same on every replica for the same nodes,
    and a node that comes or goes moves only the keys it ranks first."""
    return sorted(nodes, key=lambda node: weight(key, node), reverse=True)


def choose(
    key: str,
    views: list[NodeView],
    policy: str = "cache",
    epsilon: float = EPSILON,
    rng: random.Random | None = None,
) -> list[Choice]:
    """Every node once, in the order to try them for a create of the image `key` (its
    id where known, else its name)."""
    if policy == "random":
        order = list(views)
        (rng or random).shuffle(order)
        return [Choice(v.name, "random") for v in order]
    if policy != "cache":
        raise ValueError(f"unknown placement {policy!r}")
    by_name = {v.name: v for v in views}
    order = [by_name[name] for name in rendezvous(key, by_name)]
    # The paper's capacity: ceil((1 + epsilon) * m / n) for m sandboxes, the new one too.
    mean = (sum(v.load for v in views) + 1) / max(1, len(views))
    bound, warm_bound = math.ceil((1 + epsilon) * mean), math.ceil((1 + 2 * epsilon) * mean)

    def fits(v: NodeView, limit: int) -> bool:
        return v.load + 1 <= max(limit, v.floor) and v.load < v.capacity

    picked: list[Choice] = []
    seen: set[str] = set()

    def take(nodes: Iterable[NodeView], reason: str) -> None:
        for v in nodes:
            if v.name not in seen:
                seen.add(v.name)
                picked.append(Choice(v.name, reason))

    take(sorted((v for v in order if v.ready > 0), key=lambda v: -v.ready), "pool")
    warm = [v for v in order if (v.mounted or v.cached) and fits(v, warm_bound)]
    take((v for v in warm if v.generic_ready > 0), "warm")
    take((v for v in warm if v.mounted), "warm")
    take(warm, "warm")
    take((v for v in order if fits(v, bound)), "hash")
    take(order, "overflow")
    return picked
