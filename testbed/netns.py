"""Network namespaces for tests and benchmarks: shaped links, bridges and a delay line.

The kernel here has no netem, but `tbf` on both ends of a veth pair limits bandwidth
exactly (DESIGN.md section 6). Servers started with `ShapedLink.exec_argv(...)` run inside
the namespace and listen on `link.ns_ip`; clients on the host reach them through the pair,
so every byte crosses the rate limit. Latency is added by `delay_proxy`, a small TCP
delay line run inside the namespace in front of a server (one-way delay per direction,
so the round trip grows by twice the delay while the bandwidth stays the same).

    with shaped_link("1gbit") as link:
        subprocess.Popen(link.exec_argv(["server", "--bind", link.ns_ip]))

Everything is removed on exit, even on failure: the namespace (which takes its end of
the pair, and with it the host end) and the host end if it is still there.

The primitives below (`ip`, `tbf`, `veth_into`, `add_bridge`, `remove_link`,
`nsenter_argv`) are also what testbed/fleet.py builds its bridge of node namespaces
from. Run as root. `python -m testbed.netns proxy ...` is the delay proxy's entry point
(bench/netns.py re-exports all of this for the benchmarks).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Protocol

from testbed.processes import die_with_parent, stop_process, subprocess_env

# tbf as DESIGN.md section 6 measured it: exact rate, 256 KB bursts, 50 ms queue bound.
TBF = ("burst", "256kb", "latency", "50ms")


def ip(*args: str, ns: str | None = None) -> str:
    """`ip ARGS` (in namespace ns), its output; a failure raises with ip's message."""
    argv = ["ip", *(["-n", ns] if ns else []), *args]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {proc.stderr.strip()}")
    return proc.stdout


def tbf(dev: str, rate: str, ns: str | None = None) -> None:
    """Shape what `dev` sends (its egress) to `rate` with TBF's settings."""
    argv = ["tc", *(["-n", ns] if ns else []), "qdisc", "add", "dev", dev, "root"]
    argv += ["tbf", "rate", rate, *TBF]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")


def nsenter_argv(ns: str, argv: list[str]) -> list[str]:
    """argv run in the network namespace `ns` only (nsenter execs it: same pid).

    Unlike `ip netns exec`, which also unshares the mount namespace and mounts a fresh
    /sys (so /sys/fs/cgroup is empty), the process keeps the host's mounts: what it
    mounts (FUSE, EROFS, overlays) is visible to the host, and runc finds its cgroups."""
    return ["nsenter", f"--net=/run/netns/{ns}", "--", *argv]


def free_subnet(prefix: str = "10.77") -> int:
    """N such that PREFIX.N.0/24 is on no interface (two benchmarks may run at once)."""
    used = ip("-o", "-4", "addr", "show")
    for n in range(256):
        if f"{prefix}.{n}." not in used:
            return n
    raise RuntimeError(f"no free {prefix}.N.0/24 subnet")


def netns_exists(ns: str) -> bool:
    return ns in ip("netns", "list").split()


def link_exists(dev: str) -> bool:
    return subprocess.run(["ip", "link", "show", dev], capture_output=True).returncode == 0


def veth_into(ns: str, host_dev: str, ns_dev: str, ns_cidr: str) -> None:
    """A veth pair from the host (host_dev, left down) into ns (ns_dev, up at ns_cidr),
    with the namespace's loopback up (a server there talks to itself through it)."""
    ip("link", "add", host_dev, "type", "veth", "peer", "name", ns_dev)
    ip("link", "set", ns_dev, "netns", ns)
    ip("addr", "add", ns_cidr, "dev", ns_dev, ns=ns)
    ip("link", "set", ns_dev, "up", ns=ns)
    ip("link", "set", "lo", "up", ns=ns)


def add_bridge(dev: str, cidr: str) -> None:
    """A Linux bridge on the host with an address (how the host reaches its ports)."""
    ip("link", "add", dev, "type", "bridge")
    ip("addr", "add", cidr, "dev", dev)
    ip("link", "set", dev, "up")


def remove_link(dev: str, timeout: float = 5.0) -> None:
    """Delete a host link (a veth end goes with its peer's namespace: wait for that)."""
    deadline = time.monotonic() + timeout
    while link_exists(dev) and time.monotonic() < deadline:
        subprocess.run(["ip", "link", "delete", dev], capture_output=True)
        if link_exists(dev):
            time.sleep(0.1)


class InNamespace(Protocol):
    """What the delay proxy needs of a place: a namespace to run in, an address there."""

    ns_ip: str

    def exec_argv(self, argv: list[str]) -> list[str]: ...


