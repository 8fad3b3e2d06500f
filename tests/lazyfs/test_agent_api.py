"""The node agent through its Python client and raw HTTP: the client contract, many
commands in one sandbox, stdin/env/cwd, timeouts, files (and symlink escapes), errors
and their statuses, TTLs, metrics. One agent for the module; the node is checked clean
when it stops."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import httpx
import pytest

from lazyfs.client import AgentError, Client, Sandbox
from lazyfs.client.aio import AsyncClient, AsyncSandbox
from testbed.agent import AgentProcess, running_agent
from testbed.waiting import wait_for


@pytest.fixture(scope="module")
def served(user_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    with running_agent(tmp_path_factory.mktemp("agent"), user_store) as agent:
        yield agent.start("--max-sandboxes", "20")


@pytest.fixture
def client(served: AgentProcess) -> Iterator[Client]:
    with served.client() as c:
        yield c
        for box in c.list():  # a failed test's sandboxes must not leak into the next
            c.sandbox(box["id"]).delete(missing_ok=True)


def test_client_contract(client: Client) -> None:
    with client.create("py", memory="2G", ttl=3600) as sb:
        r = sb.exec(["python3", "-c", "import sys; print('out'); print('err', file=sys.stderr)"])
        assert (r.exit_code, r.stdout, r.stderr) == (0, b"out\n", b"err\n")
        assert isinstance(r.exit_code, int)
        sb.write_file("/repo/fix.patch", b"\x00binary\xffpatch")
        assert sb.read_file("/repo/fix.patch") == b"\x00binary\xffpatch"
        assert sb.exec(["cat", "/repo/fix.patch"]).stdout == b"\x00binary\xffpatch"
        box_id = sb.id
        assert [b["state"] for b in client.list() if b["id"] == box_id] == ["running"]
    assert box_id not in [b["id"] for b in client.list()]  # deleted on exit
    sb = client.create("py")
    assert sb.exec(["true"]).exit_code == 0
    sb.delete()
    with pytest.raises(AgentError) as err:
        sb.exec(["true"])
    assert err.value.status == 404


# Each command through the sandbox's exec server (in base, which has no python3: the
# server is the host's static binary), or through `runc exec`, which the agent falls
# back to when the server does not answer (its socket removed on the host here, as an
# operator could; the sandbox's own code cannot reach it: tests/security).
BOTH_WAYS = pytest.mark.parametrize("way", ["server", "runtime"])


@contextmanager
def _box(served: AgentProcess, way: str, **options: object) -> Iterator[Sandbox]:
    with (
        served.client() as client,
        client.create("base" if way == "server" else "py", **options) as sb,
    ):
        if way == "runtime":
            (served.node.sandboxes / sb.id / "exec.sock").unlink()
        assert sb.exec(["true"]).channel == way
        yield sb


@BOTH_WAYS
def test_state_stdin_env_cwd_between_execs(served: AgentProcess, way: str) -> None:
    with _box(served, way, env={"FROM_CREATE": "c"}) as sb:
        assert (
            sb.exec(["sh", "-c", "echo one > /tmp/state; cd /tmp; echo two >> state"]).exit_code
            == 0
        )
        assert sb.exec(["cat", "/tmp/state"]).stdout == b"one\ntwo\n"
        r = sb.exec(
            ["sh", "-c", 'read line; echo "$line $FROM_CREATE $FROM_EXEC $(pwd)"'],
            stdin=b"piped\n",
            env={"FROM_EXEC": "e"},
            cwd="/usr",
        )
        assert r.stdout == b"piped c e /usr\n", r
        assert sb.exec(["sh", "-c", "exit 7"]).exit_code == 7
        assert sb.exec(["sh", "-c", "kill -9 $$"]).exit_code == 137
        r = sb.exec(["no-such-command", "x"])
        assert r.exit_code == 127 and b"not found" in r.stderr
        for _ in range(20):  # many commands, one sandbox
            assert sb.exec(["true"]).exit_code == 0


@BOTH_WAYS
def test_exec_timeout_kills_the_command_and_keeps_the_sandbox(
    served: AgentProcess, way: str
) -> None:
    with _box(served, way) as sb:
        t0 = time.monotonic()
        r = sb.exec(["sh", "-c", "echo started; sleep 31 & sleep 31; echo never"], timeout=1)
        assert r.timed_out and r.exit_code == 137 and r.stdout == b"started\n"
        assert time.monotonic() - t0 < 10
        count = (
            "for p in /proc/[0-9]*; do tr '\\0' ' ' <$p/cmdline; echo; done | grep -c '^sleep 31'"
        )
        assert sb.exec(["sh", "-c", count]).stdout == b"0\n"  # both sleeps were killed
        assert sb.exec(["echo", "still here"]).stdout == b"still here\n"


def test_exec_server_socket_swapped_for_a_symlink_is_not_followed(
    client: Client, served: AgentProcess
) -> None:
    """The agent connects through an O_NOFOLLOW open of the socket's path: a symlink put
    there (by anyone who can write the sandbox's host directory: root) to a host socket,
    the agent's own, is not talked to; `runc exec` runs the commands instead."""
    with client.create("py") as sb:
        path = served.node.sandboxes / sb.id / "exec.sock"
        path.unlink()
        path.symlink_to(served.socket)
        for _ in range(3):
            r = sb.exec(["echo", "still works"])
            assert (r.stdout, r.channel) == (b"still works\n", "runtime")
        assert client.health()["status"] == "ok"


@BOTH_WAYS
def test_client_gone_mid_exec_kills_the_command(
    client: Client, served: AgentProcess, way: str
) -> None:
    count = "for p in /proc/[0-9]*; do tr '\\0' ' ' <$p/cmdline; echo; done | grep -c '^sleep 32'"
    with _box(served, way) as sb, _http(served) as http:
        body = {"argv": ["sh", "-c", "echo started; sleep 32"]}
        with http.stream("POST", f"/sandboxes/{sb.id}/exec/stream", json=body) as r:
            lines = r.iter_lines()  # kept: a dropped iterator closes the connection
            first = next(lines)
            assert base64.b64decode(json.loads(first)["stdout"]) == b"started\n"
            deadline = time.monotonic() + 10
            while sb.exec(["sh", "-c", count]).stdout != b"1\n":  # sh starting sleep
                assert time.monotonic() < deadline, "the command did not start"
                time.sleep(0.05)
            time.sleep(0.3)
            assert sb.exec(["sh", "-c", count]).stdout == b"1\n"  # runs while connected
        deadline = time.monotonic() + 10
        while sb.exec(["sh", "-c", count]).stdout != b"0\n":
            assert time.monotonic() < deadline, "the command outlived its client"
            time.sleep(0.1)
        assert sb.exec(["echo", "usable"]).stdout == b"usable\n"


FORK_FILLER = """
import os, time
if os.fork():
    os._exit(0)  # the filler lives on in the background, its output to /dev/null
null = os.open("/dev/null", os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
while True:  # takes every process slot that comes free
    try:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
    except OSError:
        time.sleep(0.002)
"""


def test_a_sandbox_out_of_processes_says_so(client: Client) -> None:
    with client.create("py", pids=16) as sb:
        assert sb.exec(["python3", "-c", FORK_FILLER]).exit_code == 0
        deadline = time.monotonic() + 20
        while (r := sb.exec(["true"])).exit_code == 0:  # until the filler holds them all
            assert time.monotonic() < deadline, "the filler did not fill the pids limit"
        assert r.exit_code == 126 and b"Resource temporarily unavailable" in r.stderr, r
        assert client.health()["status"] == "ok"


def test_a_sandbox_whose_init_was_killed_says_so(client: Client, served: AgentProcess) -> None:
    """PID 1, the exec server, cannot be killed from inside (tests/security); from the
    host it can (an operator, the OOM killer), and every process in the sandbox ends."""
    sb = client.create("base")
    assert sb.exec(["true"]).exit_code == 0
    os.kill(int((served.node.sandboxes / sb.id / "init.pid").read_text()), 9)
    deadline = time.monotonic() + 10
    while [b["state"] for b in client.list() if b["id"] == sb.id] != ["exited"]:
        assert time.monotonic() < deadline, client.list()
        time.sleep(0.05)
    with pytest.raises(AgentError) as err:
        sb.exec(["true"])
    assert err.value.status == 409 and "delete it" in str(err.value)
    assert sb.read_file("/etc/hostname")  # its files are still there until it is deleted
    sb.delete()


def test_the_exec_server_as_pid_1_reaps_what_commands_leave(client: Client) -> None:
    """No tini: PID 1 is the exec server, and the kernel reaps every orphan re-parented
    to it (it ignores SIGCHLD). Here a process that never reaps (`sleep`) leaves a zombie
    child, seen while it runs; once it exits, both are PID 1's and gone."""
    zombies = "cat /proc/[0-9]*/stat 2>/dev/null | grep -c ') Z '"
    leave = "(sh -c 'sleep 0.1 & exec sleep 1' >/dev/null 2>&1 &)"
    with client.create("base") as sb:
        r = sb.exec(["sh", "-c", f"{leave}; sleep 0.5; {zombies}; sleep 1.5; {zombies}"])
        assert r.stdout == b"1\n0\n", r


def test_streaming_exec(client: Client) -> None:
    with client.create("py") as sb:
        events = list(sb.exec_stream(["sh", "-c", "echo a; echo b >&2; exit 4"]))
        out = b"".join(d for k, d in events if k == "stdout")
        err = b"".join(d for k, d in events if k == "stderr")
        assert (out, err, events[-1][0], events[-1][1].exit_code) == (b"a\n", b"b\n", "exit", 4)


def test_a_stream_given_up_on_kills_its_command_and_the_client_goes_on(client: Client) -> None:
    """The client's own streaming form: a consumer that stops reading hangs up (as a
    framework's cancelled task would), so the agent kills the command; the client's
    other connections, and the sandbox, still serve."""
    count = "for p in /proc/[0-9]*; do tr '\\0' ' ' <$p/cmdline; echo; done | grep -c '^sleep 33'"
    with client.create("py") as sb:
        stream = sb.exec_stream(["sh", "-c", "echo started; sleep 33"])
        assert next(stream) == ("stdout", b"started\n")
        deadline = time.monotonic() + 10
        while sb.exec(["sh", "-c", count]).stdout != b"1\n":  # sh starting sleep
            assert time.monotonic() < deadline, "the command did not start"
            time.sleep(0.05)
        closing = time.monotonic()
        stream.close()  # GeneratorExit at the yield: the connection is closed
        assert time.monotonic() - closing < 5, "closing waited for the command to end"
        while sb.exec(["sh", "-c", count]).stdout != b"0\n":
            assert time.monotonic() < deadline, "the command outlived its stream"
            time.sleep(0.1)
        events = list(sb.exec_stream(["echo", "again"]))
        assert events[0] == ("stdout", b"again\n") and events[-1][1].exit_code == 0


def test_files_and_symlink_escapes(client: Client, served: AgentProcess) -> None:
    secret = served.node.tmp / "host-secret"
    secret.write_text("host only")
    with client.create("py") as sb:
        sb.write_file("/deep/new/dir/f.txt", b"x" * 100_000)
        assert sb.exec(["wc", "-c", "/deep/new/dir/f.txt"]).stdout.split()[0] == b"100000"
        names = {e["name"]: e["type"] for e in sb.list_dir("/deep/new/dir")}
        assert names == {"f.txt": "file"}
        assert "etc" in {e["name"] for e in sb.list_dir("/")}
        # Links made inside the sandbox to the host's file: absolute, relative, via ..
        sb.exec(["ln", "-s", str(secret), "/tmp/abs"])
        sb.exec(["ln", "-s", "../../../../../../../../" + str(secret), "/tmp/rel"])
        sb.exec(["ln", "-s", "/", "/tmp/root"])
        for path in (
            "/tmp/abs",
            "/tmp/rel",
            "/../../../../" + str(secret),
            "/tmp/root" + str(secret),
        ):
            with pytest.raises(AgentError) as err:
                sb.read_file(path)
            assert err.value.status == 404, path
        # Writing through a link must not create or change anything on the host.
        with pytest.raises(AgentError):
            sb.write_file("/tmp/abs", b"pwned")
        sb.write_file("/tmp/root/etc/via-link", b"inside")  # "/" is the sandbox's /
        assert sb.exec(["cat", "/etc/via-link"]).stdout == b"inside"
        assert secret.read_text() == "host only"
        with pytest.raises(AgentError) as err:
            sb.read_file("relative/path")
        assert err.value.status == 400
        with pytest.raises(AgentError) as err:
            sb.read_file("/etc")
        assert err.value.status == 400
    assert not (served.node.tmp / "etc" / "via-link").exists()


def test_files_written_belong_to_the_sandboxs_user(client: Client) -> None:
    with client.create("nobody-py") as sb:
        sb.write_file("/tmp/new/dir/f", b"mine")
        r = sb.exec(["sh", "-c", "id -u; stat -c %u:%g /tmp/new /tmp/new/dir /tmp/new/dir/f"])
        assert r.stdout == b"65534\n65534:5\n65534:5\n65534:5\n", r
        assert sb.exec(["sh", "-c", "echo more >> /tmp/new/dir/f"]).exit_code == 0
        assert sb.read_file("/tmp/new/dir/f") == b"minemore\n"
        assert sb.exec(["stat", "-c", "%u", "/tmp"]).stdout == b"0\n"  # existing: untouched


def test_a_read_only_sandbox_takes_no_file_and_says_what_it_was_made_with(
    client: Client,
) -> None:
    with client.create("py", cap_drop=["net_raw", "CHOWN"], read_only=True) as sb:
        assert sb.info["cap_drop"] == ["CAP_CHOWN", "CAP_NET_RAW"], sb.info
        assert sb.info["read_only"] is True, sb.info
        with pytest.raises(AgentError) as err:
            sb.write_file("/tmp/f", b"x")
        assert err.value.status == 403 and "read-only" in str(err.value), err.value
        assert sb.read_file("/etc/hostname")  # reads go on
        assert sb.exec(["sh", "-c", "touch /f 2>/dev/null || echo ro"]).stdout == b"ro\n"
    with client.create("py") as sb:
        assert sb.info["cap_drop"] == [] and sb.info["read_only"] is False, sb.info
        assert sb.info["ulimits"] == {}, sb.info
        sb.write_file("/tmp/f", b"x")


def test_a_running_sandboxs_limits_change(client: Client, served: AgentProcess) -> None:
    """PATCH /sandboxes/{id} (Sandbox.update): the limits given change in its cgroup and
    its view while it runs; the others stay."""
    cgroups, parent = Path("/sys/fs/cgroup"), served.node.cgroup_parent
    with client.create("py", memory="256M", cpu_shares=256) as sb:
        disk = sb.info["limits"]["disk"]
        view = sb.update(memory="128M", pids=30, cpus=0.5)
        assert view["limits"] == {
            "cpus": 0.5,
            "memory": 128 * 2**20,
            "pids": 30,
            "disk": disk,
            "cpu_shares": 256,  # not given: as it was
            "cpuset_cpus": None,
        }, view
        memory = cgroups / "memory" / parent / sb.id / "memory.limit_in_bytes"
        assert int(memory.read_text()) == 128 * 2**20
        assert (cgroups / "pids" / parent / sb.id / "pids.max").read_text() == "30\n"
        assert (cgroups / "cpu" / parent / sb.id / "cpu.cfs_quota_us").read_text() == "50000\n"
        assert (cgroups / "cpu" / parent / sb.id / "cpu.shares").read_text() == "256\n"
        r = sb.exec(["sh", "-c", "for i in $(seq 40); do sleep 1 & done; wait"])
        assert r.exit_code != 0 or b"fork" in r.stderr.lower(), r  # 30 pids, in force
        assert client.sandbox(sb.id).info["limits"]["pids"] == 30
        for bad in ({"memory": "lots"}, {"pids": 0}, {"image": "py"}, {"cpu_shares": 1}):
            with pytest.raises(AgentError) as err:
                sb.client.request("PATCH", f"/sandboxes/{sb.id}", json=bad)
            assert err.value.status == 400, (bad, err.value)
        assert client.sandbox(sb.id).info["limits"] == view["limits"]  # nothing changed
    with pytest.raises(AgentError) as err:
        client.request("PATCH", f"/sandboxes/{sb.id}", json={"pids": 5})
    assert err.value.status == 404


def test_a_sandboxs_stats_are_what_its_cgroup_counts(client: Client) -> None:
    """GET /sandboxes/ID/stats (Sandbox.stats): CPU time, the memory charged to it (its
    files in RAM too) and its tasks, each with its limit."""
    with client.create("py", memory="256M", pids=100) as sb:
        before = sb.stats()
        assert before["memory_limit"] == 256 * 2**20 and before["pids_limit"] == 100, before
        assert before["pids"] >= 1 and before["memory"] > 0, before
        busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
        sb.exec(["python3", "-c", busy])
        sb.exec(["sh", "-c", "head -c 30000000 /dev/zero > /tmp/fill"])  # 30 MB in RAM
        after = sb.stats()
        assert after["cpu_seconds"] - before["cpu_seconds"] >= 0.25, (before, after)
        assert after["memory"] - before["memory"] >= 25_000_000, (before, after)
    with pytest.raises(AgentError) as err:
        sb.stats()
    assert err.value.status == 404


def _http(served: AgentProcess) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(served.socket)), base_url="http://a")


