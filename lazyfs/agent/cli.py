"""`lazyfs serve` and `lazyfs sandbox ...`: the node agent's command line (argument
parsing and output; the agent is lazyfs/agent/, its client lazyfs/client/sync.py)."""

from __future__ import annotations

import argparse
import json
import os
import select
import shlex
import stat
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from chunker.errors import BadInputError
from lazyfs.sandbox.confinement import add_confinement_flags
from lazyfs.sandbox.names import names_flags
from lazyfs.service_options import add_listen_options, tls_files

if TYPE_CHECKING:
    from collections.abc import Callable

    from lazyfs.client import Sandbox

DOCKER_SOCKET = "docker.sock"  # the Docker API's socket, beside the agent's by default
DIFF_LETTERS = {"added": "A", "changed": "C", "deleted": "D"}  # `docker diff`'s


def cmd_serve(args: argparse.Namespace) -> int:
    from lazyfs.agent.node import DEFAULT_TTL, AgentConfig
    from lazyfs.agent.server import serve
    from lazyfs.settings import Settings

    pools: dict[str, int] = {}
    warmups: dict[str, list[str]] = {}
    for item in args.pool:
        image, size, warmup = parse_pool(item)
        pools[image] = size
        if warmup:
            warmups[image] = warmup
    if args.max_sandboxes < 1:
        raise BadInputError("--max-sandboxes must be 1 or more")
    if args.warm < 0:
        raise BadInputError("--warm must be 0 or more")
    from lazyfs.sandbox.limits import flag_limits

    defaults = flag_limits(args)
    settings = Settings.from_env()  # the agent's entry point: read once, passed down
    config = AgentConfig(
        store_url=args.store or settings.store_url,
        cache_dir=Path(args.cache) if args.cache else settings.cache_dir,
        runtime=args.runtime,
        max_sandboxes=args.max_sandboxes,
        pools=pools,
        warmups=warmups,
        warm=args.warm,
        defaults=defaults,
        default_ttl=parse_default_ttl(args.default_ttl, DEFAULT_TTL),
    )
    socket = Path(args.socket) if args.socket else settings.agent_socket
    token_file = Path(args.token_file) if args.token_file else None
    # The Docker Engine API beside the agent's own socket unless told where, or "none".
    docker: Path | None = socket.parent / DOCKER_SOCKET
    if args.docker_socket:
        docker = None if args.docker_socket == "none" else Path(args.docker_socket)
    return serve(config, settings, socket, args.listen, token_file, tls_files(args), docker)


def parse_default_ttl(value: str | None, default: float) -> float | None:
    """`--default-ttl SECONDS`: a positive number, or 0 / none for no TTL."""
    if value is None:
        return default
    if value.strip().lower() in ("0", "none"):
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise BadInputError(f"--default-ttl {value!r} is not a number of seconds (or 0, none)")
    return seconds


def parse_pool(item: str) -> tuple[str, int, list[str]]:
    """`IMAGE=N[:COMMAND]` -> (image, N, warm-up argv). Image names hold no "=", so the
    first one ends the image (its tag's ":" stays in it); COMMAND is split as a shell
    splits words (quotes), but no shell runs it."""
    image, sep, rest = item.partition("=")
    size, _, command = rest.partition(":")
    if not sep or not image or not size.isdigit():
        raise BadInputError(f"--pool {item!r} is not IMAGE=N[:COMMAND]")
    try:
        warmup = shlex.split(command)
    except ValueError as exc:
        raise BadInputError(f"--pool {item!r}: its warm-up command {exc}") from None
    return image, int(size), warmup


def _client(args: argparse.Namespace):  # noqa: ANN202 - lazyfs.client.Client
    from lazyfs.client import Client

    return Client(socket=args.socket)


