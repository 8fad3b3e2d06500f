"""A fleet of real node agents on this machine, for the gateway's tests and benchmarks.

    with fleet(tmp_path, nodes=4, store="s3", rate="1gbit", delay_ms=4.0) as f:
        with f.client(0) as c, c.create("agent-00") as sb: ...
        f.nodes[1].kill9(); f.nodes[1].start()
    assert f.scrubbed == {} and f.leftovers() == {}

Each node is a real `lazyfs serve` (testbed/agent.py's AgentProcess) with its own run dir,
node cache, sandbox dir and cgroup parent, in a network namespace of its own, serving
HTTPS with a bearer token on its own address (an agent refuses plain HTTP off loopback)
and its unix socket for direct checks. The layout, in a free 10.78.N.0/24:

    host: bridge lzf<tag>b at .1 (a gateway on the host reaches every agent through it)
      +-- veth -- netns lazyfs-fleet-<tag>-n<i>: agent i at .11+i, port 7070
      +-- veth, tbf `rate` both ways -- netns lazyfs-fleet-<tag>-s3 at .2:
            delay line on :9000 -> weed mini's S3 port (testbed/seaweed.py)

Agents run under `nsenter --net` (not `ip netns exec`, which would also give them a
private mount namespace and a /sys without cgroups), so their mounts are the host's and
the checks here see them.

The store's link. All agents (and the host) share one veth to the store, shaped by tbf to
`rate` on both ends: its bandwidth is the store's aggregate. `delay_ms` is what the
round trip of a request and its answer gains: the delay line holds each direction's
bytes delay_ms / 2 (so "1 Gbit/s with 4 ms added", as issue 25 and the benchmarks in
bench/ say it, is rate="1gbit", delay_ms=4.0). The delay line ends TCP: a connection's
handshake is not delayed, and the bandwidth stays the link's (measure_link() says what
it is). Measured here (measure_link(), 4 nodes, rate="1gbit", delay_ms=4): a TCP
connect over the link 0.03-0.14 ms; a small S3 request 0.2-0.45 ms straight to weed,
4.7-5.6 ms through the delay line (the relay itself costs ~0.4 ms at delay_ms=0, and
asyncio's epoll timeouts round each direction's wait up by up to 1 ms); one 64-256 MB
GET 840-950 Mbit/s through the delay line, 900-930 Mbit/s straight (tbf's 1 Gbit/s less
TCP/IP's headers). store="file" puts a file:// store on local disk instead (quicker
tests; no link, no delay).

Clean-up is always done, in order: agents SIGTERMed (they delete their sandboxes; a
node whose agent was killed is started once more to adopt and then delete its own),
whatever a node still left is scrubbed by pid, mount point and path and recorded in
`scrubbed`, then the store, the delay line and the network. `leftovers()` says what is
still there (empty after the exit, unless the clean-up itself failed).
"""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import itertools
import os
import secrets
import signal
import socket
import statistics
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config

from lazyfs.client import AgentError, Client
from testbed.agent import AgentProcess, agent_node
from testbed.agent_images import TASK_FILE, ensure_agent_images
from testbed.certs import Certs, make_certs
from testbed.images import default_cache
from testbed.mounted_trees import clean_run_dir, supervisors, workers
from testbed.mounts import mounts_below
from testbed.netns import (
    add_bridge,
    delay_proxy,
    free_subnet,
    ip,
    link_exists,
    netns_exists,
    nsenter_argv,
    remove_link,
    tbf,
    veth_into,
)
from testbed.node import LAZYFS, Node
from testbed.nodecheck import cgroup_parents, processes_mentioning
from testbed.processes import pid_alive, wait_until
from testbed.seaweed import Seaweed

__all__ = ["TASK_FILE", "Fleet", "FleetNode", "LinkFigures", "fleet"]

AGENT_PORT = 7070
PROXY_PORT = 9000  # the delay line's port in the store's namespace: the S3 endpoint
SUBNET = "10.78"
MAX_NODES = 244  # node i is at 10.78.N.(11 + i)
STOP_TIMEOUT = 30.0  # seconds an agent has to delete its sandboxes on SIGTERM
CLEAN_TIMEOUT = 20.0  # seconds a stopped node has to be clean (its data daemon's idle exit)
CONVERT_TIMEOUT = 600.0

_fleets = itertools.count()  # two fleets of one process get different names


