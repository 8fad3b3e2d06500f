"""What docker-py's own integration tests found missing or wrong in the Docker API
(bench/docker_py_suite.py, bench/results/docker_py_suite.md): each fix, with docker-py 7
as those tests use it."""

from __future__ import annotations

import contextlib
import io
import os
import re
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import docker
import pytest
from docker.errors import APIError

from lazyfs.docker.containers import DEFAULT_HOST_CONFIG
from testbed.agent import AgentProcess
from testbed.waiting import wait_for
from tests.security.probes import HEALTH_STALL, health_watch, peak_rss

MiB = 2**20


def run_to_end(dclient: docker.DockerClient, command: list[str], **kwargs: object):  # noqa: ANN201
    c = dclient.containers.run("py", command, detach=True, **kwargs)
    assert c.wait(timeout=30)["StatusCode"] == 0
    return c


def logs_become(c, expected: bytes) -> None:  # noqa: ANN001
    """Wait until the container's log is `expected` (its command has started and
    written it: a start answers before)."""
    deadline = time.monotonic() + 30
    while c.logs() != expected:
        assert time.monotonic() < deadline, c.logs()
        time.sleep(0.05)


def test_attach_with_logs_reads_them_every_time(dclient: docker.DockerClient) -> None:
    """docker-py reads a hijacked stream past the reader that read the headers: what
    came with them was lost (attach(logs=True) of an exited container read b'' one
    time in two)."""
    c = run_to_end(dclient, ["echo", "hello"])
    outputs = {dclient.api.attach(c.id, stream=False, logs=True) for _ in range(40)}
    assert outputs == {b"hello\n"}
    box = dclient.containers.run("py", ["sleep", "300"], detach=True)
    api = dclient.api
    outputs = {api.exec_start(api.exec_create(box.id, ["echo", "hi"])) for _ in range(20)}
    assert outputs == {b"hi\n"}


def test_restart_runs_the_command_again_in_the_same_sandbox(
    dclient: docker.DockerClient,
) -> None:
    c = dclient.containers.run("py", ["sh", "-c", "echo run; sleep 300"], detach=True)
    assert c.exec_run(["touch", "/kept"]).exit_code == 0
    logs_become(c, b"run\n")
    first = c.attrs["State"]["StartedAt"]
    c.restart(timeout=1)
    c.reload()
    assert c.status == "running" and c.attrs["State"]["StartedAt"] != first
    assert c.exec_run(["ls", "/kept"]).exit_code == 0
    logs_become(c, b"run\nrun\n")
    c.stop()
    c.restart()  # an exited container is started
    c.reload()
    assert c.status == "running"
    # AutoRemove: a restart is no exit that removes it.
    auto = dclient.containers.run("py", ["sleep", "300"], detach=True, auto_remove=True)
    auto.restart()
    auto.reload()
    assert auto.status == "running"


def test_logs_tail_since_until_and_timestamps(dclient: docker.DockerClient) -> None:
    c = run_to_end(
        dclient, ["sh", "-c", "echo one; sleep 0.1; echo two >&2; sleep 0.1; printf three"]
    )
    assert c.logs() == b"one\ntwo\nthree"
    assert c.logs(tail=1) == b"three"
    assert c.logs(tail=2) == b"two\nthree"
    assert c.logs(tail=2, stderr=False) == b"one\nthree"
    assert c.logs(tail=0) == b""
    assert c.logs(tail=10) == b"one\ntwo\nthree"
    assert c.logs(until=1) == b""
    assert c.logs(since=int(time.time()) + 60) == b""
    assert c.logs(since=1, until=time.time() + 60) == b"one\ntwo\nthree"
    stamped = c.logs(timestamps=True).decode().splitlines()
    assert len(stamped) == 3
    for line, text in zip(stamped, ["one", "two", "three"], strict=True):
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}Z " + text, line)


def test_log_config(dclient: docker.DockerClient) -> None:
    api = dclient.api
    config = docker.types.LogConfig(type="json-file", config={"max-file": "100"})
    made = api.create_container(
        "py", ["true"], host_config=api.create_host_config(log_config=config)
    )
    assert api.inspect_container(made)["HostConfig"]["LogConfig"] == {
        "Type": "json-file",
        "Config": {"max-file": "100"},
    }
    none = docker.types.LogConfig(type="none")
    assert dclient.containers.run("py", ["echo", "hello"], log_config=none) is None
    with pytest.raises(APIError) as err:
        api.create_container(
            "py", ["true"], host_config=api.create_host_config(log_config={"type": "asdf"})
        )
    assert err.value.status_code == 400
    assert err.value.explanation == "logger: no log driver named 'asdf' is registered"


