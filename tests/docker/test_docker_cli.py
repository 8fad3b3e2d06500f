"""The docker CLI of Debian's docker.io package (the client only: no dockerd runs),
unmodified, against `lazyfs serve --docker-socket`."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

DOCKER = "/usr/bin/docker"  # Debian's docker.io (scripts/setup.sh installs it)


@pytest.fixture
def docker_cli(docker_socket: Path):  # noqa: ANN201
    env = {**os.environ, "DOCKER_HOST": f"unix://{docker_socket}", "DOCKER_CONFIG": "/nonexistent"}
    made: list[str] = []

    def run(
        *args: str, stdin: bytes | None = None, check: bool = True
    ) -> subprocess.CompletedProcess:
        r = subprocess.run([DOCKER, *args], input=stdin, capture_output=True, env=env, timeout=120)
        if check:
            assert r.returncode == 0, (args, r.returncode, r.stdout, r.stderr)
        return r

    run.made = made  # type: ignore[attr-defined]
    yield run
    names = run("ps", "-aq").stdout.split()
    if names:
        run("rm", "-f", *[n.decode() for n in names])


def test_run_rm_prints_output_and_exit_status(docker_cli) -> None:  # noqa: ANN001
    r = docker_cli("run", "--rm", "py", "python3", "-c", "print('hello from lazyfs')")
    assert r.stdout == b"hello from lazyfs\n"
    r = docker_cli("run", "--rm", "py", "sh", "-c", "echo oops >&2; exit 7", check=False)
    assert r.returncode == 7 and r.stderr == b"oops\n"
    assert docker_cli("ps", "-aq").stdout == b""


def test_run_with_cpu_shares_and_cpuset(docker_cli) -> None:  # noqa: ANN001
    """--cpu-shares and --cpuset-cpus are applied (they were warned of and ignored)."""
    last = str(max(os.sched_getaffinity(0)))
    script = "cat /sys/fs/cgroup/cpu/cpu.shares; nproc; grep Cpus_allowed_list /proc/self/status"
    r = docker_cli(
        "run", "--rm", "--cpu-shares", "512", "--cpuset-cpus", last, "py", "sh", "-c", script
    )
    assert r.stdout.decode().split() == ["512", "1", "Cpus_allowed_list:", last], r.stdout
    assert b"not applied" not in r.stderr, r.stderr
    r = docker_cli("run", "--rm", "--cpuset-cpus", "4095", "py", "true", check=False)
    assert r.returncode == 125 and b"CPU 4095 is not one of this node's" in r.stderr, r.stderr


def test_run_with_tmpfs(docker_cli) -> None:  # noqa: ANN001
    r = docker_cli(
        "run", "--rm", "--tmpfs", "/scratch:size=1m", "py", "sh", "-c", "df -k /scratch | tail -1"
    )
    assert r.stdout.split()[:2] == [b"tmpfs", b"1024"], r.stdout
    r = docker_cli("run", "--rm", "--tmpfs", "/proc/x", "py", "true", check=False)
    assert r.returncode == 125 and b"cannot be mounted there" in r.stderr, r.stderr


def test_run_with_cap_drop_and_read_only(docker_cli) -> None:  # noqa: ANN001
    script = "grep CapBnd /proc/self/status; touch /x 2>/dev/null || echo ro; echo ok > /t/y"
    r = docker_cli(
        "run", "--rm", "--cap-drop", "ALL", "--read-only", "--tmpfs", "/t", "py", "sh", "-c", script
    )
    assert r.stdout.split() == [b"CapBnd:", b"0000000000000000", b"ro"], r.stdout
    assert b"not applied" not in r.stderr, r.stderr  # applied, so no warning
    r = docker_cli("run", "--rm", "--cap-drop", "FLY", "py", "true", check=False)
    assert r.returncode == 125 and b"is not a Linux capability" in r.stderr, r.stderr
    # As under dockerd, an exec's user is set before the capabilities go (CAP_SETUID too).
    cid = docker_cli("run", "-d", "--cap-drop", "ALL", "py", "sleep", "300").stdout.decode().strip()
    try:
        script = "id -u; grep CapBnd /proc/self/status; chown 0 /tmp 2>/dev/null || echo no"
        r = docker_cli("exec", "-u", "nobody", cid, "sh", "-c", script)
        assert r.stdout.split() == [b"65534", b"CapBnd:", b"0000000000000000", b"no"], r.stdout
        r = docker_cli("exec", cid, "sh", "-c", "id -u; grep CapEff /proc/self/status")
        assert r.stdout.split() == [b"0", b"CapEff:", b"0000000000000000"], r.stdout
    finally:
        docker_cli("rm", "-f", cid)


def test_run_with_ulimits(docker_cli) -> None:  # noqa: ANN001
    script = "grep -E 'open files|stack' /proc/self/limits"
    asked = ("--ulimit", "nofile=2048:4096", "--ulimit", "stack=-1")
    r = docker_cli("run", "--rm", *asked, "py", "sh", "-c", script)
    rows = [line.split() for line in r.stdout.decode().splitlines()]
    assert rows == [
        ["Max", "stack", "size", "unlimited", "unlimited", "bytes"],
        ["Max", "open", "files", "2048", "4096", "files"],
    ], r.stdout
    assert b"not applied" not in r.stderr, r.stderr  # applied, so no warning
    cid = docker_cli("create", "--ulimit", "nofile=2048:4096", "py", "true").stdout.decode().strip()
    try:
        shown = docker_cli("inspect", "-f", "{{json .HostConfig.Ulimits}}", cid).stdout
        assert json.loads(shown) == [{"Name": "nofile", "Soft": 2048, "Hard": 4096}], shown
    finally:
        docker_cli("rm", "-f", cid)


def test_run_resolves_localhost_and_added_hosts(docker_cli) -> None:  # noqa: ANN001
    """Every container has Docker's /etc/hosts (localhost resolved nowhere before, in an
    image without its own); --add-host adds lines to it and inspect shows them."""
    script = "getent hosts localhost db | sort"
    r = docker_cli("run", "--rm", "--add-host", "db:10.0.0.5", "py", "sh", "-c", script)
    assert r.stdout.split() == [
        b"10.0.0.5",
        b"db",
        b"::1",
        b"localhost",
        b"ip6-localhost",
        b"ip6-loopback",
    ], r.stdout
    assert b"not applied" not in r.stderr, r.stderr  # applied, so no warning
    r = docker_cli("run", "--rm", "--add-host", "gw:host-gateway", "py", "true", check=False)
    assert r.returncode == 125 and b"has no route to the node" in r.stderr, r.stderr
    made = docker_cli("create", "--add-host", "db:10.0.0.5", "py", "true")
    cid = made.stdout.decode().strip()
    try:
        shown = docker_cli("inspect", "-f", "{{json .HostConfig.ExtraHosts}}", cid).stdout
        assert json.loads(shown) == ["db:10.0.0.5"], shown
        shown = docker_cli("inspect", "-f", "{{.Config.Hostname}}", cid).stdout
        assert shown == b"lazyfs\n", shown  # every sandbox's, unless -h names it
    finally:
        docker_cli("rm", "-f", cid)


def test_run_h_names_the_container(docker_cli) -> None:  # noqa: ANN001
    """docker run -h: the container's hostname, /etc/hostname, $HOSTNAME and its line in
    /etc/hosts (a warning said "not applied" before); inspect shows it; a name that is
    none is the CLI's 125."""
    script = 'hostname; cat /etc/hostname; echo "$HOSTNAME"; getent hosts "$(hostname)"'
    r = docker_cli("run", "--rm", "-h", "task-7", "py", "sh", "-c", script)
    assert r.stdout.split() == [b"task-7"] * 3 + [b"127.0.1.1", b"task-7"], r.stdout
    assert b"not applied" not in r.stderr, r.stderr
    cid = docker_cli("create", "-h", "task-8", "py", "true").stdout.decode().strip()
    try:
        shown = docker_cli("inspect", "-f", "{{.Config.Hostname}}", cid).stdout
        assert shown == b"task-8\n", shown
    finally:
        docker_cli("rm", "-f", cid)
    r = docker_cli("run", "--rm", "-h", "bad name", "py", "true", check=False)
    assert r.returncode == 125 and b"is not a host name" in r.stderr, r.stderr