def test_errors_have_statuses_and_the_agent_stays_up(client: Client, served: AgentProcess) -> None:
    with _http(served) as http:
        cases = [
            ("POST", "/sandboxes", {"image": "no/such/image"}, 404, "not_found"),
            ("POST", "/sandboxes", {"image": "py", "memory": "lots"}, 400, "bad_request"),
            ("POST", "/sandboxes", {"image": "py", "cpus": -1}, 400, "bad_request"),
            ("POST", "/sandboxes", {"image": "py", "pids": "x"}, 400, "bad_request"),
            ("POST", "/sandboxes", {"image": "py", "cpu_shares": 1}, 400, "bad_request"),
            ("POST", "/sandboxes", {"image": "py", "cpu_shares": "x"}, 400, "bad_request"),
            ("POST", "/sandboxes", {"image": "py", "cpuset_cpus": "0-4095"}, 400, "bad_request"),
            ("POST", "/sandboxes", {"image": "py", "cpuset_cpus": "1-0"}, 400, "bad_request"),
            ("POST", "/sandboxes", {"image": "py", "cpuset_cpus": 0}, 400, "bad_request"),
            ("POST", "/sandboxes", {"image": "py", "tmpfs": ["/t"]}, 400, "bad_request"),
            ("POST", "/sandboxes", {"image": "py", "tmpfs": {"/proc": ""}}, 400, "bad_request"),
            ("POST", "/sandboxes", {"image": "py", "tmpfs": {"/t": "suid"}}, 400, "bad_request"),
            ("POST", "/sandboxes", {"image": "py", "cap_drop": "ALL"}, 400, "bad_request"),
            ("POST", "/sandboxes", {"image": "py", "cap_drop": ["FLY"]}, 400, "bad_request"),
            ("POST", "/sandboxes", {"image": "py", "read_only": "yes"}, 400, "bad_request"),
            ("POST", "/sandboxes", {"image": "py", "ulimits": ["nofile"]}, 400, "bad_request"),
            ("POST", "/sandboxes", {"image": "py", "ulimits": {"fly": [1, 1]}}, 400, "bad_request"),
            ("POST", "/sandboxes", {"image": "py", "ulimits": {"as": [8, 4]}}, 400, "bad_request"),
            ("POST", "/sandboxes", {"image": "py", "ulimits": {"nofile": [8]}}, 400, "bad_request"),
            ("POST", "/sandboxes", {"image": "py", "env": ["NOEQUALS"]}, 400, "bad_request"),
            ("POST", "/sandboxes", {}, 400, "bad_request"),
            ("GET", "/sandboxes/lazyfs-000000000000", None, 404, "unknown_sandbox"),
            ("DELETE", "/sandboxes/lazyfs-000000000000", None, 404, "unknown_sandbox"),
            ("POST", "/sandboxes/nope/exec", {"argv": ["true"]}, 404, "unknown_sandbox"),
            # No route: the API's own error shape too (lazyfs/serving.py, ApiApp).
            ("GET", "/no/such/endpoint", None, 404, "not_found"),
            ("PUT", "/health", None, 405, "method_not_allowed"),
            ("GET", "/sandboxes/x/nothing-here", None, 404, "not_found"),
        ]
        for method, path, body, status, code in cases:
            r = http.request(method, path, json=body)
            assert (r.status_code, r.json()["error"]) == (status, code), (path, body, r.text)
            assert r.json()["message"]
        r = http.post("/sandboxes", content=b"not json")
        assert r.status_code == 400
        # A limit the runtime refuses: its own reason reaches the client, in one line.
        r = http.post("/sandboxes", json={"image": "py", "memory": "100K"})
        assert (r.status_code, r.json()["error"]) == (500, "runtime_failed"), r.text
        assert "unable to set memory limit" in r.json()["message"], r.text
        with client.create("py") as sb:
            r = http.post(f"/sandboxes/{sb.id}/exec", json={"argv": []})
            assert r.status_code == 400
            r = http.post(f"/sandboxes/{sb.id}/exec", json={"argv": ["true"], "timeout": 0})
            assert r.status_code == 400
            r = http.post(
                f"/sandboxes/{sb.id}/exec",
                json={"argv": ["cat"], "stdin": base64.b64encode(b"raw").decode()},
            )
            assert base64.b64decode(r.json()["stdout"]) == b"raw"
        assert http.get("/health").json()["status"] == "ok"


