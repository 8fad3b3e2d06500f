"""One command in a running sandbox, its output as it comes, a timeout. Two ways (the
result's `channel` says which):

- **"server"**: the exec server (exec_server.c, every agent sandbox's PID 1): a process
  already inside the sandbox forks the command; one unix-socket round trip, a few ms.
  Closing the connection kills the command's process group. Protocol: docs/FORMATS.md.
- **"runtime"**: `runtime exec`, when the server does not answer (an operator removed
  its socket on the host, or the server failed): runc starts a Go binary and joins the
  namespaces each time, 10-30 ms here. It needs nothing in the image. The agent warns
  and counts it (node.py, /metrics): the sandbox's own code cannot bring it about.

Either way the command has the sandbox's user, capabilities, seccomp filter, cgroup and
namespaces. A timeout (or a client that goes away) kills the command and what it started
(its process group for the server; its descendants for `runtime exec`); the sandbox
itself stays. Processes that left them (setsid, or re-parented to the sandbox's init)
live on, as they would after a shell's command ended.

The channel (issue 20, finding 6: a sandbox's own server renamed over the old socket
made `false` exit 0): the agent makes the listening socket itself, on the host, in the
sandbox's directory, which is mounted nowhere in the sandbox (`listen()`), and the
runtime hands it to the server as fd 3; the agent keeps no copy, so once the server is
gone a connect is refused at once rather than queued. Until the server accepts, a
connect waits in the socket's backlog: a just-started sandbox needs no readiness check.
The server is non-dumpable and the namespace's init (exec_server.c), so sandbox code can
neither take its socket nor kill it. What it sends is still checked (bounded, known
frames): the process serving a command runs inside the sandbox, where its code can kill
it (the command then ends with ServerBroke, HTTP 502, never with a result).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import stat
import struct
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
from anyio.abc import ByteReceiveStream, ByteSendStream, ObjectReceiveStream, SocketStream

from chunker.errors import BadInputError, LazyfsError
from lazyfs.sandbox.oci_spec import SANDBOX_OOM_SCORE_ADJ
from lazyfs.sandbox.process import (
    CommandNotExecutable,
    CommandNotFound,
    find_command,
    merge_env,
)

Emit = Callable[[str, bytes], Awaitable[None]]  # ("stdout" | "stderr", bytes)
Started = Callable[[int], None]  # the command's PID in the sandbox, once it started
CHOOM = shutil.which("choom") or "/usr/bin/choom"  # util-linux
KILL_GRACE = 5.0  # seconds the runtime gets to exit after its command was killed
DRAIN = 1.0  # seconds to read what is left in the pipes after the command exited
SOCKET_NAME = "exec.sock"  # in the sandbox's host directory (never mounted in it)
BACKLOG = 128  # connections waiting for the server to accept (one per concurrent exec)
log = logging.getLogger("lazyfs.agent")


@dataclass
class ExecRequest:
    argv: list[str]
    cwd: str | None = None
    env: list[str] = field(default_factory=list)  # K=V over the sandbox's
    stdin: bytes | None = None
    timeout: float | None = None
    # Streamed stdin instead (the Docker API's attach and exec -i): bytes as they come,
    # b"" for its end, (rows, columns) for a terminal's new size. Server channel only.
    feed: ObjectReceiveStream[bytes | tuple[int, int]] | None = None
    terminal: bool = False  # stdin, stdout and stderr are a pseudo-terminal (stdout only)
    # (uid, gid, groups) to run as, in a sandbox whose exec server is root: the Docker
    # API's User. None: the sandbox's own user. Server channel only.
    user: tuple[int, int, list[int]] | None = None

    def __post_init__(self) -> None:
        # The exec server's protocol is NUL-separated strings, as the kernel's execve is.
        if any("\0" in item for item in [*self.argv, self.cwd or "", *self.env]):
            raise BadInputError("argv, cwd and env may not contain NUL characters")


@dataclass
class ExecResult:
    exit_code: int
    timed_out: bool
    seconds: float
    channel: str = "server"  # "server" | "runtime": how the command ran (module docstring)


@dataclass
class ExecTarget:
    """What exec needs of a sandbox."""

    box_id: str
    runtime: str
    state_root: Path  # the runtime's --root
    rootfs: Path
    env: list[str]  # the sandbox PID 1's environment (the image's Env, PATH, HOME)
    cwd: str  # its working directory
    server: Path  # the exec server's listening socket (host path, see listen())
    box_env: list[str] = field(default_factory=list)  # create's env: given to every exec
    # Capabilities its commands do not get (confinement.cap_mask), where the sandbox was
    # made with them (a warm one claimed with cap_drop): the exec server drops them.
    drop_caps: int = 0
    # Resource limits its commands get (ulimits.header), where asked at its create.
    limits: str = ""


def _confined(target: ExecTarget) -> bool:
    """Whether its commands are held to what only the exec server gives them: the
    capabilities dropped and the limits set at the create."""
    return bool(target.drop_caps or target.limits)


def _path_var(env: list[str]) -> str:
    path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    for item in env:
        if item.startswith("PATH="):
            path = item[5:]
    return path


def descendants(pid: int) -> list[int]:
    """pid's descendants, from /proc/PID/task/TID/children, parents before children."""
    found: list[int] = []
    todo = [pid]
    while todo:
        current = todo.pop()
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as f:
                    kids = [int(k) for k in f.read().split()]
                found += kids
                todo += kids
    return found