def test_top_lists_a_containers_processes(docker_cli) -> None:  # noqa: ANN001
    cid = docker_cli("run", "-d", "py", "sleep", "300").stdout.decode().strip()
    try:
        lines = docker_cli("top", cid).stdout.decode().splitlines()
        assert lines[0].split() == ["PID", "USER", "TIME", "COMMAND"], lines
        assert len(lines) == 2 and lines[1].split()[1:] == ["root", "0:00", "sleep", "300"]
        lines = docker_cli("top", cid, "-eo", "pid,comm").stdout.decode().splitlines()
        assert lines[0].split() == ["PID", "COMMAND"] and lines[1].split()[1:] == ["sleep"]
    finally:
        docker_cli("rm", "-f", cid)


def test_diff_lists_what_a_container_changed(docker_cli) -> None:  # noqa: ANN001
    cid = docker_cli("create", "py", "sh", "-c", "touch /test; rm /etc/debian_version")
    cid = cid.stdout.decode().strip()
    try:
        assert docker_cli("diff", cid).stdout == b""  # nothing yet
        docker_cli("start", "-a", cid)
        assert docker_cli("diff", cid).stdout == b"C /etc\nD /etc/debian_version\nA /test\n"
    finally:
        docker_cli("rm", "-f", cid)


def test_pause_and_unpause(docker_cli) -> None:  # noqa: ANN001
    cid = docker_cli("run", "-d", "py", "sleep", "300").stdout.decode().strip()
    try:
        docker_cli("pause", cid)
        shown = docker_cli("inspect", "-f", "{{.State.Status}} {{.State.Paused}}", cid).stdout
        assert shown == b"paused true\n", shown
        assert b"(Paused)" in docker_cli("ps", "--filter", f"id={cid}").stdout
        paused = docker_cli("ps", "-q", "--no-trunc", "--filter", "status=paused").stdout
        assert paused.split() == [cid.encode()], paused
        r = docker_cli("exec", cid, "true", check=False)
        assert r.returncode != 0 and b"is paused, unpause the container" in r.stderr, r.stderr
        r = docker_cli("pause", cid, check=False)
        assert r.returncode != 0 and b"is already paused" in r.stderr, r.stderr
        docker_cli("unpause", cid)
        assert docker_cli("exec", cid, "echo", "on").stdout == b"on\n"
        docker_cli("pause", cid)
        docker_cli("stop", cid)  # thawed to be stopped
        shown = docker_cli("inspect", "-f", "{{.State.Status}} {{.State.Paused}}", cid).stdout
        assert shown == b"exited false\n", shown
    finally:
        docker_cli("rm", "-f", cid)