def cmd_create(args: argparse.Namespace) -> int:
    from lazyfs.sandbox.confinement import flag_confinement
    from lazyfs.sandbox.limits import flag_limits
    from lazyfs.sandbox.names import flag_names
    from lazyfs.sandbox.tmpfs import parse_tmpfs, tmpfs_flags

    flag_limits(args)  # a bad flag is named as a flag, before the agent names a field
    tmpfs = tmpfs_flags(args.tmpfs)
    parse_tmpfs(tmpfs, "--tmpfs")
    flag_names(args)
    confinement = flag_confinement(args)
    ttl = None
    if args.ttl is not None:
        try:
            ttl = float(args.ttl)
        except ValueError:
            raise BadInputError(f"--ttl {args.ttl!r} is not a number of seconds") from None
    with _client(args) as client:
        box = client.create(
            args.image,
            env=args.env,
            cpus=args.cpus,
            memory=args.memory,
            pids=args.pids,
            ttl=ttl,
            network=args.network,
            disk=args.disk,
            cpu_shares=args.cpu_shares,
            cpuset_cpus=args.cpuset_cpus,
            tmpfs=tmpfs,
            cap_drop=list(confinement.cap_drop) or None,
            read_only=confinement.read_only or None,
            ulimits={name: (soft, hard) for name, soft, hard in confinement.ulimits} or None,
            extra_hosts=args.add_host,
            hostname=args.hostname,
        )
    print(box.id)
    return 0


def cmd_exec(args: argparse.Namespace) -> int:
    if not args.command_args:
        raise BadInputError("lazyfs sandbox exec needs a command after --")
    timeout = None
    if args.timeout is not None:
        try:
            timeout = float(args.timeout)
        except ValueError:
            raise BadInputError(f"--timeout {args.timeout!r} is not a number of seconds") from None
    stdin = _stdin(args.interactive)
    with _client(args) as client:
        box = client.sandbox(args.id)
        status = 1
        for kind, data in box.exec_stream(args.command_args, timeout, cwd=args.cwd, stdin=stdin):
            if kind == "exit":
                status = data.exit_code  # type: ignore[union-attr]
                if data.timed_out:  # type: ignore[union-attr]
                    print(f"lazyfs: the command timed out after {timeout:g} s", file=sys.stderr)
            else:
                stream = sys.stdout.buffer if kind == "stdout" else sys.stderr.buffer
                stream.write(data)  # type: ignore[arg-type]
                stream.flush()
    return status


def _stdin(interactive: bool) -> bytes | None:
    """What to give the command on its stdin: ours with -i; else ours only if it is a
    file, or a pipe with data (or EOF) ready now, as in `echo x | lazyfs sandbox exec`.
    An inherited pipe or terminal that nobody writes to is not waited for."""
    if sys.stdin is None:
        return None
    try:
        fd = sys.stdin.fileno()
        mode = os.fstat(fd).st_mode
    except (OSError, ValueError):
        return None
    if not interactive:
        if os.isatty(fd):
            return None
        if not stat.S_ISREG(mode):
            if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
                return None
            if not select.select([fd], [], [], 0)[0]:
                return None
    return sys.stdin.buffer.read() or None


def _split(spec: str) -> tuple[str | None, str]:
    """ID:PATH -> (ID, PATH); a local path -> (None, path)."""
    box, sep, path = spec.partition(":")
    if sep and box.startswith("lazyfs-") and path.startswith("/"):
        return box, path
    return None, spec


def cmd_cp(args: argparse.Namespace) -> int:
    src_box, src = _split(args.src)
    dst_box, dst = _split(args.dst)
    if (src_box is None) == (dst_box is None):
        raise BadInputError(
            "lazyfs sandbox cp: copy SRC ID:/DST or ID:/SRC DST (one side in a sandbox)"
        )
    with _client(args) as client:
        if dst_box is not None:
            try:
                data = Path(src).read_bytes()
            except OSError as exc:
                raise BadInputError(f"{src}: {exc.strerror}") from None
            client.sandbox(dst_box).write_file(dst, data)
        else:
            assert src_box is not None
            data = client.sandbox(src_box).read_file(src)
            if dst == "-":
                sys.stdout.buffer.write(data)
            else:
                Path(dst).write_bytes(data)
    return 0


def cmd_update(args: argparse.Namespace) -> int:
    from lazyfs.sandbox.limits import flag_limits

    flag_limits(args)  # a bad flag is named as a flag, before the agent names a field
    with _client(args) as client:
        view = client.sandbox(args.id).update(
            cpus=args.cpus,
            memory=args.memory,
            pids=args.pids,
            disk=args.disk,
            cpu_shares=args.cpu_shares,
            cpuset_cpus=args.cpuset_cpus,
        )
    print(json.dumps(view["limits"]))
    return 0


