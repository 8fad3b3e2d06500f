"""`lazyfs gateway`: the command line (lazyfs/gateway/server.py runs it)."""

from __future__ import annotations

import argparse
from pathlib import Path
from urllib.parse import urlsplit

from chunker.errors import BadInputError
from lazyfs.service_options import add_listen_options, tls_files

DEFAULT_SOCKET = "/run/lazyfs/gateway.sock"


def cmd_gateway(args: argparse.Namespace) -> int:
    # ssl here, not at the top: every `lazyfs` command builds this parser, and ssl's import
    # (~10 ms warm, ~25 ms from a cold page cache) was on `lazyfs run`'s path.
    import ssl

    from lazyfs.gateway.fleet import FleetConfig
    from lazyfs.gateway.server import GatewayConfig, serve
    from lazyfs.serving import host_port, is_loopback, read_token

    if not args.node and not args.nodes_dns:
        raise BadInputError("lazyfs gateway needs --node URL (repeatable) or --nodes-dns HOST:PORT")
    for url in args.node:
        parts = urlsplit(url)
        if parts.scheme == "http" and parts.hostname and not is_loopback(parts.hostname):
            raise BadInputError(
                f"--node {url}: plain HTTP would send the agents' token in clear; use https://"
            )
    if args.nodes_dns:
        host_port(args.nodes_dns, "--nodes-dns")
    if args.pool_per_node < 1:
        raise BadInputError("--pool-per-node must be 1 or more")
    if not args.poll > 0:
        raise BadInputError("--poll must be a positive number of seconds")
    token = (
        read_token(Path(args.node_token_file), "--node-token-file")
        if args.node_token_file
        else None
    )
    verify: ssl.SSLContext | bool = True
    if args.node_ca:
        try:
            verify = ssl.create_default_context(cafile=args.node_ca)
        except (OSError, ssl.SSLError) as exc:
            raise BadInputError(f"--node-ca {args.node_ca}: {exc}") from None
    tls = tls_files(args)
    config = GatewayConfig(
        fleet=FleetConfig(
            urls=list(args.node),
            dns=args.nodes_dns,
            token=token,
            verify=verify,
            poll=args.poll,
        ),
        socket=Path(args.socket),
        listen=args.listen,
        token_file=Path(args.token_file) if args.token_file else None,
        tls=tls,
        placement=args.placement,
        per_node=args.pool_per_node,
    )
    return serve(config)


def add_parser(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser(
        "gateway",
        help="one address for many node agents, placing each sandbox where its image is warm",
        description="Serve the node agent's API for a fleet of agents (docs/gateway.md).",
    )
    sp.set_defaults(func=cmd_gateway)
    sp.add_argument(
        "--socket",
        metavar="PATH",
        default=DEFAULT_SOCKET,
        help=f"unix socket (default {DEFAULT_SOCKET})",
    )
    add_listen_options(sp)
    sp.add_argument(
        "--node",
        metavar="URL",
        action="append",
        default=[],
        help="a node agent's URL, https://HOST:PORT (repeatable)",
    )
    sp.add_argument(
        "--nodes-dns",
        metavar="HOST:PORT",
        default=None,
        help="a DNS name that resolves to every agent (e.g. a headless Service), looked up"
        " again every 10 polls; each address is https://ADDRESS:PORT",
    )
    sp.add_argument(
        "--node-token-file", metavar="FILE", default=None, help="the agents' bearer token"
    )
    sp.add_argument(
        "--node-ca",
        metavar="FILE",
        default=None,
        help="check the agents' certificates against this CA (PEM; default: the system's)",
    )
    sp.add_argument(
        "--placement",
        choices=("cache", "random"),
        default="cache",
        help="cache: where the image is warm, else its rendezvous order with bounded loads"
        " (default); random: for comparison",
    )
    sp.add_argument(
        "--pool-per-node",
        metavar="N",
        type=int,
        default=4,
        help="a pool set here is spread over its image's first nodes, N each (default 4)",
    )
    sp.add_argument(
        "--poll",
        metavar="SECONDS",
        type=float,
        default=1.0,
        help="how often each node's placement report is asked for (default 1)",
    )
