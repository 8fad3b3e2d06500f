"""Bad input through the Docker API gets Docker's error shape and status, and the agent
and the other containers stay up."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import docker
import pytest
from docker.errors import APIError, ImageNotFound, NotFound

COUNT_SLEEPS = """
import os
print(sum(open(f"/proc/{p}/cmdline", "rb").read() == b"sleep\\x00300\\x00"
          for p in os.listdir("/proc") if p.isdigit()))
"""


@pytest.fixture
def bystander(dclient: docker.DockerClient) -> docker.models.containers.Container:
    """A container that must be unaffected by what the test does to the API."""
    return dclient.containers.run("py", ["sleep", "300"], detach=True, name="bystander")


def still_fine(dclient: docker.DockerClient, bystander) -> None:  # noqa: ANN001
    assert dclient.ping()
    assert bystander.exec_run(["echo", "fine"]).output == b"fine\n"


def test_host_bind_mounts_are_refused(dclient: docker.DockerClient, bystander) -> None:  # noqa: ANN001
    for volumes in (["/:/host"], ["/etc:/etc:ro"]):
        with pytest.raises(APIError) as err:
            dclient.containers.create("py", ["true"], volumes=volumes)
        assert err.value.status_code == 400
        assert "bind mounts are refused" in err.value.explanation
    mount = docker.types.Mount("/host", "/", type="bind")
    with pytest.raises(APIError) as err:
        dclient.containers.create("py", ["true"], mounts=[mount])
    assert err.value.status_code == 400
    assert [c.name for c in dclient.containers.list(all=True)] == ["bystander"]
    still_fine(dclient, bystander)


def test_privilege_asked_is_dropped_with_warnings(dclient: docker.DockerClient) -> None:
    api = dclient.api
    made = api.create_container(
        "py",
        ["sh", "-c", "grep CapEff /proc/self/status"],
        host_config=api.create_host_config(
            privileged=True, cap_add=["SYS_ADMIN"], security_opt=["seccomp=unconfined"]
        ),
    )
    warnings = " ".join(made["Warnings"])
    assert "Privileged" in warnings and "CapAdd" in warnings and "SecurityOpt" in warnings
    api.start(made["Id"])
    assert api.wait(made["Id"])["StatusCode"] == 0
    caps = int(api.logs(made["Id"]).split()[-1], 16)
    assert not caps & (1 << 21), "CAP_SYS_ADMIN was granted"  # 21: CAP_SYS_ADMIN
    api.remove_container(made["Id"])


def test_unknown_names_and_a_clash(dclient: docker.DockerClient, bystander) -> None:  # noqa: ANN001
    for call in (
        lambda: dclient.containers.get("nosuch"),
        lambda: dclient.api.start("nosuch"),
        lambda: dclient.api.remove_container("nosuch"),
        lambda: dclient.api.exec_inspect("nosuch"),
    ):
        with pytest.raises(NotFound):
            call()
    with pytest.raises(ImageNotFound):
        dclient.containers.create("no/such:image", ["true"])
    with pytest.raises(APIError) as err:
        dclient.containers.create("py", ["true"], name="bystander")
    assert err.value.status_code == 409 and "already in use" in err.value.explanation
    with pytest.raises(APIError) as err:
        dclient.containers.create("py", ["true"], name="bad name!")
    assert err.value.status_code == 400
    with pytest.raises(APIError) as err:
        bystander.remove()
    assert err.value.status_code == 409  # running: needs force
    still_fine(dclient, bystander)


def test_a_client_that_drops_mid_stream(
    dclient: docker.DockerClient,
    docker_socket: Path,
    bystander,  # noqa: ANN001
) -> None:
    """An exec whose client goes away mid-output: the command is killed, the agent and
    the other containers go on."""
    api = dclient.api
    exec_id = api.exec_create(bystander.id, ["sh", "-c", "echo begun; sleep 300"])["Id"]
    body = b'{"Detach": false, "Tty": false}'
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(docker_socket))
        sock.sendall(
            f"POST /v1.44/exec/{exec_id}/start HTTP/1.1\r\nHost: docker\r\n"
            "Connection: Upgrade\r\nUpgrade: tcp\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        got = b""
        while b"begun" not in got:
            got += sock.recv(4096)
        assert got.startswith(b"HTTP/1.1 101 UPGRADED")
    deadline = time.monotonic() + 10
    while api.exec_inspect(exec_id)["Running"]:
        assert time.monotonic() < deadline, "the exec outlived its client"
        time.sleep(0.05)
    left = bystander.exec_run(["python3", "-c", COUNT_SLEEPS])
    assert left.output.strip() == b"1"  # the bystander's own sleep only
    still_fine(dclient, bystander)


def test_garbage_requests(docker_socket: Path, dclient: docker.DockerClient, bystander) -> None:  # noqa: ANN001
    def ask(raw: bytes) -> bytes:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(10)
            sock.connect(str(docker_socket))
            sock.sendall(raw)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
                if b"\r\n\r\n" in answer and answer.endswith(b"}\n"):
                    break
            return answer

    def status(answer: bytes) -> int:
        return int(answer.split(b" ", 2)[1])

    body = b"{not json"
    bad_json = (
        b"POST /containers/create HTTP/1.1\r\nHost: d\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    assert status(ask(bad_json)) == 400
    assert status(ask(b"GET /nope HTTP/1.1\r\nHost: d\r\n\r\n")) == 404
    assert status(ask(b"DELETE /_ping HTTP/1.1\r\nHost: d\r\n\r\n")) == 405
    huge = b"GET /_ping HTTP/1.1\r\nHost: d\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n"
    with socket.socket(socket.AF_UNIX) as sock:  # h11 refuses it; the agent closes
        sock.connect(str(docker_socket))
        sock.settimeout(10)
        try:
            sock.sendall(huge)
            sock.recv(100)
        except OSError:
            pass
    still_fine(dclient, bystander)


def test_an_attached_client_that_drops(
    dclient: docker.DockerClient,
    docker_socket: Path,
    bystander,  # noqa: ANN001
) -> None:
    """A client gone from an attach while the container writes: its next write fails in
    the agent, which must end that connection only (it once ended the whole server)."""
    talker = dclient.containers.run(
        "py", ["sh", "-c", "while true; do echo x; sleep 0.05; done"], detach=True
    )
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(docker_socket))
        sock.sendall(
            f"POST /v1.44/containers/{talker.id}/attach?stream=1&stdout=1 HTTP/1.1\r\n"
            "Host: docker\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n\r\n".encode()
        )
        assert sock.recv(4096).startswith(b"HTTP/1.1 101")
    time.sleep(0.5)  # the talker writes on: the agent's sends to the closed socket fail
    still_fine(dclient, bystander)
    assert talker.exec_run(["true"]).exit_code == 0
    talker.remove(force=True)


def test_kill_with_a_signal_it_cannot_send_says_so(
    dclient: docker.DockerClient,
    bystander,  # noqa: ANN001
) -> None:
    with pytest.raises(APIError) as err:
        bystander.kill(signal="HUP")
    assert err.value.status_code == 400 and "only KILL" in err.value.explanation
    assert bystander.exec_run(["true"]).exit_code == 0  # not killed instead
    still_fine(dclient, bystander)