def _each(args: argparse.Namespace, act: Callable[[Sandbox], object]) -> int:
    """act on each sandbox of args.ids, in order; the first failure ends the command."""
    with _client(args) as client:
        for box_id in args.ids:
            act(client.sandbox(box_id))
    return 0


def cmd_pause(args: argparse.Namespace) -> int:
    return _each(args, lambda sb: sb.pause())


def cmd_unpause(args: argparse.Namespace) -> int:
    return _each(args, lambda sb: sb.unpause())


def cmd_diff(args: argparse.Namespace) -> int:
    with _client(args) as client:
        found = client.sandbox(args.id).changes()
    if args.json:
        print(json.dumps(found))
        return 0
    for change in found:  # as `docker diff` prints them
        print(f"{DIFF_LETTERS[change['kind']]} {change['path']}")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    with _client(args) as client:
        used = client.sandbox(args.id).stats()
    if args.json:
        print(json.dumps(used))
        return 0

    def mib(n: int | None) -> str:
        return "no limit" if n is None else f"{n / 2**20:.1f} MiB"

    pids_limit = "no limit" if used["pids_limit"] is None else used["pids_limit"]
    print(
        f"cpu {used['cpu_seconds']:.2f} s  memory {mib(used['memory'])} of"
        f" {mib(used['memory_limit'])}  pids {used['pids']} of {pids_limit}"
    )
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    return _each(args, lambda sb: sb.delete())


