"""A shaped network link for benchmarks: a network namespace behind a veth pair.

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
Run as root. `python bench/netns.py proxy ...` is the delay proxy's entry point.
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
from pathlib import Path

from testbed.processes import die_with_parent, stop_process

# tbf as DESIGN.md section 6 measured it: exact rate, 256 KB bursts, 50 ms queue bound.
TBF = ("burst", "256kb", "latency", "50ms")


def _ip(*args: str) -> str:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout


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


def _free_subnet() -> int:
    """N such that 10.77.N.0/24 is on no interface (two benchmarks may run at once)."""
    used = _ip("-o", "-4", "addr", "show")
    for n in range(256):
        if f"10.77.{n}." not in used:
            return n
    raise RuntimeError("no free 10.77.N.0/24 subnet for the benchmark link")


@contextmanager
def shaped_link(rate: str = "1gbit") -> Iterator[ShapedLink]:
    """A namespace at 10.77.N.2 behind a veth pair shaped to `rate` in both directions."""
    tag = f"{os.getpid() % 100000}"
    n = _free_subnet()
    link = ShapedLink(
        ns=f"lazyfs-bench-{tag}",
        host_dev=f"lzb{tag}h",
        ns_dev=f"lzb{tag}n",
        host_ip=f"10.77.{n}.1",
        ns_ip=f"10.77.{n}.2",
        rate=rate,
    )
    _ip("netns", "add", link.ns)
    try:
        _ip("link", "add", link.host_dev, "type", "veth", "peer", "name", link.ns_dev)
        _ip("link", "set", link.ns_dev, "netns", link.ns)
        _ip("addr", "add", f"{link.host_ip}/24", "dev", link.host_dev)
        _ip("link", "set", link.host_dev, "up")
        _ip("-n", link.ns, "addr", "add", f"{link.ns_ip}/24", "dev", link.ns_dev)
        _ip("-n", link.ns, "link", "set", link.ns_dev, "up")
        _ip("-n", link.ns, "link", "set", "lo", "up")  # the server talks to itself too
        for argv in (
            ["tc", "qdisc", "add", "dev", link.host_dev, "root", "tbf", "rate", rate, *TBF],
            [
                "tc",
                "-n",
                link.ns,
                "qdisc",
                "add",
                "dev",
                link.ns_dev,
                "root",
                "tbf",
                "rate",
                rate,
                *TBF,
            ],
        ):
            done = subprocess.run(argv, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")
        yield link
    finally:
        # Deleting the namespace destroys its veth end, which destroys the host end.
        subprocess.run(["ip", "netns", "delete", link.ns], capture_output=True)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            done = subprocess.run(["ip", "link", "show", link.host_dev], capture_output=True)
            if done.returncode != 0:
                break
            subprocess.run(["ip", "link", "delete", link.host_dev], capture_output=True)
            time.sleep(0.1)


def leftovers(link: ShapedLink) -> list[str]:
    """What of the link still exists (for the benchmark's own clean-up check)."""
    left = []
    if link.ns in _ip("netns", "list"):
        left.append(f"netns {link.ns}")
    if subprocess.run(["ip", "link", "show", link.host_dev], capture_output=True).returncode == 0:
        left.append(f"link {link.host_dev}")
    return left


# ---------------------------------------------------------------------------------------
# The delay proxy


@contextmanager
def delay_proxy(
    link: ShapedLink, listen_port: int, target_port: int, delay_ms: float
) -> Iterator[str]:
    """A TCP delay line in the namespace: ns_ip:listen_port -> ns_ip:target_port."""
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "proxy",
        "--listen",
        f"{link.ns_ip}:{listen_port}",
        "--target",
        f"{link.ns_ip}:{target_port}",
        "--delay-ms",
        str(delay_ms),
    ]
    proc = subprocess.Popen(
        link.exec_argv(argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
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
