"""Published ports (`docker run -p 127.0.0.1:8080:80`, docker-py's `ports=`): the agent
listens on a host address and port and forwards each connection it accepts to the port
on the sandbox's own loopback.

A sandbox has a network namespace of its own with only `lo` and no route out; that stays
so. The agent reaches in rather than the sandbox out: the socket to the sandbox's port is
made in the sandbox's namespace (`socket_in`), then driven from the agent's event loop
like any other. Nothing is added to the sandbox (no veth, no route, no process).

Only loopback host addresses are allowed (127.0.0.0/8, ::1; HostIp "" is 127.0.0.1
here, where Docker's is every interface): a port on another address would put the
sandbox on the network for other hosts, which is a decision for whoever runs the agent,
not for a client of its Docker API. UDP is not forwarded (refused).

A container's ports listen from its create (so that a port in use fails the create, and
leaves no sandbox) until its main process exits or it is removed, as Docker's do while
a container runs; a start after an exit listens again (a port the kernel chose is chosen
anew, as Docker does). They also stop by themselves when the sandbox's PID 1 ends (the
sandbox deleted through the agent's own API, or by its TTL), so that the host port is
not held for a sandbox that is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import ipaddress
import logging
import os
import socket
import threading
from collections.abc import Iterable
from dataclasses import dataclass

import anyio
from anyio.abc import SocketListener, SocketStream, TaskGroup, TaskStatus

from lazyfs.docker.http import HttpError
from lazyfs.libc import libc

log = logging.getLogger("lazyfs.docker")
CLONE_NEWNET = 0x40000000
DEFAULT_IP = "127.0.0.1"  # HostIp "": loopback here, not every interface
READ = 64 * 2**10  # bytes copied at a time
BACKLOG = 128  # connections the kernel queues on a published port
CONNECT_TIMEOUT = 10.0  # seconds a connection into the sandbox may take (loopback: at once)


@dataclass(frozen=True)
class Binding:
    """One published port: the sandbox's TCP `port` on a host address and port, as asked."""

    port: int
    host_ip: str  # as asked: "" is DEFAULT_IP
    host_port: str  # as asked: "" (or "0") for one the kernel chooses
    publish_all: bool = False  # from PublishAllPorts, not from PortBindings

    @property
    def key(self) -> str:
        return f"{self.port}/tcp"

    @property
    def address(self) -> str:
        return self.host_ip or DEFAULT_IP

    def shown(self, host_port: int) -> str:
        """Docker's "IP:PORT" of the bound address, for messages."""
        ip = f"[{self.address}]" if ":" in self.address else self.address
        return f"{ip}:{host_port}"


# ---------------------------------------------------------------- what is asked


def bindings(host_config: dict, exposed: Iterable[str]) -> list[Binding]:
    """The ports to publish: HostConfig.PortBindings, and with PublishAllPorts every
    exposed TCP port not bound already (on a port the kernel chooses). HttpError 400
    for what cannot be granted."""
    raw = host_config.get("PortBindings") or {}
    if not isinstance(raw, dict):
        raise HttpError(400, "HostConfig.PortBindings must be an object")
    found: list[Binding] = []
    for key, entries in raw.items():
        port = _container_port(key)
        if entries is None:  # Docker's nil list: nothing published for it
            continue
        if not isinstance(entries, list):
            raise HttpError(400, f"PortBindings {key}: a list of bindings is expected")
        found += [_binding(port, key, entry) for entry in entries]
    if host_config.get("PublishAllPorts"):
        bound = {b.port for b in found}
        for key in exposed:
            port, proto = _split_key(key)
            if proto == "tcp" and port is not None and port not in bound:
                found.append(Binding(port, "", "", publish_all=True))
    return found


def echoed(found: list[Binding]) -> dict[str, list[dict[str, str]]]:
    """HostConfig.PortBindings as inspect shows it: what was asked, keys with their
    protocol."""
    shown: dict[str, list[dict[str, str]]] = {}
    for b in found:
        if not b.publish_all:
            shown.setdefault(b.key, []).append({"HostIp": b.host_ip, "HostPort": b.host_port})
    return shown