@dataclass(frozen=True)
class ShapedLink:
    ns: str  # network namespace name
    host_dev: str  # the host end of the veth pair
    ns_dev: str  # the namespace end
    host_ip: str
    ns_ip: str
    rate: str  # tbf rate, e.g. "1gbit"

    def exec_argv(self, argv: list[str]) -> list[str]:
        """argv run inside the namespace (`ip netns exec` execs it: same pid)."""
        return ["ip", "netns", "exec", self.ns, *argv]


@contextmanager
def shaped_link(rate: str = "1gbit") -> Iterator[ShapedLink]:
    """A namespace at 10.77.N.2 behind a veth pair shaped to `rate` in both directions."""
    tag = f"{os.getpid() % 100000}"
    n = free_subnet("10.77")
    link = ShapedLink(
        ns=f"lazyfs-bench-{tag}",
        host_dev=f"lzb{tag}h",
        ns_dev=f"lzb{tag}n",
        host_ip=f"10.77.{n}.1",
        ns_ip=f"10.77.{n}.2",
        rate=rate,
    )
    ip("netns", "add", link.ns)
    try:
        veth_into(link.ns, link.host_dev, link.ns_dev, f"{link.ns_ip}/24")
        ip("addr", "add", f"{link.host_ip}/24", "dev", link.host_dev)
        ip("link", "set", link.host_dev, "up")
        tbf(link.host_dev, rate)
        tbf(link.ns_dev, rate, ns=link.ns)
        yield link
    finally:
        # Deleting the namespace destroys its veth end, which destroys the host end.
        subprocess.run(["ip", "netns", "delete", link.ns], capture_output=True)
        remove_link(link.host_dev)


def leftovers(link: ShapedLink) -> list[str]:
    """What of the link still exists (for the benchmark's own clean-up check)."""
    left = []
    if netns_exists(link.ns):
        left.append(f"netns {link.ns}")
    if link_exists(link.host_dev):
        left.append(f"link {link.host_dev}")
    return left


# ---------------------------------------------------------------------------------------
# The delay proxy


@contextmanager
def delay_proxy(
    link: InNamespace, listen_port: int, target_port: int, delay_ms: float
) -> Iterator[str]:
    """A TCP delay line in the namespace: ns_ip:listen_port -> ns_ip:target_port, each
    direction `delay_ms` late (the round trip grows by 2 * delay_ms)."""
    argv = [sys.executable, "-m", "testbed.netns", "proxy"]
    argv += ["--listen", f"{link.ns_ip}:{listen_port}", "--target", f"{link.ns_ip}:{target_port}"]
    argv += ["--delay-ms", str(delay_ms)]
    proc = subprocess.Popen(
        link.exec_argv(argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=subprocess_env(),  # this checkout's testbed, from any cwd
        cwd="/",
        start_new_session=True,
        preexec_fn=die_with_parent,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "ready" once it listens
        if not line.startswith(b"ready"):
            raise RuntimeError(f"delay proxy did not start: {proc.stderr.read().decode()}")
        yield f"http://{link.ns_ip}:{listen_port}"
    finally:
        stop_process(proc, timeout=5)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    # A delay line, not a sleep per chunk: each chunk is sent `delay` after it arrived,
    # and chunks keep arriving meanwhile, so throughput is unchanged.
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
    loop = asyncio.get_running_loop()

    async def send() -> None:
        while True:
            due, data = await queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                with suppress(OSError):
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    sender = asyncio.create_task(send())
    try:
        while True:
            data = await reader.read(1 << 18)
            await queue.put((loop.time() + delay, data))
            if not data:
                break
        await sender
    except (OSError, asyncio.CancelledError):
        sender.cancel()
    finally:
        with suppress(OSError):
            writer.close()


async def _serve_proxy(listen: str, target: str, delay: float) -> None:
    lhost, lport = listen.rsplit(":", 1)
    thost, tport = target.rsplit(":", 1)

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            sr, sw = await asyncio.open_connection(thost, int(tport))
        except OSError:
            cw.close()
            return
        await asyncio.gather(_pump(cr, sw, delay), _pump(sr, cw, delay))

    server = await asyncio.start_server(handle, lhost, int(lport))
    print("ready", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with server:
        await stop.wait()


def main() -> int:
    p = argparse.ArgumentParser(description="TCP delay proxy (run inside the namespace)")
    sub = p.add_subparsers(dest="cmd", required=True)
    px = sub.add_parser("proxy")
    px.add_argument("--listen", required=True, help="HOST:PORT")
    px.add_argument("--target", required=True, help="HOST:PORT")
    px.add_argument("--delay-ms", type=float, required=True, help="one-way, each direction")
    args = p.parse_args()
    asyncio.run(_serve_proxy(args.listen, args.target, args.delay_ms / 1000))
    return 0


if __name__ == "__main__":
    sys.exit(main())
