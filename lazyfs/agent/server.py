"""`lazyfs serve`: the agent, its API on a unix socket (and optionally TCP with a bearer
token), until SIGTERM or SIGINT; then every sandbox is deleted and every tree released.

The unix socket is made here (mode 0600: the agent runs sandboxes as root, so only root
may ask it to) and handed to hypercorn as fd://, so that it exists, with its mode, before
the agent says it is listening.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
from functools import partial
from pathlib import Path

import trio
from hypercorn.config import Config as HyperConfig
from hypercorn.trio import serve as hypercorn_serve

from chunker.errors import BadInputError
from lazyfs.agent.api import BearerAuth, build_app
from lazyfs.agent.errors import AgentBusy
from lazyfs.agent.metrics import AgentMetrics
from lazyfs.agent.node import Agent, AgentConfig

log = logging.getLogger("lazyfs.agent")
SWITCH_INTERVAL = 0.0005  # seconds a thread may hold the GIL while another waits
# Connections the kernel queues before the agent accepts them. Past it a unix socket's
# connect fails at once (EAGAIN), so a burst of clients would be refused as if no agent
# were there: hypercorn's default of 100 lost 74 of 200 creates made at once here.
BACKLOG = 2048


def serve(
    config: AgentConfig,
    socket_path: Path,
    listen: str | None = None,
    token_file: Path | None = None,
) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    token = None
    if listen is not None:
        if token_file is None:
            raise BadInputError("--listen needs --token-file (TCP clients must send a token)")
        try:
            token = token_file.read_text().strip()
        except OSError as exc:
            raise BadInputError(f"--token-file {token_file}: {exc.strerror}") from None
        if not token:
            raise BadInputError(f"--token-file {token_file} is empty")
        host, sep, port = listen.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise BadInputError(f"--listen {listen!r} is not HOST:PORT")
    # The trio thread answers requests while worker threads run Python too (a refill's
    # bundle): with the default 5 ms switch interval the loop waits up to that for the
    # GIL at each step, which is what a warm claim's first exec paid (9 ms instead of 3).
    sys.setswitchinterval(SWITCH_INTERVAL)
    agent = Agent(config)
    trio.run(_main, agent, socket_path, listen, token)
    return 0


async def _main(agent: Agent, socket_path: Path, listen: str | None, token: str | None) -> None:
    # What can fail on bad input runs outside the nursery, so that it is one error line
    # (a nursery would wrap it in an exception group).
    sock = _unix_socket(socket_path)
    try:
        await agent.prepare()
    except BaseException:
        await agent.shutdown()
        sock.close()
        socket_path.unlink(missing_ok=True)
        raise
    async with trio.open_nursery() as nursery:
        agent.start(nursery)
        metrics = AgentMetrics(agent)
        app = build_app(agent, metrics, nursery)
        stop = trio.Event()
        nursery.start_soon(_watch_signals, stop)
        try:
            async with trio.open_nursery() as servers:
                # A dup: hypercorn closes the socket it was given when it stops.
                unix = _hyper([f"fd://{os.dup(sock.fileno())}"])
                servers.start_soon(partial(hypercorn_serve, app, unix, shutdown_trigger=stop.wait))
                if listen is not None and token is not None:
                    servers.start_soon(
                        partial(
                            hypercorn_serve,
                            BearerAuth(app, token),
                            _hyper([listen]),
                            shutdown_trigger=stop.wait,
                        )
                    )
                print(f"lazyfs serve: listening on {socket_path}", file=sys.stderr, flush=True)
        finally:
            log.info("stopping: deleting %d sandboxes", len(agent.boxes))
            await agent.shutdown()
            sock.close()
            with contextlib.suppress(FileNotFoundError):
                socket_path.unlink()
            nursery.cancel_scope.cancel()


def _hyper(binds: list[str]) -> HyperConfig:
    config = HyperConfig()
    config.bind = binds
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")  # through the root handler, once
    config.graceful_timeout = 2.0
    config.keep_alive_timeout = 60.0
    config.backlog = BACKLOG  # hypercorn listen()s again on the socket it is given
    return config


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
    sock.set_inheritable(True)
    return sock


async def _watch_signals(stop: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            stop.set()
            return
