"""Exec: create, start and inspect a command in a running container.

`start` hijacks the connection (http.py) and frames the command's output on it with
Docker's 8-byte multiplexed headers, or sends it raw when the exec has a terminal (Tty:
a pseudo-terminal in the sandbox, exec protocol v3). With AttachStdin the client's bytes
go to the command's stdin as they come, and its half-close (the CLI's at the end of
stdin) is the end of it. A detached start runs the command in the background. The exit
code is set before the stream ends, so that an inspect right after it reads the final
one.
"""

from __future__ import annotations

import contextlib
import secrets
import select
from dataclasses import dataclass

import anyio
from anyio.abc import ByteStream, SocketAttribute, TaskGroup
from anyio.streams.memory import MemoryObjectSendStream

from chunker.errors import LazyfsError
from lazyfs.agent.execute import ExecRequest
from lazyfs.agent.node import Agent
from lazyfs.docker import detach
from lazyfs.docker.container_api import MULTIPLEXED, Containers, strings
from lazyfs.docker.containers import STDERR, STREAMS, Container, frame, terminal_size
from lazyfs.docker.detach import Detacher
from lazyfs.docker.errors import docker_errors
from lazyfs.docker.http import Answer, Hijacked, HttpError, Reply, Request, json_reply
from lazyfs.docker.images import Images

FEED_DEPTH = 16  # pieces of stdin queued for the command before the client waits
RAW = "application/vnd.docker.raw-stream"  # a terminal's output: no frames
KILLED = 137  # the exit code of a command killed because its client went away
GONE_EVERY = 0.5  # seconds between looks at whether an exec's client is still there


@dataclass
class ExecInstance:
    id: str
    container: Container
    argv: list[str]
    env: list[str]
    cwd: str | None
    stdin: bool
    stdout: bool
    stderr: bool
    running: bool = False
    started: bool = False
    exit_code: int | None = None
    pid: int = 0  # in the sandbox's PID namespace, once it started (0: not known)
    tty: bool = False  # the command has a terminal (the create's Tty)
    raw: bool = False  # its output unframed (the start's Tty)
    detach_keys: bytes = b""  # typed on its terminal: the client goes, the command stays
    detached: bool = False
    user: tuple[int, int, list[int]] | None = None  # None: the container's own
    feed: MemoryObjectSendStream | None = None  # its stdin and sizes, while it runs

    def started_as(self, pid: int) -> None:
        self.pid = pid