def test_inspect_has_docker_keys_and_what_was_asked(dclient: docker.DockerClient) -> None:
    api = dclient.api
    made = api.create_container(
        "py",
        ["true"],
        environment={"Foo": None, "Other": "one"},
        stop_timeout=25,
        host_config=api.create_host_config(init=True, isolation="default", mem_limit="700M"),
    )
    assert made["Warnings"] in ([], None)
    inspect = api.inspect_container(made)
    host = inspect["HostConfig"]
    assert set(DEFAULT_HOST_CONFIG) <= set(host)
    assert host["Init"] is True and host["Isolation"] == "default"
    assert host["Runtime"] == "runc" and host["Memory"] == 700 * 2**20
    assert inspect["Config"]["StopTimeout"] == 25
    assert "Foo" in inspect["Config"]["Env"] and "Other=one" in inspect["Config"]["Env"]
    assert inspect["NetworkSettings"]["MacAddress"] == ""
    api.start(made)
    assert api.wait(made)["StatusCode"] == 0
    for host_config, env in [
        (api.create_host_config(isolation="hyperv"), None),
        (None, ["PATH"]),  # unsetting the image's variable
    ]:
        with pytest.raises(APIError) as err:
            api.create_container("py", ["true"], host_config=host_config, environment=env)
        assert err.value.status_code == 400


def test_settings_not_applied_are_warned_of(dclient: docker.DockerClient) -> None:
    api = dclient.api
    made = api.create_container(
        "py",
        ["true"],
        host_config=api.create_host_config(
            dns=["192.0.2.1"],
            tmpfs={"/t": "size=1M"},
            pid_mode="host",
            mounts=[docker.types.Mount("/data", "somevolume", type="volume")],
        ),
    )
    (warning,) = made["Warnings"]
    # GroupAdd, CpuShares, CpusetCpus, Tmpfs and ShmSize are applied now.
    for key in ("Dns", "PidMode", "Mounts"):
        assert key in warning
    assert "not applied" in warning


def test_cpu_shares_and_cpuset_are_applied_and_shown(dclient: docker.DockerClient) -> None:
    """docker-py's test_container_cpu_shares and test_container_cpuset ask inspect for
    them; the sandbox's cgroup and its processes' CPUs have them too."""
    last = str(max(os.sched_getaffinity(0)))
    api = dclient.api
    made = api.create_container(
        "py",
        ["sh", "-c", "cat /sys/fs/cgroup/cpu/cpu.shares; nproc"],
        host_config=api.create_host_config(cpu_shares=512, cpuset_cpus=last),
    )
    assert made["Warnings"] in ([], None)
    host = api.inspect_container(made)["HostConfig"]
    assert (host["CpuShares"], host["CpusetCpus"]) == (512, last)
    api.start(made)
    assert api.wait(made)["StatusCode"] == 0
    assert api.logs(made).split() == [b"512", b"1"]
    for bad in ({"cpu_shares": 1}, {"cpuset_cpus": "0-4095"}):
        with pytest.raises(APIError) as err:
            api.create_container("py", ["true"], host_config=api.create_host_config(**bad))
        assert err.value.status_code == 400


