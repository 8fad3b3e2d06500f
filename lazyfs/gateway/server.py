"""`lazyfs gateway`: its sockets (as the agent's: lazyfs/serving.py), the fleet's polling
and the pools' reconciling beside the API, until SIGTERM or SIGINT. Nothing is cleaned up
on the nodes when it stops: the sandboxes are theirs, and any replica serves them."""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import anyio

from lazyfs.fds import raise_open_files_limit
from lazyfs.gateway.api import build_app
from lazyfs.gateway.fleet import Fleet, FleetConfig
from lazyfs.gateway.metrics import GatewayMetrics
from lazyfs.gateway.pools import FleetPools
from lazyfs.serving import (
    BearerAuth,
    QuietServer,
    TcpListener,
    server_config,
    tcp_listener,
    unix_listener,
)

log = logging.getLogger("lazyfs.gateway")


@dataclass
class GatewayConfig:
    fleet: FleetConfig
    socket: Path
    listen: str | None = None
    token_file: Path | None = None
    tls: tuple[Path, Path] | None = None
    placement: str = "cache"
    per_node: int = 4  # a pool's share per node (pools.py)


def serve(config: GatewayConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
    tcp = tcp_listener(config.listen, config.token_file, config.tls) if config.listen else None
    fleet = Fleet(config.fleet)  # bad --node URLs are one error line, before any socket
    raise_open_files_limit()  # two per request it passes on
    anyio.run(_main, config, fleet, tcp, backend="asyncio", backend_options={"use_uvloop": True})
    return 0


async def _main(config: GatewayConfig, fleet: Fleet, tcp: TcpListener | None) -> None:
    sock = unix_listener(config.socket, "gateway")
    servers: list[tuple[QuietServer, object]] = []
    try:
        await fleet.start()
        pools = FleetPools(fleet, config.per_node)
        app = build_app(fleet, GatewayMetrics(fleet), config.placement, pools=pools)
        servers.append((QuietServer(server_config(app)), sock))
        if tcp is not None:
            guarded = BearerAuth(app, tcp.token)
            servers.append((QuietServer(server_config(guarded, tcp.tls)), tcp.sock))
        async with anyio.create_task_group() as background:
            background.start_soon(fleet.run, pools.reconcile)
            async with anyio.create_task_group() as serving:
                for server, listener in servers:
                    serving.start_soon(server.serve, [listener])
                serving.start_soon(_stop_on_signal, [server for server, _ in servers])
                healthy = len(fleet.healthy())
                print(
                    f"lazyfs gateway: listening on {config.socket};"
                    f" {healthy} of {len(fleet.nodes)} nodes answer",
                    file=sys.stderr,
                    flush=True,
                )
            background.cancel_scope.cancel()  # the servers finished their requests
    finally:
        await fleet.close()
        sock.close()
        if tcp is not None:
            tcp.sock.close()
        with contextlib.suppress(FileNotFoundError):
            config.socket.unlink()


async def _stop_on_signal(servers: list[QuietServer]) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            for server in servers:
                server.should_exit = True
            return
