"""A real `lazyfs serve` on a private node, and the check that it leaves the node clean.

`AgentProcess` runs the agent as a subprocess with its own socket, cache, run and
sandbox directories under a tmp dir (a testbed.node.Node, as for `lazyfs run`).
`running_agent` (and the `agent` fixture on it) stops it (SIGTERM, then SIGKILL), then
fails if any mount, cgroup, runtime state, sandbox directory or process of that tmp dir
is left, after removing it. testbed/fleet.py runs several, each in a network namespace
(`wrap`), over one store (`agent_node`'s URL and env).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from lazyfs.client import AgentError, Client, Sandbox
from testbed.node import LAZYFS, Node
from testbed.processes import stop_on_sigterm

START_TIMEOUT = 30.0


@dataclass
class AgentProcess:
    node: Node
    socket: Path
    proc: subprocess.Popen | None = None
    logs: list[Path] = field(default_factory=list)
    # A prefix for the agent's argv that must exec it (its pid is the agent's), e.g.
    # nsenter into a network namespace.
    wrap: tuple[str, ...] = ()

    def start(self, *args: str) -> AgentProcess:
        """`lazyfs serve ARGS` on this node, once it answers on its socket."""
        return self.spawn(*args).wait_ready()

    def spawn(self, *args: str) -> AgentProcess:
        """Start the agent, without waiting for it (start several, then wait_ready)."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        log_path = self.node.tmp / f"agent-{len(self.logs)}.log"
        self.logs.append(log_path)
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [*self.wrap, LAZYFS, "serve", "--socket", str(self.socket), *args],
                env=self.node.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd="/",
            )
        return self

    def wait_ready(self) -> AgentProcess:
        """Once the spawned agent answers /health on its socket; fails if it exits."""
        assert self.proc is not None
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"agent exited {self.proc.returncode}: {self.log()}")
            with contextlib.suppress(AgentError), Client(socket=self.socket) as c:
                c.health()
                return self
            if time.monotonic() > deadline:
                raise AssertionError(f"agent did not answer: {self.log()}")
            time.sleep(0.05)

    def log(self) -> str:
        return self.logs[-1].read_text(errors="replace") if self.logs else ""

    def client(self) -> Client:
        return Client(socket=self.socket)

    def cli(
        self, *args: str, stdin: bytes | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[bytes]:
        """`lazyfs sandbox ARGS --socket SOCK`, --socket placed before any `--`."""
        args_list = list(args)
        cut = args_list.index("--") if "--" in args_list else len(args_list)
        argv = [LAZYFS, "sandbox", *args_list[:cut], "--socket", str(self.socket)]
        argv += args_list[cut:]
        return subprocess.run(
            argv, env=self.node.env, input=stdin or b"", capture_output=True, timeout=timeout
        )

    def stop(self, timeout: float = 30) -> int | None:
        """SIGTERM (the agent deletes its sandboxes), SIGKILL if it does not end."""
        return stop_on_sigterm(self.proc, f"the agent (log: {self.logs[-1:]})", timeout)

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()


def generic_ready(c: Client) -> int:
    """The agent's ready generic sandboxes (`lazyfs serve --warm N`)."""
    return sum(p["ready"] for p in c.pools() if p["generic"])


def agent_node(tmp: Path, store: Path | str, env: Mapping[str, str] | None = None) -> Node:
    """A private node under tmp over `store` (a file:// store's directory, or any store
    URL), with `env` added (e.g. the AWS_* an s3:// store needs)."""
    return Node(
        tmp,
        {
            **os.environ,
            **(env or {}),
            "LAZYFS_STORE": f"file://{store}" if isinstance(store, Path) else store,
            "LAZYFS_CACHE": str(tmp / "cache"),
            "LAZYFS_RUN_DIR": str(tmp / "run"),
            "LAZYFS_SANDBOX_DIR": str(tmp / "sandboxes"),
            "LAZYFS_DAEMON_IDLE": "0.2",
        },
    )


@contextlib.contextmanager
def running_agent(tmp: Path, store: Path) -> Iterator[AgentProcess]:
    """An AgentProcess (not started); stopped and the node checked clean afterwards."""
    agent = AgentProcess(agent_node(tmp, store), tmp / "agent.sock")
    try:
        yield agent
    finally:
        try:
            agent.stop()
        finally:
            node = agent.node
            left = node.wait_clean()
            if left:
                node.scrub()
            node.remove_cgroup_parent()
            assert left == {}, f"left behind: {left}\n{agent.log()}"


def assert_lost_with_its_data_daemon(c: Client, box_id: str) -> None:
    """What an agent restarted after a `kill -9` of it and its node data daemon says of
    a sandbox that outlived both: its image tree died with the daemon, so the sandbox
    is cleaned up and says so (410), not adopted with every uncached read an I/O error
    (lazyfs/agent/recovery.py)."""
    health = c.health()
    assert health["adopted_on_start"] == []
    assert "data daemon" in health["cleaned_on_start"][box_id]
    try:
        c.sandbox(box_id)
    except AgentError as lost:
        assert lost.status == 410, lost
    else:
        raise AssertionError(f"sandbox {box_id} answers after its tree died")


def hang_up_mid_exec(sb: Sandbox, socket: Path) -> None:
    """A buffered exec of a long command through the service on `socket` (an agent or a
    gateway) whose client gives up after 1 s and hangs up; then the command must be gone
    from the sandbox within 10 s (the service told the exec server: killed) and the
    sandbox still usable."""
    import httpx  # the tests' raw HTTP client, only here

    count = "for p in /proc/[0-9]*; do tr '\\0' ' ' <$p/cmdline; echo; done | grep -c '^sleep 34'"
    argv = ["sh", "-c", "touch /tmp/started; exec sleep 34"]
    transport = httpx.HTTPTransport(uds=str(socket))
    with httpx.Client(transport=transport, base_url="http://a", timeout=1.0) as http:
        try:
            http.post(f"/sandboxes/{sb.id}/exec", json={"argv": argv})
        except httpx.ReadTimeout:
            pass  # the client gave up and hung up
        else:
            raise AssertionError("a 34 s command answered within the client's 1 s")
    deadline = time.monotonic() + 10
    while "started" not in {e["name"] for e in sb.list_dir("/tmp")}:
        assert time.monotonic() < deadline, "the command never started"
        time.sleep(0.05)
    while sb.exec(["sh", "-c", count]).stdout != b"0\n":
        assert time.monotonic() < deadline, "the command outlived its client"
        time.sleep(0.1)
    assert sb.exec(["echo", "usable"]).stdout == b"usable\n"
