"""Faults the node agent must survive with a clear error (issue 12, "Bad input and
faults"): a store that stops answering (refused, and hung), a full disk, a client that
goes away from a buffered exec, a burst of clients larger than an accept queue. Each
test checks the HTTP status and that the agent serves the next request. Real servers
only: SeaweedFS stopped or frozen (SIGSTOP), a small tmpfs as the sandbox directory.

Covered elsewhere (tests/lazyfs/test_agent_api.py): an unknown image, limits that do not
parse, an unknown sandbox id, a command missing in the image, an exec timeout, a client
gone from a streaming exec.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lazyfs.client import AgentError, Client
from testbed.agent import AgentProcess, hang_up_mid_exec, running_agent
from testbed.images import TestImages
from testbed.seaweed import Seaweed

FETCH_TIMEOUT = 3  # seconds: LAZYFS_FETCH_TIMEOUT of the agents here
BURST_CLIENTS = 400  # connections at once: more than a 200-sandbox burst makes


def _convert_to_s3(test_images: TestImages, seaweed: Seaweed, url: str, tag: str) -> None:
    subprocess.run(
        [str(Path(sys.executable).parent / "lazyfs"), "convert"]
        + [f"oci:{test_images.layout}:{tag}", "--name", tag, "--store", url],
        env={**os.environ, **seaweed.env},
        check=True,
        capture_output=True,
    )


@pytest.fixture
def s3_agent(
    test_images: TestImages, seaweed: Seaweed, s3_url: str, tmp_path: Path, py_store: Path
) -> Iterator[AgentProcess]:
    """An agent (started) whose store is SeaweedFS, holding the base and python images."""
    for tag in ("base", "python"):
        _convert_to_s3(test_images, seaweed, s3_url, tag)
    with running_agent(tmp_path, py_store) as agent:
        agent.node.env.update(seaweed.env)
        agent.node.env["LAZYFS_FETCH_TIMEOUT"] = str(FETCH_TIMEOUT)
        yield agent.start("--store", s3_url)


def _still_serves(c: Client, image: str = "python") -> None:
    assert c.health()["status"] == "ok"
    with c.create(image) as sb:
        assert sb.exec(["echo", "ok"]).stdout == b"ok\n"


def test_store_refusing_connections_is_503_and_the_agent_recovers(
    s3_agent: AgentProcess, seaweed: Seaweed
) -> None:
    with s3_agent.client() as c:
        with c.create("python") as sb:  # resolved, mounted, python3's start-up cached
            assert sb.exec(["python3", "-c", "print(6 * 7)"]).stdout == b"42\n"
        with seaweed.down():
            t0 = time.monotonic()
            with pytest.raises(AgentError) as err:
                c.create("base")  # never resolved: its ref and manifest need the store
            assert (err.value.status, err.value.code) == (503, "store_unavailable")
            assert time.monotonic() - t0 < 30
            assert "gave up" in str(err.value)
            with c.create("python") as sb:  # what is cached still runs without the store
                assert sb.exec(["python3", "-c", "print(6 * 7)"]).stdout == b"42\n"
        _still_serves(c, "base")  # the store is back: the same create works


def test_store_that_hangs_is_503_within_the_fetch_timeout(
    s3_agent: AgentProcess, seaweed: Seaweed
) -> None:
    with s3_agent.client() as c:
        _still_serves(c)
        with seaweed.frozen():
            t0 = time.monotonic()
            with pytest.raises(AgentError) as err:
                c.create("base")
            took = time.monotonic() - t0
            assert (err.value.status, err.value.code) == (503, "store_unavailable"), err.value
            assert took < FETCH_TIMEOUT + 5, (
                f"the create waited {took:.1f} s: {err.value}\n{s3_agent.log()}"
            )
            assert c.health()["status"] == "ok"  # answered while the store hangs
            with c.create("python") as sb:
                # A file whose data was never fetched: EIO in the sandbox, after the fetch
                # timeout; an exit status, not an HTTP error, and the sandbox stays.
                r = sb.exec(["cat", "/usr/lib/python3.11/turtle.py"], timeout=60)
                assert r.exit_code != 0 and b"input/output error" in r.stderr.lower(), r
                assert sb.exec(["echo", "still"]).stdout == b"still\n"
        _still_serves(c, "base")


def test_full_disk_is_507_and_the_agent_keeps_serving(agent: AgentProcess) -> None:
    """A sandbox that filled its writable layer (a tmpfs of --disk bytes): a file write
    is a 507 and leaves nothing; a command gets ENOSPC; the sandbox stays, and the next
    sandbox, whose layer is its own, is made as usual."""
    agent.start("--disk", "8M")
    with agent.client() as c, c.create("py") as sb:
        with pytest.raises(AgentError) as err:
            sb.write_file("/tmp/big", b"x" * (16 * 2**20))
        assert (err.value.status, err.value.code) == (507, "disk_full")
        # The same from inside: the command fails with ENOSPC; the sandbox stays.
        r = sb.exec(["dd", "if=/dev/zero", "of=/tmp/fill", "bs=1M", "count=16"])
        assert r.exit_code != 0 and b"No space left" in r.stderr, r
        with c.create("py") as other:  # a full sandbox fills no one else's disk
            other.write_file("/tmp/big", b"x" * (4 * 2**20))
        sb.exec(["rm", "-f", "/tmp/fill"])
        sb.write_file("/tmp/small", b"fits")
        assert sb.read_file("/tmp/small") == b"fits"
        _still_serves(c, "py")


def test_client_gone_mid_buffered_exec_kills_the_command(agent: AgentProcess) -> None:
    """(The streaming form: test_agent_api.py.) A buffered exec whose client hangs up."""
    agent.start()
    with agent.client() as c, c.create("py") as sb:
        hang_up_mid_exec(sb, agent.socket)
        assert c.health()["status"] == "ok"


def test_a_burst_of_clients_is_queued_not_refused(agent: AgentProcess) -> None:
    """A unix socket refuses a connect at once (EAGAIN) when its accept queue is full, as
    if no agent were there. While the agent is frozen (SIGSTOP: it accepts nothing),
    more clients than a burst brings must still get in, and be served once it goes on."""
    agent.start()
    assert agent.proc is not None
    socks: list[socket.socket] = []
    refused = 0
    os.kill(agent.proc.pid, signal.SIGSTOP)
    try:
        for _ in range(BURST_CLIENTS):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)  # as httpx does: a non-blocking connect
            try:
                s.connect(str(agent.socket))
                socks.append(s)
            except OSError:
                refused += 1
                s.close()
    finally:
        os.kill(agent.proc.pid, signal.SIGCONT)
    try:
        assert refused == 0, f"{refused} of {BURST_CLIENTS} connects refused"
        for s in socks[:: len(socks) // 10]:  # some of them, served in turn
            s.sendall(b"GET /health HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
            assert s.recv(100).startswith(b"HTTP/1.1 200")
    finally:
        for s in socks:
            s.close()
    with agent.client() as c:
        assert c.health()["status"] == "ok"
