"""Issue 20, findings 7 and 8: what a sandbox's sockets reach.

- A `--network` sandbox shares the host's network namespace. With CAP_NET_RAW it opened
  an AF_PACKET socket on the host's lo and read a bearer token sent to an agent on TCP
  loopback. The tests run that sniff (a loopback server of the test's own, a sender
  that keeps sending it a request with a bearer token) from such a sandbox, through
  `lazyfs run --network` and through the agent (network: true), and assert that no raw
  socket opens (EPERM) and the token is never seen, while an ordinary TCP connection to
  the same server still works (the probe is valid).
- In a sandbox with its own namespace (the default) CAP_NET_RAW stays (oci_spec.py says
  why): the same sniff opens its sockets there and sees nothing of the host's lo.
- AF_VSOCK ignores network namespaces (this VM has /dev/vsock): socket() and
  socketpair() of it are refused by seccomp in every sandbox; on the host the same
  socket() succeeds (the probe is valid), and AF_INET, AF_INET6 and AF_UNIX still work.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

from testbed.agent import AgentProcess
from testbed.node import Node

SNIFF_SECONDS = 3.0

# argv: PORT SECRET. Opens what sniffers it can, reads them for SNIFF_SECONDS while the
# test sends SECRET to 127.0.0.1:PORT, and connects there once itself.
SNIFF = r"""
import errno, json, select, socket, sys, time
port, secret = int(sys.argv[1]), sys.argv[2].encode()
ETH_P_ALL = socket.htons(3)
kinds = {
    "packet_raw": (socket.AF_PACKET, socket.SOCK_RAW, ETH_P_ALL),
    "packet_dgram": (socket.AF_PACKET, socket.SOCK_DGRAM, ETH_P_ALL),
    "inet_raw_tcp": (socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP),
    "inet_raw_icmp": (socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP),
    "inet6_raw_tcp": (socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_TCP),
}
opened, refused = [], {}
for name, args in kinds.items():
    try:
        s = socket.socket(*args)
    except OSError as exc:
        refused[name] = errno.errorcode[exc.errno]
        continue
    if args[0] == socket.AF_PACKET:
        s.bind(("lo", 0))
    opened.append(s)
try:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
        connected = c.recv(100).decode().strip()
except OSError as exc:
    connected = type(exc).__name__
seen, captured, until = False, 0, time.monotonic() + float(sys.argv[3])
while opened and not seen and time.monotonic() < until:
    for s in select.select(opened, [], [], 0.1)[0]:
        data = s.recv(65536)
        captured += len(data)
        seen = seen or secret in data
print(json.dumps({"refused": refused, "opened": len(opened), "captured": captured,
                  "seen": seen, "connected": connected}))
"""

VSOCK = r"""
import errno, json, socket
def attempt(make):
    try:
        made = make()
    except OSError as exc:
        return errno.errorcode[exc.errno]
    for s in made if isinstance(made, tuple) else (made,):
        s.close()
    return "ok"
print(json.dumps({
    "vsock_stream": attempt(lambda: socket.socket(40, socket.SOCK_STREAM)),
    "vsock_dgram": attempt(lambda: socket.socket(40, socket.SOCK_DGRAM)),
    "vsock_seqpacket": attempt(lambda: socket.socket(40, socket.SOCK_SEQPACKET)),
    "vsock_pair": attempt(lambda: socket.socketpair(40, socket.SOCK_STREAM)),
    "inet": attempt(lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM)),
    "inet6": attempt(lambda: socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)),
    "unix": attempt(lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)),
    "unix_pair": attempt(lambda: socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)),
    "netlink": attempt(lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)),
}))
"""
NO_VSOCK = {
    "vsock_stream": "EPERM",
    "vsock_dgram": "EPERM",
    "vsock_seqpacket": "EPERM",
    "vsock_pair": "EPERM",
    "inet": "ok",
    "inet6": "ok",
    "unix": "ok",
    "unix_pair": "ok",
    "netlink": "ok",
}
RAW_REFUSED = {
    "packet_raw": "EPERM",
    "packet_dgram": "EPERM",
    "inet_raw_tcp": "EPERM",
    "inet_raw_icmp": "EPERM",
    "inet6_raw_tcp": "EPERM",
}


@contextlib.contextmanager
def loopback_agent_with_traffic(secret: str) -> Iterator[int]:
    """A TCP server on 127.0.0.1 (it answers "host service" to every connection), and a
    thread that sends it a request with `secret` as a bearer token every 20 ms, as a
    client of an agent on TCP loopback does. Yields the port."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    port = server.getsockname()[1]
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not select.select([server], [], [], 0.1)[0]:
                continue
            conn, _ = server.accept()
            with conn:
                conn.sendall(b"host service\n")

    def send() -> None:
        request = f"GET /health HTTP/1.1\r\nAuthorization: Bearer {secret}\r\n\r\n".encode()
        while not stop.wait(0.02):
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)) as c:
                c.sendall(request)
                c.recv(100)

    threads = [threading.Thread(target=serve), threading.Thread(target=send)]
    for t in threads:
        t.start()
    try:
        yield port
    finally:
        stop.set()
        for t in threads:
            t.join()
        server.close()


