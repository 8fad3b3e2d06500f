"""`lazyfs serve`: the agent, its API on a unix socket (and optionally TCP with a bearer
token), until SIGTERM or SIGINT; then every sandbox is deleted and every tree released.

The API is served by uvicorn (httptools' parser) on asyncio with uvloop, the agent's
code is written against anyio. On trio and hypercorn a request cost the agent 0.5-0.6
ms of CPU (/health); here 0.3 ms round trip, client included (docs/design-changes.md).

The sockets (a unix one, mode 0600, and optionally TCP with a bearer token, TLS off
loopback) are made as lazyfs/serving.py makes them for every resident service, before
the agent says it is listening, so that an address in use is one error line.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import sys
from pathlib import Path

import anyio

from lazyfs.agent.api import build_app
from lazyfs.agent.metrics import AgentMetrics
from lazyfs.agent.node import Agent, AgentConfig
from lazyfs.fds import raise_open_files_limit
from lazyfs.serving import (
    BearerAuth,
    QuietServer,
    TcpListener,
    server_config,
    tcp_listener,
    unix_listener,
)
from lazyfs.settings import Settings

log = logging.getLogger("lazyfs.agent")
SWITCH_INTERVAL = 0.0005  # seconds a thread may hold the GIL while another waits


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
    tcp = tcp_listener(listen, token_file, tls) if listen is not None else None
    # The event loop answers requests while worker threads run Python too (a refill's
    # bundle): with the default 5 ms switch interval the loop waits up to that for the
    # GIL at each step, which is what a warm claim's first exec paid (9 ms instead of 3).
    sys.setswitchinterval(SWITCH_INTERVAL)
    raise_open_files_limit()  # a descriptor per sandbox, one per image held
    agent = Agent(config, settings)
    anyio.run(
        _main,
        agent,
        socket_path,
        tcp,
        docker_socket,
        backend="asyncio",
        backend_options={"use_uvloop": True},
    )
    return 0


async def _main(
    agent: Agent,
    socket_path: Path,
    tcp: TcpListener | None,
    docker_socket: Path | None,
) -> None:
    # What can fail on bad input runs outside the task group, so that it is one error
    # line (a task group would wrap it in an exception group).
    sock = unix_listener(socket_path, "agent")
    unix = [(sock, socket_path)]
    try:
        await agent.prepare()  # first: another agent on this run dir is the error to give
        if docker_socket is not None:
            unix.append((unix_listener(docker_socket, "agent"), docker_socket))
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
        servers = [(QuietServer(server_config(app)), sock)]
        if tcp is not None:
            guarded = BearerAuth(app, tcp.token)
            servers.append((QuietServer(server_config(guarded, tcp.tls)), tcp.sock))
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


async def _stop_on_signal(servers: list[QuietServer], docker: anyio.CancelScope) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            for server in servers:
                server.should_exit = True
            docker.cancel()
            return
