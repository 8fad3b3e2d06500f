"""Finding 20 (session 57's review): the kernel's counters that a sandbox shares with the
host. There is no user namespace, so root in a sandbox is uid 0 of the host, and the
kernel keeps some limits per uid or for the whole node, none per cgroup. With the
kernel's defaults one sandbox took all of root's inotify instances, AIO events, pending
signals and message-queue bytes, shrank every other root process's new pipes, and took
the node's ptys: each then failed on the host or in every other sandbox.

Each test sets the counter back to the kernel's default first (what a fresh node has),
starts the agent, and has one sandbox hold what it can of that counter (a process in
its background that exits with the sandbox), while the host's root and another sandbox
make one of the same. lazyfs/sandbox/shared_counters.py raises the counters whose
objects a sandbox's memory limit pays for; ptys are bounded per sandbox (devpts max), and
pending signals and queue bytes by a sandbox's rlimits (half of the host's).
"""

from __future__ import annotations

import errno
import subprocess
import time
from dataclasses import dataclass

import pytest

from lazyfs.client import Client, Sandbox
from lazyfs.sandbox.oci_spec import PTYS
from lazyfs.sandbox.shared_counters import FLOORS, NO_LIMIT, SYSCTL, shared_counters_left
from lazyfs.sandbox.ulimits import default_limits
from testbed.agent import AgentProcess, generic_ready
from testbed.node import Node

HOST_PYTHON = "/usr/bin/python3"
# The kernel's own defaults of the counters tested here whose default does not depend on
# the node's memory.
KERNEL_DEFAULTS = {
    "fs/inotify/max_user_instances": 128,
    "fs/aio-max-nr": 65536,
    "fs/pipe-user-pages-soft": 16384,
}


def _set(name: str, value: int) -> None:
    (SYSCTL / name).write_text(str(value))


@pytest.fixture
def fresh_node_counters() -> None:
    """The counters as a fresh node has them (lazyfs raises them again as it starts)."""
    for name, value in KERNEL_DEFAULTS.items():
        _set(name, value)


def test_the_agent_raises_the_counters_a_sandbox_shares_with_the_host(
    agent: AgentProcess, fresh_node_counters: None
) -> None:
    assert shared_counters_left()  # the kernel's defaults are below the floors
    agent.start()
    assert shared_counters_left() == []
    for name, floor in FLOORS.items():
        assert int((SYSCTL / name).read_text()) >= floor, name
    for name in NO_LIMIT:
        assert (SYSCTL / name).read_text().strip() == "0", name


def test_lazyfs_run_raises_them_too(sandbox_node: Node, fresh_node_counters: None) -> None:
    proc = sandbox_node.run("true")
    assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr
    assert shared_counters_left() == []


# ------------------------------------------------------------ one sandbox holds, others ask

HOLD = r"""
import os, sys, time
{take}
with open("/tmp/held.tmp", "w") as f:
    f.write(f"{{taken}} {{err}}")
os.rename("/tmp/held.tmp", "/tmp/held")
time.sleep(600)  # holds it until the sandbox is deleted
"""


@dataclass
class Counter:
    """take: code that sets `taken` (how many it holds) and `err` (the errno it stopped
    at, 0 if it stopped at its own count); ask: code that prints 0 if one more can be
    had, else the errno."""

    take: str
    ask: str