def test_tmpfs_and_tmpfs_mounts_are_the_sandboxs_own(dclient: docker.DockerClient) -> None:
    """docker-py's test_create_with_tmpfs asks inspect for HostConfig.Tmpfs; the
    container has the mounts too, as asked (Mounts of type tmpfs as well)."""
    api = dclient.api
    tmpfs = {"/t1": "size=3M"}
    mount = docker.types.Mount("/t2", None, type="tmpfs", tmpfs_size=2**20, tmpfs_mode=0o700)
    made = api.create_container(
        "py",
        ["sh", "-c", "grep ' /t[12] ' /proc/mounts | cut -d' ' -f2,4"],
        host_config=api.create_host_config(tmpfs=tmpfs, mounts=[mount]),
    )
    assert made["Warnings"] in ([], None)
    host = api.inspect_container(made)["HostConfig"]
    assert host["Tmpfs"] == tmpfs and host["Mounts"][0]["Target"] == "/t2"
    api.start(made)
    assert api.wait(made)["StatusCode"] == 0
    lines = api.logs(made).decode().splitlines()
    assert [line.split()[0] for line in lines] == ["/t1", "/t2"], lines
    assert "size=3072k" in lines[0] and "noexec" in lines[0]
    assert "size=1024k" in lines[1] and "mode=700" in lines[1]
    # ShmSize: the runtime's /dev/shm, replaced by one of that size.
    made = api.create_container(
        "py",
        ["sh", "-c", "df -k /dev/shm | tail -1"],
        host_config=api.create_host_config(shm_size="128M"),
    )
    assert api.inspect_container(made)["HostConfig"]["ShmSize"] == 128 * 2**20
    api.start(made)
    assert api.wait(made)["StatusCode"] == 0
    assert api.logs(made).split()[1] == b"131072", api.logs(made)  # 1 KiB blocks
    bad_mode = {"Type": "tmpfs", "Target": "/t3", "TmpfsOptions": {"Mode": "x"}}
    for bad in ({"tmpfs": ["/proc"]}, {"tmpfs": {"/t": "suid"}}, {"mounts": [bad_mode]}):
        with pytest.raises(APIError) as err:
            api.create_container("py", ["true"], host_config=api.create_host_config(**bad))
        assert err.value.status_code == 400, bad


def test_cap_drop_and_read_only_are_applied_and_shown(dclient: docker.DockerClient) -> None:
    """docker-py's cap_drop and read_only: in the container's capabilities and root, in
    inspect's HostConfig, and put_archive into the read-only root is dockerd's 403."""
    api = dclient.api
    made = api.create_container(
        "py",
        ["sh", "-c", "grep CapEff /proc/self/status; touch /x 2>/dev/null || echo ro; sleep 60"],
        host_config=api.create_host_config(cap_drop=["NET_RAW", "chown"], read_only=True),
    )
    assert made["Warnings"] in ([], None)
    host = api.inspect_container(made)["HostConfig"]
    assert host["CapDrop"] == ["NET_RAW", "chown"] and host["ReadonlyRootfs"] is True, host
    api.start(made)
    deadline = time.monotonic() + 30
    while b"ro" not in api.logs(made) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert api.logs(made).split() == [b"CapEff:", b"00000000a80405fa", b"ro"]
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w") as tar:
        tar.addfile(tarfile.TarInfo("empty"), io.BytesIO(b""))
    with pytest.raises(APIError) as err:
        api.put_archive(made, "/tmp", data.getvalue())
    assert err.value.status_code == 403 and "read-only" in str(err.value)
    api.remove_container(made, force=True)
    with pytest.raises(APIError) as err:
        api.create_container("py", ["true"], host_config=api.create_host_config(cap_drop=["FLY"]))
    assert err.value.status_code == 400


def test_ulimits_are_applied_and_shown(dclient: docker.DockerClient) -> None:
    """docker-py's ulimits (docker.types.Ulimit): in the container's limits and in
    inspect's HostConfig; a name that is no limit is a 400."""
    api = dclient.api
    asked = [docker.types.Ulimit(name="nofile", soft=2048, hard=4096)]
    made = api.create_container(
        "py",
        ["grep", "open files", "/proc/self/limits"],
        host_config=api.create_host_config(ulimits=asked),
    )
    try:
        assert made["Warnings"] in ([], None)
        host = api.inspect_container(made)["HostConfig"]
        assert host["Ulimits"] == [{"Name": "nofile", "Soft": 2048, "Hard": 4096}], host
        api.start(made)
        assert api.wait(made, timeout=30)["StatusCode"] == 0
        assert api.logs(made).split()[3:5] == [b"2048", b"4096"]
    finally:
        api.remove_container(made, force=True)
    bad = [docker.types.Ulimit(name="fly", soft=1, hard=1)]
    with pytest.raises(APIError) as err:
        api.create_container("py", ["true"], host_config=api.create_host_config(ulimits=bad))
    assert err.value.status_code == 400 and "is not a limit's name" in str(err.value)