def exposed_ports(*sources: object) -> dict[str, dict]:
    """Config.ExposedPorts: the image's and the create's merged, keys with a protocol."""
    merged: dict[str, dict] = {}
    for source in sources:
        if isinstance(source, dict):
            merged.update({k if "/" in k else f"{k}/tcp": {} for k in source})
    return merged


def _split_key(key: str) -> tuple[int | None, str]:
    """("80/tcp" or "80") -> (80, "tcp"); (None, proto) when the port is not a number."""
    number, _, proto = str(key).partition("/")
    port = int(number) if number.isdigit() and 0 < int(number) < 65536 else None
    return port, (proto or "tcp").lower()


def _container_port(key: str) -> int:
    port, proto = _split_key(key)
    if port is None:
        raise HttpError(400, f"Invalid containerPort: {key}")
    if proto != "tcp":
        raise HttpError(
            400, f"PortBindings {key}: publishing {proto.upper()} ports is not supported (TCP only)"
        )
    return port


def _binding(port: int, key: str, entry: object) -> Binding:
    if entry is None:
        entry = {}
    if not isinstance(entry, dict):
        raise HttpError(400, f"PortBindings {key}: a binding is an object with HostIp, HostPort")
    host_ip = str(entry.get("HostIp") or "")
    host_port = str(entry.get("HostPort") or "")
    _check_host_ip(host_ip, key)
    if host_port and not (host_port.isdigit() and int(host_port) < 65536):
        if "-" in host_port:
            raise HttpError(
                400, f"PortBindings {key}: host port ranges ({host_port}) are not supported"
            )
        raise HttpError(400, f"Invalid hostPort: {host_port}")
    return Binding(port, host_ip, host_port)


def _check_host_ip(host_ip: str, key: str) -> None:
    """Loopback only: another address would expose the sandbox to other hosts."""
    if not host_ip:
        return
    try:
        address = ipaddress.ip_address(host_ip)
    except ValueError:
        raise HttpError(400, f"PortBindings {key}: invalid HostIp {host_ip!r}") from None
    if not address.is_loopback:
        raise HttpError(
            400,
            f"PortBindings {key}: HostIp {host_ip} is refused: a lazyfs sandbox's ports are"
            " published on loopback only (127.0.0.1 or ::1; an empty HostIp is 127.0.0.1),"
            " since another address would expose the sandbox to other hosts",
        )


# ---------------------------------------------------------------- what inspect and ps show


def port_map(exposed: Iterable[str], published: Published | None) -> dict[str, list | None]:
    """NetworkSettings.Ports: each exposed port, null when not published, else its
    bindings as `docker port` prints them."""
    shown: dict[str, list | None] = dict.fromkeys(exposed)
    for binding, host_port in _bound(published):
        entry = {"HostIp": binding.address, "HostPort": str(host_port)}
        shown[binding.key] = [*(shown.get(binding.key) or []), entry]
    return shown


def port_list(exposed: Iterable[str], published: Published | None) -> list[dict]:
    """`GET /containers/json`'s Ports: `docker ps`'s PORTS column."""
    found = _bound(published)
    shown: list[dict] = [
        {"IP": b.address, "PrivatePort": b.port, "PublicPort": host_port, "Type": "tcp"}
        for b, host_port in found
    ]
    bound = {b.key for b, _ in found}
    for key in exposed:
        port, proto = _split_key(key)
        if port is not None and key not in bound:
            shown.append({"PrivatePort": port, "Type": proto})
    return shown


def _bound(published: Published | None) -> list[tuple[Binding, int]]:
    return published.ports if published is not None and published.listening else []


# ---------------------------------------------------------------- forwarding