INOTIFY = Counter(
    take="""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
fds, err = [], 0
while len(fds) < 300 and not err:
    fd = libc.inotify_init1(0)
    fds.append(fd) if fd >= 0 else None
    err = 0 if fd >= 0 else ctypes.get_errno()
taken = len(fds)
""",
    ask="""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
print(0 if libc.inotify_init1(0) >= 0 else ctypes.get_errno())
""",
)
PIPES = Counter(  # 1,100 empty pipes: past 16,384 pages (16 each) for root
    take="""
import resource
resource.setrlimit(resource.RLIMIT_NOFILE, (4096, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
pipes = [os.pipe() for _ in range(1100)]
taken, err = len(pipes), 0
""",
    ask="""
import fcntl, os
r, w = os.pipe()
print(0 if fcntl.fcntl(w, fcntl.F_GETPIPE_SZ) == 65536 else "small")
""",
)
AIO = Counter(  # 16 x 8,192 events: twice the kernel's default for the node
    take="""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
contexts, err = [], 0
while len(contexts) < 16 and not err:
    context = ctypes.c_ulong(0)
    err = 0 if libc.syscall(206, 8192, ctypes.byref(context)) == 0 else ctypes.get_errno()
    contexts.append(context)
taken = len(contexts) - bool(err)
""",
    ask="""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
context = ctypes.c_ulong(0)
print(0 if libc.syscall(206, 128, ctypes.byref(context)) == 0 else ctypes.get_errno())
""",
)
PTY = Counter(
    take="""
held, err = [], 0
while len(held) < 5000 and not err:
    try:
        held.append(os.openpty())
    except OSError as e:
        err = e.errno
taken = len(held)
""",
    ask="""
import os
try:
    os.openpty(); print(0)
except OSError as e:
    print(e.errno)
""",
)
SIGNALS = Counter(  # real-time signals queued to itself, blocked
    take="""
import ctypes, signal
libc = ctypes.CDLL(None, use_errno=True)
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMIN])
taken, err, pid = 0, 0, os.getpid()
while taken < 200000 and not err:
    if libc.sigqueue(pid, signal.SIGRTMIN, ctypes.c_void_p(0)) == 0:
        taken += 1
    else:
        err = ctypes.get_errno()
""",
    ask="""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
timer = ctypes.c_void_p()
print(0 if libc.timer_create(1, None, ctypes.byref(timer)) == 0 else ctypes.get_errno())
""",
)
QUEUES = Counter(  # POSIX message queues of 10 x 8 KiB
    take="""
import ctypes
rt = ctypes.CDLL("librt.so.1", use_errno=True)
class Attr(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_long), ("maxmsg", ctypes.c_long),
                ("msgsize", ctypes.c_long), ("curmsgs", ctypes.c_long), ("pad", ctypes.c_long * 4)]
taken, err = 0, 0
while taken < 200 and not err:
    attr = ctypes.byref(Attr(0, 10, 8192, 0))
    fd = rt.mq_open(b"/q%d" % taken, os.O_CREAT | os.O_RDWR, 0o600, attr)
    taken, err = (taken + 1, 0) if fd >= 0 else (taken, ctypes.get_errno())
""",
    ask="""
import ctypes, os
rt = ctypes.CDLL("librt.so.1", use_errno=True)
name = b"/lazyfs-test-%d" % os.getpid()
fd = rt.mq_open(name, os.O_CREAT | os.O_RDWR, 0o600, None)
print(0 if fd >= 0 else ctypes.get_errno())
rt.mq_unlink(name)
""",
)


