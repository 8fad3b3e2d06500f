"""The exec server (lazyfs/agent/exec_server.c) against the agent's own client code
(execute.py), run on the host with a socket from execute.listen() in a private directory
as its fd 3, as the runtime hands it over: the protocol's edges that the agent's tests
through real sandboxes (test_agent_api.py, tests/security) do not reach."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from chunker.errors import BadInputError
from lazyfs.agent.execute import (
    SETS_LIMITS,
    SOCKET_NAME,
    ExecRequest,
    ExecTarget,
    _connect,
    _via_server,
    listen,
)
from lazyfs.settings import Settings

SERVER = Settings.from_env().exec_server
ENV = ["PATH=/usr/bin:/bin", "LANG=C"]
AGENT_LOOP = {"backend": "asyncio", "backend_options": {"use_uvloop": True}}  # as the agent


def spawn_server(fd3: int | None) -> int:
    """The server in a session of its own, `fd3` (if any) as its fd 3 (as runc's
    --preserve-fds 1 gives it); its pid."""
    actions = []
    if fd3 is not None:  # from above 3: a dup2 onto itself would keep close-on-exec
        actions.append((os.POSIX_SPAWN_DUP2, fcntl.fcntl(fd3, fcntl.F_DUPFD_CLOEXEC, 4), 3))
    try:
        return os.posix_spawn(
            str(SERVER), [str(SERVER)], os.environ, file_actions=actions, setsid=True
        )
    finally:
        for action in actions:
            os.close(action[1])


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Path]:
    with listen(tmp_path) as sock:
        pid = spawn_server(sock.fileno())
    try:
        assert (tmp_path / SOCKET_NAME).stat().st_mode & 0o777 == 0o600  # root's alone
        yield tmp_path / SOCKET_NAME
    finally:
        os.killpg(pid, 9)
        os.waitpid(pid, 0)


def test_the_server_needs_a_listening_socket_at_fd_3(tmp_path: Path) -> None:
    with socket.socket(socket.AF_UNIX) as unbound:
        for fd3 in [None, unbound.fileno()]:  # nothing there; a socket that does not listen
            _, status = os.waitpid(spawn_server(fd3), 0)
            assert os.waitstatus_to_exitcode(status) == 2


def test_commands_do_not_inherit_the_socket_and_it_refuses_once_the_server_is_gone(
    tmp_path: Path,
) -> None:
    with listen(tmp_path) as sock:
        pid = spawn_server(sock.fileno())
    path = tmp_path / SOCKET_NAME
    try:
        listening = os.readlink(f"/proc/{pid}/fd/3").encode()  # socket:[INODE]
        code, _, out, _ = run(path, ExecRequest(["sh", "-c", "readlink /proc/$$/fd/*; true"]))
        assert code == 0 and b"pipe:" in out and listening not in out, out
    finally:
        os.killpg(pid, 9)
        os.waitpid(pid, 0)
    # Nobody else holds the socket (listen()'s caller closed its copy): refused at once.
    assert anyio.run(_connect, path) == f"{path}: Connection refused"


def run(
    sock: Path,
    req: ExecRequest,
    cwd: str = "/",
    pids: list[int] | None = None,
    target: ExecTarget | None = None,
) -> tuple[int, bool, bytes, bytes]:
    """The command's (status, timed out, stdout, stderr); `pids` gets the PID it reports;
    `target`: the capabilities it drops and the limits it sets."""
    out: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}

    async def emit(kind: str, data: bytes) -> None:
        out[kind] += data

    async def main() -> tuple[int, bool]:
        stream = await _connect(sock)
        assert not isinstance(stream, str), stream
        return await _via_server(
            stream, req, cwd, ENV, emit, pids.append if pids is not None else None, target
        )

    code, timed_out = anyio.run(main, **AGENT_LOOP)
    return code, timed_out, bytes(out["stdout"]), bytes(out["stderr"])


def test_status_output_env_cwd(server: Path, tmp_path: Path) -> None:
    script = 'echo "$LANG $(pwd)"; echo err >&2; exit 3'
    assert run(server, ExecRequest(["sh", "-c", script]), cwd=str(tmp_path)) == (
        3,
        False,
        f"C {tmp_path}\n".encode(),
        b"err\n",
    )
    assert run(server, ExecRequest(["sh", "-c", "kill -TERM $$"]))[0] == 128 + 15


def test_the_command_pid_comes_before_its_output(server: Path) -> None:
    """Protocol version 3: the PID frame (what Docker's exec inspect reports)."""
    pids: list[int] = []
    code, _, out, _ = run(server, ExecRequest(["sh", "-c", "echo $$"]), pids=pids)
    assert code == 0 and pids == [int(out)], (pids, out)
    pids = []
    run(server, ExecRequest(["no-such-command"]), pids=pids)
    assert pids == []  # it never started: no PID


def test_commands_that_cannot_start(server: Path, tmp_path: Path) -> None:
    code, _, _, err = run(server, ExecRequest(["no-such-command"]))
    assert (code, err) == (127, b"no-such-command: command not found\n")
    (tmp_path / "data").write_text("not a program")
    (tmp_path / "data").chmod(0o644)
    code, _, _, err = run(server, ExecRequest([str(tmp_path / "data")]))
    assert (code, err) == (126, f"{tmp_path}/data: permission denied\n".encode())
    code, _, _, err = run(server, ExecRequest(["true"]), cwd="/no/such/dir")
    assert (code, err) == (127, b"/no/such/dir: Not a directory\n")


def test_stdin_and_output_bigger_than_a_pipe(server: Path) -> None:
    data = os.urandom(3 * 2**20)  # both pipes fill while the other is being read
    code, _, out, _ = run(server, ExecRequest(["cat"], stdin=data))
    assert code == 0 and out == data
    code, _, out, _ = run(server, ExecRequest(["head", "-c", "10", "/dev/zero"], stdin=data))
    assert (code, out) == (0, b"\0" * 10)  # a command that stops reading its stdin early


def test_a_background_child_holding_the_pipes_does_not_hold_the_exit(server: Path) -> None:
    t0 = time.monotonic()
    code, _, out, _ = run(server, ExecRequest(["sh", "-c", "echo fg; sleep 30 & exit 4"]))
    assert (code, out) == (4, b"fg\n") and time.monotonic() - t0 < 5


def test_closing_the_connection_kills_the_command_group(server: Path, tmp_path: Path) -> None:
    marker = tmp_path / "alive"
    script = f"(while :; do touch {marker}; sleep 0.05; done) & sleep 30"
    code, timed_out, _, _ = run(server, ExecRequest(["sh", "-c", script], timeout=0.5))
    assert timed_out and code == 137
    time.sleep(0.3)
    marker.unlink()
    time.sleep(0.3)
    assert not marker.exists()  # the background loop went with its group


def test_limits_are_set_on_the_command_and_a_bad_one_stops_it(server: Path) -> None:
    """Protocol version 5: "RESOURCE:SOFT:HARD,..." set on the command before it starts
    (-1: unlimited); one the kernel refuses is the command's failure to start."""

    def limited(limits: str) -> ExecTarget:
        return ExecTarget("x", "runc", server, server, [], "/", server, limits=limits)

    script = "ulimit -Sn; ulimit -Hn; ulimit -c; ulimit -Hs"
    asked = limited("7:100:200,4:0:0,3:8388608:-1")
    assert run(server, ExecRequest(["sh", "-c", script]), target=asked)[:3] == (
        0,
        False,
        b"100\n200\n0\nunlimited\n",
    )
    code, _, out, err = run(server, ExecRequest(["echo", "x"]), target=limited("7:300:200"))
    assert (code, out, err) == (126, b"", b"echo: Invalid argument\n")


def test_requests_that_are_not_the_protocol_leave_it_serving(server: Path) -> None:
    for junk in [
        b"",
        b"\x00\x00",
        struct.pack(">III", 0, 1, 0),
        struct.pack(">III", 5, 9, 0) + b"a\0b\0\0",  # more arguments than strings
        struct.pack(">III", 3, 1, 0) + b"abc",  # not NUL-terminated
        struct.pack(">III", 2**31, 1, 0),  # far over the header limit
        *(  # limits that are not "RESOURCE:SOFT:HARD,..."
            struct.pack(">III", len(bad) + 5, 1, SETS_LIMITS) + bad + b"\0/\0true\0"
            for bad in (b"7:1", b"16:1:1", b"7:1:2,", b"7:-2:1", b"x:1:1", b"7:1:2:3")
        ),
    ]:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(server))
            s.sendall(junk)
            s.shutdown(socket.SHUT_WR)
            s.settimeout(10)
            # Closed, no answer (a reset: it closed with our bytes unread).
            with contextlib.suppress(ConnectionResetError):
                assert s.recv(100) == b""
    assert run(server, ExecRequest(["echo", "still"]))[:3] == (0, False, b"still\n")