def kill_tree(pid_file: Path) -> None:
    try:
        pid = int(pid_file.read_text())
    except (OSError, ValueError):
        return  # the runtime had not started the command yet: killing it is enough
    for target in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, signal.SIGKILL)


async def execute(
    target: ExecTarget, req: ExecRequest, emit: Emit, started: Started | None = None
) -> ExecResult:
    """Run req in the sandbox; output goes to emit as it comes. A command that is not in
    the image is exit 127 (126: not executable), with the shell's message on stderr.
    `started` is told the command's PID in the sandbox when the exec server reports it
    (not through `runtime exec`, nor from a server older than protocol version 3)."""
    t0 = time.perf_counter()
    over = [*target.box_env, *req.env]
    cwd = req.cwd or target.cwd
    sock = await _connect(target.server)
    if isinstance(sock, SocketStream):  # it looks the command up itself, as execvp does
        env = merge_env([*target.env, *over], [], None)
        code, timed_out = await _via_server(sock, req, cwd, env, emit, started, target)
        return ExecResult(code, timed_out, time.perf_counter() - t0)
    if req.feed is not None or req.terminal or req.user is not None or _confined(target):
        # `runtime exec` would give the command the capabilities and limits the sandbox
        # was made with, not those its create asked for.
        raise ServerBroke(
            f"sandbox {target.box_id}: its exec server does not answer ({sock}); a terminal,"
            " streamed stdin, another user, dropped capabilities or ulimits need it"
        )
    log.warning(
        "sandbox %s: its exec server does not answer (%s); running %r with `%s exec`",
        target.box_id,
        sock,
        req.argv[0],
        Path(target.runtime).name,
    )
    try:  # before `runtime exec`, whose own message for it is a runc error
        find_command(target.rootfs, req.argv[0], _path_var([*target.env, *over]), cwd)
    except (CommandNotFound, CommandNotExecutable) as exc:
        await emit("stderr", f"{exc}\n".encode())
        return ExecResult(exc.exit_code, False, time.perf_counter() - t0, "runtime")
    return await _via_runtime(target, req, over, emit, t0)


