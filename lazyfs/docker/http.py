"""A small HTTP/1.1 server for the Docker Engine API, on h11 (python-hyper's sans-IO
HTTP) over anyio streams.

Not uvicorn, which serves the agent's own API: Docker's clients "hijack" a connection.
`exec start` and `attach` answer `101 UPGRADED` and then carry raw bytes both ways on
the same socket (stdin in, multiplexed output out); ASGI has no way to hand a handler
the socket, and uvicorn refuses any upgrade but WebSocket. h11 parses every request and
writes every response, and after a 101 gives back the bytes it read past the request
(`trailing_data`); only that raw stream is ours.

A handler returns one of three answers:
- `Reply`: a whole body (JSON mostly), with its Content-Length;
- `Streamed`: headers at once, then a chunked body as it comes (`logs --follow`, `wait`:
  the CLI waits for wait's headers before it starts the container);
- `Hijacked`: 101 when the client asked to upgrade, else 200 with the connection closed
  after the stream (as dockerd does), then the handler's coroutine owns the socket. Its
  first bytes wait until the client has read the headers (docker-py reads the stream
  past its buffered reader, and would lose bytes that came with them).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import re
import socket
import sys
import termios
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import anyio
import h11
from anyio.abc import ByteStream, SocketAttribute, SocketListener

from lazyfs.serving import pieces

log = logging.getLogger("lazyfs.docker")
READ = 64 * 2**10  # bytes asked of the socket at a time
MAX_HEAD = 64 * 2**10  # a request's line and headers
MAX_BODY = 64 * 2**20  # a request body read whole (JSON; a streamed route's as it comes)
IDLE = 60.0  # seconds an idle keep-alive connection is kept
HEADERS_READ = 1.0  # seconds a hijacked stream's first bytes wait for its headers' read
HEADERS_POLL = 0.001  # seconds between looks at whether they were read, at most


class HttpError(Exception):
    """An answer of the Docker API's error shape: `{"message": ...}` with a status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Request:
    method: str
    path: str  # unquoted, without the /v1.xx prefix
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-case names
    body: bytes = b""  # read whole (at most MAX_BODY), unless the route streams it
    params: dict[str, str] = field(default_factory=dict)  # from the route's pattern
    # A route that streams its body (Router.add's streamed) reads it here, as it comes.
    pieces: Callable[[], AsyncGenerator[bytes, None]] | None = None

    def arg(self, name: str, default: str | None = None) -> str | None:
        values = self.query.get(name)
        return values[-1] if values else default

    def flag(self, name: str, default: bool = False) -> bool:
        """A boolean query parameter: docker-py sends 1/0 or true/false, the CLI 1/true."""
        value = self.arg(name)
        if value is None:
            return default
        return value.lower() not in ("", "0", "false", "no")

    def number(self, name: str, default: int | None = None) -> int | None:
        value = self.arg(name)
        if value is None or value == "":
            return default
        try:
            return int(value)
        except ValueError:
            raise HttpError(400, f"{name}: {value!r} is not a number") from None

    def json(self) -> dict:
        """The JSON object body; {} when there is none."""
        if not self.body.strip():
            return {}
        try:
            doc = json.loads(self.body)
        except ValueError as exc:
            raise HttpError(400, f"the request body is not JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise HttpError(400, "the request body must be a JSON object")
        return doc

    @property
    def upgrade(self) -> bool:
        return "upgrade" in self.headers.get("connection", "").lower()


@dataclass
class Reply:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)


def json_line(doc: object) -> bytes:
    return json.dumps(doc).encode() + b"\n"


def json_reply(doc: object, status: int = 200) -> Reply:
    return Reply(status, json_line(doc))


@dataclass
class Streamed:
    chunks: AsyncGenerator[bytes, None]  # closed however the answer ends
    content_type: str = "application/json"
    status: int = 200
    headers: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class Hijacked:
    run: Callable[[ByteStream], Awaitable[None]]
    content_type: str


Answer = Reply | Streamed | Hijacked
Handler = Callable[[Request], Awaitable[Answer]]
_VERSIONED = re.compile(r"^/v[0-9]+\.[0-9]+(/.*)$")


@dataclass
class Route:
    method: str
    regex: re.Pattern[str]
    handler: Handler
    streamed: bool  # its body is read by the handler (Request.pieces), not by http.py