def test_many_commands_at_once(server: Path) -> None:
    async def main() -> list[int]:
        codes: list[int] = []

        async def one(i: int) -> None:
            async def emit(kind: str, data: bytes) -> None:
                assert data == f"{i}\n".encode()

            stream = await _connect(server)
            assert not isinstance(stream, str), stream
            req = ExecRequest(["sh", "-c", f"echo {i}; exit {i % 7}"])
            codes.append((await _via_server(stream, req, "/", ENV, emit))[0] - i % 7)

        async with anyio.create_task_group() as tasks:
            for i in range(100):
                tasks.start_soon(one, i)
        return codes

    assert anyio.run(main, **AGENT_LOOP) == [0] * 100


def test_nul_in_a_request_is_bad_input() -> None:
    with pytest.raises(BadInputError, match="NUL"):
        ExecRequest(["echo", "a\0b"])


# ---------------------------------------------------------------- streamed stdin, a terminal


def talk(sock: Path, req: ExecRequest, script: list[tuple[bytes, object]]) -> tuple[int, bytes]:
    """Run req with streamed stdin: for each (expected, send) step, wait until the output
    so far ends with `expected` (b"": do not wait), then feed `send` (bytes, b"" for the
    end, or (rows, columns)). The command's (status, output)."""
    out = bytearray()
    got = anyio.Event()

    async def emit(kind: str, data: bytes) -> None:
        nonlocal got
        out.extend(data)
        got.set()
        got = anyio.Event()

    async def main() -> int:
        send, receive = anyio.create_memory_object_stream[bytes | tuple[int, int]](16)
        req.feed = receive
        stream = await _connect(sock)
        assert not isinstance(stream, str), stream
        async with anyio.create_task_group() as tg:

            async def typist() -> None:
                for expected, item in script:
                    with anyio.fail_after(10):
                        while not out.endswith(expected):
                            await got.wait()
                    await send.send(item)  # type: ignore[arg-type]

            tg.start_soon(typist)
            with anyio.fail_after(20):
                code, _ = await _via_server(stream, req, "/", ENV, emit)
        return code

    code = anyio.run(main, **AGENT_LOOP)
    return code, bytes(out)


