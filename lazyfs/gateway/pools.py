"""Pools across the fleet: `PUT /pools/IMAGE {"size": N}` at the gateway spreads N over
the image's first nodes in rendezvous order, at most `per_node` each, and keeps it spread
as nodes come and go.

The gateway keeps no state: each node's share is set with the whole-fleet target beside
it (`fleet`: {"size", "at", "image"}, kept by the agent in its pool and shown in its
placement report). After every poll, `reconcile` takes the newest fleet target of each
image from the reports and sets every healthy node's share again where it differs. The
spread is a function of the target and the healthy nodes, so every replica computes the
same one; a node that stops answering has its share moved to the next node in the
image's order, and gets it back when it answers again.
"""

from __future__ import annotations

import json
import logging
import math
import time
from typing import Any

import anyio

from lazyfs.gateway.fleet import Fleet, Node
from lazyfs.gateway.placement import rendezvous
from lazyfs.gateway.upstream import Answer, BrokeOff, Unreached

log = logging.getLogger("lazyfs.gateway")
PER_NODE = 4  # a pool's share on one node, at most, while the fleet has nodes to spare
PUT_TIMEOUT = 30.0  # seconds a node may take to set a pool (a first lookup of the image)


def spread(size: int, order: list[str], per_node: int = PER_NODE) -> dict[str, int]:
    """Node -> share of `size`: over the first ceil(size / per_node) nodes of `order`
    (all of them, if that is more than there are), as evenly as whole numbers go."""
    if size <= 0 or not order:
        return {}
    used = min(len(order), max(1, math.ceil(size / per_node)))
    base, extra = divmod(size, used)
    return {name: base + (1 if i < extra else 0) for i, name in enumerate(order[:used])}


def merged_pools(answers: dict[str, list[dict]]) -> list[dict]:
    """The pools of every node (node name -> its GET /pools list) as one list: per image
    the sums of target, ready, creating and failures, and each node's part."""
    merged: dict[str, dict[str, Any]] = {}
    for name, pools in answers.items():
        for pool in pools:
            key = pool.get("image_id") or "generic"
            into = merged.setdefault(
                key,
                {
                    **pool,
                    "target": 0,
                    "ready": 0,
                    "creating": 0,
                    "failures": 0,
                    "nodes": {},
                },
            )
            for count in ("target", "ready", "creating", "failures"):
                into[count] += pool.get(count) or 0
            into["last_error"] = into.get("last_error") or pool.get("last_error")
            fleet = pool.get("fleet")
            if fleet and (not into.get("fleet") or fleet["at"] > into["fleet"]["at"]):
                into["fleet"] = fleet
            into["nodes"][name] = {"target": pool.get("target"), "ready": pool.get("ready")}
    return list(merged.values())


class FleetPools:
    def __init__(self, fleet: Fleet, per_node: int = PER_NODE) -> None:
        self.fleet = fleet
        self.per_node = per_node

    async def set(self, image: str, size: int, warmup: list[str] | None) -> dict[str, Answer]:
        """Spread a new fleet-wide target for `image` (a name, as creates give it): each
        node's answer to its PUT, by node name. Nodes that held a share and get none now
        are set to 0."""
        target = {"size": size, "at": time.time(), "image": image}
        healthy = self.fleet.healthy()
        shares = spread(size, rendezvous(image, [n.name for n in healthy]), self.per_node)
        image_id = self.fleet.image_id(image)
        puts: dict[str, int] = {}
        for node in healthy:
            share = shares.get(node.name, 0)
            if share or _pool_target(node, image_id):
                puts[node.name] = share
        if not puts and healthy:  # a size of 0 for a pool nobody has: the first node says
            puts[rendezvous(image, [n.name for n in healthy])[0]] = 0
        answers: dict[str, Answer] = {}

        async def put(node: Node, share: int) -> None:
            answers[node.name] = await self._put(node, image, share, warmup, target)

        async with anyio.create_task_group() as tasks:
            for name, share in puts.items():
                tasks.start_soon(put, self.fleet.nodes[name], share)
        return answers

    async def reconcile(self) -> None:
        """Set each healthy node's share of each image's newest fleet target, where its
        report shows another (after every poll; see the top)."""
        healthy = self.fleet.healthy()
        newest: dict[str, tuple[dict, list[str] | None]] = {}
        for node in healthy:
            for image_id, image in ((node.report or {}).get("images") or {}).items():
                target = image.get("fleet")
                if target and (image_id not in newest or target["at"] > newest[image_id][0]["at"]):
                    newest[image_id] = (target, image.get("warmup"))
        if not newest:
            return
        names = [n.name for n in healthy]
        async with anyio.create_task_group() as tasks:
            for image_id, (target, warmup) in newest.items():
                shares = spread(target["size"], rendezvous(target["image"], names), self.per_node)
                for node in healthy:
                    image = ((node.report or {}).get("images") or {}).get(image_id, {})
                    share, have = shares.get(node.name, 0), image.get("pool", 0)
                    stale = (image.get("fleet") or {}).get("at") != target["at"]
                    if share != have or (stale and (share or have)):
                        tasks.start_soon(self._reset, node, share, warmup, target)

    async def _reset(self, node: Node, share: int, warmup: list[str] | None, target: dict) -> None:
        # By the name the target was set for, as creates use it: the node's pool view
        # then names the image as the fleet's user does (GET /pools).
        answer = await self._put(node, target["image"], share, warmup, target)
        if answer.status != 200:
            log.warning(
                "node %s: setting pool %s to %d failed: HTTP %d %s",
                node.name,
                target["image"],
                share,
                answer.status,
                answer.body[:200],
            )

    async def _put(
        self, node: Node, image: str, share: int, warmup: list[str] | None, target: dict
    ) -> Answer:
        body: dict[str, Any] = {"size": share, "fleet": target}
        if warmup is not None:
            body["warmup"] = warmup
        try:
            return await node.http.call(
                "PUT",
                f"/pools/{image}",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
                timeout=PUT_TIMEOUT,
            )
        except (Unreached, BrokeOff) as exc:
            if isinstance(exc, Unreached):
                self.fleet.mark_down(node, str(exc))
            message = f"node {node.name} did not answer: {exc}"
            error = {"error": "node_unavailable", "message": message}
            return Answer(503, "application/json", json.dumps(error).encode())


def _pool_target(node: Node, image_id: str | None) -> int:
    if image_id is None:
        return 0
    return (((node.report or {}).get("images") or {}).get(image_id) or {}).get("pool", 0)
