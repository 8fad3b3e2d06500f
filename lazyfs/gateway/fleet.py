"""The fleet's nodes: who they are, whether they answer, and what they last reported.

Membership comes from what the cluster already has: a static list (`--node URL`) and/or
a DNS name that resolves to every agent (`--nodes-dns HOST:PORT`, e.g. a Kubernetes
headless Service in front of the agent DaemonSet), resolved again every DNS_EVERY polls
(10 s by default). A node that DNS stops naming leaves the fleet (its sandboxes' calls answer 503
naming it); a static one stays.

Each node is polled every `poll` seconds for its placement report (the agent's GET
/placement, lazyfs/agent/report.py). One that refuses connections or breaks off is
unhealthy at once, one whose report does not come within POLL_TIMEOUT SLOW_POLLS times
in a row too: it leaves placement until it answers again, while calls to its sandboxes
are still tried (each with its own timeout).

Each node has one NodeHttp (upstream.py): its keep-alive connections carry every call to it.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import anyio

from chunker.errors import BadInputError
from lazyfs.gateway.placement import FLOOR_PER_CPU, NodeView
from lazyfs.gateway.upstream import BrokeOff, NodeHttp, Unreached

log = logging.getLogger("lazyfs.gateway")
POLL = 1.0  # seconds between two polls of a node's report
POLL_TIMEOUT = 2.0  # seconds a report may take before the node counts as not answering
# Reports in a row that time out before a node that still takes connections leaves
# placement: in a burst an agent's event loop answers seconds late (its requests wait
# before its app sees them: docs/design-changes.md, session 19), and one late report
# took busy, healthy nodes out until none was left ("no node of the fleet answers").
# A node that refuses connections, or breaks off a call, leaves at once.
SLOW_POLLS = 3
DNS_EVERY = 10  # polls between two resolutions of --nodes-dns
MAX_NAMES = 100_000  # image names remembered (name -> id) before the table starts over
PLACED_WARM = 10.0  # seconds an image sent to a node counts as warm there without a report


@dataclass
class FleetConfig:
    urls: list[str] = field(default_factory=list)  # --node
    dns: str | None = None  # --nodes-dns HOST:PORT
    dns_scheme: str = "https"  # for the nodes DNS names
    token: str | None = None  # the agents' bearer token
    verify: ssl.SSLContext | bool = True  # how their certificates are checked
    poll: float = POLL


@dataclass
class Node:
    name: str  # HOST:PORT, as sandbox ids name it
    url: str
    http: NodeHttp
    static: bool = True
    report: dict | None = None
    cached: frozenset[str] = frozenset()  # its report's `cached` image ids
    healthy: bool = False
    slow_polls: int = 0  # reports in a row that did not come within POLL_TIMEOUT
    error: str = "not polled yet"
    last_ok: float | None = None  # time.monotonic() of its last report
    # Its load between reports, as this gateway knows it: the creates it sent here that
    # are not answered yet (a burst's wait in the agent's queue before its report's
    # "creating" counts them: seconds), and the sandboxes they made since the report.
    inflight: int = 0
    made: int = 0
    # Image (as creates name it) -> when this gateway last sent a create of it here: warm
    # there before any report can say so (a burst's creates all come within one poll).
    placed: dict[str, float] = field(default_factory=dict)

    def view(self, image: str, image_id: str | None) -> NodeView:
        """What placement needs of this node for one image (a healthy node's): `image`
        as the create names it, its id if known."""
        report = self.report or {}
        # max(): the report's creating counts this gateway's creates the agent has begun
        # (and other replicas'); inflight those it has not seen yet too.
        creating = max(report.get("creating", 0), self.inflight)
        load = report.get("claimed", 0) + self.made + creating
        found = (report.get("images") or {}).get(image_id or "", {})
        return NodeView(
            name=self.name,
            load=load,
            capacity=report.get("max_sandboxes", 1),
            floor=FLOOR_PER_CPU * report.get("cpus", 1),
            ready=found.get("ready", 0),
            mounted=bool(found.get("mounted")) or self._placed_recently(image),
            cached=image_id is not None and image_id in self.cached,
            generic_ready=report.get("generic_ready", 0),
        )

    def placed_here(self, image: str) -> None:
        """A create of `image` is sent here (in the load until it is answered, and warm
        for PLACED_WARM seconds)."""
        self.inflight += 1
        now = time.monotonic()
        self.placed[image] = now
        if len(self.placed) > MAX_NAMES:
            self.placed = {k: t for k, t in self.placed.items() if now - t < PLACED_WARM}

    def create_ended(self, image: str, made: bool) -> None:
        """The create placed_here() counted was answered (or given up): a sandbox made
        here counts in the load until the next report; one not made leaves no warmth."""
        self.inflight -= 1
        if made:
            self.made += 1
        else:
            self.placed.pop(image, None)

    def _placed_recently(self, image: str) -> bool:
        when = self.placed.get(image)
        return when is not None and time.monotonic() - when < PLACED_WARM

    def status(self) -> dict:
        """The node in the gateway's /health."""
        report = self.report or {}
        return {
            "name": self.name,
            "url": self.url,
            "healthy": self.healthy,
            "error": None if self.healthy else self.error,
            "seconds_since_report": None
            if self.last_ok is None
            else round(time.monotonic() - self.last_ok, 3),
            "sandboxes": report.get("sandboxes"),
            "claimed": report.get("claimed"),
            "max_sandboxes": report.get("max_sandboxes"),
        }


def node_name(url: str) -> str:
    """HOST:PORT of a node's URL (the port its scheme implies if it gives none)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadInputError(f"--node {url!r} is not an http:// or https:// URL")
    if parts.path not in ("", "/") or parts.query or parts.username:
        raise BadInputError(f"--node {url!r}: give only scheme://HOST:PORT")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{host}:{port}"


class Fleet:
    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        self.nodes: dict[str, Node] = {}
        self._names: dict[str, str] = {}  # image name -> id, from reports and creates
        for url in config.urls:
            self._add(node_name(url), url.rstrip("/"), static=True)

    def _add(self, name: str, url: str, static: bool) -> Node:
        http = NodeHttp(url, self.config.token, self.config.verify)
        node = self.nodes[name] = Node(name, url, http, static)
        return node

    # ------------------------------------------------------------------ asking

    def get(self, name: str) -> Node | None:
        return self.nodes.get(name)

    def healthy(self) -> list[Node]:
        return [node for node in self.nodes.values() if node.healthy]

    def image_id(self, name: str) -> str | None:
        """The image id a create's `image` names, if any node's report or an earlier
        create told (ids themselves are their own key)."""
        return self._names.get(name)

    def learn(self, name: str, image_id: str) -> None:
        if len(self._names) >= MAX_NAMES:
            self._names.clear()
        self._names[name] = image_id

    # ------------------------------------------------------------------ keeping up

    async def run(self, after_poll: Callable[[], Awaitable[None]] | None = None) -> None:
        """Resolve and poll for as long as the gateway runs (the first round is done by
        start() before the gateway answers); `after_poll` runs after each round."""
        polls = 0
        while True:
            await anyio.sleep(self.config.poll)
            polls += 1
            if self.config.dns and polls % DNS_EVERY == 0:
                await self.resolve()
            await self.poll_all()
            if after_poll is not None:
                await after_poll()

    async def start(self) -> None:
        if self.config.dns:
            await self.resolve()
        await self.poll_all()

    async def resolve(self) -> None:
        """The nodes --nodes-dns names now: new ones join, gone ones leave."""
        assert self.config.dns is not None
        host, _, port = self.config.dns.rpartition(":")
        try:
            found = await anyio.getaddrinfo(host.strip("[]"), int(port), type=2)  # SOCK_STREAM
        except OSError as exc:
            log.warning("--nodes-dns %s: %s; keeping the nodes it named before", host, exc)
            return
        names = set()
        for _family, _type, _proto, _canon, address in found:
            ip = str(address[0])
            name = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
            names.add(name)
            if name not in self.nodes:
                log.info("node %s joins (DNS %s)", name, host)
                self._add(name, f"{self.config.dns_scheme}://{name}", static=False)
        for name, node in list(self.nodes.items()):
            if not node.static and name not in names:
                log.info("node %s leaves (DNS %s no longer names it)", name, host)
                del self.nodes[name]
                await node.http.close()

    async def poll_all(self) -> None:
        async with anyio.create_task_group() as tasks:
            for node in list(self.nodes.values()):
                tasks.start_soon(self._poll, node)
        for node in self.nodes.values():
            for image_id, image in ((node.report or {}).get("images") or {}).items():
                for name in image.get("names", ()):
                    self.learn(name, image_id)

    async def _poll(self, node: Node) -> None:
        try:
            with anyio.fail_after(POLL_TIMEOUT):
                answer = await node.http.call("GET", "/placement")  # fail_after times it
            if answer.status != 200:
                raise RuntimeError(f"GET /placement answered HTTP {answer.status}")
            report = answer.json()
        except (Unreached, BrokeOff, TimeoutError, RuntimeError, ValueError) as exc:
            why = str(exc) or type(exc).__name__
            if isinstance(exc, TimeoutError):
                node.slow_polls += 1
                if node.healthy and node.slow_polls < SLOW_POLLS:
                    log.info("node %s is slow to report (%d in a row)", node.name, node.slow_polls)
                    return  # busy, not gone: it stays in placement for now
                why = f"no report within {POLL_TIMEOUT:g} s, {node.slow_polls} times in a row"
            if node.healthy:
                log.warning("node %s stops answering: %s", node.name, why)
            node.healthy, node.error = False, why
            return
        node.slow_polls = 0
        if not node.healthy:
            log.info("node %s answers", node.name)
        node.report, node.healthy, node.error = report, True, ""
        node.cached = frozenset(report.get("cached") or ())
        node.last_ok, node.made = time.monotonic(), 0

    def mark_down(self, node: Node, why: str) -> None:
        """A call found the node not answering: out of placement until its next report."""
        if node.healthy:
            log.warning("node %s stops answering: %s", node.name, why)
        node.healthy, node.error = False, why

    async def close(self) -> None:
        for node in self.nodes.values():
            await node.http.close()