async def _via_runtime(
    target: ExecTarget, req: ExecRequest, over: list[str], emit: Emit, t0: float
) -> ExecResult:
    # Next to the runtime's state (the run dir), not in the sandbox's own directory: when
    # the sandbox has filled its disk, `rm` to free it must still run.
    name = f"exec-{target.box_id}-{os.getpid()}-{time.monotonic_ns()}.pid"
    pid_file = target.state_root.parent / name
    argv = [target.runtime, "--root", str(target.state_root), "exec", "--pid-file", str(pid_file)]
    if req.cwd:
        argv += ["--cwd", req.cwd]
    for item in over:
        argv += ["--env", item]
    argv += [target.box_id, *req.argv]
    # The exec'd process inherits `runtime exec`'s OOM bias, i.e. the agent's (-500):
    # raise it to a sandbox's first (lazyfs/oom.py).
    argv = [CHOOM, "-n", str(SANDBOX_OOM_SCORE_ADJ), "--", *argv]
    proc = await anyio.open_process(
        argv,
        stdin=subprocess.PIPE if req.stdin else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd="/",
    )
    timed_out = False
    try:
        async with anyio.create_task_group() as tasks:
            pumps_done = [anyio.Event(), anyio.Event()]
            tasks.start_soon(_pump, proc.stdout, "stdout", emit, pumps_done[0])
            tasks.start_soon(_pump, proc.stderr, "stderr", emit, pumps_done[1])
            if req.stdin:
                tasks.start_soon(_feed, proc.stdin, req.stdin)
            with anyio.move_on_after(req.timeout) as scope:
                await proc.wait()
            if scope.cancelled_caught:
                timed_out = True
                kill_tree(pid_file)
                with anyio.move_on_after(KILL_GRACE):
                    await proc.wait()
            with anyio.move_on_after(DRAIN):  # a background child may hold the pipes
                for done in pumps_done:
                    await done.wait()
            tasks.cancel_scope.cancel()
    finally:
        if proc.returncode is None:  # cancelled: the client went away, or we stop
            kill_tree(pid_file)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        with anyio.CancelScope(shield=True):
            await proc.aclose()  # its pipes, and its exit waited for
        pid_file.unlink(missing_ok=True)
    code = proc.returncode
    if timed_out:
        code = 128 + signal.SIGKILL
    elif code < 0:
        code = 128 - code
    return ExecResult(code, timed_out, time.perf_counter() - t0, "runtime")


async def _pump(stream: ByteReceiveStream, kind: str, emit: Emit, done: anyio.Event) -> None:
    try:
        async for chunk in stream:  # to its end of stream
            await emit(kind, chunk)
    finally:
        done.set()


async def _feed(stream: ByteSendStream, data: bytes) -> None:
    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
        await stream.send(data)
    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
        await stream.aclose()


# ---------------------------------------------------------------- the exec server

STDOUT, STDERR, EXIT, PID = 1, 2, 3, 4
STDIN, RESIZE = 0, 5  # agent -> server, when stdin is streamed
STREAMED, TERMINAL, AS_USER = 1 << 31, 1 << 30, 1 << 29  # flags in the request's stdin word
DROPS_CAPS = 1 << 28  # exec protocol version 4
SETS_LIMITS = 1 << 27  # exec protocol version 5
MAX_FRAME = 16 * 2**20  # the server sends at most 64 KiB a frame; more is a broken server
MAX_STDIN_FRAME = 65536  # the server takes at most this much stdin a frame


class ServerBroke(LazyfsError):
    """The sandbox's exec server answered something that is not the protocol."""