def cmd_ls(args: argparse.Namespace) -> int:
    with _client(args) as client:
        boxes = client.list()
    if args.json:
        print(json.dumps(boxes, indent=2))
        return 0
    print(f"{'ID':<20} {'STATE':<9} {'POOL':<5} IMAGE")
    for b in boxes:
        state = "paused" if b.get("paused") else b["state"]
        print(f"{b['id']:<20} {state:<9} {'yes' if b['from_pool'] else 'no':<5} {b['image']}")
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser(
        "serve",
        help="run the node agent (sandboxes, pools, HTTP API)",
        description="Run the node agent: sandboxes, warm pools and their HTTP API (docs/api.md).",
    )
    sp.set_defaults(func=cmd_serve)
    sp.add_argument(
        "--socket",
        metavar="PATH",
        default=None,
        help="unix socket (default: $LAZYFS_AGENT_SOCKET or /run/lazyfs/agent.sock)",
    )
    add_listen_options(sp)
    sp.add_argument(
        "--docker-socket",
        metavar="PATH",
        default=None,
        help="answer the Docker Engine API on this unix socket (root-only; default:"
        " docker.sock beside --socket; none: not at all)",
    )
    sp.add_argument(
        "--default-ttl",
        metavar="SECONDS",
        default=None,
        help="a sandbox's ttl when its client sets none (default 3600; 0 or none: no TTL)",
    )
    sp.add_argument(
        "--store", metavar="URL", default=None, help="file:///PATH or s3://BUCKET/PREFIX"
    )
    sp.add_argument("--cache", metavar="DIR", default=None, help="node cache directory")
    sp.add_argument(
        "--pool",
        metavar="IMAGE=N[:COMMAND]",
        action="append",
        default=[],
        help="keep N ready sandboxes of IMAGE, after running the warm-up COMMAND once"
        " (its reads fill the node cache); repeatable",
    )
    sp.add_argument(
        "--warm",
        metavar="N",
        type=int,
        default=0,
        help="keep N generic sandboxes ready, which a create of any image whose user is"
        " root takes when its own pool has none (default 0)",
    )
    sp.add_argument("--runtime", metavar="PATH", default="runc", help="OCI runtime (default: runc)")
    sp.add_argument(
        "--max-sandboxes",
        metavar="N",
        type=int,
        default=100,
        help="refuse new sandboxes past N (default 100)",
    )
    # Per-sandbox defaults, for creates that do not ask (issue 20: a sandbox without
    # limits could take the node's memory). 4G: several times what a test suite or a
    # build in these images takes; the writable layer's pages count in it too.
    sp.add_argument(
        "--memory",
        metavar="SIZE",
        default="4G",
        help="memory limit of a sandbox whose create sets none (default 4G)",
    )
    sp.add_argument(
        "--pids",
        metavar="N",
        default="4096",
        help="process limit of a sandbox whose create sets none (default 4096)",
    )
    sp.add_argument(
        "--disk",
        metavar="SIZE",
        default="10G",
        help="writable-layer size of a sandbox whose create sets none (default 10G)",
    )
    sp.add_argument(
        "--cpus",
        metavar="N",
        default=None,
        help="CPU limit of a sandbox whose create sets none (default: none)",
    )

    box = sub.add_parser(
        "sandbox",
        help="sandboxes on the node agent (lazyfs serve)",
        description="Sandboxes on the node agent that `lazyfs serve` runs on this node.",
    )
    boxes = box.add_subparsers(dest="sandbox_command", required=True, metavar="COMMAND")

    def command(name: str, func, help: str) -> argparse.ArgumentParser:  # noqa: ANN001
        p = boxes.add_parser(name, help=help, description=help)
        p.add_argument("--socket", metavar="PATH", default=None, help="the agent's unix socket")
        p.set_defaults(func=func)
        return p

    p = command("create", cmd_create, "make a sandbox of IMAGE; prints its id")
    p.add_argument("image", metavar="IMAGE")
    p.add_argument("--env", metavar="K=V", action="append", default=[], help="repeatable")
    p.add_argument(
        "--tmpfs",
        metavar="PATH[:OPTIONS]",
        action="append",
        default=[],
        help="a tmpfs of its own at PATH, e.g. /scratch:size=64m (docker's); repeatable",
    )
    add_confinement_flags(p)
    names_flags(p)
    _limit_flags(p, "the agent's")
    p.add_argument(
        "--ttl",
        metavar="SECONDS",
        default=None,
        help="delete it after this long (default: the agent's --default-ttl)",
    )
    p.add_argument("--network", action="store_true", help="share the host's network")

    p = command("exec", cmd_exec, "run a command in a sandbox; exits with its status")
    p.add_argument("id", metavar="ID")
    p.add_argument("--timeout", metavar="SECONDS", default=None)
    p.add_argument("--cwd", metavar="DIR", default=None)
    p.add_argument(
        "-i",
        "--interactive",
        action="store_true",
        help="pass stdin to the command, waiting for its end (default: only a file, or a"
        " pipe that has data now)",
    )
    p.add_argument("command_args", nargs="*", metavar="-- COMMAND [ARG...]")

    p = command("cp", cmd_cp, "copy a file into (SRC ID:DST) or out of (ID:SRC DST) a sandbox")
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST")

    p = command("update", cmd_update, "change a running sandbox's limits; prints them")
    p.add_argument("id", metavar="ID")
    _limit_flags(p, "unchanged")

    p = command("pause", cmd_pause, "freeze every process of sandboxes")
    p.add_argument("ids", nargs="+", metavar="ID")

    p = command("unpause", cmd_unpause, "let paused sandboxes run again")
    p.add_argument("ids", nargs="+", metavar="ID")

    p = command("diff", cmd_diff, "what a sandbox changed in its image's files (A, C, D)")
    p.add_argument("id", metavar="ID")
    p.add_argument("--json", action="store_true")

    p = command("stats", cmd_stats, "what a sandbox uses now: CPU time, memory, processes")
    p.add_argument("id", metavar="ID")
    p.add_argument("--json", action="store_true")

    p = command("rm", cmd_rm, "delete sandboxes")
    p.add_argument("ids", nargs="+", metavar="ID")

    p = command("ls", cmd_ls, "list the agent's sandboxes")
    p.add_argument("--json", action="store_true")


def _limit_flags(p: argparse.ArgumentParser, unset: str) -> None:
    """A sandbox's limit flags (create's, update's); `unset`: what one not given means."""
    p.add_argument("--cpus", metavar="N", default=None, help=f"CPU limit (default: {unset})")
    p.add_argument(
        "--cpu-shares",
        metavar="N",
        default=None,
        help=f"relative CPU weight when CPUs are contended, 2-262144 (default: {unset})",
    )
    p.add_argument(
        "--cpuset-cpus",
        metavar="LIST",
        default=None,
        help=f"the CPUs it may run on, e.g. 0-1,3 (default: {unset})",
    )
    p.add_argument("--memory", metavar="SIZE", default=None, help=f"(default: {unset})")
    p.add_argument("--pids", metavar="N", default=None, help=f"(default: {unset})")
    p.add_argument(
        "--disk",
        metavar="SIZE",
        default=None,
        help=f"size of its writable layer (files and inodes; default: {unset})",
    )
