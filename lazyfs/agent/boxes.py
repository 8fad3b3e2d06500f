"""One sandbox as the agent keeps it (`AgentBox`) and the states it goes through.

A sandbox here is lazyfs.sandbox.runtime's `Sandbox` whose PID 1 is the exec server, a
static binary from the host (exec_server.c), so that it can run many commands, each with
one fork+exec (execute.py; `runtime exec` when the server does not answer).

Its state is a `BoxState`, and every change goes through `AgentBox.move`, which refuses
one that TRANSITIONS does not list: a refused move is a bug in the agent (BadTransition,
not a LazyfsError, so that no `suppress(LazyfsError)` hides it), never a client's
mistake. The table is the one place that says what may follow what, as a daemon state
machine does (Nydus's DaemonStateMachine). The on-disk record (records.py) keeps the
state's string, the enum's value, so records written before the enum read unchanged.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

from lazyfs.agent.errors import ReadOnlyRoot
from lazyfs.agent.execute import SOCKET_NAME, ExecTarget
from lazyfs.agent.records import BoxRecord
from lazyfs.sandbox.confinement import cap_mask
from lazyfs.sandbox.runtime import RuntimeFailed, Sandbox
from lazyfs.sandbox.ulimits import header, parse_ulimits


class BoxState(enum.Enum):
    # Started, not handed out: a pooled sandbox, or a cold one until its create returns.
    READY = "ready"
    WARMUP = "warmup"  # running a pool's warm-up command, then deleted (pools.py)
    RUNNING = "running"  # handed out: takes commands
    EXITED = "exited"  # its PID 1 (the exec server) ended: it runs nothing more
    DELETING = "deleting"  # being deleted; gone from the agent's books when done


# What a sandbox is when it first appears in the agent's books: made (READY), or adopted
# after a restart (RUNNING: only running sandboxes are adopted, recovery.py).
INITIAL = frozenset({BoxState.READY, BoxState.RUNNING})

TRANSITIONS: dict[BoxState, frozenset[BoxState]] = {
    # A claim (pool or cold), a pool's warm-up, its PID 1 ending, a delete.
    BoxState.READY: frozenset(
        {BoxState.RUNNING, BoxState.WARMUP, BoxState.EXITED, BoxState.DELETING}
    ),
    BoxState.WARMUP: frozenset({BoxState.EXITED, BoxState.DELETING}),
    BoxState.RUNNING: frozenset({BoxState.EXITED, BoxState.DELETING}),
    # An exited sandbox is only deleted (by its client, its TTL or a pool's prune).
    BoxState.EXITED: frozenset({BoxState.DELETING}),
    # Deleted twice: at shutdown the refill task may clean up the sandbox it just made
    # while shutdown() deletes every sandbox, that one too (Sandbox.delete is idempotent).
    BoxState.DELETING: frozenset({BoxState.DELETING}),
}


class BadTransition(RuntimeError):
    """A state change the table does not allow: a bug in the agent (an internal error)."""


@dataclass
class AgentBox:
    sandbox: Sandbox
    record: BoxRecord
    target: ExecTarget
    state: BoxState
    execs: int = 0

    def __post_init__(self) -> None:
        if self.state not in INITIAL:
            raise BadTransition(f"sandbox {self.record.id} cannot start as {self.state.value}")

    @property
    def id(self) -> str:
        return self.record.id

    def check_writable(self) -> None:
        """ReadOnlyRoot for a sandbox made with a read-only root: the file API writes
        into its rootfs from the host, past the mount's read-only flag, so it says no
        itself (as dockerd refuses `docker cp` into such a container)."""
        if self.record.read_only:
            raise ReadOnlyRoot(f"sandbox {self.record.id}: its root is read-only")

    def move(self, to: BoxState) -> None:
        """Change the state, or BadTransition if TRANSITIONS does not allow it."""
        if to not in TRANSITIONS[self.state]:
            raise BadTransition(
                f"sandbox {self.record.id}: {self.state.value} -> {to.value} is not allowed"
            )
        self.state = to

    def poll(self) -> None:
        """Mark the sandbox exited if its PID 1 (our child since `runtime create`) ended.
        The sandbox's own code cannot kill it (the namespace's init: exec_server.c); the
        host can (an operator, the OOM killer), and it exits at once if its start went
        wrong."""
        pid = self.sandbox.pid
        if pid is None or self.state not in (BoxState.RUNNING, BoxState.READY, BoxState.WARMUP):
            return
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            self.sandbox.pid = None
            code = os.waitstatus_to_exitcode(status)
            self.sandbox.exit_status = 128 - code if code < 0 else code
            self.move(BoxState.EXITED)

    def check_started(self) -> None:
        """RuntimeFailed if the sandbox's PID 1, its exec server, already ended: a pool
        must not take it (a claim would check again: Pools.take)."""
        self.poll()
        if self.state is BoxState.EXITED:
            raise RuntimeFailed(
                f"sandbox {self.record.id}: its exec server exited at start"
                f" (status {self.sandbox.exit_status}; the bundle's log says why)"
            )

    def view(self) -> dict:
        r = self.record
        return {
            "id": r.id,
            "image": r.image,
            "image_id": r.image_id,
            "state": self.state.value,
            "created": r.created,
            "expires": r.expires,
            "from_pool": r.from_pool,
            "limits": {
                "cpus": r.cpus,
                "memory": r.memory,
                "pids": r.pids,
                "disk": r.disk,
                "cpu_shares": r.cpu_shares,
                "cpuset_cpus": r.cpuset,
            },
            "network": r.network,
            "tmpfs": r.tmpfs,
            "cap_drop": r.cap_drop,
            "read_only": r.read_only,
            "ulimits": r.ulimits,
            "extra_hosts": r.extra_hosts,
            "hostname": r.hostname,
            "paused": r.paused,
            "execs": self.execs,
        }


def exec_target(sandbox: Sandbox, record: BoxRecord) -> ExecTarget:
    """What execute.py needs of the sandbox."""
    return ExecTarget(
        sandbox.id,
        record.runtime,
        sandbox.state,
        sandbox.rootfs,
        record.process_env,
        record.cwd,
        sandbox.dir / SOCKET_NAME,
        box_env=record.env,
        drop_caps=cap_mask(record.cap_drop),
        limits=header(parse_ulimits(record.ulimits)),
    )