# ---------------------------------------------------------------------------------------
# The network


@dataclass(frozen=True)
class FleetNet:
    """A fleet's network: every name and address follows from tag, subnet and size."""

    tag: str
    subnet: int
    nodes: int
    with_store: bool

    def addr(self, host: int) -> str:
        return f"{SUBNET}.{self.subnet}.{host}"

    @property
    def bridge(self) -> str:
        return f"lzf{self.tag}b"

    @property
    def host_ip(self) -> str:
        return self.addr(1)

    @property
    def store_ns(self) -> str:
        return f"lazyfs-fleet-{self.tag}-s3"

    @property
    def store_ip(self) -> str:
        return self.addr(2)

    @property
    def store_devs(self) -> tuple[str, str]:
        return f"lzf{self.tag}sh", f"lzf{self.tag}sn"

    def node_ns(self, i: int) -> str:
        return f"lazyfs-fleet-{self.tag}-n{i}"

    def node_ip(self, i: int) -> str:
        return self.addr(11 + i)

    def node_devs(self, i: int) -> tuple[str, str]:
        return f"lzf{self.tag}n{i}h", f"lzf{self.tag}n{i}p"

    def namespaces(self) -> list[str]:
        store = [self.store_ns] if self.with_store else []
        return [*(self.node_ns(i) for i in range(self.nodes)), *store]

    def host_devs(self) -> list[str]:
        store = [self.store_devs[0]] if self.with_store else []
        return [*(self.node_devs(i)[0] for i in range(self.nodes)), *store, self.bridge]


@dataclass(frozen=True)
class StorePlace:
    """The store's namespace as testbed.netns.delay_proxy wants a place."""

    ns: str
    ns_ip: str

    def exec_argv(self, argv: list[str]) -> list[str]:
        return nsenter_argv(self.ns, argv)


def _attach(net: FleetNet, ns: str, devs: tuple[str, str], address: str) -> None:
    """A namespace with one veth into the fleet's bridge, at address."""
    ip("netns", "add", ns)
    veth_into(ns, devs[0], devs[1], f"{address}/24")
    ip("link", "set", devs[0], "master", net.bridge)
    ip("link", "set", devs[0], "up")


@contextlib.contextmanager
def fleet_network(nodes: int, with_store: bool, rate: str) -> Iterator[FleetNet]:
    """The bridge, a namespace per node and (with_store) the store's, its link shaped to
    `rate` both ways: the bridge port's egress carries requests to the store, the
    store's end carries its answers. Removed on exit, always."""
    tag = f"{os.getpid() % 100000}{next(_fleets)}"
    net = FleetNet(tag, free_subnet(SUBNET), nodes, with_store)
    try:
        add_bridge(net.bridge, f"{net.host_ip}/24")
        for i in range(nodes):
            _attach(net, net.node_ns(i), net.node_devs(i), net.node_ip(i))
        if with_store:
            _attach(net, net.store_ns, net.store_devs, net.store_ip)
            tbf(net.store_devs[0], rate)
            tbf(net.store_devs[1], rate, ns=net.store_ns)
        yield net
    finally:
        remove_network(net)


def remove_network(net: FleetNet) -> None:
    """The namespaces (each takes its veth pair along), then any host end and the bridge."""
    for ns in net.namespaces():
        subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
    for dev in net.host_devs():
        remove_link(dev)


def network_leftovers(net: FleetNet) -> list[str]:
    namespaces = [f"netns {ns}" for ns in net.namespaces() if netns_exists(ns)]
    return namespaces + [f"link {dev}" for dev in net.host_devs() if link_exists(dev)]


# ---------------------------------------------------------------------------------------
# The store


@dataclass(frozen=True)
class Store:
    url: str  # what agents and `lazyfs convert` use
    env: dict[str, str]  # what a process needs to reach it (AWS_*)
    seaweed: Seaweed | None  # the S3 server (None: a file:// store)


@contextlib.contextmanager
def s3_store(root: Path, net: FleetNet, delay_ms: float) -> Iterator[Store]:
    """weed mini in the store's namespace, behind the delay line (delay_ms / 2 each way)."""
    place = StorePlace(net.store_ns, net.store_ip)
    weed = Seaweed(root / "seaweed", ip=net.store_ip, wrap=place.exec_argv)
    try:
        weed.start()
        with delay_proxy(place, PROXY_PORT, weed.ports["s3.port"], delay_ms / 2) as endpoint:
            env = {**weed.env, "AWS_ENDPOINT_URL": endpoint}
            yield Store(f"s3://{weed.bucket}/fleet", env, weed)
    finally:
        weed.stop()