def test_ttl_deletes_an_abandoned_sandbox(client: Client) -> None:
    sb = client.create("py", ttl=1)
    assert sb.exec(["true"]).exit_code == 0
    deadline = time.monotonic() + 10
    while sb.id in [b["id"] for b in client.list()]:
        assert time.monotonic() < deadline, "TTL passed and the sandbox is still there"
        time.sleep(0.1)
    with pytest.raises(AgentError) as err:
        sb.exec(["true"])
    assert err.value.status == 404


def test_metrics(client: Client) -> None:
    with client.create("py") as sb:
        sb.exec(["true"])
        text = client.metrics()
    for needle in (
        'lazyfs_sandboxes{state="running"} 1.0',
        'lazyfs_claims_total{source="cold"}',
        'lazyfs_claim_seconds_bucket{le="0.5",source="cold"}',
        "lazyfs_exec_seconds_count",
        'lazyfs_execs_total{channel="server"}',
        'lazyfs_execs_total{channel="runtime"}',
    ):
        assert needle in text, needle
    assert "lazyfs_node_cache_bytes_fetched " in text and "lazyfs_node_cache_hits " in text
    assert "lazyfs_node_cache_image_files_removed " in text
    mounted = [line for line in text.splitlines() if line.startswith("lazyfs_mounted_images ")]
    assert float(mounted[0].split()[1]) >= 1  # py, and base if its linger has not passed


