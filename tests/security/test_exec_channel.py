"""The exec channel (issue 20, finding 6: "the policy can forge its own results").

Before: the exec server bound its socket in /dev/lazyfs, a directory the sandbox could
write, and the agent connected to whatever socket was there; a 20-line server renamed
over it made every exec, `false` included, return "42 passed" and exit 0. Now the agent
makes the listening socket on the host, in a directory mounted nowhere in the sandbox,
and hands it to the server as fd 3; the server is the sandbox's PID 1 (unkillable from
inside) and non-dumpable (lazyfs/agent/exec_server.c).

Each test performs an attack as root inside an agent's sandbox (python test image) and
asserts that no forged result comes back; where a probe could fail for an unrelated
reason, it is also run where it must work (a dumpable process of the sandbox, or the host
without seccomp). The exec channel is the agent's only: `lazyfs run` has none.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import signal
import socket
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lazyfs.client import AgentError, Client, Sandbox
from lazyfs.settings import Settings
from testbed.agent import AgentProcess, running_agent

PTRACE = {"x86_64": 101, "aarch64": 117}[platform.machine()]
PIDFD_OPEN, PIDFD_GETFD = 434, 438  # the same on every architecture
SERVER = Settings.from_env().exec_server
HOST_PYTHON = "/usr/bin/python3"  # Debian's: nobody can run it (not a root-only pyenv)
NOBODY = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]


@pytest.fixture(scope="module")
def served(py_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    with running_agent(tmp_path_factory.mktemp("agent"), py_store) as agent:
        yield agent.start("--pool", "py=1")


@pytest.fixture
def client(served: AgentProcess) -> Iterator[Client]:
    with served.client() as c:
        yield c
        for box in c.list():  # a failed test's sandboxes must not leak into the next
            if box["state"] != "ready":
                c.sandbox(box["id"]).delete(missing_ok=True)


def _wait_for(check: object, what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _ready(c: Client) -> int:
    return sum(p["ready"] for p in c.pools())


def _assert_real(sb: Sandbox) -> None:
    """`false` exits 1 and a known command's output is its own, through the server."""
    r = sb.exec(["false"])
    assert (r.exit_code, r.stdout, r.channel) == (1, b"", "server"), r
    r = sb.exec(["sh", "-c", "echo $((6 * 7)) real; exit 3"])
    assert (r.exit_code, r.stdout, r.channel) == (3, b"42 real\n", "server"), r


# ------------------------------------------------------------ a server of its own

# The finding's attack: a server that answers every command "42 passed", exit 0, bound
# under a temporary name and renamed over the old socket path and over every socket the
# hunt below found. It logs each connection it gets.
FORGER = r"""
import os, select, socket, struct, sys
os.makedirs("/dev/lazyfs", exist_ok=True)
servers = []
for path in ["/dev/lazyfs/exec.sock", *sys.argv[1:]]:
    s = socket.socket(socket.AF_UNIX)
    tmp = path + ".forged"
    if os.path.lexists(tmp):
        os.unlink(tmp)
    s.bind(tmp)
    s.listen(16)
    os.rename(tmp, path)
    servers.append(s)
log = open("/tmp/forger.log", "w", buffering=1)
while True:
    for s in select.select(servers, [], [])[0]:
        c, _ = s.accept()
        log.write("connection\n")
        c.settimeout(2)
        try:  # the request first: closing before the client sent it gave it EPIPE
            c.recv(65536)
        except OSError:
            pass
        c.sendall(struct.pack(">BI", 1, 10) + b"42 passed\n" + struct.pack(">BIi", 3, 4, 0))
        c.close()
"""

# Every unix socket the sandbox can name: socket files anywhere in its tree, and the
# names in /proc/net/unix (its network namespace's; with --network, the host's, whose
# abstract names are left alone: they are other services, and not the agent's). To
# each, an exec request for `echo pwned`; what answers is printed as JSON.
HUNTER = r"""
import json, os, socket, struct, subprocess, sys
found = set(subprocess.run(
    ["find", "/", "-path", "/proc", "-prune", "-o", "-path", "/sys", "-prune",
     "-o", "-type", "s", "-print"], capture_output=True, text=True).stdout.split())
with open("/proc/net/unix") as f:
    for line in f.readlines()[1:]:
        fields = line.split()
        if len(fields) == 8:
            found.add(fields[7])
own_netns = sys.argv[1] == "own"
argv, env = [b"echo", b"pwned"], [b"PATH=/usr/bin:/bin"]
header = b"".join(x + b"\0" for x in [b"/", *argv, *env])
request = struct.pack(">III", len(header), len(argv), 0) + header
answers = {}
for name in sorted(found):
    if name.startswith("@") and not own_netns:
        continue
    address = "\0" + name[1:] if name.startswith("@") else name
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(2)
    try:
        s.connect(address)
        s.sendall(request)
        answers[name] = s.recv(4096).decode(errors="replace")
    except OSError as e:
        answers[name] = "refused: " + e.strerror
    finally:
        s.close()
print(json.dumps(answers))
"""