def test_a_hostname_is_the_containers(dclient: docker.DockerClient) -> None:
    """docker-py's hostname: the container's own (its UTS namespace and /etc/hostname),
    shown by inspect; a container without one is `lazyfs`."""
    named = dclient.containers.run(
        "py", ["sh", "-c", "hostname; cat /etc/hostname"], hostname="swe-1", detach=True
    )
    try:
        assert named.wait(timeout=30)["StatusCode"] == 0
        assert named.logs() == b"swe-1\nswe-1\n"
        assert named.attrs["Config"]["Hostname"] == "swe-1"
    finally:
        named.remove(force=True)
    assert dclient.containers.run("py", ["hostname"], remove=True) == b"lazyfs\n"


def test_extra_hosts_are_in_etc_hosts_and_shown(dclient: docker.DockerClient) -> None:
    """docker-py's extra_hosts (a dict, sent as ["NAME:IP"]): resolved in the container
    beside localhost, and in inspect's HostConfig."""
    script = "getent hosts db localhost; cat /etc/hostname"
    container = dclient.containers.run(
        "py", ["sh", "-c", script], extra_hosts={"db": "10.0.0.5"}, detach=True
    )
    try:
        assert container.wait(timeout=30)["StatusCode"] == 0
        assert container.logs().split() == [
            b"10.0.0.5",
            b"db",
            b"::1",
            b"localhost",
            b"ip6-localhost",
            b"ip6-loopback",
            b"lazyfs",
        ]
        assert container.attrs["HostConfig"]["ExtraHosts"] == ["db:10.0.0.5"]
        assert container.diff() is None  # (dockerd's null): the files are no change of its
    finally:
        container.remove(force=True)


def test_top_lists_the_containers_command_and_not_the_runtimes(
    dclient: docker.DockerClient,
) -> None:
    """docker-py's test_top: busybox ps's columns and one process, the command (the
    exec server, the sandbox's PID 1, is the runtime's); ps_args run the host's ps, its
    rows kept by PID; a container that is not running is dockerd's 409."""
    container = dclient.containers.run("py", ["sleep", "60"], detach=True)
    try:
        top = dclient.api.top(container.id)
        assert top["Titles"] == ["PID", "USER", "TIME", "COMMAND"], top
        assert len(top["Processes"]) == 1 and top["Processes"][0][1:] == [
            "root",
            "0:00",
            "sleep 60",
        ]
        container.exec_run(["sh", "-c", "sleep 30 & exit 0"])
        pids = {row[0] for row in container.top()["Processes"]}
        assert len(pids) == 2, pids  # the exec's child, left running, is the container's
        top = dclient.api.top(container.id, ps_args="-eo pid,args")
        assert top["Titles"] == ["PID", "COMMAND"], top
        assert sorted(row[1] for row in top["Processes"]) == ["sleep 30", "sleep 60"], top
        assert {row[0] for row in top["Processes"]} == pids
        with pytest.raises(APIError) as err:
            dclient.api.top(container.id, ps_args="-eo args")
        assert err.value.status_code == 500 and "no PID column" in str(err.value)
        container.kill()
        container.wait(timeout=30)
        with pytest.raises(APIError) as err:
            container.top()
        assert err.value.status_code == 409 and "is not running" in str(err.value)
    finally:
        container.remove(force=True)


# Run in the container: swaps /etc/passwd with what argv[1] names, as fast as it can,
# so that a reader that checks the path and then opens it meets the other one.
SWAPPER = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
open("/tmp/swapper.pid", "w").write(str(os.getpid()))
while True:
    libc.renameat2(-100, b"/etc/passwd", -100, sys.argv[1].encode(), 2)  # RENAME_EXCHANGE