def test_update_changes_a_running_containers_limits(docker_cli) -> None:  # noqa: ANN001
    cid = docker_cli("run", "-d", "--memory", "256m", "py", "sleep", "300").stdout.decode().strip()
    docker_cli("update", "--memory", "128m", "--cpus", "0.5", "--pids-limit", "40", cid)
    shown = docker_cli(
        "inspect",
        "-f",
        "{{.HostConfig.Memory}} {{.HostConfig.NanoCpus}} {{.HostConfig.PidsLimit}}",
        cid,
    )
    assert shown.stdout.split() == [b"134217728", b"500000000", b"40"], shown.stdout
    r = docker_cli(
        "exec", cid, "sh", "-c", "for i in $(seq 50); do sleep 1 & done; wait", check=False
    )
    assert r.returncode != 0 or b"fork" in r.stderr.lower(), r  # 40 pids, in force
    r = docker_cli("update", "--memory", "lots", cid, check=False)
    assert r.returncode != 0, r


def test_stats_no_stream(docker_cli) -> None:  # noqa: ANN001
    cid = docker_cli("run", "-d", "--memory", "256m", "py", "sleep", "300").stdout.decode().strip()
    r = docker_cli("stats", "--no-stream", "--format", "{{.ID}} {{.MemUsage}} {{.PIDs}}", cid)
    shown_id, used, _, limit, pids = r.stdout.decode().split()
    assert cid.startswith(shown_id) and limit == "256MiB" and int(pids) >= 2, r.stdout
    assert used.endswith(("KiB", "MiB")), r.stdout


def test_detached_exec_ps_inspect_logs_stop_rm(docker_cli) -> None:  # noqa: ANN001
    cid = docker_cli("run", "-d", "--name", "w1", "py", "sh", "-c", "echo up; sleep 300")
    cid = cid.stdout.decode().strip()
    assert len(cid) == 64
    assert docker_cli("exec", "w1", "sh", "-c", "echo in; exit 0").stdout == b"in\n"
    r = docker_cli("exec", "w1", "sh", "-c", "exit 5", check=False)
    assert r.returncode == 5
    assert (
        docker_cli("exec", "-i", "w1", "cat", stdin=b"through stdin\n").stdout == b"through stdin\n"
    )
    assert b"w1" in docker_cli("ps").stdout
    [info] = json.loads(docker_cli("inspect", "w1").stdout)
    assert info["Id"] == cid and info["State"]["Running"] is True and info["Name"] == "/w1"
    assert docker_cli("logs", "w1").stdout == b"up\n"
    docker_cli("stop", "-t", "1", "w1")
    assert docker_cli("ps", "-q").stdout == b""
    assert cid[:12].encode() in docker_cli("ps", "-aq").stdout
    docker_cli("rm", "w1")
    assert docker_cli("ps", "-aq").stdout == b""