class Published:
    """A container's published ports while they listen: one listening socket per
    binding; each connection accepted is forwarded into the sandbox's network namespace
    (`netns`, a descriptor of it: the namespace is held, not looked up by a pid again).
    `run` is the task that does it; `close` stops it and frees the host ports."""

    def __init__(self, netns: int, pidfd: int) -> None:
        self.ports: list[tuple[Binding, int]] = []  # (binding, the host port bound)
        self._sockets: list[socket.socket] = []
        self._netns = netns
        self._pidfd = pidfd  # the sandbox's PID 1: readable once it has ended
        self._scope = anyio.CancelScope()
        self._closed = anyio.Event()

    def add(self, binding: Binding, sock: socket.socket) -> None:
        """A listening socket for `binding`, owned from here."""
        self._sockets.append(sock)
        self.ports.append((binding, sock.getsockname()[1]))

    def __str__(self) -> str:
        return ", ".join(f"{b.shown(port)}->{b.key}" for b, port in self.ports)

    @property
    def listening(self) -> bool:
        return not self._scope.cancel_called and not self._closed.is_set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Forward until stopped. Runs in the Docker API's task group, which is the
        agent's: whatever goes wrong here is logged, never raised into it."""
        try:
            with self._scope:
                async with anyio.create_task_group() as tasks:
                    for (binding, _), sock in zip(self.ports, self._sockets, strict=True):
                        listener = await SocketListener.from_socket(sock)
                        tasks.start_soon(self._accept, listener, binding.port)
                    tasks.start_soon(self._watch)
                    task_status.started()
        except Exception:  # noqa: BLE001 - a bug stops these ports, not the agent
            log.exception("docker: published ports %s failed", self)
        finally:
            self.release()

    async def start(self, tasks: TaskGroup) -> None:
        """Forward in `tasks` (the Docker API's: the agent's), from when this returns;
        on an error nothing is left listening."""
        try:
            await tasks.start(self.run)
        except BaseException:
            self.release()  # idempotent: run's own end may have released them already
            raise

    def stop(self) -> None:
        """Stop forwarding; the ports are free once `run` has unwound (see close)."""
        self._scope.cancel()

    async def close(self) -> None:
        """Stop forwarding and return once the host ports are free."""
        self.stop()
        with anyio.CancelScope(shield=True):  # quick; a cancelled caller still frees them
            await self._closed.wait()

    def release(self) -> None:
        """Close the sockets and descriptors (idempotent: also after a failed start)."""
        for sock in self._sockets:
            sock.close()
        for fd in (self._netns, self._pidfd):
            if fd >= 0:
                os.close(fd)
        self._netns = self._pidfd = -1
        self._closed.set()

    async def _watch(self) -> None:
        """Stop when the sandbox's PID 1 ends: nothing could answer inside any more,
        and the host port is freed without waiting for a client to remove the
        container."""
        await anyio.wait_readable(self._pidfd)
        log.info("docker: the sandbox of ports %s has ended: they are closed", self)
        self.stop()

    async def _accept(self, listener: SocketListener, port: int) -> None:
        async with listener, anyio.create_task_group() as connections:
            while True:
                try:
                    client = await listener.accept()
                except (OSError, anyio.BrokenResourceError) as exc:
                    # Out of descriptors, say: keep listening, without spinning.
                    log.warning("docker: accepting on a port published for %d: %s", port, exc)
                    await anyio.sleep(0.1)
                    continue
                connections.start_soon(self._forward, client, port)

    async def _forward(self, client: SocketStream, port: int) -> None:
        async with client:
            try:
                inside = await connect_inside(self._netns, port)
            except OSError as exc:
                # Nothing listens there (yet): the client's connection is closed, as
                # Docker's proxy does. Debug: a harness polls until its server is up.
                log.debug("docker: no connection to port %d in the sandbox: %s", port, exc)
                return
            except Exception:  # noqa: BLE001 - one connection's bug, not the others'
                log.exception("docker: forwarding to port %d failed", port)
                return
            async with inside:
                await splice(client, inside)