"""


def test_top_reads_nothing_the_container_put_at_its_passwd(
    dclient: docker.DockerClient, docker_agent: AgentProcess, tmp_path: Path
) -> None:
    """docker top names users from the container's /etc/passwd, which its code may swap,
    between the agent's check of the path and its open, with a link to a host file (the
    host file's lines were shown as users) or a FIFO (each such top held one of the
    agent's threads for good; 40 of them stopped every create on the node), or make a
    sparse 1 GiB file (read whole: the agent's memory grew by 2 GB). The file is read as
    the file API reads one; a user it does not name is shown by number."""
    secret = tmp_path / "secret"
    secret.write_text("leaked-from-host:x:4242:4242::/:/bin/sh\n")
    container = dclient.containers.run("py", ["sleep", "300"], detach=True)
    try:
        as_4242 = "import os; os.setuid(4242); os.execvp('sleep', ['sleep', '299'])"
        container.exec_run(["python3", "-c", as_4242], detach=True)
        wait_for(lambda: any(row[3] == "sleep 299" for row in container.top()["Processes"]))
        for other in (f"ln -s {secret} /etc/other", "mkfifo /etc/other"):
            assert container.exec_run(["sh", "-c", other]).exit_code == 0
            container.exec_run(["python3", "-c", SWAPPER, "/etc/other"], detach=True)
            with ThreadPoolExecutor(1) as pool:  # a FIFO held the request for good
                for _ in range(60):
                    top = pool.submit(container.top).result(timeout=20)
                    users = {row[3]: row[1] for row in top["Processes"]}
                    assert users.get("sleep 299") == "4242", (other, top)
            stop = "kill $(cat /tmp/swapper.pid) && rm -f /etc/other /etc/passwd"
            assert container.exec_run(["sh", "-c", stop]).exit_code == 0
        with peak_rss(docker_agent.proc.pid) as rise:
            container.exec_run(["truncate", "-s", "1G", "/etc/passwd"])
            top = container.top()
            assert {row[3]: row[1] for row in top["Processes"]} == {
                "sleep 300": "0",
                "sleep 299": "4242",
            }, top
            assert rise() < 100 * 2**20
        assert dclient.containers.run("py", ["true"], remove=True) == b""  # creates work
    finally:
        container.remove(force=True)


# Run in the container: one process with argv[2] arguments of 128 KiB (its soft stack
# limit raised so that the kernel takes them) forks argv[1] children, which share those
# pages copy-on-write: each shows 5 MiB of command line for a few hundred KiB.
BIG_ARGV = r"""
import os, resource, signal, sys, time
if sys.argv[1] == "child":
    for _ in range(int(sys.argv[2])):
        if os.fork() == 0:
            while True:
                signal.pause()
    open("/tmp/ready", "w").close()
    while True:
        signal.pause()
resource.setrlimit(resource.RLIMIT_STACK, (64 * 2**20, resource.RLIM_INFINITY))
arg = "a" * (128 * 1024 - 1)  # MAX_ARG_STRLEN - 1: the most one argument may be
if os.fork() == 0:
    os.setsid()
    os.execv(sys.executable, [sys.executable, "-c", sys.argv[3], "child", sys.argv[1]]
             + [arg] * int(sys.argv[2]))
while not os.path.exists("/tmp/ready"):
    time.sleep(0.1)
"""


def test_top_reads_a_bounded_head_of_each_command_line(
    dclient: docker.DockerClient, docker_agent: AgentProcess
) -> None:
    """Session 57's red team (finding 1): top read each process's /proc/PID/cmdline
    whole, kept every row and encoded the answer on the event loop, so 300 processes
    showing 5 MiB of arguments each (sharing their pages: ~300 MiB of the sandbox's
    memory) took the agent's peak RSS up 4.5 GB and held /health 11-14 s. Now each
    command line is its first 4 KiB and the answer is encoded off the loop; with ps_args
    `ps`'s output is cut at 16 MiB (it was held whole: 128 KiB a process, as procps cuts
    a line) and top is a 500 that says so. Here 150 such processes."""
    box = dclient.containers.run("py", ["sleep", "600"], detach=True)
    try:
        kids = 150
        r = box.exec_run(["python3", "-c", BIG_ARGV, str(kids), "40", BIG_ARGV])
        assert r.exit_code == 0, r.output
        with health_watch(docker_agent) as latencies, peak_rss(docker_agent.proc.pid) as rise:
            t0 = time.perf_counter()
            shown = box.top()
            took = time.perf_counter() - t0
            with pytest.raises(APIError) as err:
                dclient.api.top(box.id, ps_args="-eo pid,args")
            small = dclient.api.top(box.id, ps_args="-eo pid,comm")
            grew = rise()
        print(
            f"top: {took:.2f} s; agent peak +{grew / MiB:.0f} MiB;"
            f" slowest /health {max(latencies) * 1000:.0f} ms"
        )
        commands = [row[3] for row in shown["Processes"]]
        assert commands[0] == "sleep 600", commands[0]
        big = commands[1:]
        assert len(big) == kids + 1, [c[:100] for c in big]
        for command in big:
            assert len(command) == 4096 and f" child {kids} a" in command, command[:300]
            assert command.startswith("/") and command.endswith("a" * 1000), command[:300]
        assert err.value.status_code == 500 and "output passed 16 MiB" in str(err.value)
        assert len(small["Processes"]) == kids + 2, small
        assert {row[0] for row in small["Processes"]} == {r[0] for r in shown["Processes"]}
        assert grew < 64 * MiB, grew / MiB
        assert max(latencies) < HEALTH_STALL, max(latencies)
    finally:
        box.remove(force=True)


def _db(head: str, tail: str, size: int) -> str:
    """A passwd or group of `size` bytes: `head`, ":\\n" lines, `tail` (a sandbox's
    cheapest way to many lines: one list each in the code before)."""
    fill = size - len(head) - len(tail)
    return head + ":\n" * (fill // 2) + tail


def test_exec_as_a_user_looks_up_the_files_without_a_list_per_line(
    dclient: docker.DockerClient, docker_agent: AgentProcess
) -> None:
    """Session 57's red team (finding 2): `docker exec -u` and `docker top` split the
    sandbox's /etc/passwd and /etc/group (up to 4 MiB each) into a list per line, in
    anyio's default pool: a 4 MiB file of ":\\n" lines cost the agent ~690 MiB per exec,
    5.5 GB with eight at once. Now the files are read as text, at most 1 MiB, and only
    the entries asked for are looked up, in the Docker API's pool for sandbox files.
    Here files just under 1 MiB (+350 MiB per exec on the code before, four at once);
    the user, its groups (one in a hostile member list) and top's names still right;
    files over 1 MiB are as none: root is root, a named user is not found."""
    box = dclient.containers.run("py", ["sleep", "600"], detach=True)
    try:
        passwd = _db(
            "root:x:0:0:root:/root:/bin/sh\n",
            "runner:x:1234:1234::/home/runner:/bin/sh\n",
            MiB - 100,
        )
        hostile = "big:x:77:" + "a," * 100_000 + "runner\n"
        group = _db("root:x:0:\n" + hostile, "runner:x:1234:\nstaff:x:50:alice,runner\n", MiB - 100)
        box.put_archive("/etc", _tar({"passwd": passwd, "group": group}))
        want = b"uid=1234(runner) gid=1234(runner) groups=1234(runner),50(staff),77(big)\n"
        box.exec_run(["sleep", "300"], user="runner", detach=True)
        api = dclient.api

        def run_id(_: int) -> bytes:
            e = api.exec_create(box.id, ["id"], user="runner")
            return api.exec_start(e["Id"])

        with (
            health_watch(docker_agent) as latencies,
            peak_rss(docker_agent.proc.pid) as rise,
            ThreadPoolExecutor(4) as pool,
        ):
            t0 = time.perf_counter()
            assert run_id(0) == want
            took = time.perf_counter() - t0
            assert list(pool.map(run_id, range(4))) == [want] * 4
            users = {row[3]: row[1] for row in box.top()["Processes"]}
            grew = rise()
        print(
            f"exec -u runner: {took:.2f} s; with 4 more and a top: agent peak"
            f" +{grew / MiB:.0f} MiB; slowest /health {max(latencies) * 1000:.0f} ms"
        )
        assert users == {"sleep 600": "root", "sleep 300": "runner"}, users
        assert grew < 64 * MiB, grew / MiB
        assert max(latencies) < HEALTH_STALL, max(latencies)
        over = _db("root:x:0:0:root:/root:/bin/sh\n", "runner:x:1234:1234::/:/bin/sh\n", 2 * MiB)
        box.put_archive("/etc", _tar({"passwd": over}))
        assert box.exec_run(["id", "-u"], user="root").output == b"0\n"
        with pytest.raises(APIError) as err:
            box.exec_run(["id"], user="runner")
        assert err.value.status_code == 400, err.value
    finally:
        box.remove(force=True)


def _tar(files: dict[str, str]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def test_diff_is_the_containers_changes(dclient: docker.DockerClient) -> None:
    """docker-py's DiffTest and ContainerTest.test_diff: after the container ran, its
    new file is Kind 1 (added), its directory Kind 0 (changed)."""
    container = dclient.containers.run("py", ["sh", "-c", "mkdir /d && touch /d/test"], detach=True)
    try:
        assert container.wait(timeout=30)["StatusCode"] == 0
        assert container.diff() == [{"Path": "/d", "Kind": 1}, {"Path": "/d/test", "Kind": 1}]
        assert dclient.api.diff(container.id) == container.diff()
    finally:
        container.remove(force=True)


DEEP_DIRS = r"""
import os
os.chdir("/tmp")
for _ in range(20):
    os.mkdir("d" * 250); os.chdir("d" * 250)