def test_images_and_pull(docker_cli) -> None:  # noqa: ANN001
    assert b"py" in docker_cli("images").stdout
    docker_cli("pull", "py")
    # Not converted, and its registry (a closed port here) cannot be reached: one line.
    r = docker_cli("pull", "127.0.0.1:9/nosuch:1", check=False)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert b"127.0.0.1:9" in r.stderr, r.stderr


def test_exec_it_is_an_interactive_terminal(docker_cli, docker_socket: Path) -> None:  # noqa: ANN001
    """`docker exec -it` from a terminal: keys typed reach a shell on a terminal in the
    sandbox, with the client's window size, and `exit` ends it (R2E-Gym's way)."""
    import fcntl
    import struct
    import termios
    import time

    docker_cli("run", "-d", "--name", "tty1", "py", "sleep", "300")
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = {**os.environ, "DOCKER_HOST": f"unix://{docker_socket}", "DOCKER_CONFIG": "/nonexistent"}
    proc = subprocess.Popen(
        [DOCKER, "exec", "-it", "tty1", "sh"], stdin=slave, stdout=slave, stderr=slave, env=env
    )
    os.close(slave)
    seen = b""

    def until(text: bytes) -> None:
        nonlocal seen
        deadline = time.monotonic() + 20
        while text not in seen:
            assert time.monotonic() < deadline, seen
            try:
                seen += os.read(master, 4096)
            except OSError:
                break

    try:
        os.write(master, b"stty size; echo $((6 * 7))\n")
        until(b"42\r\n")
        assert b"40 120" in seen, seen
        os.write(master, b"exit 3\n")
        assert proc.wait(timeout=20) == 3
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


def test_run_i_and_run_it(docker_cli, docker_socket: Path) -> None:  # noqa: ANN001
    """`docker run -i` passes stdin on; `docker run -it` is a shell on a terminal."""
    import fcntl
    import struct
    import termios
    import time

    r = docker_cli("run", "-i", "--rm", "py", "sh", "-c", "cat; echo end", stdin=b"piped\n")
    assert r.stdout == b"piped\nend\n"
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 90, 0, 0))
    env = {**os.environ, "DOCKER_HOST": f"unix://{docker_socket}", "DOCKER_CONFIG": "/nonexistent"}
    proc = subprocess.Popen(
        [DOCKER, "run", "-it", "--rm", "py", "sh"], stdin=slave, stdout=slave, stderr=slave, env=env
    )
    os.close(slave)
    seen = b""
    try:
        # The CLI sends the window size once the container has started: ask until it is
        # there (the shell may read its first line before the size came).
        deadline = time.monotonic() + 20
        while b"30 90" not in seen:
            assert time.monotonic() < deadline, seen
            os.write(master, b"test -t 0 && stty size; echo $((6 * 7))\n")
            time.sleep(0.3)
            seen += os.read(master, 65536)
        assert b"42\r\n" in seen, seen
        os.write(master, b"exit 4\n")
        assert proc.wait(timeout=20) == 4
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    assert docker_cli("ps", "-aq").stdout == b""  # --rm


def test_logs_follow_and_kill(docker_cli, docker_socket: Path) -> None:  # noqa: ANN001
    docker_cli(
        "run", "-d", "--name", "w2", "py", "sh", "-c", "echo one; sleep 1; echo two; sleep 300"
    )
    env = {**os.environ, "DOCKER_HOST": f"unix://{docker_socket}", "DOCKER_CONFIG": "/nonexistent"}
    follow = subprocess.Popen([DOCKER, "logs", "-f", "w2"], stdout=subprocess.PIPE, env=env)
    try:
        assert follow.stdout is not None
        assert follow.stdout.readline() == b"one\n"
        assert follow.stdout.readline() == b"two\n"  # came after the follow began
        docker_cli("kill", "w2")
        assert follow.wait(timeout=20) == 0  # the follow ends with the container
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.wait()
    [info] = json.loads(docker_cli("inspect", "w2").stdout)
    assert info["State"]["Status"] == "exited" and info["State"]["ExitCode"] == 137
    assert docker_cli("kill", "w2", check=False).returncode != 0  # not running: 409
