"""What a gateway needs of this node to place sandboxes (`GET /placement`, issue 25).

A gateway polls every node about once a second, so the answer is small and cheap: no
store or runtime work, only the agent's books and one listing of the node cache's
manifests directory. Per image: the names it was asked by here, whether its tree is
mounted, its pool's ready sandboxes and target, and the sandboxes of it the node holds.
Only the images the node uses now (a tree held, a pool, sandboxes) or was asked for in
the last NAMES_FOR seconds are listed: the agent keeps every name it ever looked up
(a store outage is answered from them), and listing them all made the report grow with
every image the node ever ran, 1.3 MB with 5,000 of them, which every gateway parsed
every second from every node. A gateway remembers the names it learned.
`cached`: the images whose manifest is in the node cache (their chunks may be too): a
node where an image ran before starts it again with fewer store reads. An image on
layer trees (docs/FORMATS.md) counts as mounted, or cached, when all its trees are.

The shape is documented in docs/api.md ("Placement") and read by lazyfs/gateway/.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from lazyfs.agent.boxes import BoxState

if TYPE_CHECKING:
    from lazyfs.agent.images import ImageInfo
    from lazyfs.agent.node import Agent

IDLE = frozenset({BoxState.READY, BoxState.WARMUP})  # not handed out: no load of a claim
NAMES_FOR = 600.0  # seconds a name looked up here is still listed (see the top)


def placement_report(agent: Agent) -> dict:
    images: dict[str, dict] = {}

    def entry(image_id: str) -> dict:
        return images.setdefault(
            image_id, {"names": [], "mounted": False, "ready": 0, "pool": 0, "sandboxes": 0}
        )

    held = agent.trees.paths()
    layered = [info for info in agent.images.infos() if info.layers]
    layer_trees = {t for info in layered for t in info.layers}
    for image_id in held:
        if image_id not in layer_trees:  # an image's merged tree
            entry(image_id)["mounted"] = True
    for info in layered:  # an image on layer trees: mounted when all of them are
        if all(t in held for t in info.layers):
            entry(info.image_id)["mounted"] = True
    generic_ready = 0
    for pool in agent.pools.values():
        if not pool.image.image_id:
            generic_ready = len(pool.ready)
        elif pool.target or pool.ready:
            found = entry(pool.image.image_id)
            found["ready"], found["pool"] = len(pool.ready), pool.target
            if pool.fleet is not None:
                found["fleet"] = pool.fleet
            if pool.warmup:
                found["warmup"] = pool.warmup
    claimed = 0
    for box in agent.boxes.values():
        if box.state not in IDLE:
            claimed += 1
            if box.record.image_id:
                entry(box.record.image_id)["sandboxes"] += 1
    now = time.monotonic()
    for name, (when, image_id) in agent.images.known().items():
        if image_id in images or now - when < NAMES_FOR:  # in use, or lately
            entry(image_id)["names"].append(name)
    return {
        "sandboxes": len(agent.boxes),
        "claimed": claimed,
        "creating": agent.creating,
        "max_sandboxes": agent.config.max_sandboxes,
        "cpus": os.cpu_count() or 1,
        "generic_ready": generic_ready,
        "images": images,
        "cached": _cached_images(agent, layered),
    }


def _cached_images(agent: Agent, layered: list[ImageInfo]) -> list[str]:
    """Image ids whose manifest the node cache holds (CACHE/manifests/<id>.db), and
    those of the images on layer trees looked up here whose trees' manifests it holds
    (their own manifest is never fetched: the ref says what they need)."""
    try:
        with os.scandir(agent.config.cache_dir / "manifests") as found:
            ids = {e.name[:-3] for e in found if e.name.endswith(".db") and len(e.name) == 67}
    except FileNotFoundError:
        ids = set()
    ids.update(info.image_id for info in layered if all(t in ids for t in info.layers))
    return sorted(ids)
