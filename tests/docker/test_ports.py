"""Published ports (HostConfig.PortBindings) through docker-py and the docker CLI: the
agent listens on a loopback host port and forwards each connection into the sandbox's
network namespace, which still has no way out."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import docker
import pytest
from docker.errors import APIError
from docker.models.containers import Container

from lazyfs.docker.containers import container_id
from testbed.agent import AgentProcess

DOCKER = "/usr/bin/docker"  # Debian's docker.io (scripts/setup.sh installs it)
READY_TIMEOUT = 30.0

# A server in the sandbox: reads each connection to its end of stream (the client's
# half-close), then answers what it read upper-cased and closes; connections at once.
ECHO = """
import socket, threading
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 9000))
s.listen()
def one(c):
    data = b""
    while chunk := c.recv(65536):
        data += chunk
    c.sendall(data.upper())
    c.close()
while True:
    c, _ = s.accept()
    threading.Thread(target=one, args=(c,), daemon=True).start()
"""
WEB = (
    "mkdir -p /srv && echo hello > /srv/hello.txt && cd /srv"
    " && exec python3 -m http.server 8000 --bind 127.0.0.1"
)


def free_port(host: str = "127.0.0.1") -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def can_bind(port: int) -> bool:
    """Whether a server could listen on 127.0.0.1:port (with SO_REUSEADDR, as servers
    do: the forwarded connections' TIME_WAIT does not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
        return True


def echo(port: int, data: bytes, host: str = "127.0.0.1") -> bytes:
    """Send `data`, half-close, read the answer to its end."""
    with socket.create_connection((host, port), timeout=30) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        return read_all(s)


def read_all(s: socket.socket) -> bytes:
    got = b""
    while chunk := s.recv(65536):
        got += chunk
    return got


def wait_for(check: Callable[[], bool], what: str) -> None:
    """Until check() is true; a server in a sandbox takes a moment to listen, and until
    it does a forwarded connection is closed at once."""
    deadline = time.monotonic() + READY_TIMEOUT
    while True:
        with contextlib.suppress(OSError):
            if check():
                return
        assert time.monotonic() < deadline, f"{what}: not within {READY_TIMEOUT} s"
        time.sleep(0.1)


def fetch(port: int, path: str = "/hello.txt") -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
        return r.read()


def echo_container(dclient: docker.DockerClient, ports: dict) -> Container:
    c = dclient.containers.run("py", ["python3", "-c", ECHO], detach=True, ports=ports)
    c.reload()
    return c


def sandboxes(agent: AgentProcess) -> list[dict]:
    with agent.client() as client:
        return client.list()


@pytest.fixture
def docker_cli(docker_socket: Path, dclient: docker.DockerClient):  # noqa: ANN201
    """The docker CLI on the agent (dclient removes what it made)."""
    env = {**os.environ, "DOCKER_HOST": f"unix://{docker_socket}", "DOCKER_CONFIG": "/nonexistent"}

    def run(*args: str) -> subprocess.CompletedProcess:
        r = subprocess.run([DOCKER, *args], capture_output=True, env=env, timeout=120)
        assert r.returncode == 0, (args, r.returncode, r.stdout, r.stderr)
        return r

    return run


@pytest.fixture
def host_listener() -> Iterator[socket.socket]:
    """A TCP server of the test's on the host's 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s


def test_http_server_in_sandbox_is_reached_through_the_host_port(
    dclient: docker.DockerClient,
) -> None:
    port = free_port()
    c = dclient.containers.run(
        "py", ["sh", "-c", WEB], detach=True, ports={"8000/tcp": ("127.0.0.1", port)}
    )
    wait_for(lambda: fetch(port) == b"hello\n", "the http server")
    assert b"hello.txt" in fetch(port, "/")
    c.reload()
    shown = [{"HostIp": "127.0.0.1", "HostPort": str(port)}]
    assert c.ports == {"8000/tcp": shown}
    assert c.attrs["HostConfig"]["PortBindings"] == {"8000/tcp": shown}
    assert "8000/tcp" in c.attrs["Config"]["ExposedPorts"]
    [listed] = dclient.api.containers()
    assert listed["Ports"] == [
        {"IP": "127.0.0.1", "PrivatePort": 8000, "PublicPort": port, "Type": "tcp"}
    ]


def test_connections_at_once_half_close_and_bulk(dclient: docker.DockerClient) -> None:
    c = echo_container(dclient, {"9000/tcp": None})  # a host port the kernel chooses
    [binding] = c.ports["9000/tcp"]
    assert binding["HostIp"] == "127.0.0.1"
    port = int(binding["HostPort"])
    wait_for(lambda: echo(port, b"ping") == b"PING", "the echo server")
    # Two connections open at once: the second is answered while the first still waits.
    with socket.create_connection(("127.0.0.1", port), timeout=30) as first:
        first.sendall(b"first ")
        assert echo(port, b"second") == b"SECOND"
        first.sendall(b"done")
        first.shutdown(socket.SHUT_WR)  # the half-close reaches the server: it answers
        assert read_all(first) == b"FIRST DONE"
    bulk = os.urandom(4 * 2**20).hex().encode()  # 8 MiB, both ways
    assert echo(port, bulk) == bulk.upper()
    results: list[bytes] = []
    threads = [
        threading.Thread(target=lambda i=i: results.append(echo(port, b"n%d" % i)))
        for i in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == sorted(b"N%d" % i for i in range(8))


def test_host_port_is_released_after_remove(dclient: docker.DockerClient) -> None:
    port = free_port()
    c = echo_container(dclient, {"9000/tcp": port})
    wait_for(lambda: echo(port, b"a") == b"A", "the echo server")
    assert not can_bind(port)
    c.remove(force=True)
    assert can_bind(port)
    c = echo_container(dclient, {"9000/tcp": port})  # published again at once
    wait_for(lambda: echo(port, b"b") == b"B", "the second echo server")
    c.remove(force=True)


def test_stop_releases_the_port_and_start_publishes_it_again(
    dclient: docker.DockerClient,
) -> None:
    port = free_port()
    c = echo_container(dclient, {"9000/tcp": port})
    wait_for(lambda: echo(port, b"a") == b"A", "the echo server")
    c.stop(timeout=1)
    assert can_bind(port)
    c.reload()
    assert c.ports == {}
    assert c.attrs["HostConfig"]["PortBindings"] == {
        "9000/tcp": [{"HostIp": "", "HostPort": str(port)}]
    }
    c.start()
    wait_for(lambda: echo(port, b"b") == b"B", "the echo server started again")


def test_docker_port_cli(docker_cli, dclient: docker.DockerClient) -> None:  # noqa: ANN001
    port = free_port()
    docker_cli("run", "-d", "--name", "web", "-p", f"127.0.0.1:{port}:8000", "py", "sh", "-c", WEB)
    assert docker_cli("port", "web").stdout == f"8000/tcp -> 127.0.0.1:{port}\n".encode()
    assert docker_cli("port", "web", "8000").stdout == f"127.0.0.1:{port}\n".encode()
    assert f"127.0.0.1:{port}->8000/tcp".encode() in docker_cli("ps").stdout
    wait_for(lambda: fetch(port) == b"hello\n", "the http server")
    docker_cli("run", "-d", "--name", "any", "-p", "8000", "py", "sh", "-c", WEB)
    shown = docker_cli("port", "any", "8000").stdout.decode().strip()
    ip, _, chosen = shown.rpartition(":")
    assert ip == "127.0.0.1" and int(chosen) > 0
    wait_for(lambda: fetch(int(chosen)) == b"hello\n", "the second http server")


def test_ipv6_loopback(dclient: docker.DockerClient) -> None:
    try:
        port = free_port("::1")
    except OSError:
        pytest.skip("no ::1 on this host")
    c = echo_container(dclient, {"9000/tcp": ("::1", port)})
    assert c.ports == {"9000/tcp": [{"HostIp": "::1", "HostPort": str(port)}]}
    wait_for(lambda: echo(port, b"six", "::1") == b"SIX", "the echo server on ::1")


def test_refused_bindings_leave_nothing(
    dclient: docker.DockerClient, docker_agent: AgentProcess
) -> None:
    port = free_port()
    for ports, message in [
        ({"9000/tcp": ("0.0.0.0", port)}, "loopback only"),
        ({"9000/tcp": ("192.0.2.1", port)}, "loopback only"),
        ({"53/udp": port}, "UDP ports is not supported"),
        ({"9000/tcp": "8000-8010"}, "ranges"),
    ]:
        with pytest.raises(APIError) as err:
            dclient.containers.create("py", ["true"], ports=ports)
        assert err.value.status_code == 400, ports
        assert message in err.value.explanation, err.value.explanation
    assert dclient.containers.list(all=True) == []
    assert sandboxes(docker_agent) == []


def test_port_in_use_fails_the_create_and_leaves_no_sandbox(
    dclient: docker.DockerClient, docker_agent: AgentProcess, host_listener: socket.socket
) -> None:
    taken = host_listener.getsockname()[1]
    with pytest.raises(APIError) as err:
        dclient.containers.run("py", ["sleep", "300"], detach=True, ports={"9000/tcp": taken})
    assert err.value.status_code == 500
    assert f"Bind for 127.0.0.1:{taken} failed: port is already allocated" in str(err.value)
    assert dclient.containers.list(all=True) == []
    assert sandboxes(docker_agent) == []
    # A port another container publishes is in use too; the first one is unaffected.
    port = free_port()
    c = echo_container(dclient, {"9000/tcp": port})
    with pytest.raises(APIError) as err:
        echo_container(dclient, {"9000/tcp": port, "9001/tcp": None})
    assert "port is already allocated" in str(err.value)
    assert [x.id for x in dclient.containers.list(all=True)] == [c.id]
    assert len(sandboxes(docker_agent)) == 1
    wait_for(lambda: echo(port, b"still") == b"STILL", "the first echo server")


def test_sandbox_still_cannot_reach_out(
    dclient: docker.DockerClient, host_listener: socket.socket
) -> None:
    port = free_port()
    c = echo_container(dclient, {"9000/tcp": port})
    wait_for(lambda: echo(port, b"in") == b"IN", "the echo server")
    host_port = host_listener.getsockname()[1]
    for target in (host_port, port):  # the test's server; the published port itself
        probe = f"import socket; socket.create_connection(('127.0.0.1', {target}), timeout=5)"
        r = c.exec_run(["python3", "-c", probe])
        assert r.exit_code != 0 and b"ConnectionRefusedError" in r.output, r.output
    r = c.exec_run(
        ["python3", "-c", "import socket; socket.create_connection(('192.0.2.1', 80), 3)"]
    )
    assert r.exit_code != 0 and b"unreachable" in r.output, r.output
    host_listener.setblocking(False)
    with pytest.raises(BlockingIOError):
        host_listener.accept()  # no connection came from the sandbox


def test_sandbox_deleted_through_agent_api_frees_the_port(
    dclient: docker.DockerClient, docker_agent: AgentProcess
) -> None:
    # Created, not started: the ports listen from the create, and no main process ends
    # to close them; the sandbox's PID 1 ending does.
    port = free_port()
    c = dclient.containers.create("py", ["sleep", "300"], ports={"9000/tcp": port})
    assert not can_bind(port)
    with docker_agent.client() as client:
        (box,) = [b["id"] for b in client.list() if container_id(b["id"]) == c.id]
        client.sandbox(box).delete()
    wait_for(lambda: can_bind(port), "the port freed")


def held_by_agent(agent: AgentProcess) -> list[str]:
    """What the agent's descriptors are, but its unix sockets (the Docker API's clients
    keep connections open): TCP sockets, namespaces, pidfds."""
    assert agent.proc is not None
    with open("/proc/net/unix") as f:
        unix = {f"socket:[{line.split()[6]}]" for line in f.readlines()[1:]}
    held = []
    for fd in os.listdir(f"/proc/{agent.proc.pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            target = os.readlink(f"/proc/{agent.proc.pid}/fd/{fd}")
            if target not in unix:
                held.append(target)
    return sorted(held)


def test_agent_keeps_no_descriptor(
    dclient: docker.DockerClient, docker_agent: AgentProcess
) -> None:
    port = free_port()
    c = echo_container(dclient, {"9000/tcp": port})
    wait_for(lambda: echo(port, b"a") == b"A", "the echo server")
    c.remove(force=True)
    before = held_by_agent(docker_agent)
    for _ in range(3):
        c = echo_container(dclient, {"9000/tcp": port, "9001/tcp": None})
        wait_for(lambda: echo(port, b"a") == b"A", "the echo server")
        for _ in range(20):
            assert echo(port, b"b") == b"B"
        c.remove(force=True)
    assert held_by_agent(docker_agent) == before


def test_publish_all_ports_and_host_network(dclient: docker.DockerClient) -> None:
    api = dclient.api
    made = api.create_container(
        "py",
        ["python3", "-c", ECHO],
        ports=[9000],  # ExposedPorts, as `docker run --expose 9000 -P` sends them
        host_config=api.create_host_config(publish_all_ports=True),
    )
    api.start(made["Id"])
    [binding] = api.inspect_container(made["Id"])["NetworkSettings"]["Ports"]["9000/tcp"]
    assert binding["HostIp"] == "127.0.0.1"
    port = int(binding["HostPort"])
    wait_for(lambda: echo(port, b"all") == b"ALL", "the echo server")
    # Docker's rule: a container on the host's network publishes nothing (it needs not).
    # (docker-py refuses to send it; dockerd, and the CLI, take it with a warning.)
    host = {"NetworkMode": "host", "PortBindings": {"9000/tcp": [{"HostPort": ""}]}}
    body = {"Image": "py", "Cmd": ["true"], "HostConfig": host}
    made = api._result(api._post_json(api._url("/containers/create"), data=body), json=True)
    assert any("discarded" in w for w in made["Warnings"])
    assert api.inspect_container(made["Id"])["NetworkSettings"]["Ports"] == {}
