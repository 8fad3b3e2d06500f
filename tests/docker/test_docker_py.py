"""docker-py 7, unmodified, against `lazyfs serve --docker-socket`: what SWE-style
harnesses call (create, start, exec_run, logs, wait, stop, kill, remove, images)."""

from __future__ import annotations

import stat
import time
from pathlib import Path

import docker
import pytest
from docker.errors import APIError, ImageNotFound, NotFound


def test_ping_and_version(dclient: docker.DockerClient) -> None:
    assert dclient.ping() is True
    version = dclient.version()
    assert version["ApiVersion"] >= "1.41" and version["Os"] == "linux"


def test_the_socket_is_root_only_and_beside_the_agents(docker_socket: Path) -> None:
    assert docker_socket.parent / "agent.sock" == docker_socket.with_name("agent.sock")
    assert docker_socket.with_name("agent.sock").exists()
    st = docker_socket.stat()
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0


def test_run_prints_output_and_is_removed(dclient: docker.DockerClient) -> None:
    out = dclient.containers.run("py", ["python3", "-c", "print(6 * 7)"], remove=True)
    assert out == b"42\n"
    assert dclient.containers.list(all=True) == []


def test_run_that_fails_raises_container_error(dclient: docker.DockerClient) -> None:
    with pytest.raises(docker.errors.ContainerError) as err:
        dclient.containers.run("py", ["sh", "-c", "echo bad >&2; exit 3"])
    assert err.value.exit_status == 3
    assert b"bad" in err.value.stderr


def test_detached_container_exec_and_lifecycle(dclient: docker.DockerClient) -> None:
    c = dclient.containers.run(
        "py",
        ["sleep", "300"],
        detach=True,
        name="worker",
        environment={"GREETING": "hi"},
        working_dir="/tmp",
        labels={"task": "t1"},
    )
    c.reload()
    assert c.status == "running" and c.name == "worker"
    assert c.attrs["Config"]["Labels"] == {"task": "t1"}
    assert dclient.containers.get("worker").id == c.id
    assert dclient.containers.get(c.id[:12]).id == c.id
    r = c.exec_run(["sh", "-c", "echo $GREETING; pwd; echo err >&2; exit 4"])
    assert r.exit_code == 4
    assert r.output == b"hi\n/tmp\nerr\n"
    r = c.exec_run(["sh", "-c", "echo out; echo err >&2"], demux=True)
    assert r.output == (b"out\n", b"err\n")
    r = c.exec_run("pwd", workdir="/", environment={"X": "1"})
    assert r.output == b"/\n"
    r = c.exec_run(["sh", "-c", "echo $X"], environment={"X": "1"})
    assert r.output == b"1\n"
    chunks = c.exec_run(["sh", "-c", "echo a; sleep 0.2; echo b"], stream=True).output
    assert b"".join(chunks) == b"a\nb\n"
    assert [x.name for x in dclient.containers.list(filters={"label": "task=t1"})] == ["worker"]
    assert dclient.containers.list(filters={"label": "task=t2"}) == []
    with pytest.raises(APIError) as err:
        dclient.containers.create("py", ["true"], name="worker")
    assert err.value.status_code == 409
    c.stop(timeout=1)
    c.reload()
    assert c.status == "exited" and c.attrs["State"]["ExitCode"] == 137
    assert c.wait()["StatusCode"] == 137
    assert dclient.containers.list(filters={"name": "worker"}) == []
    assert [x.id for x in dclient.containers.list(all=True, filters={"name": "worker"})] == [c.id]
    c.remove()
    with pytest.raises(NotFound):
        dclient.containers.get("worker")


def test_logs_wait_and_kill(dclient: docker.DockerClient) -> None:
    c = dclient.containers.create(
        "py", ["sh", "-c", "echo one; echo two >&2; sleep 0.3; echo three"]
    )
    assert c.status == "created"
    c.start()
    assert c.wait(timeout=30)["StatusCode"] == 0
    assert c.logs() == b"one\ntwo\nthree\n"
    assert c.logs(stderr=False) == b"one\nthree\n"
    c.remove()
    c = dclient.containers.run("py", ["sh", "-c", "echo started; sleep 300"], detach=True)
    follow = c.logs(stream=True, follow=True)
    assert next(follow) == b"started\n"
    c.kill()
    assert c.wait()["StatusCode"] == 137
    assert list(follow) == []
    c.remove()


def test_images(dclient: docker.DockerClient) -> None:
    image = dclient.images.get("py")
    assert "py:latest" in image.tags
    assert image.attrs["Config"]["Cmd"]
    assert image.attrs["Size"] > 1_000_000
    assert any("py:latest" in i.tags for i in dclient.images.list())
    assert dclient.images.get("docker.io/library/py:latest").id == image.id
    assert dclient.images.pull("py").id == image.id
    with pytest.raises(ImageNotFound):
        dclient.images.get("nosuchimage")
    with pytest.raises(ImageNotFound):
        dclient.containers.create("nosuchimage", ["true"])