open("hidden-payload", "w").write("x")
os.mkdir("hidden-dir")
"""


def test_diff_lists_what_lies_past_path_max(dclient: docker.DockerClient) -> None:
    """Session 57: the walk opened each directory by its whole path, and past PATH_MAX
    (4096 bytes) took it for gone: 20 levels of 250-byte names hid a file and a
    directory from `docker diff`, which answered 200 without a word. dockerd lists them,
    and now so does the agent."""
    container = dclient.containers.run("py", ["sleep", "300"], detach=True)
    try:
        r = container.exec_run(["python3", "-c", DEEP_DIRS])
        assert r.exit_code == 0, r.output
        deep = "/tmp/" + "/".join(["d" * 250] * 20)
        found = {c["Path"]: c["Kind"] for c in container.diff()}
        assert found[deep + "/hidden-payload"] == 1 and found[deep + "/hidden-dir"] == 1
        assert sum(p.startswith("/tmp/d") for p in found) == 22, sorted(map(len, found))
    finally:
        container.remove(force=True)


def test_pause_and_unpause_as_docker_py_sees_them(dclient: docker.DockerClient) -> None:
    """docker-py's PauseTest and ContainerTest.test_pause: State.Paused and the status
    follow; a paused container is removed by force."""
    container = dclient.containers.run("py", ["sleep", "300"], detach=True)
    try:
        container.pause()
        container.reload()
        assert container.status == "paused" and container.attrs["State"]["Paused"] is True
        with pytest.raises(APIError) as err:
            container.exec_run(["true"])
        assert err.value.status_code == 409
        container.unpause()
        container.reload()
        assert container.status == "running" and container.attrs["State"]["Paused"] is False
        container.pause()
    finally:
        container.remove(force=True)


def test_update_is_applied_and_shown(dclient: docker.DockerClient) -> None:
    """docker-py's test_update_container and ContainerTest.test_update: the new limits
    in inspect; a restart policy is warned of, not applied."""
    api = dclient.api
    made = api.create_container(
        "py", ["sleep", "60"], host_config=api.create_host_config(mem_limit=400 * 2**20)
    )
    api.start(made)
    answer = api.update_container(made, mem_limit=300 * 2**20, cpu_shares=3)
    assert answer["Warnings"] in ([], None), answer
    host = api.inspect_container(made)["HostConfig"]
    assert (host["Memory"], host["CpuShares"]) == (300 * 2**20, 3), host
    answer = api.update_container(made, restart_policy={"Name": "always"})
    assert "RestartPolicy" in " ".join(answer["Warnings"]), answer
    api.remove_container(made, force=True)
    with pytest.raises(APIError) as err:
        api.update_container("no-such-container", mem_limit=2**30)
    assert err.value.status_code == 404


def test_stats_in_dockerds_shape(dclient: docker.DockerClient) -> None:
    """docker-py's test_get_container_stats_no_stream and ContainerTest.test_stats: one
    document with dockerd's keys, the sandbox's memory and limit in it; a stream of them."""
    api = dclient.api
    made = api.create_container(
        "py", ["sleep", "60"], host_config=api.create_host_config(mem_limit=200 * 2**20)
    )
    api.start(made)
    doc = api.stats(made, stream=False)
    for key in ("read", "networks", "precpu_stats", "cpu_stats", "memory_stats", "blkio_stats"):
        assert key in doc, doc
    assert doc["memory_stats"]["limit"] == 200 * 2**20 and doc["memory_stats"]["usage"] > 0
    assert doc["precpu_stats"]["system_cpu_usage"] > 0  # a sample a second before
    assert doc["cpu_stats"]["system_cpu_usage"] > doc["precpu_stats"]["system_cpu_usage"]
    assert doc["pids_stats"]["current"] >= 2 and doc["id"] == made["Id"]
    once = api.stats(made, stream=False, one_shot=True)
    assert once["precpu_stats"]["system_cpu_usage"] == 0
    stream = api.stats(made, decode=True)
    first, second = next(stream), next(stream)
    assert second["precpu_stats"] == first["cpu_stats"], (first, second)
    stream.close()
    api.remove_container(made, force=True)


def test_anonymous_volumes_are_directories(dclient: docker.DockerClient) -> None:
    api = dclient.api
    made = api.create_container("py", ["ls", "/vol1", "/deep/er"], volumes=["/vol1", "/deep/er"])
    assert api.inspect_container(made)["Config"]["Volumes"] == {"/vol1": {}, "/deep/er": {}}
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w") as tar:
        info = tarfile.TarInfo("a.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    assert api.put_archive(made, "/vol1", data.getvalue())
    api.start(made)
    assert api.wait(made)["StatusCode"] == 0
    assert b"a.txt" in api.logs(made)
    with pytest.raises(APIError) as err:
        api.create_container("py", ["true"], volumes=["relative"])
    assert err.value.status_code == 400


# Run as a container's main process: leaves behind, in the sandbox, a process that swaps
# 20 directories with links to "/" as fast as it can, then exits.
SWAP_DIRS_WITH_ROOT = """
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
for k in range(20):
    os.makedirs(f"/a{k}/x"); os.symlink("/", f"/b{k}")