def listen(sandbox_dir: Path) -> socket.socket:
    """The exec server's listening socket, bound at SOCKET_NAME in the sandbox's host
    directory (mode 0600: only root on the host connects), for the runtime to hand to
    the server as fd 3; the caller closes its copy once the runtime has passed it on.
    Bound through an O_PATH descriptor of the directory: a unix socket's path is at most
    107 bytes, and a sandbox directory (under a test's tmp dir) can be longer."""
    dir_fd = os.open(sandbox_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        where = f"/proc/self/fd/{dir_fd}/{SOCKET_NAME}"
        sock.bind(where)
        os.chmod(where, 0o600)
        sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    finally:
        os.close(dir_fd)
    return sock


async def _connect(path: Path) -> SocketStream | str:
    """A connection to the server, or why there is none: refused at once if the server
    is gone (nothing else holds the socket), queued if it has not accepted yet."""
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            return f"{path} is not a socket"
        try:
            # Through the O_PATH fd: the very inode checked above, and no limit on the
            # path's length (as in listen()).
            return await anyio.connect_unix(f"/proc/self/fd/{fd}")
        except OSError as exc:
            return f"{path}: {exc.strerror}"
    finally:
        os.close(fd)


async def _via_server(
    stream: SocketStream,
    req: ExecRequest,
    cwd: str,
    env: list[str],
    emit: Emit,
    started: Started | None = None,
    target: ExecTarget | None = None,
) -> tuple[int, bool]:
    """(exit code, timed out). Closing the stream is how the command is killed.
    target: the capabilities to drop and the limits to set, if any."""
    drop_caps, limits = (target.drop_caps, target.limits) if target else (0, "")
    async with stream:
        items = [cwd, *req.argv, *env]
        if req.user is not None:
            uid, gid, groups = req.user
            items.insert(0, f"{uid}:{gid}:{','.join(map(str, groups))}")
        if drop_caps:  # before the user (docs/FORMATS.md, exec protocol)
            items.insert(0, f"{drop_caps:x}")
        if limits:  # before those
            items.insert(0, limits)
        header = b"".join(item.encode() + b"\0" for item in items)
        stdin = req.stdin or b""
        word = len(stdin) | (STREAMED if req.feed else 0) | (TERMINAL if req.terminal else 0)
        word |= (AS_USER if req.user is not None else 0) | (DROPS_CAPS if drop_caps else 0)
        word |= SETS_LIMITS if limits else 0
        fixed = struct.pack(">III", len(header), len(req.argv), word)
        # A server that cannot fork (the pids limit is full) answers and closes at once,
        # maybe before it has read the request: its answer is then read below.
        with contextlib.suppress(anyio.BrokenResourceError):
            await stream.send(fixed + header + stdin)
        if req.feed is None:
            return await _answers(stream, req, emit, started)
        # The feed's task ends with the answers. A task group would wrap their error
        # (ServerBroke) in an exception group: it is taken out again.
        result: list[tuple[int, bool]] = []

        async def answers() -> None:
            result.append(await _answers(stream, req, emit, started))
            feeding.cancel_scope.cancel()

        try:
            async with anyio.create_task_group() as feeding:
                feeding.start_soon(_stdin_frames, stream, req.feed)
                feeding.start_soon(answers)
        except BaseExceptionGroup as group:
            raise group.exceptions[0] from None
        return result[0]


async def _stdin_frames(
    stream: SocketStream, feed: ObjectReceiveStream[bytes | tuple[int, int]]
) -> None:
    """Streamed stdin to the server as frames, until its end (b"" or the feed closed)."""
    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
        async with feed:
            async for item in feed:
                if isinstance(item, tuple):
                    await stream.send(struct.pack(">BIHH", RESIZE, 4, *item))
                    continue
                if not item:
                    break
                for start in range(0, len(item), MAX_STDIN_FRAME):
                    piece = item[start : start + MAX_STDIN_FRAME]
                    await stream.send(struct.pack(">BI", STDIN, len(piece)) + piece)
        await stream.send(struct.pack(">BI", STDIN, 0))


async def _answers(
    stream: SocketStream, req: ExecRequest, emit: Emit, started: Started | None
) -> tuple[int, bool]:
    """The server's frames until its exit frame: (exit code, timed out)."""
    buffer = bytearray()
    with anyio.move_on_after(req.timeout):
        while True:
            while len(buffer) >= 5:
                kind, size = struct.unpack(">BI", buffer[:5])
                if kind not in (STDOUT, STDERR, EXIT, PID) or size > MAX_FRAME:
                    raise ServerBroke("the sandbox's exec server broke the protocol")
                if len(buffer) < 5 + size:
                    break
                data = bytes(buffer[5 : 5 + size])
                del buffer[: 5 + size]
                if kind == EXIT:
                    return _exit_code(data), False
                if kind == PID:
                    if started is not None and len(data) == 4:
                        started(struct.unpack(">i", data)[0])
                    continue
                await emit("stdout" if kind == STDOUT else "stderr", data)
            try:
                chunk = await stream.receive(65536)
            except (anyio.EndOfStream, anyio.BrokenResourceError):  # or reset: gone
                chunk = b""
            if not chunk:
                raise ServerBroke("the sandbox's exec server went away mid-command")
            buffer += chunk
    return 128 + signal.SIGKILL, True


def _exit_code(data: bytes) -> int:
    code = struct.unpack(">i", data)[0] if len(data) == 4 else -1
    if not 0 <= code <= 255:
        raise ServerBroke("the sandbox's exec server sent no exit status")
    return code