def _wait_for(path: str, sb: Sandbox, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while sb.exec(["test", "-s", path]).exit_code != 0:
        assert time.monotonic() < deadline, f"nothing at {path} in {timeout} s"
        time.sleep(0.05)
    return sb.exec(["cat", path]).stdout.decode()


def _hold(c: Client, counter: Counter) -> tuple[Sandbox, int, int]:
    """A sandbox (a generic claim) whose background process holds what it could take."""
    deadline = time.monotonic() + 30
    while generic_ready(c) < 1:
        assert time.monotonic() < deadline, "no generic sandbox ready"
        time.sleep(0.05)
    sb = c.create("py")
    script = HOLD.format(take=counter.take)
    launch = 'setsid python3 -c "$0" </dev/null >/tmp/hold.out 2>&1 &'
    assert sb.exec(["sh", "-c", launch, script]).exit_code == 0
    taken, err = map(int, _wait_for("/tmp/held", sb).split())
    return sb, taken, err


def _host_asks(counter: Counter) -> str:
    said = subprocess.run([HOST_PYTHON, "-c", counter.ask], capture_output=True, text=True)
    return said.stdout.strip() or said.stderr


def _attack(agent: AgentProcess, counter: Counter, *, warm: int = 2) -> tuple[int, int, str, str]:
    """(taken, errno the holder stopped at, what the host's root got, what another
    sandbox got) while one sandbox holds the counter."""
    agent.start("--warm", str(warm))
    with agent.client() as c, c.create("py") as other:
        assert other.exec(["python3", "-c", counter.ask]).stdout.strip() == b"0"
        holder, taken, err = _hold(c, counter)
        with holder:
            host = _host_asks(counter)
            in_other = other.exec(["python3", "-c", counter.ask]).stdout.decode().strip()
    print(f"held {taken} (then errno {err}); the host's root: {host}; another sandbox: {in_other}")
    return taken, err, host, in_other


def test_inotify_instances_held_by_a_sandbox_leave_the_hosts_root_its_own(
    agent: AgentProcess, fresh_node_counters: None
) -> None:
    """128 instances a uid before: the sandbox took every one of root's (EMFILE for the
    host's root, containerd, systemd, and every other sandbox)."""
    taken, err, host, other = _attack(agent, INOTIFY)
    assert (taken, err) == (300, 0)  # past the kernel's 128: its memory pays for them
    assert host == "0" and other == "0"


def test_pipes_held_by_a_sandbox_leave_every_other_pipe_its_size(
    agent: AgentProcess, fresh_node_counters: None
) -> None:
    """Past 16,384 pages of pipes a uid, a capability-less process's new pipe had 8 KiB
    instead of 64 (and could not grow): every other sandbox's, its exec output's too."""
    taken, err, host, other = _attack(agent, PIPES)
    assert (taken, err) == (1100, 0)
    assert host == "0" and other == "0"


def test_aio_events_held_by_a_sandbox_leave_the_node_its_own(
    agent: AgentProcess, fresh_node_counters: None
) -> None:
    """fs.aio-max-nr (65,536) is one count for the node: eight io_setup calls took it
    from every process (InnoDB, libaio, QEMU)."""
    taken, err, host, other = _attack(agent, AIO)
    assert (taken, err) == (16, 0)
    assert host == "0" and other == "0"


def test_a_sandbox_has_ptys_of_its_own_not_the_nodes(
    agent: AgentProcess, fresh_node_counters: None
) -> None:
    """Every devpts instance but the host's shares kernel.pty.max less the reserve
    (3,072): one sandbox took them all, and no other could open a terminal."""
    taken, err, host, other = _attack(agent, PTY)
    assert (taken, err) == (PTYS, errno.ENOSPC)  # its own instance's max
    assert host == "0" and other == "0"


def test_signals_queued_in_a_sandbox_leave_the_hosts_root_its_own(
    agent: AgentProcess, fresh_node_counters: None
) -> None:
    """Pending signals count per uid against the receiver's RLIMIT_SIGPENDING: with the
    host's limit a sandbox queued every one of root's, and the host's timer_create and
    sigqueue failed (EAGAIN)."""
    taken, err, host, _other = _attack(agent, SIGNALS)
    limit = default_limits()["sigpending"][0]  # less what root's processes have pending
    assert err == errno.EAGAIN and limit - 100 < taken <= limit, (taken, limit)
    assert host == "0"  # the host's root keeps the other half


def test_message_queues_of_a_sandbox_leave_the_hosts_root_its_own(
    agent: AgentProcess, fresh_node_counters: None
) -> None:
    """Queue bytes count per uid against the maker's RLIMIT_MSGQUEUE (819,200): nine
    empty queues in a sandbox and the host's root could make none (EMFILE)."""
    taken, err, host, _other = _attack(agent, QUEUES)
    assert err == errno.EMFILE and 0 < taken < 9  # within half of the host's bytes
    assert host == "0"


def test_lazyfs_runs_sandbox_has_the_same_bounds(sandbox_node: Node) -> None:
    """`lazyfs run` makes its sandbox from the same spec: its ptys and its limits."""
    probe = (
        "import os, resource\n"
        + PTY.take
        + "print(taken, err, resource.getrlimit(resource.RLIMIT_SIGPENDING)[1],"
        " resource.getrlimit(resource.RLIMIT_MSGQUEUE)[1])"
    )
    proc = sandbox_node.run("python3", "-c", probe)
    assert proc.returncode == 0, proc.stderr
    limits = default_limits()
    expected = [PTYS, errno.ENOSPC, limits["sigpending"][1], limits["msgqueue"][1]]
    assert list(map(int, proc.stdout.split())) == expected, proc.stdout