def _hunt(sb: Sandbox, netns: str) -> dict[str, str]:
    r = sb.exec(["python3", "-c", HUNTER, netns], timeout=60)
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def _start_forger(sb: Sandbox, extra: list[str]) -> None:
    launch = 'setsid python3 -c "$0" "$@" </dev/null >/tmp/forger.out 2>&1 &'
    assert sb.exec(["sh", "-c", launch, FORGER, *extra]).exit_code == 0
    _wait_for(
        lambda: sb.exec(["test", "-e", "/tmp/forger.log"]).exit_code == 0,
        "the forging server to listen",
    )


@pytest.mark.parametrize("how", ["pooled", "network"])
def test_a_forging_server_in_the_sandbox_is_never_reached(client: Client, how: str) -> None:
    """The sandbox hunts for the exec server's socket (socket files, /proc/net/unix)
    and finds none that runs a command; then it puts its own "42 passed" server at the
    old path and over everything it found. `false` still exits 1."""
    if how == "pooled":  # a claim from the warm pool: started in the background
        _wait_for(lambda: _ready(client) == 1, "the pool to fill")
    with client.create("py", network=how == "network") as sb:
        assert sb.info["from_pool"] == (how == "pooled")
        netns = "own" if how == "pooled" else "host"
        found = _hunt(sb, netns)
        pwned = {name: answer for name, answer in found.items() if "pwned" in answer}
        assert pwned == {}, found  # no socket in reach runs a command
        # Replaced too, each that exists in the sandbox's tree (with --network, the
        # host's socket names in /proc/net/unix mostly do not).
        there = [n for n, answer in found.items() if n.startswith("/") and "No such" not in answer]
        _start_forger(sb, there)
        _assert_real(sb)
        assert sb.exec(["cat", "/tmp/forger.log"]).stdout == b""  # the agent never came
        # ... and its own server answers the sandbox itself: the attack was live.
        assert "42 passed" in _hunt(sb, netns)["/dev/lazyfs/exec.sock"]


def test_a_symlink_to_a_host_socket_in_the_sandbox_is_never_followed(
    client: Client, served: AgentProcess
) -> None:
    """Before: the agent followed what the sandbox put at /dev/lazyfs/exec.sock (it was
    checked to be no symlink). Now nothing there is looked at: a link to the agent's own
    socket changes nothing."""
    with client.create("py") as sb:
        link = f"mkdir -p /dev/lazyfs; ln -sf {served.socket} /dev/lazyfs/exec.sock"
        assert sb.exec(["sh", "-c", link]).exit_code == 0
        _assert_real(sb)
        assert client.health()["status"] == "ok"


# ------------------------------------------------------------ reading or taking it

# ptrace, /proc/PID/{environ,mem,fd/N} and pidfd_getfd against `pid`; each "ok" or the
# errno's name. ATTACH and SEIZE go to two processes (a tracee stays traced until the
# probe exits): `pid` and `pid2`.
PROBE = f"""
import ctypes, errno, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
def call(nr, *args):
    ctypes.set_errno(0)
    r = libc.syscall(nr, *(ctypes.c_long(a) for a in args))
    return ("ok", r) if r >= 0 else (errno.errorcode[ctypes.get_errno()], r)
def attempt(f):
    try:
        f()
        return "ok"
    except OSError as e:
        return errno.errorcode[e.errno]
pid, pid2, fd = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
found = {{}}
found["ptrace_attach"] = call({PTRACE}, 16, pid, 0, 0)[0]
found["ptrace_seize"] = call({PTRACE}, 0x4206, pid2, 0, 0)[0]
found["environ"] = attempt(lambda: open(f"/proc/{{pid}}/environ", "rb").read())
found["mem"] = attempt(lambda: open(f"/proc/{{pid}}/mem", "rb").close())
found["fd_readlink"] = attempt(lambda: os.readlink(f"/proc/{{pid}}/fd/{{fd}}"))
found["fd_open"] = attempt(lambda: os.close(os.open(f"/proc/{{pid}}/fd/{{fd}}", os.O_RDONLY)))
why, pidfd = call({PIDFD_OPEN}, pid, 0)
found["pidfd_getfd"] = call({PIDFD_GETFD}, pidfd, fd, 0)[0] if pidfd >= 0 else why
print(json.dumps(found))
"""
REFUSED = {
    "ptrace_attach": "EPERM",
    "ptrace_seize": "EPERM",
    "environ": "EACCES",
    "mem": "EACCES",
    "fd_readlink": "EACCES",
    "fd_open": "EACCES",
    "pidfd_getfd": "EPERM",
}