if os.fork() == 0:
    os.setsid()
    end = time.time() + 60
    while time.time() < end:
        for k in range(20):
            libc.renameat2(-100, f"/a{k}".encode(), -100, f"/b{k}".encode(), 2)
    os._exit(0)
"""


def test_prune_counts_the_layer_not_what_a_walk_is_led_to(dclient: docker.DockerClient) -> None:
    """Session 55's review: prune summed a stopped container's layer with a walk by
    path, and the sandbox's code (which outlives its main process) swapped directories
    with links to "/" under it: 14 MB counted for a 20-byte layer, the host's files
    stat'ed. Now it is the layer's tmpfs's own count of what it holds."""
    made = [run_to_end(dclient, ["python3", "-c", SWAP_DIRS_WITH_ROOT]) for _ in range(3)]
    time.sleep(0.5)  # the swappers are at it
    result = dclient.containers.prune()
    assert set(result["ContainersDeleted"]) == {c.id for c in made}
    assert result["SpaceReclaimed"] < 3 * 2**20, result  # three small layers


def test_prune_removes_the_stopped(dclient: docker.DockerClient) -> None:
    done = run_to_end(dclient, ["sh", "-c", "head -c 100000 /dev/zero > /data"])
    created = dclient.containers.create("py", ["true"], labels={"keep": "no"})
    labelled = run_to_end(dclient, ["true"], labels={"keep": "yes"})
    running = dclient.containers.run("py", ["sleep", "300"], detach=True)
    result = dclient.containers.prune(filters={"label": "keep=no"})
    assert result["ContainersDeleted"] == [created.id]
    result = dclient.containers.prune()
    assert set(result["ContainersDeleted"]) == {done.id, labelled.id}
    assert result["SpaceReclaimed"] >= 100000
    assert [c.id for c in dclient.containers.list(all=True)] == [running.id]
    assert dclient.containers.prune() == {"ContainersDeleted": None, "SpaceReclaimed": 0}


def test_logs_are_streamed_a_line_at_a_time(dclient: docker.DockerClient) -> None:
    out = dclient.containers.run("py", ["sh", "-c", "echo hello && echo world"], stream=True)
    assert list(out) == [b"hello\n", b"world\n"]


def test_start_answers_once_the_command_runs(dclient: docker.DockerClient) -> None:
    """dockerd's start answers once the process runs: right after it, it is there."""
    api = dclient.api
    for n in range(5):
        argv = ["sleep", f"300.{n}{os.getpid()}"]  # one no other process has
        made = api.create_container("py", argv)
        api.start(made)
        wanted = "\0".join(argv).encode() + b"\0"
        assert wanted in host_commands(), f"{argv} is not running"
        api.remove_container(made, force=True)


def host_commands() -> list[bytes]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            found.append(Path(f"/proc/{pid}/cmdline").read_bytes())
    return found