class Router:
    def __init__(self) -> None:
        self.routes: list[Route] = []

    def add(self, method: str, pattern: str, handler: Handler, streamed: bool = False) -> None:
        """`pattern`: a path with {name} parts; {name:path} matches slashes too (image
        names have them). `streamed`: the handler reads the body as it comes."""
        regex = re.sub(r"\{(\w+):path\}", r"(?P<\1>.+)", pattern)
        regex = re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", regex)
        self.routes.append(Route(method, re.compile(f"^{regex}$"), handler, streamed))

    def find(self, method: str, path: str) -> tuple[Route, dict[str, str]]:
        allowed = False
        for route in self.routes:
            found = route.regex.match(path)
            if found:
                if route.method == method or (route.method == "GET" and method == "HEAD"):
                    return route, found.groupdict()
                allowed = True
        if allowed:
            raise HttpError(405, f"{method} is not allowed on {path}")
        raise HttpError(404, f"page not found: {method} {path}")


async def serve(listener: SocketListener, router: Router, headers: list[tuple[str, str]]) -> None:
    """Answer connections until cancelled. `headers`: sent with every answer (Api-Version,
    Server)."""

    async def one(stream: ByteStream) -> None:
        async with stream:
            try:
                await _Connection(stream, router, headers).run()
            except anyio.get_cancelled_exc_class():
                raise
            except Exception as exc:  # noqa: BLE001 - one connection never ends the server
                if _client_gone(exc):
                    return
                if isinstance(exc, h11.RemoteProtocolError):  # the client's; ours: below
                    log.info("docker API: a client broke HTTP: %s", exc)
                    return
                log.error("docker API: a connection failed: %r", exc, exc_info=exc)

    await listener.serve(one)


GONE = (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, ConnectionError)


