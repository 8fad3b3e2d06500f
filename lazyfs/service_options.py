"""The command-line options every resident service (`lazyfs serve`, `lazyfs gateway`)
shares for its TCP listener (lazyfs/serving.py's tcp_listener takes them). Only argparse
here: every `lazyfs` command builds its parser with these, `lazyfs run` too."""

from __future__ import annotations

import argparse
from pathlib import Path

from chunker.errors import BadInputError


def add_listen_options(parser: argparse.ArgumentParser) -> None:
    """--listen, --token-file, --tls-cert and --tls-key (tcp_listener, tls_files)."""
    parser.add_argument(
        "--listen", metavar="HOST:PORT", default=None, help="also serve TCP (needs --token-file)"
    )
    parser.add_argument(
        "--token-file", metavar="FILE", default=None, help="the bearer token TCP clients must send"
    )
    parser.add_argument(
        "--tls-cert",
        metavar="FILE",
        default=None,
        help="serve TCP over TLS with this certificate chain (PEM); needed off loopback",
    )
    parser.add_argument(
        "--tls-key", metavar="FILE", default=None, help="the --tls-cert's key (PEM)"
    )


def tls_files(args: argparse.Namespace) -> tuple[Path, Path] | None:
    """(--tls-cert, --tls-key), both or neither, and only with --listen."""
    if not (args.tls_cert or args.tls_key):
        return None
    if not (args.tls_cert and args.tls_key):
        raise BadInputError("--tls-cert and --tls-key go together")
    if args.listen is None:
        raise BadInputError("--tls-cert is for the TCP listener: give --listen HOST:PORT too")
    return Path(args.tls_cert), Path(args.tls_key)
