"""The sockets and HTTP servers of lazyfs's resident services (`lazyfs serve`, the node
agent, and `lazyfs gateway`): one way to listen, for both.

- A unix socket made with mode 0600 before the service says it listens (the agent runs
  sandboxes as root, and the gateway reaches every agent: only root may ask either).
- Optionally TCP, where every request needs `Authorization: Bearer <token>`
  (BearerAuth). The token travels in every request, so plain HTTP is allowed only on a
  loopback address; any other needs TLS (certificate chain and key, PEM). Loopback is no
  secret from a process that can read the host's lo, so TLS is worth having there too.
- uvicorn (httptools' parser) serves each socket without its own signal handlers: the
  service stops its servers itself and then cleans up (QuietServer).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import logging
import os
import re
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from chunker.errors import BadInputError, LazyfsError

# Connections the kernel queues before the service accepts them. Past it a unix socket's
# connect fails at once (EAGAIN), so a burst of clients would be refused as if nothing
# were there: a backlog of 100 lost 74 of 200 creates made at once on an agent.
BACKLOG = 2048
KEEP_ALIVE = 60.0  # seconds an idle client connection is kept (the clients pool them)
GRACE = 2.0  # seconds requests in progress get to finish when the service stops
T = TypeVar("T")


# The node agent's HTTP API (docs/api.md): path, handler name, methods. The agent and the
# gateway (which serves it unchanged for a fleet) both build their routes from it.
ENDPOINTS: list[tuple[str, str, list[str]]] = [
    ("/health", "health", ["GET"]),
    ("/metrics", "metrics", ["GET"]),
    ("/sandboxes", "list_boxes", ["GET"]),
    ("/sandboxes", "create", ["POST"]),
    ("/sandboxes/{id}", "get_box", ["GET"]),
    ("/sandboxes/{id}", "update_box", ["PATCH"]),
    ("/sandboxes/{id}", "delete_box", ["DELETE"]),
    ("/sandboxes/{id}/stats", "box_stats", ["GET"]),
    ("/sandboxes/{id}/changes", "box_changes", ["GET"]),
    ("/sandboxes/{id}/pause", "pause_box", ["POST"]),
    ("/sandboxes/{id}/unpause", "unpause_box", ["POST"]),
    ("/sandboxes/{id}/exec", "exec_buffered", ["POST"]),
    ("/sandboxes/{id}/exec/stream", "exec_stream", ["POST"]),
    ("/sandboxes/{id}/files", "read_file", ["GET"]),
    ("/sandboxes/{id}/files", "write_file", ["PUT"]),
    ("/sandboxes/{id}/dir", "list_dir", ["GET"]),
    ("/pools", "get_pools", ["GET"]),
    ("/pools/{image:path}", "set_pool", ["PUT"]),
    ("/warm", "set_warm", ["PUT"]),
]


Handler = Callable[[Request], Awaitable[Response]]


class ApiApp:
    """The API as an ASGI app: each request to its handler (by path and method), each
    failure answered by on_error (the service's error shape), never the service's end.

    Not Starlette's Router and its middleware stack (two exception middlewares, a
    wrapper per route, a regex per route tried in turn): through the gateway every call
    is served twice, and that stack was ~12% of the gateway's Python time per proxied
    request (docs/design-changes.md, "the gateway's own HTTP client"). Starlette's
    Request and Response are kept."""

    def __init__(
        self,
        handlers: dict[str, Handler],
        on_error: Callable[[Exception], Response],
        endpoints: list[tuple[str, str, list[str]]] = ENDPOINTS,
    ) -> None:
        self.on_error = on_error
        routes: dict[str, dict[str, Handler]] = {}  # path template -> method -> handler
        for path, name, methods in endpoints:
            for method in methods:
                routes.setdefault(path, {})[method] = handlers[name]
        self.fixed = {path: m for path, m in routes.items() if "{" not in path}
        self.patterns = [
            (re.compile(_PARAM.sub(_param_regex, path) + "$"), m)
            for path, m in routes.items()
            if "{" in path
        ]

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return  # no lifespan, no websockets
        path = scope["path"]
        by_method = self.fixed.get(path)
        if by_method is None:
            for pattern, methods in self.patterns:
                if (m := pattern.match(path)) is not None:
                    scope["path_params"] = m.groupdict()
                    by_method = methods
                    break
        handler = by_method.get(scope["method"]) if by_method is not None else None
        if handler is None:
            response = _no_route(scope["method"], path, by_method)
        else:
            try:
                response = await handler(Request(scope, receive, send))
            except Exception as exc:
                response = self.on_error(exc)
        await response(scope, receive, send)


_PARAM = re.compile(r"\{(\w+)(:path)?\}")


def _param_regex(m: re.Match[str]) -> str:
    return f"(?P<{m[1]}>.+)" if m[2] else f"(?P<{m[1]}>[^/]+)"


def _no_route(method: str, path: str, by_method: dict[str, Handler] | None) -> Response:
    if by_method is None:
        message = f"no such endpoint: {path}"
        return JSONResponse({"error": "not_found", "message": message}, status_code=404)
    allowed = ", ".join(sorted(by_method))
    return JSONResponse(
        {"error": "method_not_allowed", "message": f"{method} {path}: allowed {allowed}"},
        status_code=405,
        headers={"Allow": allowed},
    )


class SocketBusy(LazyfsError):
    """Another live service answers on the unix socket asked for."""


@dataclass
class TcpListener:
    sock: socket.socket
    token: str
    tls: tuple[Path, Path] | None  # (certificate chain, key)


def tcp_listener(
    listen: str, token_file: Path | None, tls: tuple[Path, Path] | None
) -> TcpListener:
    """The bound TCP socket for `--listen HOST:PORT` with its token and TLS files, or
    one BadInputError line: no token, plain HTTP off loopback, TLS files that do not
    load, an address that cannot be bound."""
    if token_file is None:
        raise BadInputError("--listen needs --token-file (TCP clients must send a token)")
    host, port = host_port(listen, "--listen")
    if tls is None and not is_loopback(host):
        raise BadInputError(
            f"--listen {listen}: plain HTTP would send the token in clear off this host;"
            " give --tls-cert FILE --tls-key FILE, or listen on 127.0.0.1"
        )
    if tls is not None:
        _check_tls(*tls)
    token = read_token(token_file, "--token-file")
    return TcpListener(_tcp_socket(listen, host, port), token, tls)


def read_token(path: Path, flag: str) -> str:
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise BadInputError(f"{flag} {path}: {exc.strerror}") from None
    if not token:
        raise BadInputError(f"{flag} {path} is empty")
    return token


def host_port(text: str, flag: str) -> tuple[str, int]:
    """HOST and PORT of "HOST:PORT" ("[::1]:8080" too), or BadInputError naming flag."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise BadInputError(f"{flag} {text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback one (a name is looked up: an
    address of "localhost" may be set to anything in /etc/hosts)."""
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False  # _tcp_socket says why
    addresses = {ipaddress.ip_address(info[4][0].split("%")[0]) for info in found}
    return bool(addresses) and all(a.is_loopback for a in addresses)


def _check_tls(cert: Path, key: Path) -> None:
    """The certificate and key load (as uvicorn will load them), or one error line now
    rather than a traceback once the service runs."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key)
    except OSError as exc:
        raise BadInputError(f"--tls-cert/--tls-key: {exc.filename}: {exc.strerror}") from None
    except ssl.SSLError as exc:
        raise BadInputError(f"--tls-cert {cert} / --tls-key {key}: {exc.reason or exc}") from None


def _tcp_socket(listen: str, host: str, port: int) -> socket.socket:
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        raise BadInputError(f"--listen {listen}: {exc.strerror or exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise BadInputError(f"--listen {listen}: {exc.strerror or exc}") from None
    return sock


def unix_listener(path: Path, what: str) -> socket.socket:
    """The service's unix socket at path, mode 0600; SocketBusy if a live `what` (e.g.
    "agent") answers there; a dead one's socket file is replaced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        probe = socket.socket(socket.AF_UNIX)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # a dead service's socket
        else:
            raise SocketBusy(f"another {what} answers on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    sock.listen(BACKLOG)
    return sock


class QuietServer(uvicorn.Server):
    """uvicorn's server without its own signal handlers: SIGTERM and SIGINT are the
    service's (it stops every server, then cleans up); uvicorn's would raise the signal
    again once it stopped, ending the service before it cleaned up."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def server_config(app: object, tls: tuple[Path, Path] | None = None) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        http="httptools",
        ws="none",
        lifespan="off",
        access_log=False,
        proxy_headers=False,  # nothing reads a client's address; the middleware cost a step
        log_config=None,  # through the root handler, once
        timeout_keep_alive=KEEP_ALIVE,
        timeout_graceful_shutdown=GRACE,
        backlog=BACKLOG,  # asyncio listen()s again on the socket it is given
        ssl_certfile=str(tls[0]) if tls else None,
        ssl_keyfile=str(tls[1]) if tls else None,
    )


class BearerAuth:
    """ASGI middleware for a TCP listener: every request needs the bearer token."""

    def __init__(self, app: Callable, token: str) -> None:
        self.app = app
        self.token = token.encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, b"Bearer " + self.token):
                response = JSONResponse(
                    {"error": "unauthorized", "message": "a valid bearer token is required"},
                    status_code=401,
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


PIECE = 2**20  # bytes of a big answer written per turn of the event loop


def pieces(body: bytes) -> Iterator[memoryview]:
    """body in slices of at most PIECE bytes (views: nothing is copied)."""
    view = memoryview(body)
    for at in range(0, len(view), PIECE):
        yield view[at : at + PIECE]


class PiecewiseResponse(Response):
    """A Response whose body, when it is over PIECE bytes, is written a piece at a time
    with a turn of the event loop between pieces (a buffered exec's output, a file read).

    Written at once, the transport writes all it can before it returns, and a client
    that reads as fast as it comes keeps it writing: one 80 MB answer held the agent's
    event loop 132 ms, and six of them at once stalled /health for 0.5-1.0 s in 4 of 17
    runs of tests/security/test_file_api.py."""

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if len(self.body) <= PIECE:  # nearly every answer: as Starlette sends it
            await super().__call__(scope, receive, send)
            return
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        sent, size = 0, len(self.body)
        for piece in pieces(self.body):
            sent += len(piece)
            await send({"type": "http.response.body", "body": piece, "more_body": sent < size})
            await asyncio.sleep(0)  # the loop's other work, between pieces


class BreakableResponse(StreamingResponse):
    """A streamed answer whose source may fail after the head is sent (a file the
    sandbox grows past the limit while it is read, the read's timeout). Too late for a
    status: the body breaks off without its last chunk and the connection closes, so
    the client sees an answer cut short, never a short one taken for the whole. The
    failure is one line of the service's log (uvicorn adds one, "returned without
    completing response"), not a traceback: the sandbox chose it, the service is fine."""

    def __init__(self, pieces: AsyncIterator[bytes], what: str, media_type: str) -> None:
        super().__init__(pieces, media_type=media_type)
        self.pieces, self.what = pieces, what

    async def stream_response(self, send: Callable) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        while True:
            try:
                piece = await anext(self.pieces)
            except StopAsyncIteration:
                break
            except (LazyfsError, OSError) as exc:
                logging.getLogger("lazyfs.serving").warning("%s broke off: %s", self.what, exc)
                return
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def unless_client_leaves(request: Request, work: Coroutine[Any, Any, T]) -> T | None:
    """work's result, or None if the client hung up first: the work is then cancelled
    (for an exec, that kills the command, as when a streaming client goes away; through
    the gateway, its call to the node is closed, which the agent takes as its own client
    leaving). The request's body has been read, so the next ASGI message is the
    disconnect.

    The work runs in the request's own task and one watcher cancels it: not in an anyio
    task group beside the watcher, which cost 0.4-0.5 ms of each proxied create and exec
    (docs/design-changes.md, session 19) and ~0.1 ms of each exec on the agent (session
    27, bench/agent_ab.py), nor in a task of its own and asyncio.wait."""
    task = asyncio.current_task()
    assert task is not None
    state = {"running": True, "left": False}

    def on_gone(watch: asyncio.Future[None]) -> None:
        if state["running"] and not watch.cancelled() and watch.exception() is None:
            state["left"] = True
            task.cancel()

    gone = asyncio.ensure_future(_disconnect(request))
    gone.add_done_callback(on_gone)
    try:
        return await work
    except asyncio.CancelledError:
        if state["left"]:
            task.uncancel()
            return None
        raise
    finally:
        state["running"] = False
        gone.cancel()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
