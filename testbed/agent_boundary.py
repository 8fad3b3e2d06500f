"""The sandbox boundary's test suites (tests/lazyfs/test_sandbox_security.py and
test_sandbox_limits.py) run on `lazyfs run`'s sandboxes (testbed.node.Node) and on the
agent's generic sandboxes, which take an image's root at the claim (issue 23). This is
the second: the part of Node's interface those suites use (tmp, run, ok), served by an
agent started with --warm, each command in a new sandbox claimed from the generic pool
(checked: a cold create would test the other path).

What differs between the two is named here and on Node, not tested around: the
sandbox's init (tini at /dev/init for `lazyfs run`; the agent's exec server at
/dev/lazyfs-exec, PID 1) and how many tasks run beside a command (tini; the exec server
and the process serving that command)."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

from lazyfs.client import Client
from lazyfs.sandbox.ulimits import parse_flag
from testbed.agent import AgentProcess
from testbed.node import Node

READY_TIMEOUT = 30.0  # seconds for the generic pool to have a ready sandbox
# `lazyfs run`'s flags that take a value and are the create's fields (dashes as _).
LIMIT_FLAGS = (
    "--memory",
    "--pids",
    "--cpus",
    "--disk",
    "--cpu-shares",
    "--cpuset-cpus",
    "--linger",
)


class AgentBoundary:
    init_path = "/dev/lazyfs-exec"
    tasks_beside_command = 2  # the exec server (PID 1) and its child serving the command
    says_oom = False  # an exec's result has no OOM message (`lazyfs run` prints one)
    own_user_namespace = False  # its sandboxes' root is the host's

    def __init__(self, agent: AgentProcess) -> None:
        self.agent = agent
        self.tmp: Path = agent.node.tmp
        # A test may run two commands at once (the limits suite's neighbour). The wait
        # for a ready generic sandbox and the claim of it are one step under this lock,
        # or both threads see the same ready sandbox and one of them creates cold.
        self._claim = threading.Lock()

    def _wait_ready(self, c: Client) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while not any(p["generic"] and p["ready"] for p in c.pools()):
            assert time.monotonic() < deadline, "the generic pool has no ready sandbox"
            time.sleep(0.05)

    def run(
        self,
        *command: str,
        options: tuple[str, ...] = (),
        image: str = "py",
        stdin: str | None = None,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        """As Node.run: `lazyfs run`'s --network and limits (LIMIT_FLAGS) become the
        create's; --linger is the agent's own (its trees linger anyway)."""
        create: dict = {}
        args = list(options)
        while args:
            flag = args.pop(0)
            if flag == "--network":
                create["network"] = True
            elif flag == "--tmpfs":  # PATH[:OPTIONS], as `lazyfs run` takes it
                path, _, tmpfs_options = args.pop(0).partition(":")
                create.setdefault("tmpfs", {})[path] = tmpfs_options
            elif flag == "--cap-drop":
                create.setdefault("cap_drop", []).append(args.pop(0))
            elif flag == "--read-only":
                create["read_only"] = True
            elif flag == "--add-host":
                create.setdefault("extra_hosts", []).append(args.pop(0))
            elif flag == "--hostname":
                create["hostname"] = args.pop(0)
            elif flag == "--ulimit":
                name, soft, hard = parse_flag(args.pop(0))
                create.setdefault("ulimits", {})[name] = (soft, hard)
            elif flag in LIMIT_FLAGS:
                value = args.pop(0)
                if flag != "--linger":
                    key = flag[2:].replace("-", "_")
                    create[key] = float(value) if flag == "--cpus" else value
            else:
                raise AssertionError(f"no agent equivalent for {flag}")
        if "pids" in create:
            create["pids"] = int(create["pids"])
        # A sandbox with the node's network is made for the create (a cold one); any
        # other takes a generic one (tmpfs mounts of its own, a read-only root,
        # capabilities dropped and ulimits within the default hard limits too, at the
        # claim).
        generic = not create.get("network")
        with Client(socket=self.agent.socket) as c:
            with self._claim:
                if generic:
                    self._wait_ready(c)
                sb = c.create(image, **create)
            try:
                assert sb.info["from_pool"] == generic, sb.info
                r = sb.exec(
                    list(command),
                    timeout=timeout,
                    stdin=stdin.encode() if stdin is not None else None,
                )
            finally:
                sb.delete()
        return subprocess.CompletedProcess(
            list(command),
            r.exit_code,
            r.stdout.decode(errors="replace"),
            r.stderr.decode(errors="replace"),
        )

    def ok(self, *command: str, options: tuple[str, ...] = ()) -> str:
        proc = self.run(*command, options=options)
        assert proc.returncode == 0, f"{command} exited {proc.returncode}: {proc.stderr}"
        return proc.stdout


Boundary = Node | AgentBoundary  # what the boundary suites take
