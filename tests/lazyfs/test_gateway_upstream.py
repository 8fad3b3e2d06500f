"""The gateway's HTTP client to the node agents (lazyfs/gateway/upstream.py): against a
real uvicorn server on loopback (as the agents serve), and, for the faults a real server
does not show on demand (an answer cut off, a node that never answers), a raw socket
server next to it. The whole gateway against real agents: test_gateway.py, test_fleet.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import uvicorn

from lazyfs.gateway import upstream
from lazyfs.gateway.upstream import BrokeOff, NodeHttp, Unreached
from testbed.certs import make_certs
from testbed.seaweed import free_port

TOKEN = "upstream-test-token"
BIG = 5 * 2**20  # bytes of a streamed answer: over the client's read-ahead (1 MiB)


async def app(scope: dict, receive, send) -> None:  # type: ignore[no-untyped-def]
    """Echoes what it was sent; GET /big streams BIG bytes in pieces."""
    if scope["type"] != "http":
        return
    headers = dict(scope["headers"])
    if scope["path"] == "/big":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(BIG // 2**16):
            await send({"type": "http.response.body", "body": b"x" * 2**16, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    digest, size = hashlib.sha256(), 0
    while True:
        message = await receive()
        digest.update(message.get("body", b""))
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    body = json.dumps(
        {
            "method": scope["method"],
            "path": scope["path"],
            "query": scope["query_string"].decode(),
            "client": scope["client"][1],
            "auth": headers.get(b"authorization", b"").decode(),
            "injected": b"x-injected" in headers,
            "size": size,
            "sha": digest.hexdigest(),
        }
    ).encode()
    status = 404 if scope["path"] == "/missing" else 200
    content_type = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": status, "headers": content_type})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
def server() -> Iterator[str]:
    """A uvicorn server (httptools, as the agents) in a thread; its URL."""
    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, http="httptools", log_level="warning", lifespan="off"
    )
    config.timeout_keep_alive = 1  # so that a test can outlive a kept connection
    served = uvicorn.Server(config)
    thread = threading.Thread(target=served.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not served.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        served.should_exit = True
        thread.join(10)


def test_calls_carry_their_request_and_reuse_one_connection(server: str) -> None:
    async def main() -> list[dict]:
        http = NodeHttp(server, TOKEN, True)
        try:
            seen = []
            for i in range(20):
                answer = await http.call(
                    "POST", "/sandboxes/x/exec", params=[("n", str(i))], data=b"a" * i
                )
                assert (answer.status, answer.content_type) == (200, "application/json")
                seen.append(answer.json())
            missing = await http.call("GET", "/missing")
            assert missing.status == 404  # an error status is an answer, not a failure
            return seen
        finally:
            await http.close()

    seen = asyncio.run(main())
    assert [s["query"] for s in seen] == [f"n={i}" for i in range(20)]
    assert [s["size"] for s in seen] == list(range(20))
    assert {(s["method"], s["path"], s["auth"]) for s in seen} == {
        ("POST", "/sandboxes/x/exec", f"Bearer {TOKEN}")
    }
    assert len({s["client"] for s in seen}) == 1  # one keep-alive connection for all


def test_a_path_is_quoted_not_written_raw(server: str) -> None:
    """What a client put in a sandbox id reaches the node as that path, never as a
    request line or header of its own."""
    odd = "/sandboxes/x HTTP/1.1\r\nX-Injected: 1\r\n\r\nGET /y?z#w%41"

    async def main() -> dict:
        http = NodeHttp(server, None, True)
        try:
            return (await http.call("GET", odd, params=[("a", "b c")])).json()
        finally:
            await http.close()

    seen = asyncio.run(main())
    assert (seen["path"], seen["query"], seen["injected"]) == (odd, "a=b+c", False), seen


def test_bodies_stream_both_ways(server: str) -> None:
    piece = bytes(range(256)) * 256  # 64 KiB

    async def body() -> AsyncIterator[bytes]:
        for _ in range(48):  # 3 MiB, sent chunked (no length given)
            yield piece

    async def main() -> tuple[dict, int, int]:
        http = NodeHttp(server, None, True)
        try:
            up = (await http.call("PUT", "/files", data=body())).json()
            response = await http.stream("GET", "/big")
            got, reads = 0, 0
            async for part in response.pieces():
                got += len(part)
                reads += 1
                if reads == 1:
                    await asyncio.sleep(0.2)  # a slow reader: the client pauses reading
            again = await http.call("GET", "/after")  # the connection came back whole
            return up, got, again.status
        finally:
            await http.close()

    up, got, status = asyncio.run(main())
    assert up["size"] == 48 * len(piece)
    assert up["sha"] == hashlib.sha256(piece * 48).hexdigest()
    assert (got, status) == (BIG, 200)


def test_a_kept_connection_the_node_closed_is_not_used(server: str) -> None:
    async def main() -> tuple[int, int]:
        http = NodeHttp(server, None, True)
        try:
            first = (await http.call("GET", "/one")).json()["client"]
            await asyncio.sleep(1.5)  # uvicorn closes an idle connection after 1 s here
            second = (await http.call("GET", "/two")).json()["client"]
            return first, second
        finally:
            await http.close()

    first, second = asyncio.run(main())
    assert first != second


def test_an_old_idle_connection_is_not_reused(server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One idle longer than IDLE_REUSE is closed, not sent on: the agent may be closing
    it at that very moment (its keep-alive is 60 s)."""
    monkeypatch.setattr(upstream, "IDLE_REUSE", 0.2)

    async def main() -> tuple[int, int, int]:
        http = NodeHttp(server, None, True)
        try:
            first = (await http.call("GET", "/one")).json()["client"]
            again = (await http.call("GET", "/two")).json()["client"]
            await asyncio.sleep(0.4)  # < uvicorn's 1 s here: the server has not closed it
            later = (await http.call("GET", "/three")).json()["client"]
            return first, again, later
        finally:
            await http.close()

    first, again, later = asyncio.run(main())
    assert first == again != later