@contextlib.contextmanager
def file_store(root: Path) -> Iterator[Store]:
    path = root / "store"
    path.mkdir(parents=True, exist_ok=True)
    yield Store(f"file://{path}", {}, None)


# ---------------------------------------------------------------------------------------
# A node


@dataclass
class FleetNode:
    """One node agent in its namespace; start() after kill9() brings back the same node
    (namespace, address, run dir, cache: it adopts the sandboxes that outlived it)."""

    index: int
    ns: str
    ip: str
    agent: AgentProcess
    args: tuple[str, ...]  # `lazyfs serve` arguments after --socket
    token: str
    ca: Path
    host_dev: str  # the host end of its veth into the bridge
    killed: bool = False  # kill9() was called (what the clean-up may then find: below)

    @property
    def url(self) -> str:
        return f"https://{self.ip}:{AGENT_PORT}"

    @property
    def node(self) -> Node:
        return self.agent.node

    @property
    def run_dir(self) -> Path:
        return self.node.tmp / "run"

    @property
    def cache(self) -> Path:
        return self.node.tmp / "cache"

    @property
    def running(self) -> bool:
        return self.agent.proc is not None and self.agent.proc.poll() is None

    def client(self, **options: float) -> Client:
        """A client over the node's TLS address with the fleet's token and CA."""
        return Client(url=self.url, token=self.token, verify=self.ca, **options)

    def local_client(self) -> Client:
        """A client over the agent's unix socket (no network, no token)."""
        return self.agent.client()

    def spawn(self) -> FleetNode:
        self.agent.spawn(*self.args)
        return self

    def wait_ready(self, timeout: float = 30.0) -> FleetNode:
        """Once the agent answers on its socket and on its TLS address."""
        self.agent.wait_ready()
        wait_until(self._answers_tls, timeout, f"node {self.index} on {self.url}")
        return self

    def _answers_tls(self) -> bool:
        with contextlib.suppress(AgentError), self.client(timeout=2) as c:
            return c.health()["status"] == "ok"
        return False

    def start(self) -> FleetNode:
        return self.spawn().wait_ready()

    def stop(self) -> int | None:
        """SIGTERM (the agent deletes its sandboxes), SIGKILL if it does not end."""
        return self.agent.stop(STOP_TIMEOUT)

    def daemon_pids(self) -> list[int]:
        """The node data daemon's supervisor and workers (by this node's run dir)."""
        return supervisors(self.run_dir) + workers(self.run_dir)

    def kill9(self) -> list[int]:
        """kill -9 of the agent and of its node data daemon (supervisor before workers,
        which it would restart; again until none is left), as when the node's software
        crashes: its sandboxes keep running. Returns the pids killed."""
        self.killed = True
        killed: list[int] = []
        if self.running:
            assert self.agent.proc is not None
            killed.append(self.agent.proc.pid)
            self.agent.kill9()
        deadline = time.monotonic() + 10
        while pids := self.daemon_pids():
            assert time.monotonic() < deadline, f"node {self.index}'s daemon lives: {pids}"
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed += [p for p in pids if p not in killed]
            wait_until(lambda pids=pids: not any(map(pid_alive, pids)), 10, "kill -9")
        return killed

    @contextlib.contextmanager
    def partitioned(self) -> Iterator[None]:
        """The node cut off the network for the body of a with-block (its veth into the
        bridge down: packets to it are dropped, not refused, so callers see timeouts;
        it loses the store too). Reconnected afterwards, always."""
        ip("link", "set", self.host_dev, "down")
        try:
            yield
        finally:
            ip("link", "set", self.host_dev, "up")

    def cache_bytes(self) -> int:
        """Bytes the node cache takes on disk (allocated blocks)."""
        files = (p for p in self.cache.rglob("*") if p.is_file() and not p.is_symlink())
        return sum(p.stat().st_blocks * 512 for p in files)

    def leftovers(self) -> dict[str, list]:
        """What this node left: its sandboxes' traces (testbed/nodecheck.py), anything
        under its dir, and its cgroup parent."""
        left = dict(self.node.leftovers())
        left["cgroup parent"] = cgroup_parents(self.node.cgroup_parent)
        return {f"node {self.index} {k}": v for k, v in left.items() if v}