def listen(found: list[Binding], pid: int, endpoint: str) -> Published:
    """Listen on the bindings, to forward into the network namespace of `pid` (the
    sandbox's PID 1, our child: not reaped, so the pid is still its) once started.
    Without an await, so that a concurrent start of the same container sees them
    taken. HttpError 500, Docker's message, for a host port in use; nothing is left
    listening then. `endpoint`: the container's name and id, for that message."""
    try:
        netns = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            os.close(netns)
            raise
    except OSError as exc:
        raise HttpError(409, f"the container's sandbox is not running: {exc.strerror}") from None
    published = Published(netns, pidfd)  # owns both descriptors from here
    try:
        for binding in found:
            published.add(binding, _listen(binding, endpoint))
    except BaseException:
        published.release()
        raise
    return published


def _listen(binding: Binding, endpoint: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in binding.address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # As any server does: a port whose last connections wait out TIME_WAIT can be
        # published again at once (a listening socket on it still refuses the bind).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((binding.address, int(binding.host_port or 0)))
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        shown = binding.shown(int(binding.host_port or 0))
        reason = "port is already allocated" if exc.errno == errno.EADDRINUSE else exc.strerror
        raise HttpError(
            500,
            f"driver failed programming external connectivity on endpoint {endpoint}:"
            f" Bind for {shown} failed: {reason}",
        ) from None
    return sock


def socket_in(netns: int, family: int) -> socket.socket:
    """A TCP socket in the network namespace `netns`, to be used from any thread.

    A socket belongs for life to the namespace its maker was in when it made it, and
    setns(CLONE_NEWNET) moves only the calling thread. The thread that enters is made
    for this and ends right after: no thread the agent goes on using (the event loop's,
    anyio's workers) is ever in a sandbox's namespace, so nothing else the agent does
    (its store's connections, a name lookup) can land there, and there is no way back
    to get wrong (a worker whose setns back to the agent's namespace failed would stay
    inside, and be reused). Run it in a worker thread: it waits for that thread."""
    made: list[socket.socket | OSError] = []

    def enter_and_make() -> None:
        try:
            if libc.setns(netns, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns: {os.strerror(err)}")
            made.append(socket.socket(family, socket.SOCK_STREAM))
        except OSError as exc:
            made.append(exc)

    thread = threading.Thread(target=enter_and_make, name="lazyfs-netns", daemon=True)
    thread.start()
    thread.join()
    if isinstance(made[0], OSError):
        raise made[0]
    return made[0]


async def connect_inside(netns: int, port: int) -> SocketStream:
    """A connection to `port` on the sandbox's loopback: 127.0.0.1, else ::1 (a server
    bound to "localhost" may listen on ::1 only)."""
    try:
        return await _connect(netns, socket.AF_INET, ("127.0.0.1", port))
    except ConnectionRefusedError as refused:
        with contextlib.suppress(OSError):
            return await _connect(netns, socket.AF_INET6, ("::1", port))
        raise refused from None


async def _connect(netns: int, family: int, address: tuple[str, int]) -> SocketStream:
    sock = await anyio.to_thread.run_sync(socket_in, netns, family)
    try:
        sock.setblocking(False)
        err = sock.connect_ex(address)
        if err == errno.EINPROGRESS:
            with anyio.fail_after(CONNECT_TIMEOUT):
                await anyio.wait_writable(sock)
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            raise OSError(err, os.strerror(err))  # ECONNREFUSED: ConnectionRefusedError
        return await SocketStream.from_socket(sock)
    except BaseException:
        sock.close()
        raise


async def splice(a: SocketStream, b: SocketStream) -> None:
    """Copy both ways until each side has sent its end of stream. One side's end is
    passed on as a half-close (a client that shuts down its sending side still reads
    the answer); a side that breaks (reset) ends both ways."""
    async with anyio.create_task_group() as both:
        both.start_soon(_copy, a, b, both.cancel_scope)
        both.start_soon(_copy, b, a, both.cancel_scope)


async def _copy(source: SocketStream, sink: SocketStream, both: anyio.CancelScope) -> None:
    try:
        while True:
            try:
                data = await source.receive(READ)
            except anyio.EndOfStream:
                await sink.send_eof()
                return
            await sink.send(data)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        both.cancel()