def _client_gone(exc: BaseException) -> bool:
    """Whether exc (every exception of a group) is the client going away."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_client_gone(inner) for inner in exc.exceptions)
    return isinstance(exc, GONE)


class _Connection:
    def __init__(self, stream: ByteStream, router: Router, headers: list[tuple[str, str]]):
        self.stream = stream
        self.router = router
        self.headers = headers
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)

    async def run(self) -> None:
        while True:
            with anyio.move_on_after(IDLE):
                event = await self._next()
            if event is None or isinstance(event, h11.ConnectionClosed):
                return
            assert isinstance(event, h11.Request)
            try:
                request = _request(event)
                route, request.params = self.router.find(request.method, request.path)
                if route.streamed:
                    request.pieces = self._body
                else:
                    request.body = await self._whole_body()
                answer = await route.handler(request)
            except HttpError as exc:
                answer = _error(exc.status, str(exc))
            except Exception as exc:  # noqa: BLE001 - a bug answers 500, the agent stays up
                log.exception("docker API: %s %s failed", event.method, event.target)
                answer = _error(500, f"internal error: {exc}")
            if isinstance(answer, Hijacked):
                await self._hijack(request, answer)
                return
            await self._answer(event.method == b"HEAD", answer)
            if h11.DONE not in (self.conn.our_state, self.conn.their_state) or (
                self.conn.their_state is not h11.DONE  # a body left unread: a 413
            ):
                return
            self.conn.start_next_cycle()

    async def _next(self) -> h11.Event | None:
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                try:
                    data = await self.stream.receive(READ)
                except anyio.EndOfStream:
                    data = b""
                self.conn.receive_data(data)
                continue
            if event is h11.PAUSED:
                return None
            return event

    async def _whole_body(self) -> bytes:
        body = bytearray()
        async for piece in self._body():
            body += piece
            if len(body) > MAX_BODY:
                raise HttpError(413, f"a request body over {MAX_BODY} bytes")
        return bytes(body)

    async def _body(self) -> AsyncGenerator[bytes, None]:
        """The request's body, as it comes. A body left unread closes the connection
        after the answer (run)."""
        while True:
            part = await self._next()
            if isinstance(part, h11.Data):
                yield bytes(part.data)
            elif isinstance(part, h11.EndOfMessage) or part is None:
                return
            else:
                raise HttpError(400, "the request ended early")

    async def _send(self, event: h11.Event) -> None:
        data = self.conn.send(event)
        if data:
            await self.stream.send(data)

    async def _answer(self, head_only: bool, answer: Reply | Streamed) -> None:
        headers = [*self.headers, ("Content-Type", answer.content_type)]
        if self.conn.their_state is not h11.DONE:
            # A body left unread (a streamed route refused it, a 413): the connection
            # closes after this answer (run), and the client must know it, or it sends
            # its next request on it and reads a reset (docker-py's PUT archive to a
            # missing container, then a GET, failed so one time in a few).
            headers.append(("Connection", "close"))
        if isinstance(answer, Reply):
            headers += [*answer.headers, ("Content-Length", str(len(answer.body)))]
            await self._send(h11.Response(status_code=answer.status, headers=headers))
            if answer.body and not head_only:
                # A piece per send, each a turn of the event loop: an archive or a log of
                # 100 MB written at once held the loop while the client read (serving.py).
                for piece in pieces(answer.body):
                    await self._send(h11.Data(data=piece))
            await self._send(h11.EndOfMessage())
            return
        headers += [*answer.headers, ("Transfer-Encoding", "chunked")]
        await self._send(h11.Response(status_code=answer.status, headers=headers))
        async with contextlib.aclosing(answer.chunks) as chunks:
            try:
                async for chunk in chunks:
                    if chunk:
                        await self._send(h11.Data(data=chunk))
            except HttpError as exc:
                # Too late for a status: the body breaks off without its last chunk, and
                # the connection closes, so the client sees an answer cut short.
                log.info("docker API: an answer broke off: %s", exc)
                return
        await self._send(h11.EndOfMessage())

    async def _hijack(self, request: Request, answer: Hijacked) -> None:
        headers = [*self.headers, ("Content-Type", answer.content_type)]
        if request.upgrade:
            headers += [("Connection", "Upgrade"), ("Upgrade", "tcp")]
            response = h11.InformationalResponse(
                status_code=101, headers=headers, reason=b"UPGRADED"
            )
            await self._send(response)
            leftover, _ = self.conn.trailing_data
        else:  # dockerd's answer to a client that did not ask: 200, closed at the end
            head = b"HTTP/1.1 200 OK\r\n" + b"".join(
                f"{k}: {v}\r\n".encode() for k, v in [*headers, ("Connection", "close")]
            )
            await self.stream.send(head + b"\r\n")
            leftover = b""
        await answer.run(_Hijacked(self.stream, leftover))


def _unread(sock: socket.socket) -> int:
    """Bytes sent on a unix socket that its peer has not read yet (SIOCOUTQ)."""
    buf = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    return int.from_bytes(buf, sys.byteorder, signed=True)


async def _until_read(stream: ByteStream) -> None:
    """Wait (at most HEADERS_READ s) until the peer has read what was sent: the answer's
    headers. docker-py reads a hijacked answer's body from the raw socket, past the
    buffered reader that read the headers: bytes that came with the headers, in that
    reader's buffer, are lost to it (`attach(logs=True)` of an exited container, or
    the output of a quick exec, read as empty now and then)."""
    sock = stream.extra(SocketAttribute.raw_socket, None)
    if sock is None or sock.family != socket.AF_UNIX:
        return
    delay = HEADERS_POLL / 16  # a client reading already takes some microseconds
    with anyio.move_on_after(HEADERS_READ), contextlib.suppress(OSError):  # closed: the send says
        while _unread(sock) > 0:
            await anyio.sleep(delay)
            delay = min(2 * delay, HEADERS_POLL)


class _Hijacked(ByteStream):
    """The socket after the answer's headers: first what h11 had read past the request;
    the first send waits until the client has read the headers (_until_read)."""

    def __init__(self, stream: ByteStream, first: bytes) -> None:
        self.stream = stream
        self.first = first
        self.headers_read = False

    async def receive(self, max_bytes: int = READ) -> bytes:
        if self.first:
            data, self.first = self.first[:max_bytes], self.first[max_bytes:]
            return data
        return await self.stream.receive(max_bytes)

    async def send(self, item: bytes) -> None:
        if not self.headers_read:
            await _until_read(self.stream)
            self.headers_read = True
        await self.stream.send(item)

    async def send_eof(self) -> None:
        await self.stream.send_eof()

    async def aclose(self) -> None:
        await self.stream.aclose()

    @property
    def extra_attributes(self) -> Mapping[Any, Callable[[], Any]]:
        return self.stream.extra_attributes  # the socket's, for a watch on its peer


def _request(event: h11.Request) -> Request:
    """The request's line and headers; its body is read later (_Connection.run)."""
    target = urlsplit(event.target.decode("latin-1"))
    path = unquote(target.path)
    versioned = _VERSIONED.match(path)
    if versioned:
        path = versioned.group(1)
    return Request(
        event.method.decode(),
        path,
        parse_qs(target.query, keep_blank_values=True),
        {k.decode().lower(): v.decode("latin-1") for k, v in event.headers},
    )


def _error(status: int, message: str) -> Reply:
    return json_reply({"message": message}, status)