def test_unknown_container_is_not_found(dclient: docker.DockerClient) -> None:
    with pytest.raises(NotFound) as err:
        dclient.containers.get("nosuch")
    assert "No such container" in str(err.value)


def test_exec_on_a_terminal_and_with_stdin(dclient: docker.DockerClient) -> None:
    c = dclient.containers.run("py", ["sleep", "300"], detach=True)
    r = c.exec_run(["sh", "-c", "test -t 0 && test -t 1 && echo tty; echo err >&2"], tty=True)
    assert (r.exit_code, r.output) == (0, b"tty\r\nerr\r\n")  # one stream, raw, CRLF
    # A conversation: each line answered before the next is sent.
    api = dclient.api
    exec_id = api.exec_create(c.id, ["sh", "-c", "read a; echo got $a; read b; echo got $b"],
                              stdin=True)["Id"]  # fmt: skip
    sock = api.exec_start(exec_id, socket=True)._sock
    sock.settimeout(20)
    answers = b""
    for line, answer in ((b"one\n", b"got one\n"), (b"two\n", b"got two\n")):
        sock.sendall(line)
        while not answers.endswith(frame(answer)):
            chunk = sock.recv(4096)
            assert chunk, answers
            answers += chunk
    while sock.recv(4096):  # the stream ends once the command has; its code is final
        pass
    sock.close()
    assert api.exec_inspect(exec_id)["ExitCode"] == 0
    c.remove(force=True)


def frame(data: bytes, stream: int = 1) -> bytes:
    return bytes([stream, 0, 0, 0]) + len(data).to_bytes(4, "big") + data


def test_container_on_a_terminal(dclient: docker.DockerClient) -> None:
    c = dclient.containers.run("py", ["sh", "-c", "test -t 1 && echo tty"], tty=True, detach=True)
    assert c.wait(timeout=30)["StatusCode"] == 0
    assert c.logs() == b"tty\r\n"
    c.remove()


def test_user_for_the_container_and_for_an_exec(dclient: docker.DockerClient) -> None:
    """The image's user is root, so the exec server may run commands as another."""
    c = dclient.containers.run("py", ["sleep", "300"], detach=True, user="nobody")
    assert c.exec_run(["id", "-un"]).output == b"nobody\n"  # the container's User
    assert c.exec_run(["id", "-u"], user="root").output == b"0\n"
    assert c.exec_run(["id"], user="1234:5678").output.startswith(b"uid=1234 gid=5678")
    r = c.exec_run(["sh", "-c", "touch /root/x"], user="nobody")
    assert r.exit_code != 0  # it really is nobody: /root is not its
    with pytest.raises(APIError) as err:
        c.exec_run(["true"], user="nosuchuser")
    assert err.value.status_code == 400
    c.remove(force=True)


def test_detach_keys_end_an_attach_and_the_command_runs_on(dclient: docker.DockerClient) -> None:
    c = dclient.api.create_container("py", "cat", detach=True, stdin_open=True, tty=True)
    dclient.api.start(c)
    sock = dclient.api.attach_socket(c, {"stdin": True, "stdout": True, "stream": True})._sock
    sock.settimeout(20)
    sock.sendall(b"typed\n")
    seen = b""
    while b"typed\r\n" not in seen:  # the terminal's echo and cat's copy come back
        seen += sock.recv(4096)
    sock.sendall(b"\x10\x11")  # ctrl-p ctrl-q
    while sock.recv(4096):  # the attach ends
        pass
    sock.close()
    assert dclient.api.inspect_container(c)["State"]["Running"] is True  # cat runs on
    # An exec on a terminal too: its keys given at create.
    exec_id = dclient.api.exec_create(c, "cat", stdin=True, tty=True, detach_keys="ctrl-x")["Id"]
    sock = dclient.api.exec_start(exec_id, socket=True, tty=True)._sock
    sock.settimeout(20)
    sock.sendall(b"\x18")
    while sock.recv(4096):
        pass
    sock.close()
    time.sleep(1)  # past the agent's look at the connection (0.5 s)
    assert dclient.api.exec_inspect(exec_id)["Running"] is True
    dclient.api.remove_container(c, force=True)


def test_group_add(dclient: docker.DockerClient) -> None:
    out = dclient.containers.run("py", ["id", "-G"], group_add=[1000, "staff"], remove=True)
    assert set(out.split()) >= {b"0", b"1000", b"50"}, out  # staff is 50 in Debian