def _probe(sb: Sandbox, script: str) -> dict[str, str]:
    r = sb.exec(["sh", "-c", script, "probe", PROBE], timeout=60)
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def test_the_exec_server_cannot_be_ptraced_read_or_have_its_socket_taken(client: Client) -> None:
    """Sandbox root (no CAP_SYS_PTRACE) against PID 1, which holds the listening socket
    as fd 3, and against the process serving the probe's own command (its parent)."""
    with client.create("py") as sb:
        assert _probe(sb, 'exec python3 -c "$1" 1 1 3') == REFUSED
        # The probe's parent: the exec server's process for this command.
        assert _probe(sb, 'exec python3 -c "$1" $PPID $PPID 0') == REFUSED
        # The probe works: against ordinary (dumpable) processes of the sandbox all of
        # it succeeds, but pidfd_getfd, which the seccomp profile refuses outright (the
        # host test below shows that the server refuses it without seccomp too).
        control = (
            "sleep 30 >/dev/null & a=$!; sleep 30 >/dev/null & b=$!;"
            ' python3 -c "$1" $a $b 0; kill -9 $a $b'
        )
        assert _probe(sb, control) == dict.fromkeys(REFUSED, "ok") | {"pidfd_getfd": "EPERM"}
        assert sb.exec(["cat", "/proc/1/cmdline"]).stdout == b"/dev/lazyfs-exec\0"


def test_the_host_log_on_pid_1s_stdout_cannot_be_written_through_proc(
    client: Client, served: AgentProcess
) -> None:
    """PID 1's stdout and stderr are the bundle's log, a file on the host outside every
    limit of the sandbox. Reopening them through /proc/1/fd (which worked with a dumpable
    tini as PID 1) is refused; the log stays as it was."""
    with client.create("py") as sb:
        log = served.node.sandboxes / sb.id / "log"
        before = log.read_bytes()
        r = sb.exec(["sh", "-c", "echo forged >> /proc/1/fd/1 || echo refused"])
        assert r.stdout == b"refused\n" and b"Permission denied" in r.stderr, r
        assert log.read_bytes() == before


def _spawn_as_nobody(argv: list[str], fd3: int | None = None) -> int:
    """argv as uid/gid 65534 on the host (no seccomp, no namespace), `fd3` as its fd 3."""
    actions = []
    if fd3 is not None:  # from above 3: a dup2 onto itself would keep close-on-exec
        actions.append((os.POSIX_SPAWN_DUP2, fcntl.fcntl(fd3, fcntl.F_DUPFD_CLOEXEC, 4), 3))
    try:
        return os.posix_spawnp("setpriv", [*NOBODY, *argv], os.environ, file_actions=actions)
    finally:
        for action in actions:
            os.close(action[1])


def test_without_seccomp_the_exec_server_still_cannot_be_read_or_have_its_socket_taken() -> None:
    """The non-dumpable layer alone: the server run on the host as nobody, probed by
    nobody (same uid, no seccomp: only dumpability decides), against a `sleep` of
    nobody's where every probe works, pidfd_getfd included."""
    with tempfile.TemporaryDirectory(prefix="lazyfs-exec-probe-") as tmp:
        os.chmod(tmp, 0o755)  # nobody runs the copy of the server in it
        server = Path(tmp) / "lazyfs-exec-server"
        server.write_bytes(Path(SERVER).read_bytes())
        server.chmod(0o755)
        pids: list[int] = []
        try:
            with socket.socket(socket.AF_UNIX) as listener:
                listener.bind(f"{tmp}/exec.sock")
                listener.listen(8)
                pids.append(_spawn_as_nobody([str(server)], listener.fileno()))
            pids.append(_spawn_as_nobody(["sleep", "30"]))
            pids.append(_spawn_as_nobody(["sleep", "30"]))
            # A command run to its exit: the server made itself non-dumpable before.
            assert _run_true(f"{tmp}/exec.sock") == 0

            def probe(*args: int) -> dict[str, str]:
                argv = [*NOBODY, HOST_PYTHON, "-c", PROBE, *map(str, args)]
                out = subprocess.run(argv, capture_output=True, check=True, cwd="/")
                return json.loads(out.stdout)

            assert probe(pids[0], pids[0], 3) == REFUSED
            assert probe(pids[1], pids[2], 0) == dict.fromkeys(REFUSED, "ok")
        finally:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)


