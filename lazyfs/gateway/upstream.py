"""The gateway's calls to one node agent: HTTP/1.1 over keep-alive connections, on
asyncio with httptools' response parser (the parser uvicorn serves with).

Not aiohttp, nor httpx (the async client's library): through the gateway every call pays
one more request, and the gateway's goal is 2 ms added to a claim + exec, which is two
requests. Profiled on this 2-core machine (py-spy, a proxied GET in a loop, TLS both
ways), aiohttp was 36% of the gateway's Python time, ~0.17 ms of a proxied request's
0.43 ms of CPU; httpx had cost twice aiohttp. A request here is one write of its head and
body and httptools' callbacks for the answer (docs/design-changes.md, "the gateway's own
HTTP client"). What the gateway needs of a client is small: a request with a body of
bytes or a stream of pieces, an answer whole or as it comes, connect and read timeouts.

Failures come in two kinds, because the gateway acts on them differently:
- Unreached: no connection could be made (refused, no route, the connect timed out, a
  TLS handshake that failed): nothing reached the node, so a create may go to the next;
- BrokeOff: the request may have reached it (reset, closed, read timed out): not tried
  elsewhere (a create may have made its sandbox there).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

import httptools

CONNECT_TIMEOUT = 3.0  # seconds to connect to a node (TCP), for any call
HANDSHAKE_TIMEOUT = 60.0  # seconds for the TLS handshake after it
CONNECTIONS = 512  # per node: one per call in flight (an exec holds one while it runs)
IDLE_KEPT = 64  # idle keep-alive connections kept per node
# Seconds an idle connection is reused for: well under the agents' keep-alive (60 s,
# lazyfs/serving.py), so that a call never goes out on a connection the agent is closing
# at that moment (it would break off: a create would then not be tried elsewhere).
IDLE_REUSE = 15.0
BUFFERED = 2**20  # bytes of an answer read ahead of its reader before reading pauses


class Unreached(Exception):
    """No connection to the node: the request did not reach it."""


class BrokeOff(Exception):
    """The node took the request (maybe) and failed to answer it whole."""


@dataclass
class Answer:
    status: int
    content_type: str | None
    body: bytes

    def json(self) -> Any:
        import json

        return json.loads(self.body)


class NodeHttp:
    def __init__(self, url: str, token: str | None, verify: ssl.SSLContext | bool) -> None:
        self.url = url.rstrip("/")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url}: not an http:// or https:// URL")
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl: ssl.SSLContext | None = None
        if parts.scheme == "https" and isinstance(verify, ssl.SSLContext):
            self._ssl = verify
        elif parts.scheme == "https":
            self._ssl = ssl.create_default_context()
        # What every request's head starts with, after its request line.
        common = f"Host: {parts.netloc}\r\n"
        if token:
            common += f"Authorization: Bearer {token}\r\n"
        self._common = common.encode("latin-1")
        self._idle: list[_Connection] = []
        self._slots = asyncio.Semaphore(CONNECTIONS)

    async def call(
        self,
        method: str,
        path: str,
        *,
        params: Sequence[tuple[str, str]] | None = None,
        data: bytes | AsyncIterable[bytes] | None = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> Answer:
        """The whole answer (status, type, body) of one request."""
        response = await self.stream(
            method, path, params=params, data=data, headers=headers, timeout=timeout
        )
        return await whole(response)

    async def stream(
        self,
        method: str,
        path: str,
        *,
        params: Sequence[tuple[str, str]] | None = None,
        data: bytes | AsyncIterable[bytes] | None = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> NodeResponse:
        """The answer with its head read and its body not yet (pieces() or whole(); a
        caller that stops early calls release()). `timeout`: seconds the node may stay
        silent, for the head and for each piece of the body."""
        # Quoted: a path holds what a client sent (a sandbox id is anything without a
        # "/"); raw, a CR LF in it would end the request line and add headers of its own.
        target = quote(path)
        if params:
            target += f"?{urlencode(params)}"
        head = [f"{method} {target} HTTP/1.1\r\n".encode("latin-1"), self._common]
        for name, value in (headers or {}).items():
            head.append(f"{name}: {value}\r\n".encode("latin-1"))
        chunked = False
        if isinstance(data, bytes):
            head.append(b"Content-Length: %d\r\n" % len(data))
        elif data is None:
            head.append(b"Content-Length: 0\r\n")
        elif not any(name.lower() == "content-length" for name in headers or {}):
            chunked = True
            head.append(b"Transfer-Encoding: chunked\r\n")
        head.append(b"\r\n")
        await self._slots.acquire()
        try:
            conn = await self._connection()
        except BaseException:
            self._slots.release()
            raise
        response = NodeResponse(self, conn, timeout)
        conn.response = response
        try:
            if isinstance(data, bytes) or data is None:
                conn.transport.write(b"".join(head) + (data or b""))
            else:
                conn.transport.write(b"".join(head))
                await conn.send_stream(data, chunked)
            await response.head()
        except BaseException:
            response.release()
            raise
        return response

    async def _connection(self) -> _Connection:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if conn.usable() and now - conn.idle_since < IDLE_REUSE:
                return conn
            conn.close()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT):
                sock = await _tcp_connect(loop, self._host, self._port)
        except TimeoutError:
            raise Unreached(f"no connection to {self.url} within {CONNECT_TIMEOUT:g} s") from None
        except OSError as exc:
            raise Unreached(f"cannot connect to {self.url}: {_why(exc)}") from None
        # The TLS handshake is not under the connect timeout: in a burst (200 creates at
        # once, each a new connection) handshakes on a busy node took longer than it,
        # and healthy nodes were taken for gone (bench/fleet.py, node loss). Nothing is
        # sent before it ends, so a failure is still Unreached.
        try:
            _, conn = await loop.create_connection(
                _Connection,
                sock=sock,
                ssl=self._ssl,
                server_hostname=self._host if self._ssl else None,
                ssl_handshake_timeout=HANDSHAKE_TIMEOUT if self._ssl else None,
            )
        except (OSError, ssl.SSLError) as exc:
            sock.close()
            raise Unreached(f"cannot connect to {self.url}: {_why(exc)}") from None
        return conn

    def _done_with(self, conn: _Connection, reuse: bool) -> None:
        self._slots.release()
        if reuse and conn.usable() and len(self._idle) < IDLE_KEPT:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.close()

    async def close(self) -> None:
        while self._idle:
            self._idle.pop().close()


class NodeResponse:
    """A node's answer: status and content type once its head is read, then its body as
    it comes. Its connection goes back to the node's pool once the body is read whole."""

    def __init__(self, http: NodeHttp, conn: _Connection, timeout: float | None) -> None:
        self._http = http
        self._conn: _Connection | None = conn
        self._timeout = timeout
        self.status = 0
        self.content_type: str | None = None
        self._pieces: deque[bytes] = deque()
        self._buffered = 0
        self._complete = False
        self._failed: BrokeOff | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._has_head = False

    # called by the connection
    def got_head(self, status: int, content_type: str | None) -> None:
        self.status, self.content_type, self._has_head = status, content_type, True
        self._wake()

    def got_piece(self, piece: bytes) -> None:
        self._pieces.append(piece)
        self._buffered += len(piece)
        if self._buffered > BUFFERED and self._conn is not None:
            self._conn.transport.pause_reading()
        self._wake()

    def got_end(self) -> None:
        self._complete = True
        self._wake()

    def failed(self, why: str) -> None:
        if not self._complete:
            self._failed = BrokeOff(why)
            self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _wait(self) -> None:
        """Until the connection has more to say; BrokeOff after `timeout` of silence."""
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        timer = None
        if self._timeout is not None:
            timer = loop.call_later(self._timeout, _expire, waiter, self._timeout)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    # for the caller
    async def head(self) -> None:
        while not self._has_head:
            if self._failed is not None:
                raise self._failed
            await self._wait()

    async def pieces(self) -> AsyncIterator[bytes]:
        """The body as it comes; BrokeOff if the node stops mid-way."""
        while True:
            while self._pieces:
                piece = self._pieces.popleft()
                self._buffered -= len(piece)
                if self._buffered <= BUFFERED // 2 and self._conn is not None:
                    self._conn.transport.resume_reading()
                yield piece
            if self._complete:
                self.release()
                return
            if self._failed is not None:
                self.release()
                raise self._failed
            await self._wait()

    def release(self) -> None:
        """Done with the answer: its connection is kept for the next call if the answer
        was read whole, else closed."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.response = None
            self._http._done_with(conn, self._complete and conn.keep_alive)


def _expire(waiter: asyncio.Future[None], seconds: float) -> None:
    if not waiter.done():
        waiter.set_exception(BrokeOff(f"no answer within {seconds:g} s"))


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a node; httptools calls the on_* methods."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.parser = httptools.HttpResponseParser(self)
        self.response: NodeResponse | None = None
        self.keep_alive = True
        self.lost = False
        self.idle_since = 0.0  # when it went back to the pool (time.monotonic())
        self._content_type: str | None = None
        self._drained: asyncio.Future[None] | None = None

    def usable(self) -> bool:
        return not self.lost and self.keep_alive and not self.transport.is_closing()

    def close(self) -> None:
        self.lost = True
        self.transport.close()

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.keep_alive = False
            if self.response is not None:
                self.response.failed(f"the node's answer does not parse: {exc}")
            self.close()

    def eof_received(self) -> None:
        self.keep_alive = False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.response is not None:
            self.response.failed(_why(exc) if exc else "the node closed the connection")
        if self._drained is not None and not self._drained.done():
            self._drained.set_exception(BrokeOff("the node closed the connection"))

    def pause_writing(self) -> None:
        self._drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None

    async def send_stream(self, data: AsyncIterable[bytes], chunked: bool) -> None:
        """A request body as it comes (chunked unless its length was given)."""
        async for piece in data:
            if self.lost:
                raise BrokeOff("the node closed the connection")
            if piece:
                self.transport.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            if self._drained is not None:
                await self._drained
        if chunked:
            self.transport.write(b"0\r\n\r\n")

    # httptools
    def on_message_begin(self) -> None:
        self._content_type = None

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self._content_type = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()
        if self.response is not None:
            self.response.got_head(self.parser.get_status_code(), self._content_type)

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response.got_piece(body)

    def on_message_complete(self) -> None:
        if self.response is not None:
            self.response.got_end()


async def whole(response: NodeResponse) -> Answer:
    """A streamed answer read to its end and released (its connection closed if that
    end never comes: cancelled, the node is told so); BrokeOff if the node stops."""
    try:
        body = b"".join([piece async for piece in response.pieces()])
    finally:
        response.release()
    return Answer(response.status, response.content_type, body)


async def _tcp_connect(loop: asyncio.AbstractEventLoop, host: str, port: int) -> socket.socket:
    """A connected non-blocking TCP socket to host:port (each address in turn)."""
    last: OSError | None = None
    for family, kind, proto, _, address in await loop.getaddrinfo(
        host, port, type=socket.SOCK_STREAM
    ):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await loop.sock_connect(sock, address)
            return sock
        except OSError as exc:
            sock.close()
            last = exc
        except BaseException:
            sock.close()
            raise
    raise last or OSError(f"no address for {host}")


def _why(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__