def test_async_client(served: AgentProcess, client: Client) -> None:
    from lazyfs.client.aio import AsyncClient

    async def episode() -> tuple[bytes, str | None, bytes]:
        async with AsyncClient(socket=served.socket) as c, await c.create("py", ttl=60) as sb:
            await sb.write_file("/work/a.txt", b"async")
            r = await sb.exec(["cat", "/work/a.txt"], timeout=30)
            return r.stdout, r.channel, await sb.read_file("/work/a.txt")

    assert asyncio.run(episode()) == (b"async", "server", b"async")
    assert client.list() == []


def test_the_async_client_has_more_than_100_calls_in_flight(
    served: AgentProcess, client: Client
) -> None:
    """httpx's default pool held an AsyncClient to 100 connections: the 101st exec waited
    for another sandbox's command to end. 110 long execs at once through one client must
    all be running together."""
    boxes = [client.create("py", ttl=120) for _ in range(4)]
    marker = "touch /tmp/running.$$ && exec sleep 60"

    def running() -> int:
        return sum(
            int(b.exec(["sh", "-c", "ls /tmp | grep -c running || true"]).stdout) for b in boxes
        )

    async def calls() -> int:
        async with AsyncClient(socket=served.socket) as c, anyio.create_task_group() as tasks:
            for i in range(110):
                tasks.start_soon(_long_exec, c, boxes[i % 4].id, marker)
            seen = 0
            with anyio.move_on_after(30):
                while (seen := await anyio.to_thread.run_sync(running)) < 110:
                    await anyio.sleep(0.2)
            tasks.cancel_scope.cancel()  # hanging up kills the commands
            return seen

    try:
        assert asyncio.run(calls()) == 110
    finally:
        for box in boxes:
            box.delete(missing_ok=True)


