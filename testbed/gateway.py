"""A real `lazyfs gateway` for tests: a subprocess on its own unix socket, in front of
the agents' URLs it is given; stopped (SIGTERM, then SIGKILL) by its owner."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from lazyfs.client import AgentError, Client
from testbed.node import LAZYFS
from testbed.processes import stop_on_sigterm

START_TIMEOUT = 30.0


@dataclass
class GatewayProcess:
    socket: Path
    nodes: list[str]  # the agents' URLs
    token_file: Path | None = None  # the agents' token
    node_ca: Path | None = None
    poll: float = 0.2  # seconds between reports: short, so that tests need not wait
    wrap: tuple[str, ...] = ()  # a command prefix (e.g. a mount namespace of its own)
    program: str = LAZYFS  # another checkout's for a side-by-side (bench/gateway_ab.py)
    proc: subprocess.Popen | None = None
    logs: list[Path] = field(default_factory=list)

    def start(self, *args: str) -> GatewayProcess:
        """Started and answering /health with every node healthy (the first poll)."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        log_path = self.socket.with_name(f"gateway-{len(self.logs)}.log")
        self.logs.append(log_path)
        argv = [self.program, "gateway", "--socket", str(self.socket), "--poll", str(self.poll)]
        for url in self.nodes:
            argv += ["--node", url]
        if self.token_file is not None:
            argv += ["--node-token-file", str(self.token_file)]
        if self.node_ca is not None:
            argv += ["--node-ca", str(self.node_ca)]
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [*self.wrap, *argv, *args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"gateway exited {self.proc.returncode}: {self.log()}")
            with contextlib.suppress(AgentError), Client(socket=self.socket) as c:
                c.health()
                return self
            if time.monotonic() > deadline:
                raise AssertionError(f"gateway did not answer: {self.log()}")
            time.sleep(0.05)

    def log(self) -> str:
        return self.logs[-1].read_text(errors="replace") if self.logs else ""

    def client(self, timeout: float = 60.0) -> Client:
        return Client(socket=self.socket, timeout=timeout)

    def wait_healthy(self, count: int, timeout: float = 15.0) -> dict:
        """/health once `count` nodes answer (after a node's start or loss)."""
        deadline = time.monotonic() + timeout
        with self.client() as c:
            while True:
                health = c.health()
                if health["healthy_nodes"] == count:
                    return health
                if time.monotonic() > deadline:
                    raise AssertionError(f"{count} healthy nodes expected: {health}")
                time.sleep(0.05)

    def stop(self, timeout: float = 15) -> int | None:
        return stop_on_sigterm(self.proc, f"the gateway (log: {self.logs[-1:]})", timeout)

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()


@contextlib.contextmanager
def running_gateway(
    socket: Path,
    nodes: list[str],
    token_file: Path | None = None,
    node_ca: Path | None = None,
    poll: float = 0.2,
    program: str = LAZYFS,
) -> Iterator[GatewayProcess]:
    """A GatewayProcess (not started), stopped afterwards whatever happened."""
    gateway = GatewayProcess(socket, nodes, token_file, node_ca, poll, program=program)
    try:
        yield gateway
    finally:
        if gateway.proc is not None and gateway.proc.poll() is None:
            gateway.proc.kill()
            gateway.proc.wait()