# ---------------------------------------------------------------------------------------
# The fleet


@dataclass(frozen=True)
class LinkFigures:
    """What the store's link measured (Fleet.measure_link)."""

    connect_ms: float  # TCP connect to weed's S3 port: the link's own round trip
    request_ms: float  # a small S3 request through the delay line (median, keep-alive)
    direct_request_ms: float  # the same request straight to weed (no delay line)
    get_mbit_s: float  # one big GET through the delay line
    direct_get_mbit_s: float  # the same GET straight to weed (tbf only)
    put_mbit_s: float  # the PUT of that object, through the delay line
    size: int  # the object's bytes

    @property
    def added_ms(self) -> float:
        """The round trip the delay line adds to a request."""
        return self.request_ms - self.direct_request_ms


@dataclass
class Fleet:
    root: Path
    net: FleetNet
    certs: Certs
    token: str
    store_url: str
    store_env: dict[str, str]
    seaweed: Seaweed | None
    nodes: list[FleetNode] = field(default_factory=list)
    # What the clean-up had to remove by force (a node's agent left it): the test asserts
    # it is empty.
    scrubbed: dict[str, list] = field(default_factory=dict)

    @property
    def ca(self) -> Path:
        return self.certs.ca

    @property
    def host_ip(self) -> str:
        """The bridge's address: a gateway on the host listens here or reaches from here."""
        return self.net.host_ip

    def client(self, i: int, **options: float) -> Client:
        return self.nodes[i].client(**options)

    def start(self) -> None:
        """Start every agent that is not running (all at once, then wait for each)."""
        stopped = [n for n in self.nodes if not n.running]
        for node in stopped:
            node.spawn()
        for node in stopped:
            node.wait_ready()

    def host_env(self) -> dict[str, str]:
        """The environment of a host process using the fleet's store (convert, gc...)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        return {**env, **self.store_env, "LAZYFS_STORE": self.store_url}

    def convert(self, source: str, name: str) -> None:
        """`lazyfs convert SOURCE --name NAME` into the fleet's store, from the host."""
        argv = [LAZYFS, "convert", source, "--name", name, "--store", self.store_url]
        done = subprocess.run(
            argv, env=self.host_env(), capture_output=True, text=True, timeout=CONVERT_TIMEOUT
        )
        if done.returncode != 0:
            raise RuntimeError(f"lazyfs convert {source} failed: {done.stderr.strip()}")

    def convert_many(self, sources: Mapping[str, str], jobs: int = 2) -> None:
        """name -> source, `jobs` at a time. The first goes alone: the others then find
        the layers they share with it converted (the store's converted-layer records)."""
        items = list(sources.items())
        if not items:
            return
        self.convert(items[0][1], items[0][0])
        with ThreadPoolExecutor(jobs) as pool:
            list(pool.map(lambda item: self.convert(item[1], item[0]), items[1:]))

    def convert_agent_images(self, count: int, jobs: int = 2) -> dict[str, str]:
        """The first `count` of testbed/agent_images.py's 50 distinct images (a shared
        python base, a small task layer each), converted under their tags (agent-00...).
        Returns tag -> what `cat TASK_FILE` prints in a sandbox of it."""
        images = ensure_agent_images(default_cache())
        tags = images.tags[:count]
        assert len(tags) == count, f"there are {len(images.tags)} agent images"
        self.convert_many({t: f"oci:{images.layout}:{t}" for t in tags}, jobs)
        return {t: images.expected[t] for t in tags}

    def leftovers(self) -> dict[str, list]:
        """What the fleet left on the machine: every node's traces, mounts and processes
        under its directory, the delay line, the namespaces, links and bridge."""
        left: dict[str, list] = {}
        for node in self.nodes:
            left |= node.leftovers()
        left["mounts"] = mounts_below(self.root)
        left["processes"] = processes_mentioning(str(self.root))
        if self.net.with_store:
            left["processes"] += processes_mentioning(f"{self.net.store_ip}:{PROXY_PORT}")
        left["network"] = network_leftovers(self.net)
        return {k: v for k, v in left.items() if v}

    def link_bytes(self) -> tuple[int, int]:
        """Bytes sent so far over the store's link: (to the store, from the store), as
        its two tbf qdiscs counted them (the store's own answers to itself excluded)."""
        assert self.net.with_store, "a file:// store has no link"
        host_dev, ns_dev = self.net.store_devs
        return _tbf_sent(host_dev), _tbf_sent(ns_dev, self.net.store_ns)

    def measure_link(self, size: int = 64 << 20) -> LinkFigures:
        """The store's link as the agents see it: round trips and one big GET."""
        assert self.seaweed is not None, "a file:// store has no link"
        weed, proxy = self.seaweed.endpoint, self.store_env["AWS_ENDPOINT_URL"]
        put_s, key = _put_big(self.seaweed, proxy, size)
        try:
            return LinkFigures(
                connect_ms=_connect_ms(self.net.store_ip, self.seaweed.ports["s3.port"]),
                request_ms=_request_ms(proxy),
                direct_request_ms=_request_ms(weed),
                get_mbit_s=size * 8 / 1e6 / _get_seconds(self.seaweed, proxy, key),
                direct_get_mbit_s=size * 8 / 1e6 / _get_seconds(self.seaweed, weed, key),
                put_mbit_s=size * 8 / 1e6 / put_s,
                size=size,
            )
        finally:
            self.seaweed.client().delete_object(Bucket=self.seaweed.bucket, Key=key)

    # --- clean-up

    def teardown(self) -> None:
        """Stop every agent (SIGTERM: they delete their sandboxes), then make sure each
        node is clean, scrubbing (and recording in `scrubbed`) what one was not."""
        for node in self.nodes:
            _sigterm(node)
        for node in self.nodes:
            self._stopped(node)
        for node in self.nodes:
            self._clean(node)

    def _stopped(self, node: FleetNode) -> None:
        proc = node.agent.proc
        if proc is None:
            return
        try:
            proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            self.scrubbed[f"node {node.index} agent"] = ["did not stop on SIGTERM"]

    def _clean(self, node: FleetNode) -> None:
        """A node left with sandboxes (its agent was killed) gets its agent once more:
        it adopts them on start and deletes them on stop, as a real node's restart
        would. Then its data daemon's idle exit; whatever is still there is scrubbed."""
        if node.node.sandboxes.is_dir() and any(node.node.sandboxes.iterdir()):
            with contextlib.suppress(AssertionError):
                node.start()
                node.stop()
        if node.killed:
            _remove_killed_allocations(node.node.sandboxes)
        left = node.node.wait_clean(CLEAN_TIMEOUT)
        if left:
            self.scrubbed.update({f"node {node.index} {k}": v for k, v in left.items()})
            clean_run_dir(node.run_dir)
            node.node.scrub()
        node.node.remove_cgroup_parent()