class Execs:
    def __init__(
        self, agent: Agent, tasks: TaskGroup, containers: Containers, images: Images
    ) -> None:
        self.agent = agent
        self.tasks = tasks
        self.containers = containers
        self.images = images
        self.execs: dict[str, ExecInstance] = {}

    @docker_errors
    async def exec_create(self, request: Request) -> Answer:
        container = self.containers.find(request.params["id"])
        if container.status != "running":
            raise HttpError(409, f"Container {container.id} is not running")
        self.containers.refuse_if_paused(container)
        body = request.json()
        if body.get("Privileged"):
            raise HttpError(400, "Privileged exec is not granted in a lazyfs sandbox")
        argv = body.get("Cmd")
        argv = [argv] if isinstance(argv, str) else argv
        if not argv or not all(isinstance(a, str) for a in argv):
            raise HttpError(400, "No exec command specified")
        user = body.get("User") or ""
        if not isinstance(user, str):
            raise HttpError(400, "User must be a string")
        as_user = await self.containers.user_of(container, user)
        instance = ExecInstance(
            secrets.token_hex(32),
            container,
            argv,
            strings(body.get("Env"), "Env"),
            body.get("WorkingDir") or container.config.get("WorkingDir") or None,
            bool(body.get("AttachStdin")),
            bool(body.get("AttachStdout", True)),
            bool(body.get("AttachStderr", True)),
            tty=bool(body.get("Tty")),
            user=as_user,
            # docker-py sends detachKeys: dockerd's Go JSON reads keys in any case.
            detach_keys=detach.parse(body.get("DetachKeys") or body.get("detachKeys"))
            if body.get("Tty")
            else b"",
        )
        self._prune()
        self.execs[instance.id] = instance
        container.exec_ids.append(instance.id)
        return json_reply({"Id": instance.id}, 201)

    def _exec(self, exec_id: str) -> ExecInstance:
        instance = self.execs.get(exec_id)
        if instance is not None and instance.container.removed.is_set():
            self._prune()
            instance = None
        if instance is None:
            raise HttpError(404, f"No such exec instance: {exec_id}")
        return instance

    def _prune(self) -> None:
        """Forget the exec instances of removed containers, as dockerd does."""
        for exec_id in [i for i, e in self.execs.items() if e.container.removed.is_set()]:
            del self.execs[exec_id]

    @docker_errors
    async def exec_start(self, request: Request) -> Answer:
        instance = self._exec(request.params["id"])
        body = request.json()
        # The start's Tty says how the output is sent (raw, or framed), as dockerd does;
        # the create's whether the command has a terminal. docker-py starts a terminal
        # exec with Tty false unless told, and reads frames then.
        instance.raw = bool(body.get("Tty"))
        if instance.started:
            raise HttpError(409, f"Exec command {instance.id} has already run")
        self.agent.running(instance.container.box_id)
        self.containers.refuse_if_paused(instance.container)
        instance.started = instance.running = True
        if body.get("Detach"):
            self.tasks.start_soon(self._run_exec, instance, None)
            return Reply(200)

        async def run(stream: ByteStream) -> None:
            async with stream:
                await self._run_exec(instance, stream)

        return Hijacked(run, RAW if instance.raw else MULTIPLEXED)

    @docker_errors
    async def exec_resize(self, request: Request) -> Answer:
        instance = self._exec(request.params["id"])
        size = terminal_size(request)
        if instance.feed is not None and size is not None:
            with contextlib.suppress(anyio.WouldBlock, anyio.ClosedResourceError):
                instance.feed.send_nowait(size)  # a size dropped is followed by the next
        return Reply(200)

    async def _run_exec(self, instance: ExecInstance, stream: ByteStream | None) -> None:
        """Run the command; its output on `stream` (None: detached), framed, or raw on a
        terminal. The exit code is set before the stream ends.

        stdin streams: what the client sends goes to the command as it comes, and its
        half-close (the CLI's at the end of stdin) is the end of it. A terminal always
        has a feed, for its size (resize), and without AttachStdin no end: it stays open.
        """
        feed, fed = None, None
        if instance.tty or (instance.stdin and stream is not None):
            feed, fed = anyio.create_memory_object_stream[bytes | tuple[int, int]](FEED_DEPTH)
            instance.feed = feed

        async def emit(kind: str, data: bytes) -> None:
            wanted = instance.stdout if kind == "stdout" else instance.stderr
            if stream is not None and wanted and not instance.detached:
                await stream.send(data if instance.raw else frame(STREAMS[kind], data))

        req = ExecRequest(
            instance.argv,
            instance.cwd,
            instance.env,
            feed=fed,
            terminal=instance.tty,
            user=instance.user,
        )
        try:
            async with anyio.create_task_group() as watching:
                if stream is not None:
                    watching.start_soon(_cancel_when_gone, stream, watching.cancel_scope, instance)
                    if instance.stdin and feed is not None:
                        watching.start_soon(_pass_stdin, stream, feed, instance)
                try:
                    result = await self.agent.exec(
                        instance.container.box_id, req, emit, instance.started_as
                    )
                    instance.exit_code = result.exit_code
                except LazyfsError as exc:
                    instance.exit_code = 126
                    if stream is not None:
                        line = f"lazyfs: {exc}\n".encode()
                        await stream.send(line if instance.raw else frame(STDERR, line))
                watching.cancel_scope.cancel()
        except* (anyio.BrokenResourceError, anyio.ClosedResourceError, ConnectionError):
            pass  # the client went away: the command was killed with the exec's end
        finally:
            instance.feed = None
            if feed is not None:
                feed.close()
            if instance.exit_code is None:
                instance.exit_code = KILLED
            instance.running = False

    @docker_errors
    async def exec_inspect(self, request: Request) -> Answer:
        instance = self._exec(request.params["id"])
        return json_reply(
            {
                "ID": instance.id,
                "Running": instance.running,
                "ExitCode": instance.exit_code,
                "ProcessConfig": {
                    "entrypoint": instance.argv[0],
                    "arguments": instance.argv[1:],
                    "tty": instance.tty,
                    "privileged": False,
                    "user": instance.container.config.get("User", ""),
                },
                "OpenStdin": instance.stdin,
                "OpenStdout": instance.stdout,
                "OpenStderr": instance.stderr,
                "CanRemove": False,
                "ContainerID": instance.container.id,
                "DetachKeys": "",
                "Pid": instance.pid,
            }
        )


async def _pass_stdin(
    stream: ByteStream, feed: MemoryObjectSendStream, instance: ExecInstance
) -> None:
    """The client's bytes to the command's stdin, until the client half-closes; or until
    it types the detach keys (on a terminal): then the client is let go (its
    connection closed) and the command runs on, its output dropped."""
    detacher = Detacher(instance.detach_keys) if instance.detach_keys else None
    while True:
        try:
            data = await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError):
            break
        detached = False
        if detacher is not None:
            data, detached = detacher.scan(data)
        if data:
            await feed.send(data)
        if detached:
            instance.detached = True
            await stream.aclose()
            return  # no end of stdin: the terminal stays open, as dockerd leaves it
    await feed.send(b"")  # its end


async def _cancel_when_gone(
    stream: ByteStream, scope: anyio.CancelScope, instance: ExecInstance
) -> None:
    """Cancel `scope` (and so kill the command) once the client has closed its
    connection. Looked at every GONE_EVERY s with poll(): a command with no output
    would never fail a send. POLLHUP means both ways are shut; a half-close (the CLI's
    at the end of stdin) reads as end of file too, and is not the end. A client that
    detached (its keys) was let go on purpose: the command stays."""
    sock = stream.extra(SocketAttribute.raw_socket, None)
    if sock is None:
        return
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLHUP)  # POLLHUP and POLLERR always come
    while not instance.detached and not poller.poll(0):
        await anyio.sleep(GONE_EVERY)
    if not instance.detached:  # looked at first: its socket is closed, its fd maybe reused
        scope.cancel()