async def _long_exec(c: AsyncClient, box_id: str, script: str) -> None:
    await AsyncSandbox(c, box_id).exec(["sh", "-c", script], timeout=120)


def test_a_sandboxs_changes_to_its_image_are_listed(client: Client) -> None:
    """GET /sandboxes/ID/changes (`docker diff`): added, changed and deleted paths, the
    directories they lie under as changed, a directory made again (opaque) with what the
    image had in it deleted; nothing for a sandbox that changed nothing."""
    with client.create("py") as sb:
        assert sb.changes() == [], sb.changes()
        script = (
            "mkdir -p /new/dir && echo x > /new/dir/f && echo more >> /usr/lib/os-release"
            " && rm /etc/debian_version && rm -r /usr/share/doc && mkdir /usr/share/doc"
            " && touch /usr/share/doc/only && printf x > \"$(printf '/bad\\377name')\""
        )
        assert sb.exec(["sh", "-c", script]).exit_code == 0
        found = {c["path"]: c["kind"] for c in sb.changes()}
        assert sorted(found) == [c["path"] for c in sb.changes()]  # sorted by path
        expected = {
            "/bad\ufffdname": "added",
            "/etc": "changed",
            "/etc/debian_version": "deleted",
            "/new": "added",
            "/new/dir": "added",
            "/new/dir/f": "added",
            "/usr": "changed",
            "/usr/lib": "changed",
            "/usr/lib/os-release": "changed",
            "/usr/share": "changed",
            "/usr/share/doc": "changed",
            "/usr/share/doc/only": "added",
        }
        assert {p: k for p, k in found.items() if not p.startswith("/usr/share/doc/")} | {
            "/usr/share/doc/only": found.get("/usr/share/doc/only")
        } == expected, found
        gone = [p for p, k in found.items() if p.startswith("/usr/share/doc/") and k == "deleted"]
        assert len(gone) > 10 and all(p.count("/") == 4 for p in gone), gone  # its packages'
    with pytest.raises(AgentError) as err:
        client.sandbox("lazyfs-000000000000").changes()
    assert err.value.status == 404