def test_nothing_listening_is_unreached() -> None:
    port = free_port()  # free: nothing listens there

    async def main() -> None:
        http = NodeHttp(f"http://127.0.0.1:{port}", None, True)
        with pytest.raises(Unreached, match=f"127.0.0.1:{port}"):
            await http.call("GET", "/health")

    asyncio.run(main())


class RawServer:
    """A loopback socket server that answers each connection with `reply` (then
    closes), or with nothing while the test runs."""

    def __init__(self, reply: bytes | None) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.reply = reply
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.05)  # so that close() is seen within that
        while self.sock.fileno() != -1:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            self.conns.append(conn)
            conn.recv(65536)
            if self.reply is not None:
                conn.sendall(self.reply)
                conn.close()

    def close(self) -> None:
        self.sock.close()
        for conn in self.conns:
            conn.close()
        self.thread.join(5)


@pytest.mark.parametrize(
    "reply",
    [
        b"",  # closed before any answer
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part",  # cut off
        b"NOT HTTP AT ALL\r\n\r\n",  # an answer that does not parse
    ],
)
def test_an_answer_the_node_breaks_off_is_broke_off(reply: bytes) -> None:
    raw = RawServer(reply)

    async def main() -> None:
        http = NodeHttp(raw.url, None, True)
        with pytest.raises(BrokeOff):
            await http.call("POST", "/sandboxes", data=b"{}")
        await http.close()

    try:
        asyncio.run(main())
    finally:
        raw.close()


def test_a_slow_tls_handshake_is_not_a_node_that_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connect timeout is the TCP connect's: a handshake that comes later (a busy
    node in a burst of new connections) is waited for, not taken for a lost node."""
    monkeypatch.setattr(upstream, "CONNECT_TIMEOUT", 0.2)
    certs = make_certs(tmp_path, ["127.0.0.1"])
    server_side = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_side.load_cert_chain(certs.cert, certs.key)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        conn, _ = listener.accept()
        time.sleep(0.6)  # accepted at once, the handshake three times the connect timeout
        with server_side.wrap_socket(conn, server_side=True) as tls:
            tls.recv(65536)
            tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    async def main() -> bytes:
        client_side = ssl.create_default_context(cafile=certs.ca)
        http = NodeHttp(f"https://127.0.0.1:{port}", None, client_side)
        try:
            return (await http.call("GET", "/health", timeout=5)).body
        finally:
            await http.close()

    try:
        assert asyncio.run(main()) == b"ok"
    finally:
        listener.close()
        thread.join(5)


def test_a_silent_node_is_broke_off_after_the_timeout() -> None:
    raw = RawServer(None)

    async def main() -> float:
        http = NodeHttp(raw.url, None, True)
        t0 = time.monotonic()
        with pytest.raises(BrokeOff, match="no answer within 0.5 s"):
            await http.call("GET", "/health", timeout=0.5)
        await http.close()
        return time.monotonic() - t0

    try:
        took = asyncio.run(main())
    finally:
        raw.close()
    assert 0.4 < took < 5


def test_a_cancelled_call_closes_its_connection() -> None:
    """The agent takes a closed connection as its client leaving (an exec is killed)."""
    raw = RawServer(None)

    async def main() -> None:
        http = NodeHttp(raw.url, None, True)
        call = asyncio.ensure_future(http.call("POST", "/sandboxes/x/exec", data=b"{}"))
        await asyncio.sleep(0.3)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await http.close()

    try:
        asyncio.run(main())
        deadline = time.monotonic() + 5
        conn = raw.conns[0]
        conn.settimeout(5)
        assert conn.recv(1) == b""  # the client's end is closed: EOF
        assert time.monotonic() < deadline
    finally:
        raw.close()