def _run_true(path: str) -> int:
    """`true` through the exec server listening at path: its exit status."""
    header = b"/\0true\0PATH=/usr/bin:/bin\0"
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(20)
        s.connect(path)
        s.sendall(struct.pack(">III", len(header), 1, 0) + header)
        reply = b""
        while chunk := s.recv(4096):
            reply += chunk
    # The pid frame (protocol v3), then the exit frame alone.
    assert reply[:5] == struct.pack(">BI", 4, 4), reply
    reply = reply[9:]
    assert reply[:5] == struct.pack(">BI", 3, 4), reply
    return struct.unpack(">i", reply[5:9])[0]


# ------------------------------------------------------------ killing it


def test_signals_from_inside_do_not_stop_the_exec_server(client: Client) -> None:
    """`kill -9 1`, `kill -STOP 1` and `kill -9 -1` as sandbox root: the next command
    still goes through the server. (Before, `kill -9 -1` killed the server under tini,
    tini exited and the sandbox was over: 409.)"""
    with client.create("py") as sb:
        assert sb.exec(["sh", "-c", "kill -9 1"]).exit_code == 0  # sent; the kernel drops it
        _assert_real(sb)
        assert sb.exec(["sh", "-c", "kill -STOP 1"]).exit_code == 0
        state = sb.exec(["sh", "-c", "grep State /proc/1/status"], timeout=10)
        assert not state.timed_out and b"S (sleeping)" in state.stdout, state
        _assert_real(sb)
        assert sb.exec(["sh", "-c", "setsid sleep 300 >/dev/null 2>&1 &"]).exit_code == 0
        count = (
            "for p in /proc/[0-9]*; do tr '\\0' ' ' <$p/cmdline; echo; done | grep -c '^sleep 300'"
        )
        assert sb.exec(["sh", "-c", count]).stdout == b"1\n"
        # The process serving this very command dies too: the command gets no result.
        with pytest.raises(AgentError) as err:
            sb.exec(["sh", "-c", "kill -9 -1; sleep 1; echo 42 passed"])
        assert err.value.status == 502, err.value
        _assert_real(sb)
        assert sb.exec(["sh", "-c", count]).stdout == b"0\n"  # kill -9 -1 did kill the rest
        assert [b["state"] for b in client.list() if b["id"] == sb.id] == ["running"]


def test_killing_the_process_serving_a_command_gives_an_error_never_a_result(
    client: Client,
) -> None:
    """The one part of the channel inside the sandbox's reach: the process the server
    forks per command. Killing it from the command ends the exec with a 502
    (exec_server_failed), in the buffered and the streaming form, never with the exit
    status or output that the command then makes up."""
    forge = "kill -9 $PPID; echo 42 passed; exit 0"
    with client.create("py") as sb:
        with pytest.raises(AgentError) as err:
            sb.exec(["sh", "-c", forge])
        assert (err.value.status, err.value.code) == (502, "exec_server_failed")
        events = []
        with pytest.raises(AgentError) as err:
            events.extend(sb.exec_stream(["sh", "-c", forge]))
        assert err.value.code == "exec_server_failed" and events == [], events
        _assert_real(sb)


# ------------------------------------------------------------ the fallback


def _runtime_execs(c: Client) -> float:
    for line in c.metrics().splitlines():
        if line.startswith('lazyfs_execs_total{channel="runtime"}'):
            return float(line.split()[1])
    raise AssertionError("no lazyfs_execs_total{channel=runtime} in /metrics")


@pytest.mark.parametrize("broken", ["removed", "refused"])
def test_when_the_server_does_not_answer_the_agent_uses_the_runtime_and_says_so(
    client: Client, served: AgentProcess, broken: str
) -> None:
    """The sandbox cannot bring this about (above); an operator can remove the socket
    on the host ("removed": no such file), and a server that is gone leaves a socket
    nobody accepts on ("refused": made here as a socket file whose listener is closed).
    Commands then run through `runc exec`, and every result, the log and /metrics say
    "runtime"."""
    with client.create("py") as sb:
        before = _runtime_execs(client)
        path = served.node.sandboxes / sb.id / "exec.sock"
        path.unlink()
        if broken == "refused":
            with socket.socket(socket.AF_UNIX) as dead:
                dead.bind(str(path))
        r = sb.exec(["false"])
        assert (r.exit_code, r.channel) == (1, "runtime"), r
        r = sb.exec(["sh", "-c", "echo $((6 * 7)) real; exit 3"])
        assert (r.exit_code, r.stdout, r.channel) == (3, b"42 real\n", "runtime"), r
        *_, (kind, end) = sb.exec_stream(["true"])
        assert kind == "exit" and end.channel == "runtime"  # type: ignore[union-attr]
        assert _runtime_execs(client) == before + 3
        why = "No such file or directory" if broken == "removed" else "Connection refused"
        assert f"{sb.id}: its exec server does not answer ({path}: {why})" in served.log()