def test_changes_past_path_max_are_listed(client: Client) -> None:
    """Session 57: what lay deeper than PATH_MAX (4096 bytes) under the upper directory
    was left out of GET /sandboxes/ID/changes without a word; now it is listed."""
    script = (
        "import os\nos.chdir('/tmp')\nfor _ in range(20):\n"
        "    os.mkdir('d' * 250); os.chdir('d' * 250)\n"
        "open('hidden-payload', 'w').write('x'); os.mkdir('hidden-dir')\n"
    )
    with client.create("py") as sb:
        assert sb.exec(["python3", "-c", script]).exit_code == 0
        found = {c["path"]: c["kind"] for c in sb.changes()}
    deep = "/tmp/" + "/".join(["d" * 250] * 20)
    assert found[deep + "/hidden-payload"] == "added" and found[deep + "/hidden-dir"] == "added"
    assert sum(p.startswith("/tmp/d") for p in found) == 22, sorted(map(len, found))


def test_a_paused_sandbox_runs_nothing_until_unpaused_and_is_deleted_as_any(
    client: Client, served: AgentProcess
) -> None:
    """POST /sandboxes/ID/pause: every process frozen (a background loop stops writing),
    an exec is a 409, its files and stats still answer; unpause lets it go on; a paused
    sandbox is deleted at once and leaves no cgroup."""
    sb = client.create("py")
    loop = "while :; do echo x >> /tmp/ticks; sleep 0.02; done"
    sb.exec(["sh", "-c", f"nohup sh -c '{loop}' >/dev/null 2>&1 &"])
    wait_for(lambda: sb.exec(["test", "-s", "/tmp/ticks"]).exit_code == 0, what="a tick")
    wait_for(lambda: len(sb.read_file("/tmp/ticks")) > 10, what="the loop to tick")
    assert sb.pause()["paused"] is True and sb.pause()["paused"] is True  # twice: no error
    frozen = len(sb.read_file("/tmp/ticks"))
    time.sleep(0.3)
    assert len(sb.read_file("/tmp/ticks")) == frozen  # nothing ran
    with pytest.raises(AgentError) as err:
        sb.exec(["true"])
    assert (err.value.status, err.value.code) == (409, "sandbox_paused"), err.value
    assert sb.stats()["pids"] >= 3 and client.sandbox(sb.id).info["paused"] is True
    assert sb.unpause()["paused"] is False
    wait_for(lambda: len(sb.read_file("/tmp/ticks")) > frozen + 10, what="the loop to go on")
    assert sb.exec(["true"]).exit_code == 0
    sb.pause()
    t0 = time.monotonic()
    sb.delete()
    assert time.monotonic() - t0 < 5
    leftovers = [p for p in Path("/sys/fs/cgroup").glob(f"*/*/{sb.id}")]
    assert leftovers == [], leftovers
    with pytest.raises(AgentError) as err:
        sb.pause()
    assert err.value.status == 404