def _remove_killed_allocations(sandbox_dir: Path) -> None:
    """The lock files (.new-*.lock) of sandbox ids being allocated when the agent was
    killed. The next agent removes only those older than a minute (cleanup_stale in
    lazyfs/sandbox/runtime.py: younger ones may be another allocator's), so a test that
    kills an agent mid-refill would otherwise wait that long; ours are stopped."""
    for path in sandbox_dir.glob(".new-*.lock"):
        with contextlib.suppress(OSError), open(path, "rb") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # unheld: its allocator died
            path.unlink()


def _sigterm(node: FleetNode) -> None:
    if node.running:
        assert node.agent.proc is not None
        node.agent.proc.send_signal(signal.SIGTERM)


# ---------------------------------------------------------------------------------------
# Link measurements


def _tbf_sent(dev: str, ns: str | None = None) -> int:
    """The "Sent N bytes" of dev's root tbf qdisc."""
    out = subprocess.run(
        ["tc", *(["-n", ns] if ns else []), "-s", "qdisc", "show", "dev", dev, "root"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return int(out.split(" Sent ", 1)[1].split()[0])


def _connect_ms(host: str, port: int, rounds: int = 20) -> float:
    """Median TCP connect time: one SYN / SYN-ACK round trip over the link."""
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        with socket.create_connection((host, port), timeout=5):
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def _request_ms(endpoint: str, rounds: int = 20) -> float:
    """Median time of an unsigned HEAD of the bucket on one kept-alive connection (weed
    answers at once: 403), after a first request that opens it."""
    host, port = endpoint.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    times = []
    try:
        for i in range(rounds + 1):
            t0 = time.perf_counter()
            conn.request("HEAD", "/lazyfs-test")
            conn.getresponse().read()
            if i:
                times.append(time.perf_counter() - t0)
    finally:
        conn.close()
    return statistics.median(times) * 1000


def _put_big(weed: Seaweed, endpoint: str, size: int) -> tuple[float, str]:
    key = f"link-probe-{secrets.token_hex(4)}"
    body = os.urandom(size)  # incompressible: what crosses the link is `size` bytes
    s3 = _client_at(weed, endpoint)
    t0 = time.perf_counter()
    s3.put_object(Bucket=weed.bucket, Key=key, Body=body)
    return time.perf_counter() - t0, key


def _get_seconds(weed: Seaweed, endpoint: str, key: str) -> float:
    """Seconds from a GET's request to its last byte."""
    s3 = _client_at(weed, endpoint)
    t0 = time.perf_counter()
    body = s3.get_object(Bucket=weed.bucket, Key=key)["Body"]
    while body.read(1 << 20):
        pass
    return time.perf_counter() - t0


def _client_at(weed: Seaweed, endpoint: str) -> Any:
    """A boto3 client of weed's bucket at endpoint (weed's own, or the delay line)."""
    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=weed.access_key,
        aws_secret_access_key=weed.secret_key,
        region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}, read_timeout=120),
    )


