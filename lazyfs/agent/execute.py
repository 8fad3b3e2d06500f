"""One command in a running sandbox: `runtime exec`, its output as it comes, a timeout.

Why `runtime exec` (runc: 10-20 ms a call here) and not yet a server inside the sandbox:
it needs nothing in the image, inherits the sandbox's user, capabilities, seccomp
profile and cgroup from its config.json, and is the runtime's own tested path. A faster
exec path (a process already inside the sandbox) is the warm-pool step's job.

A timeout (or a client that goes away) kills the command and every process it started
that is still its descendant, then the runtime exec; the sandbox itself (its PID 1) stays.
Processes that daemonized away from the command (re-parented to the sandbox's init) are
not its descendants any more and live on, as they would after a shell's command ended.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import trio

from lazyfs.sandbox_process import CommandNotExecutable, CommandNotFound, find_command

Emit = Callable[[str, bytes], Awaitable[None]]  # ("stdout" | "stderr", bytes)
KILL_GRACE = 5.0  # seconds the runtime gets to exit after its command was killed
DRAIN = 1.0  # seconds to read what is left in the pipes after the command exited


@dataclass
class ExecRequest:
    argv: list[str]
    cwd: str | None = None
    env: list[str] = field(default_factory=list)  # K=V over the sandbox's
    stdin: bytes | None = None
    timeout: float | None = None


@dataclass
class ExecResult:
    exit_code: int
    timed_out: bool
    seconds: float


@dataclass
class ExecTarget:
    """What exec needs of a sandbox."""

    box_id: str
    runtime: str
    state_root: Path  # the runtime's --root
    rootfs: Path
    env: list[str]  # the sandbox PID 1's environment (the image's Env, PATH, HOME)
    cwd: str  # its working directory
    box_env: list[str] = field(default_factory=list)  # create's env: given to every exec


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


async def execute(target: ExecTarget, req: ExecRequest, emit: Emit) -> ExecResult:
    """Run req in the sandbox; output goes to emit as it comes. A command that is not in
    the image is exit 127 (126: not executable), with the shell's message on stderr."""
    t0 = time.perf_counter()
    over = [*target.box_env, *req.env]
    cwd = req.cwd or target.cwd
    try:
        find_command(target.rootfs, req.argv[0], _path_var([*target.env, *over]), cwd)
    except (CommandNotFound, CommandNotExecutable) as exc:
        await emit("stderr", f"{exc}\n".encode())
        return ExecResult(exc.exit_code, False, time.perf_counter() - t0)
    pid_file = target.rootfs.parent / f"exec-{os.getpid()}-{time.monotonic_ns()}.pid"
    argv = [target.runtime, "--root", str(target.state_root), "exec", "--pid-file", str(pid_file)]
    if req.cwd:
        argv += ["--cwd", req.cwd]
    for item in over:
        argv += ["--env", item]
    argv += [target.box_id, *req.argv]
    proc = await trio.lowlevel.open_process(
        argv,
        stdin=subprocess.PIPE if req.stdin else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd="/",
    )
    timed_out = False
    try:
        async with trio.open_nursery() as nursery:
            pumps_done = [trio.Event(), trio.Event()]
            nursery.start_soon(_pump, proc.stdout, "stdout", emit, pumps_done[0])
            nursery.start_soon(_pump, proc.stderr, "stderr", emit, pumps_done[1])
            if req.stdin:
                nursery.start_soon(_feed, proc.stdin, req.stdin)
            with trio.move_on_after(req.timeout if req.timeout else float("inf")) as scope:
                await proc.wait()
            if scope.cancelled_caught:
                timed_out = True
                kill_tree(pid_file)
                with trio.move_on_after(KILL_GRACE):
                    await proc.wait()
            with trio.move_on_after(DRAIN):  # a background child may hold the pipes
                for done in pumps_done:
                    await done.wait()
            nursery.cancel_scope.cancel()
    finally:
        if proc.returncode is None:  # cancelled: the client went away, or we stop
            kill_tree(pid_file)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with trio.CancelScope(shield=True):
                await proc.wait()
        pid_file.unlink(missing_ok=True)
    code = proc.returncode
    if timed_out:
        code = 128 + signal.SIGKILL
    elif code < 0:
        code = 128 - code
    return ExecResult(code, timed_out, time.perf_counter() - t0)


async def _pump(stream: trio.abc.ReceiveStream, kind: str, emit: Emit, done: trio.Event) -> None:
    try:
        while chunk := await stream.receive_some(65536):
            await emit(kind, chunk)
    finally:
        done.set()


async def _feed(stream: trio.abc.SendStream, data: bytes) -> None:
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        await stream.send_all(data)
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        await stream.aclose()