def test_streamed_stdin_is_a_conversation(server: Path) -> None:
    script = 'read a; echo "got $a"; read b; echo "got $b"; cat'
    steps: list[tuple[bytes, object]] = [
        (b"", b"one\n"),
        (b"got one\n", b"two\n"),  # sent only once the answer to the first line came
        (b"got two\n", b"rest " * 30000),  # more than a frame and a pipe
        (b"", b""),
    ]
    code, out = talk(server, ExecRequest(["sh", "-c", script]), steps)
    assert code == 0 and out == b"got one\ngot two\n" + b"rest " * 30000


def test_a_terminal_with_its_size_and_end_of_input(server: Path) -> None:
    script = "test -t 0 && test -t 1 && test -t 2 && echo tty; stty size; cat; echo end"
    steps: list[tuple[bytes, object]] = [
        (b"", (33, 111)),  # before its first read: the size it sees
        (b"33 111\r\n", b"typed\n"),
        (b"typed\r\n", b""),  # the echo, then cat's copy; then ^D ends cat
    ]
    req = ExecRequest(["sh", "-c", script], terminal=True)
    code, out = talk(server, req, steps)
    assert code == 0, out
    assert out.startswith(b"tty\r\n33 111\r\n") and out.endswith(b"end\r\n"), out
    assert out.count(b"typed\r\n") == 2, out  # the terminal's echo and cat's output


def test_a_terminal_without_stdin_stays_open(server: Path) -> None:
    """`docker exec -t` without -i: no input, no end of it; the command reads on."""
    script = "test -t 0 && echo tty; read x; echo never"
    req = ExecRequest(["sh", "-c", script], timeout=1.0, terminal=True)
    code, timed_out, out, _ = run(server, req)
    assert timed_out and out == b"tty\r\n", out