# ---------------------------------------------------------------------------------------
# The context manager


def _serve_args(net: FleetNet, i: int, root: Path, certs: Certs) -> tuple[str, ...]:
    return (
        *("--listen", f"{net.node_ip(i)}:{AGENT_PORT}", "--token-file", str(root / "token")),
        *("--tls-cert", str(certs.cert), "--tls-key", str(certs.key)),
        *("--docker-socket", "none"),
    )


def _make_node(
    net: FleetNet, i: int, root: Path, certs: Certs, token: str, store: Store, extra: Sequence[str]
) -> FleetNode:
    tmp = root / f"node{i}"
    tmp.mkdir(parents=True)
    wrap = tuple(nsenter_argv(net.node_ns(i), []))  # nsenter --net=... --
    agent = AgentProcess(agent_node(tmp, store.url, store.env), tmp / "agent.sock", wrap=wrap)
    args = (*_serve_args(net, i, root, certs), *extra)
    ns, address, host_dev = net.node_ns(i), net.node_ip(i), net.node_devs(i)[0]
    return FleetNode(i, ns, address, agent, args, token, certs.ca, host_dev)


@contextlib.contextmanager
def fleet(
    tmp: Path,
    nodes: int = 4,
    store: str = "s3",
    rate: str = "1gbit",
    delay_ms: float = 4.0,
    agent_args: Sequence[str] = (),
    start: bool = True,
) -> Iterator[Fleet]:
    """`nodes` agents (`lazyfs serve ... *agent_args`) over one store ("s3": SeaweedFS
    behind a `rate` link with `delay_ms` added to each round trip; "file": a local
    directory), under tmp/fleet. start=False: call f.start() (e.g. after converting the
    images its --pool arguments name). Everything is gone afterwards, failure or not."""
    assert store in ("s3", "file"), f"store is s3 or file, not {store!r}"
    assert 1 <= nodes <= MAX_NODES, f"1 to {MAX_NODES} nodes (.11 to .254 of the subnet)"
    root = tmp / "fleet"
    root.mkdir(parents=True)
    with contextlib.ExitStack() as stack:
        net = stack.enter_context(fleet_network(nodes, store == "s3", rate))
        ips = [net.node_ip(i) for i in range(nodes)] + [net.host_ip, "127.0.0.1"]
        certs = make_certs(root / "tls", ips)
        token = secrets.token_hex(16)
        (root / "token").write_text(token + "\n")
        (root / "token").chmod(0o600)
        where = s3_store(root, net, delay_ms) if store == "s3" else file_store(root)
        st = stack.enter_context(where)
        f = Fleet(root, net, certs, token, st.url, st.env, st.seaweed)
        stack.callback(f.teardown)
        make = partial(_make_node, net, root=root, certs=certs, token=token, store=st)
        f.nodes = [make(i, extra=agent_args) for i in range(nodes)]
        if start:
            f.start()
        yield f
