"""Exec: create, start and inspect a command in a running container.

`start` hijacks the connection (http.py) and frames the command's output on it with
Docker's 8-byte multiplexed headers. With AttachStdin the client's bytes up to its
half-close (the CLI's at the end of stdin) are the command's stdin, read before the
command starts: the exec server takes stdin whole. A detached start runs the command in
the background. The exit code is set before the stream ends, so that an inspect right
after it reads the final one.
"""

from __future__ import annotations

import secrets
import select
from dataclasses import dataclass

import anyio
from anyio.abc import ByteStream, SocketAttribute, TaskGroup

from chunker.errors import LazyfsError
from lazyfs.agent.execute import ExecRequest
from lazyfs.agent.node import Agent
from lazyfs.docker.container_api import MULTIPLEXED, Containers, check_user, strings
from lazyfs.docker.containers import STDERR, STREAMS, Container, frame
from lazyfs.docker.errors import docker_errors
from lazyfs.docker.http import Answer, Hijacked, HttpError, Reply, Request, json_reply
from lazyfs.docker.images import Images

MAX_STDIN = 48 * 2**20  # an exec's stdin, read whole before the command starts
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
        body = request.json()
        if body.get("Tty"):
            raise HttpError(400, "Tty: a terminal for exec is not supported yet")
        if body.get("Privileged"):
            raise HttpError(400, "Privileged exec is not granted in a lazyfs sandbox")
        argv = body.get("Cmd")
        argv = [argv] if isinstance(argv, str) else argv
        if not argv or not all(isinstance(a, str) for a in argv):
            raise HttpError(400, "No exec command specified")
        info = await self.images.find(container.image) if not container.adopted else None
        if info is not None:
            check_user(body.get("User"), info)
        instance = ExecInstance(
            secrets.token_hex(32),
            container,
            argv,
            strings(body.get("Env"), "Env"),
            body.get("WorkingDir") or container.config.get("WorkingDir") or None,
            bool(body.get("AttachStdin")),
            bool(body.get("AttachStdout", True)),
            bool(body.get("AttachStderr", True)),
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
        if body.get("Tty"):
            raise HttpError(400, "Tty: a terminal for exec is not supported yet")
        if instance.started:
            raise HttpError(409, f"Exec command {instance.id} has already run")
        self.agent.running(instance.container.box_id)
        instance.started = instance.running = True
        if body.get("Detach"):
            self.tasks.start_soon(self._run_exec, instance, None)
            return Reply(200)

        async def run(stream: ByteStream) -> None:
            async with stream:
                await self._run_exec(instance, stream)

        return Hijacked(run, MULTIPLEXED)

    async def _run_exec(self, instance: ExecInstance, stream: ByteStream | None) -> None:
        """Run the command; its output framed on `stream` (None: detached). The exit
        code is set before the stream ends."""
        stdin = None
        try:
            if stream is not None and instance.stdin:
                stdin = await _read_all(stream, MAX_STDIN)

            async def emit(kind: str, data: bytes) -> None:
                wanted = instance.stdout if kind == "stdout" else instance.stderr
                if stream is not None and wanted:
                    await stream.send(frame(STREAMS[kind], data))

            req = ExecRequest(instance.argv, instance.cwd, instance.env, stdin)
            async with anyio.create_task_group() as watching:
                if stream is not None:
                    watching.start_soon(_cancel_when_gone, stream, watching.cancel_scope)
                try:
                    result = await self.agent.exec(
                        instance.container.box_id, req, emit, instance.started_as
                    )
                    instance.exit_code = result.exit_code
                except LazyfsError as exc:
                    instance.exit_code = 126
                    if stream is not None:
                        await stream.send(frame(STDERR, f"lazyfs: {exc}\n".encode()))
                watching.cancel_scope.cancel()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, ConnectionError):
            pass  # the client went away: the command was killed with the exec's end
        finally:
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
                    "tty": False,
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


async def _read_all(stream: ByteStream, limit: int) -> bytes:
    """What the client sends until it half-closes (the CLI does at stdin's end)."""
    data = bytearray()
    while True:
        try:
            data += await stream.receive()
        except anyio.EndOfStream:
            return bytes(data)
        if len(data) > limit:
            raise HttpError(413, f"stdin over {limit} bytes")


async def _cancel_when_gone(stream: ByteStream, scope: anyio.CancelScope) -> None:
    """Cancel `scope` (and so kill the command) once the client has closed its
    connection. Looked at every GONE_EVERY s with poll(): a command with no output
    would never fail a send. POLLHUP means both ways are shut; a half-close (the CLI's
    at the end of stdin) reads as end of file too, and is not the end."""
    sock = stream.extra(SocketAttribute.raw_socket, None)
    if sock is None:
        return
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLHUP)  # POLLHUP and POLLERR always come
    while not poller.poll(0):
        await anyio.sleep(GONE_EVERY)
    scope.cancel()
