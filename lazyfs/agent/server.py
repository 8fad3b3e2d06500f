"""`lazyfs serve`: the agent, its API on a unix socket (and optionally TCP with a bearer
token), until SIGTERM or SIGINT; then every sandbox is deleted and every tree released.

The API is served by uvicorn (httptools' parser) on asyncio with uvloop, the agent's
code is written against anyio. On trio and hypercorn a request cost the agent 0.5-0.6
ms of CPU (/health); here 0.3 ms round trip, client included (docs/design-changes.md).

The sockets are made here: the unix one with mode 0600 (the agent runs sandboxes as
root, so only root may ask it to), so that it exists, with its mode, before the agent
says it is listening, and the TCP one so that an address in use is one error line.

TCP carries the bearer token in every request, so it is served in plain HTTP only on a
loopback address; any other address needs TLS (--tls-cert, --tls-key: uvicorn's TLS on
the pre-bound socket). Loopback is no secret from a process that can read the host's
lo (a sandbox with CAP_NET_RAW in the host's network namespace could, before issue 20),
so TLS is worth having there too.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import signal
import socket
import ssl
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import uvicorn

from chunker.errors import BadInputError
from lazyfs.agent.api import BearerAuth, build_app
from lazyfs.agent.errors import AgentBusy
from lazyfs.agent.metrics import AgentMetrics
from lazyfs.agent.node import Agent, AgentConfig
from lazyfs.settings import Settings

log = logging.getLogger("lazyfs.agent")
SWITCH_INTERVAL = 0.0005  # seconds a thread may hold the GIL while another waits
# Connections the kernel queues before the agent accepts them. Past it a unix socket's
# connect fails at once (EAGAIN), so a burst of clients would be refused as if no agent
# were there: a backlog of 100 lost 74 of 200 creates made at once here.
BACKLOG = 2048
KEEP_ALIVE = 60.0  # seconds an idle client connection is kept (the client pools them)
GRACE = 2.0  # seconds requests in progress get to finish when the agent stops


def serve(
    config: AgentConfig,
    settings: Settings,
    socket_path: Path,
    listen: str | None = None,
    token_file: Path | None = None,
    tls: tuple[Path, Path] | None = None,
    docker_socket: Path | None = None,
) -> int:
    """`tls`: (certificate chain, key), PEM files, for the TCP listener. `docker_socket`:
    where to answer the Docker Engine API too (lazyfs/docker/)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)  # not its start-up lines
    token, tcp = None, None
    if listen is not None:
        if token_file is None:
            raise BadInputError("--listen needs --token-file (TCP clients must send a token)")
        host, port = _host_port(listen)
        if tls is None and not _is_loopback(host):
            raise BadInputError(
                f"--listen {listen}: plain HTTP would send the token in clear off this host;"
                " give --tls-cert FILE --tls-key FILE, or listen on 127.0.0.1"
            )
        if tls is not None:
            _check_tls(*tls)
        try:
            token = token_file.read_text().strip()
        except OSError as exc:
            raise BadInputError(f"--token-file {token_file}: {exc.strerror}") from None
        if not token:
            raise BadInputError(f"--token-file {token_file} is empty")
        tcp = _tcp_socket(listen, host, port)
    # The event loop answers requests while worker threads run Python too (a refill's
    # bundle): with the default 5 ms switch interval the loop waits up to that for the
    # GIL at each step, which is what a warm claim's first exec paid (9 ms instead of 3).
    sys.setswitchinterval(SWITCH_INTERVAL)
    agent = Agent(config, settings)
    anyio.run(
        _main,
        agent,
        socket_path,
        tcp,
        token,
        tls,
        docker_socket,
        backend="asyncio",
        backend_options={"use_uvloop": True},
    )
    return 0


async def _main(
    agent: Agent,
    socket_path: Path,
    tcp: socket.socket | None,
    token: str | None,
    tls: tuple[Path, Path] | None,
    docker_socket: Path | None,
) -> None:
    # What can fail on bad input runs outside the task group, so that it is one error
    # line (a task group would wrap it in an exception group).
    sock = _unix_socket(socket_path)
    unix = [(sock, socket_path)]
    try:
        await agent.prepare()  # first: another agent on this run dir is the error to give
        if docker_socket is not None:
            unix.append((_unix_socket(docker_socket), docker_socket))
    except BaseException:
        await agent.shutdown()
        for listener, path in unix:
            listener.close()
            path.unlink(missing_ok=True)
        raise
    async with anyio.create_task_group() as tasks:
        agent.start(tasks)
        metrics = AgentMetrics(agent)
        app = build_app(agent, metrics, tasks)
        servers = [(_Server(_config(app)), sock)]
        if tcp is not None and token is not None:
            servers.append((_Server(_config(BearerAuth(app, token), tls)), tcp))
        docker = anyio.CancelScope()  # the Docker API's server, stopped with the others
        try:
            async with anyio.create_task_group() as serving:
                for server, listener in servers:
                    serving.start_soon(server.serve, [listener])
                if docker_socket is not None:
                    serving.start_soon(_serve_docker, agent, tasks, unix[1][0], docker)
                stoppable = [server for server, _ in servers]
                serving.start_soon(_stop_on_signal, stoppable, docker)
                print(f"lazyfs serve: listening on {socket_path}", file=sys.stderr, flush=True)
        finally:
            log.info("stopping: deleting %d sandboxes", len(agent.boxes))
            await agent.shutdown()
            for listener, path in [*((listener, None) for _, listener in servers), *unix]:
                listener.close()
                if path is not None:
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
            tasks.cancel_scope.cancel()


async def _serve_docker(
    agent: Agent, tasks: anyio.abc.TaskGroup, sock: socket.socket, scope: anyio.CancelScope
) -> None:
    from anyio.abc import SocketListener

    from lazyfs.docker.api import DockerAPI
    from lazyfs.docker.http import serve as serve_http

    api = DockerAPI(agent, tasks)
    listener = await SocketListener.from_socket(sock)
    with scope:
        await serve_http(listener, api.router(), api.headers())


class _Server(uvicorn.Server):
    """uvicorn's server without its own signal handlers: SIGTERM and SIGINT are the
    agent's (_stop_on_signal stops every server, then the agent deletes its sandboxes);
    uvicorn's would raise the signal again once it stopped, ending the agent before it
    cleaned up."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _config(app: object, tls: tuple[Path, Path] | None = None) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        http="httptools",
        ws="none",
        lifespan="off",
        access_log=False,
        log_config=None,  # through the root handler, once
        timeout_keep_alive=KEEP_ALIVE,
        timeout_graceful_shutdown=GRACE,
        backlog=BACKLOG,  # asyncio listen()s again on the socket it is given
        ssl_certfile=str(tls[0]) if tls else None,
        ssl_keyfile=str(tls[1]) if tls else None,
    )


async def _stop_on_signal(servers: list[_Server], docker: anyio.CancelScope) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            for server in servers:
                server.should_exit = True
            docker.cancel()
            return


def _host_port(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise BadInputError(f"--listen {listen!r} is not HOST:PORT")
    return host.strip("[]"), int(port)  # [::1]:8080


def _is_loopback(host: str) -> bool:
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
    rather than a traceback once the agent runs."""
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


def _unix_socket(path: Path) -> socket.socket:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        probe = socket.socket(socket.AF_UNIX)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # a dead agent's socket
        else:
            raise AgentBusy(f"another agent answers on {path}")
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