def _sniff_argv(port: int, secret: str) -> list[str]:
    return ["python3", "-c", SNIFF, str(port), secret, str(SNIFF_SECONDS)]


def _assert_cannot_sniff(result: dict) -> None:
    assert result["refused"] == RAW_REFUSED, result
    assert not result["seen"] and result["opened"] == 0, result
    assert result["connected"] == "host service", result  # the host's lo is reachable


def test_network_sandbox_cannot_sniff_host_loopback_through_run(sandbox_node: Node) -> None:
    secret = secrets.token_hex(16)
    with loopback_agent_with_traffic(secret) as port:
        out = sandbox_node.ok(*_sniff_argv(port, secret), options=("--network",))
    _assert_cannot_sniff(json.loads(out))


def test_network_sandbox_cannot_sniff_host_loopback_through_agent(agent: AgentProcess) -> None:
    agent.start()
    secret = secrets.token_hex(16)
    with (
        loopback_agent_with_traffic(secret) as port,
        agent.client() as c,
        c.create("py", network=True) as sb,
    ):
        r = sb.exec(_sniff_argv(port, secret))
    assert r.exit_code == 0, r.stderr
    _assert_cannot_sniff(json.loads(r.stdout))


def test_own_namespace_keeps_raw_sockets_but_sees_nothing_of_the_host(
    sandbox_node: Node,
) -> None:
    """The decision in oci_spec.HOST_NETWORK_CAPABILITIES: with a namespace of its own a
    sandbox's raw sockets open, and read its own lo only, never the host's traffic."""
    secret = secrets.token_hex(16)
    with loopback_agent_with_traffic(secret) as port:
        result = json.loads(sandbox_node.ok(*_sniff_argv(port, secret)))
    assert result["opened"] == len(RAW_REFUSED) and result["refused"] == {}, result
    assert not result["seen"], result
    assert result["connected"] == "ConnectionRefusedError", result  # not the host's lo


def test_vsock_is_refused_in_every_sandbox(sandbox_node: Node) -> None:
    host = json.loads(
        subprocess.run(
            [sys.executable, "-c", VSOCK], capture_output=True, text=True, check=True
        ).stdout
    )
    assert host["vsock_stream"] == "ok", f"the probe needs vsock on the host: {host}"
    assert json.loads(sandbox_node.ok("python3", "-c", VSOCK)) == NO_VSOCK
    assert json.loads(sandbox_node.ok("python3", "-c", VSOCK, options=("--network",))) == NO_VSOCK


def test_vsock_is_refused_through_the_agent(agent: AgentProcess) -> None:
    agent.start()
    with agent.client() as c:
        for network in (False, True):
            with c.create("py", network=network) as sb:
                r = sb.exec(["python3", "-c", VSOCK])
                assert r.exit_code == 0, r.stderr
                assert json.loads(r.stdout) == NO_VSOCK, f"network={network}"


def test_the_sniffer_runs_on_the_host(tmp_path: object) -> None:
    """The sniff script itself works where CAP_NET_RAW reaches the host's lo (here, as
    root on the host): what the sandbox tests assert it cannot do, it does."""
    secret = secrets.token_hex(16)
    with loopback_agent_with_traffic(secret) as port:
        t0 = time.monotonic()
        out = subprocess.run(
            [sys.executable, *_sniff_argv(port, secret)[1:]],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    result = json.loads(out)
    assert result["seen"] and result["refused"] == {}, result
    assert time.monotonic() - t0 < SNIFF_SECONDS + 5
