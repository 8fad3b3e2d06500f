"""The node agent as a process: warm pools, --max-sandboxes, `kill -9` and restart, the
`lazyfs sandbox` command line. Each test has its own agent; the node is checked clean
after it stops."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from lazyfs.client import AgentError, Client, Sandbox
from lazyfs.sandbox.ulimits import default_nofile
from testbed.agent import AgentProcess, assert_lost_with_its_data_daemon
from testbed.mounted_trees import supervisors, workers
from testbed.node import LAZYFS
from testbed.waiting import wait_for


def ready(c: Client, image: str = "py") -> int:
    return sum(p["ready"] for p in c.pools() if p["image"] == image)


def test_claims_come_from_the_pool_and_it_refills(agent: AgentProcess) -> None:
    agent.start("--pool", "py=2")
    with agent.client() as c:
        wait_for(lambda: ready(c) == 2, what="the pool to fill")
        pooled = {b["id"] for b in c.list() if b["state"] == "ready"}
        assert len(pooled) == 2
        a, b = c.create("py"), c.create("py")
        assert {a.id, b.id} == pooled and a.info["from_pool"] and b.info["from_pool"]
        assert a.exec(["echo", "warm"]).stdout == b"warm\n"
        wait_for(lambda: ready(c) == 2, what="the pool to refill")
        last = str(max(os.sched_getaffinity(0)))
        limited = c.create(  # set on a pooled one
            "py", memory="256M", pids=50, cpus=0.5, cpu_shares=256, cpuset_cpus=last
        )
        assert limited.info["from_pool"]
        assert limited.info["limits"] == {
            "cpus": 0.5,
            "memory": 256 * 2**20,
            "pids": 50,
            "disk": 10 * 2**30,
            "cpu_shares": 256,
            "cpuset_cpus": last,
        }
        cgroups = Path("/sys/fs/cgroup")
        parent = agent.node.cgroup_parent
        assert (cgroups / "cpu" / parent / limited.id / "cpu.shares").read_text() == "256\n"
        assert (cgroups / "cpuset" / parent / limited.id / "cpuset.cpus").read_text() == last + "\n"
        memory = cgroups / "memory" / parent / limited.id / "memory.limit_in_bytes"
        assert int(memory.read_text()) == 256 * 2**20
        assert int((cgroups / "pids" / parent / limited.id / "pids.max").read_text()) == 50
        fork_bomb = limited.exec(["sh", "-c", "for i in $(seq 80); do sleep 1 & done; wait"])
        assert fork_bomb.exit_code != 0 or b"fork" in fork_bomb.stderr.lower()
        limited.delete()
        wait_for(lambda: ready(c) == 2, what="the pool to refill again")
        cold = c.create("py", network=True)  # a pooled sandbox has its own network: cold
        assert not cold.info["from_pool"]
        text = c.metrics()
        assert 'lazyfs_claims_total{source="pool"} 3.0' in text
        assert 'lazyfs_claims_total{source="cold"} 1.0' in text
        c.set_pool("py", 0)
        wait_for(lambda: ready(c) == 0, what="the pool to shrink")
        c.set_pool("base", 1)
        wait_for(lambda: ready(c, "base") == 1, what="a pool set through the API")
        for box in (a, b, cold):
            box.delete()


def _caps(box: Sandbox) -> dict[str, str]:
    out = box.exec(["grep", "^Cap", "/proc/self/status"]).stdout.decode()
    return dict(line.split(":\t") for line in out.splitlines())


def test_a_pooled_claim_drops_capabilities_and_keeps_them_dropped_after_a_restart(
    agent: AgentProcess,
) -> None:
    """A sandbox of the image's pool was made with the default capabilities: a claim
    with cap_drop has its exec server drop them from every command, also once a
    restarted agent adopted it. One with read_only skips the pool (its root is set)."""
    agent.start("--pool", "py=1")
    with agent.client() as c:
        wait_for(lambda: ready(c) == 1, what="the pool to fill")
        dropped = c.create("py", cap_drop=["NET_RAW", "chown"])
        assert dropped.info["from_pool"] and dropped.info["cap_drop"] == [
            "CAP_CHOWN",
            "CAP_NET_RAW",
        ]
        less = {"CapInh": "0000000000000000", "CapAmb": "0000000000000000"}
        less.update({k: "00000000a80405fa" for k in ("CapPrm", "CapEff", "CapBnd")})
        assert _caps(dropped) == less
        wait_for(lambda: ready(c) == 1, what="the pool to refill")
        read_only = c.create("py", read_only=True)
        assert not read_only.info["from_pool"] and ready(c) == 1
        assert read_only.exec(["sh", "-c", "touch /x 2>/dev/null || echo ro"]).stdout == b"ro\n"
        plain = c.create("py")  # the pool's: the defaults
        assert plain.info["from_pool"] and _caps(plain)["CapEff"] == "00000000a80425fb"
    agent.kill9()
    agent.start()
    with agent.client() as c:
        assert sorted(c.health()["adopted_on_start"]) == sorted(
            [dropped.id, read_only.id, plain.id]
        )
        again = c.sandbox(dropped.id)
        assert _caps(again) == less and again.info["cap_drop"] == ["CAP_CHOWN", "CAP_NET_RAW"]
        with pytest.raises(AgentError) as err:
            c.sandbox(read_only.id).write_file("/tmp/f", b"x")
        assert err.value.status == 403
        for box in (dropped, read_only, plain):
            c.sandbox(box.id).delete()


def _open_files(box: Sandbox) -> list[str]:
    out = box.exec(["grep", "open files", "/proc/self/limits"]).stdout.decode()
    return out.split()[3:5]


def test_a_pooled_claim_sets_ulimits_and_keeps_them_after_a_restart(agent: AgentProcess) -> None:
    """A sandbox of the image's pool was made with the default limits: a claim with
    ulimits within them has its exec server set them on every command, also once a
    restarted agent adopted it. One made for its create (here: the node's network) has
    them from its spec too."""
    agent.start("--pool", "py=1")
    with agent.client() as c:
        wait_for(lambda: ready(c) == 1, what="the pool to fill")
        limited = c.create("py", ulimits={"nofile": (4096, 8192), "core": (0, 0)})
        assert limited.info["from_pool"], limited.info
        assert limited.info["ulimits"] == {"core": [0, 0], "nofile": [4096, 8192]}
        assert _open_files(limited) == ["4096", "8192"]
        cold = c.create("py", network=True, ulimits={"nofile": (2048, 2048)})
        assert not cold.info["from_pool"] and _open_files(cold) == ["2048", "2048"]
        wait_for(lambda: ready(c) == 1, what="the pool to refill")
        plain = c.create("py")  # the pool's: the defaults
        assert plain.info["from_pool"] and plain.info["ulimits"] == {}
        assert _open_files(plain) == ["1024", str(default_nofile()[1])]
    agent.kill9()
    agent.start()
    with agent.client() as c:
        assert sorted(c.health()["adopted_on_start"]) == sorted([limited.id, cold.id, plain.id])
        assert _open_files(c.sandbox(limited.id)) == ["4096", "8192"]
        assert _open_files(c.sandbox(cold.id)) == ["2048", "2048"]
        for box in (limited, cold, plain):
            c.sandbox(box.id).delete()


def test_a_paused_sandbox_stays_paused_across_a_restart(agent: AgentProcess) -> None:
    """kill -9 of the agent while a sandbox is paused: the restarted agent adopts it as
    paused (execs refused), unpauses it, and deletes one still paused."""
    agent.start()
    with agent.client() as c:
        kept, gone = c.create("py"), c.create("py")
        kept.pause()
        gone.pause()
    agent.kill9()
    agent.start()
    with agent.client() as c:
        assert sorted(c.health()["adopted_on_start"]) == sorted([kept.id, gone.id])
        again = c.sandbox(kept.id)
        assert again.info["paused"] is True
        with pytest.raises(AgentError) as err:
            again.exec(["true"])
        assert err.value.status == 409
        again.unpause()
        assert again.exec(["echo", "on"]).stdout == b"on\n"
        c.sandbox(gone.id).delete()
        again.delete()
    assert agent.stop() == 0
    assert agent.node.wait_clean(timeout=10) == {}


def test_max_sandboxes_refuses_with_429_and_stays_up(agent: AgentProcess) -> None:
    agent.start("--max-sandboxes", "2", "--pool", "base=1")
    with agent.client() as c:
        wait_for(lambda: ready(c, "base") == 1, what="the pool to fill")
        first = c.create("py")
        second = c.create("py")  # the ready pooled sandbox gives way for it
        with pytest.raises(AgentError) as err:
            c.create("py")
        assert err.value.status == 429 and "--max-sandboxes 2" in str(err.value)
        first.delete()
        third = c.create("py")
        assert third.exec(["true"]).exit_code == 0
        for box in (second, third):
            box.delete()
        assert c.health()["status"] == "ok"


def test_kill_9_then_restart_adopts_running_and_cleans_the_rest(agent: AgentProcess) -> None:
    agent.start("--pool", "py=1")
    with agent.client() as c:
        wait_for(lambda: ready(c) == 1, what="the pool to fill")
        pooled = next(b["id"] for b in c.list() if b["state"] == "ready")
        kept = c.create("base")
        kept.exec(["sh", "-c", "echo before > /tmp/mark"])
    agent.kill9()
    agent.start()
    with agent.client() as c:
        health = c.health()
        assert health["adopted_on_start"] == [kept.id]
        assert pooled in health["cleaned_on_start"]
        again = c.sandbox(kept.id)
        # Still through its exec server: the socket is on the host, and the server
        # (PID 1, holding it) outlived the agent.
        r = again.exec(["cat", "/tmp/mark"])
        assert (r.stdout, r.channel) == (b"before\n", "server")
        assert [b["id"] for b in c.list()] == [kept.id]
        with pytest.raises(AgentError) as err:
            c.sandbox(pooled)
        assert err.value.status == 410
        # The pooled sandbox's directory, container and cgroup are gone.
        assert not (agent.node.sandboxes / pooled).exists()
    agent.kill9()  # and once more: the fixture's restart-free stop must clean it too
    agent.start()
    agent.stop()


def test_kill_9_of_the_agent_and_its_data_daemon_loses_what_sat_on_dead_trees(
    agent: AgentProcess,
) -> None:
    """With the data daemon dead, a running sandbox's tree answers EIO for every read not
    cached: the restarted agent cleans it up (410) rather than keep it half-working, and
    unmounts a lingering tree that no daemon serves (found by the gateway's fleet)."""
    agent.start()
    run_dir = Path(agent.node.env["LAZYFS_RUN_DIR"])
    with agent.client() as c:
        running = c.create("py")
        c.create("base").delete()  # its tree lingers (LAZYFS_AGENT_LINGER)
        trees = tree_mounts(run_dir)
        assert len(trees) == 2
    daemon = supervisors(run_dir) + workers(run_dir)
    assert daemon
    agent.kill9()
    for pid in daemon:
        os.kill(pid, 9)
    agent.start()
    with agent.client() as c:
        assert_lost_with_its_data_daemon(c, running.id)
        assert tree_mounts(run_dir) == []  # neither dead tree is left mounted
        fresh = c.create("py")
        assert fresh.exec(["python3", "-c", "print(6 * 7)"]).stdout == b"42\n"
        fresh.delete()


def tree_mounts(run_dir: Path) -> list[str]:
    """Image trees mounted under the node's run dir (any state)."""
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    return [p for p in points if p.startswith(f"{run_dir}/images/")]


def test_cli(agent: AgentProcess, tmp_path: Path) -> None:
    agent.start()
    made = agent.cli(
        "create", "py", "--env", "GREETING=hi", "--memory", "512M", "--ttl", "600",
        "--ulimit", "nofile=2048:4096",
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    box_id = made.stdout.decode().strip()
    assert box_id.startswith("lazyfs-")
    done = agent.cli("exec", box_id, "--", "grep", "open files", "/proc/self/limits")
    assert done.stdout.split()[3:5] == [b"2048", b"4096"], done
    assert agent.cli("exec", box_id, "--", "touch", "/x").returncode == 0
    assert agent.cli("diff", box_id).stdout == b"A /x\n"
    assert agent.cli("pause", box_id).returncode == 0
    assert b" paused " in agent.cli("ls").stdout
    assert b"is paused" in agent.cli("exec", box_id, "--", "true").stderr
    assert agent.cli("unpause", box_id).returncode == 0
    assert json.loads(agent.cli("diff", box_id, "--json").stdout) == [
        {"path": "/x", "kind": "added"}
    ]
    done = agent.cli("exec", box_id, "--", "sh", "-c", 'echo "$GREETING"; echo e >&2; exit 5')
    assert (done.returncode, done.stdout, done.stderr) == (5, b"hi\n", b"e\n")
    done = agent.cli("exec", box_id, "--cwd", "/tmp", "--", "pwd")
    assert done.stdout == b"/tmp\n"
    done = agent.cli("exec", box_id, "--", "cat", stdin=b"from stdin")
    assert done.stdout == b"from stdin"
    # An inherited pipe nobody writes to is not waited for (without -i).
    read_end, write_end = os.pipe()
    try:
        quiet = subprocess.run(
            [LAZYFS, "sandbox", "exec", box_id, "--socket", str(agent.socket), "--", "cat"],
            stdin=read_end,
            capture_output=True,
            env=agent.node.env,
            timeout=30,
        )
    finally:
        os.close(read_end)
        os.close(write_end)
    assert (quiet.returncode, quiet.stdout) == (0, b"")
    done = agent.cli("exec", box_id, "--timeout", "0.5", "--", "sleep", "20")
    assert done.returncode == 137 and b"timed out" in done.stderr
    local = tmp_path / "local.txt"
    local.write_bytes(b"copied in")
    assert agent.cli("cp", str(local), f"{box_id}:/work/in.txt").returncode == 0
    back = tmp_path / "back.txt"
    assert agent.cli("cp", f"{box_id}:/work/in.txt", str(back)).returncode == 0
    assert back.read_bytes() == b"copied in"
    listed = json.loads(agent.cli("ls", "--json").stdout)
    assert [(b["id"], b["image"], b["state"]) for b in listed] == [(box_id, "py", "running")]
    changed = agent.cli("update", box_id, "--memory", "256M", "--pids", "50")
    assert json.loads(changed.stdout)["memory"] == 256 * 2**20, changed.stderr
    used = json.loads(agent.cli("stats", box_id, "--json").stdout)
    assert (used["memory_limit"], used["pids_limit"]) == (256 * 2**20, 50) and used["pids"] >= 1
    line = agent.cli("stats", box_id).stdout.decode()
    assert line.startswith("cpu ") and "of 256.0 MiB" in line and "of 50" in line, line
    assert box_id.encode() in agent.cli("ls").stdout
    assert agent.cli("rm", box_id).returncode == 0
    assert json.loads(agent.cli("ls", "--json").stdout) == []
    for args, needle in [
        (("rm", box_id), b"no sandbox"),
        (("create", "no-such-image"), b"no image"),
        (("create", "py", "--memory", "lots"), b"--memory"),
        (("create", "py", "--ulimit", "fly=1"), b"--ulimit"),
        (("exec", box_id, "--", "true"), b"no sandbox"),
        (("exec", box_id), b"needs a command"),
        (("cp", "a", "b"), b"one side in a sandbox"),
        (("update", box_id, "--memory", "lots"), b"--memory"),
        (("stats", box_id), b"no sandbox"),
        (("diff", box_id), b"no sandbox"),
    ]:
        bad = agent.cli(*args)
        assert bad.returncode != 0 and needle in bad.stderr, (args, bad.stderr)
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    for args, needle in [
        (("--socket", str(agent.socket)), b"another agent answers"),
        (("--socket", str(tmp_path / "2.sock")), b"another agent already serves"),
        (("--socket", str(tmp_path / "3.sock"), "--runtime", "nosuch"), b"--runtime"),
        (("--socket", str(tmp_path / "4.sock"), "--pool", "py=x"), b"IMAGE=N"),
        (("--socket", str(tmp_path / "5.sock"), "--pool", "py=1:sh -c 'x"), b"warm-up"),
    ]:
        bad = subprocess.run(
            [LAZYFS, "serve", *args], capture_output=True, env=agent.node.env, timeout=60
        )
        assert bad.returncode != 0 and needle in bad.stderr, (args, bad.stderr)
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert agent.cli("ls").returncode == 0  # the running agent did not notice
    agent.stop()
    bad = subprocess.run(
        [LAZYFS, "serve", "--socket", str(agent.socket), "--pool", "no-such-image=1"],
        capture_output=True,
        env=agent.node.env,
        timeout=60,
    )
    assert bad.returncode == 3 and b"no image" in bad.stderr, bad.stderr
    assert not agent.socket.exists()
    gone = agent.cli("ls")
    assert gone.returncode != 0 and b"is `lazyfs serve` running?" in gone.stderr


def test_tcp_needs_the_bearer_token(agent: AgentProcess, tmp_path: Path) -> None:
    with socket.socket() as probe:  # a free port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    agent.start("--listen", f"127.0.0.1:{port}", "--token-file", str(token))
    url = f"http://127.0.0.1:{port}"
    assert httpx.get(f"{url}/health").status_code == 401
    assert httpx.get(f"{url}/health", headers={"Authorization": "Bearer nope"}).status_code == 401
    with Client(url=url, token="s3cret") as c, c.create("py") as sb:
        assert sb.exec(["echo", "over tcp"]).stdout == b"over tcp\n"
    bad = subprocess.run(
        [LAZYFS, "serve", "--socket", str(tmp_path / "x.sock"), "--listen", "127.0.0.1:1"],
        capture_output=True,
        env=agent.node.env,
        timeout=60,
    )
    assert bad.returncode == 2 and b"--token-file" in bad.stderr


def _nice(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


def _server_socket(agent: AgentProcess, box_id: str) -> Path:
    return agent.node.sandboxes / box_id / "exec.sock"


def test_a_pooled_sandbox_is_started_and_its_claim_runs_with_the_claims_env_and_limits(
    agent: AgentProcess,
) -> None:
    agent.start("--pool", "py=1")
    with agent.client() as c:
        wait_for(lambda: ready(c) == 1, what="the pool to fill")
        pooled = next(b["id"] for b in c.list() if b["state"] == "ready")
        # Prepared up to its first command: the exec server's socket (made by the agent,
        # handed to it as fd 3) listens before any claim.
        # Made in the background at a low priority, and back at the normal one once
        # ready, so that the claimant's commands run at it with no work at the claim.
        assert _server_socket(agent, pooled).is_socket()
        init = int((agent.node.sandboxes / pooled / "init.pid").read_text())
        assert _nice(init) == 0
        sb = c.create("py", env={"GREETING": "claimed"}, cpus=0.5, memory="300M", pids=40)
        assert sb.id == pooled and sb.info["from_pool"] and sb.info["state"] == "running"
        # The very first command: the claim's env, and run by the exec server (its
        # parent), not by `runc exec` (whose commands' parent is outside the sandbox).
        r = sb.exec(
            ["sh", "-c", 'echo "$GREETING"; tr "\\0" " " < /proc/$PPID/cmdline; echo; nice']
        )
        assert (r.exit_code, r.channel) == (0, "server"), r.stderr
        assert r.stdout.decode().splitlines() == ["claimed", "/dev/lazyfs-exec ", "0"]
        cgroups, parent = Path("/sys/fs/cgroup"), agent.node.cgroup_parent
        cpu = cgroups / "cpu" / parent / pooled / "cpu.cfs_quota_us"
        assert int(cpu.read_text()) == 50_000
        memory = cgroups / "memory" / parent / pooled
        assert int((memory / "memory.limit_in_bytes").read_text()) == 300 * 2**20
        assert int((memory / "memory.memsw.limit_in_bytes").read_text()) == 300 * 2**20
        assert int((cgroups / "pids" / parent / pooled / "pids.max").read_text()) == 40
        hog = sb.exec(["python3", "-c", "b = bytearray(400 * 2**20); print('survived')"])
        assert hog.exit_code != 0 and b"survived" not in hog.stdout  # the limit holds
        # A later command sees the same env; the pool has refilled meanwhile.
        assert sb.exec(["sh", "-c", 'echo "$GREETING"']).stdout == b"claimed\n"
        wait_for(lambda: ready(c) == 1, what="the pool to refill")
        sb.delete()


def _exec_in_background(agent: AgentProcess, box_id: str, argv: list[str]) -> threading.Thread:
    """Run argv in the sandbox from another thread (its own client), as a claimant would."""

    def run() -> None:
        with agent.client() as c, contextlib.suppress(AgentError, httpx.HTTPError):
            c.sandbox(box_id).exec(argv)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_refill_waits_for_the_claimed_sandboxs_first_command_but_not_for_long(
    agent: AgentProcess,
) -> None:
    """A refill's `runc create` beside a just-claimed sandbox's first command slows that
    command (niceness does not prevent it), so the refill waits for it to end, for at
    most LAZYFS_REFILL_DEFER after the claim."""
    agent.node.env["LAZYFS_REFILL_DEFER"] = "4"
    agent.start("--pool", "py=1")
    with agent.client() as c:
        wait_for(lambda: ready(c) == 1, what="the pool to fill")
        (pool,) = c.pools()
        assert pool["creating"] == 0
        # A first command of 2 s: no refill while it runs, one as soon as it ended.
        claimed = time.monotonic()
        sb = c.create("py")
        assert sb.info["from_pool"]
        first = _exec_in_background(agent, sb.id, ["sleep", "2"])
        sent = time.monotonic()
        while time.monotonic() - sent < 1.5:  # it runs at least until sent + 2
            (pool,) = c.pools()
            assert (pool["creating"], pool["ready"]) == (0, 0), "a refill ran beside it"
            time.sleep(0.05)
        first.join(20)
        wait_for(lambda: c.pools()[0]["creating"] or ready(c) == 1, what="the refill to start")
        assert time.monotonic() - claimed < 4, "the refill waited for the bound, not the end"
        wait_for(lambda: ready(c) == 1, what="the pool to refill")
        sb.delete()
        # A first command that outlasts the bound does not hold the refill back.
        sb = c.create("py")
        assert sb.info["from_pool"]
        long = _exec_in_background(agent, sb.id, ["sleep", "30"])
        wait_for(lambda: ready(c) == 1, what="the pool to refill during a long command")
        assert long.is_alive()
        sb.delete()  # ends the command
        long.join(10)
        assert not long.is_alive()


def test_a_pooled_sandbox_whose_exec_server_died_is_not_handed_out(agent: AgentProcess) -> None:
    agent.start("--pool", "py=1")
    with agent.client() as c:
        wait_for(lambda: ready(c) == 1, what="the pool to fill")
        dead = next(b["id"] for b in c.list() if b["state"] == "ready")
        # PID 1 is the exec server: only the host can kill it (an operator, the OOM killer).
        init = int((agent.node.sandboxes / dead / "init.pid").read_text())
        os.kill(init, 9)

        def init_ended() -> bool:
            try:
                return Path(f"/proc/{init}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
            except OSError:
                return True

        wait_for(init_ended, what="the sandbox's init to exit")
        sb = c.create("py")
        assert sb.id != dead
        assert sb.exec(["echo", "alive"]).stdout == b"alive\n"
        wait_for(lambda: ready(c) == 1, what="the pool to refill")
        (pool,) = c.pools()
        assert pool["failures"] >= 1 and dead in pool["last_error"], pool
        assert dead not in [b["id"] for b in c.list()]
        assert not (agent.node.sandboxes / dead).exists()
        sb.delete()


def _fetched(c: Client) -> int:
    """The node cache's bytes fetched, once the data daemon's stats (published about
    once a second) have stopped moving."""
    last = None
    while True:
        lines = [x for x in c.metrics().splitlines() if x.startswith("lazyfs_node_cache_bytes_f")]
        now = int(float(lines[0].split()[1]))
        if now == last:
            return now
        last = now
        time.sleep(1.3)


WARMED = "/usr/lib/x86_64-linux-gnu/libdb-5.3.so"  # read by neither sh nor python3
NOT_WARMED = "/usr/bin/perl"


def test_pool_warm_up_fills_the_node_cache_before_the_first_claim(agent: AgentProcess) -> None:
    agent.node.env["LAZYFS_PREFETCH"] = "0"  # only the warm-up may fetch ahead of the claim
    agent.start("--pool", f"py=1:sh -c 'cat {WARMED} > /dev/null'")
    with agent.client() as c:
        wait_for(lambda: ready(c) == 1, timeout=60, what="the pool to warm up and fill")
        (pool,) = c.pools()
        assert pool["warmup"] == ["sh", "-c", f"cat {WARMED} > /dev/null"]
        assert pool["warmed"]["exit_code"] == 0, pool
        assert [b["state"] for b in c.list()] == ["ready"]  # the warm-up's sandbox is gone
        before = _fetched(c)
        assert before > 0
        with c.create("py") as sb:
            assert sb.info["from_pool"]
            assert sb.exec(["sh", "-c", f"cat {WARMED} > /dev/null"]).exit_code == 0
            assert _fetched(c) == before  # all of it was in the node cache already
            assert sb.exec(["sh", "-c", f"cat {NOT_WARMED} > /dev/null"]).exit_code == 0
            assert _fetched(c) > before  # what the warm-up did not read is fetched
        # Through the API: a new warm-up runs again; a malformed one is a 400.
        view = c.set_pool("py", 1, warmup=["sh", "-c", "exit 3"])
        assert view["warmup"] == ["sh", "-c", "exit 3"]
        wait_for(lambda: (c.pools()[0]["warmed"] or {}).get("exit_code") == 3, timeout=60)
        assert "exited 3" in c.pools()[0]["last_error"]
        for bad in ("true", [1], [""]):
            with pytest.raises(AgentError) as err:
                c.set_pool("py", 1, warmup=bad)  # type: ignore[arg-type]
            assert err.value.status == 400 and "warmup" in str(err.value)


def test_a_stop_while_the_pool_fills_leaves_nothing(agent: AgentProcess) -> None:
    """SIGTERM lands while the refill is making or starting a sandbox (where in that,
    the timing decides): that one is deleted too, nothing is left."""
    for _ in range(3):
        agent.start("--pool", "py=4")
        with agent.client() as c:
            wait_for(lambda: ready(c) >= 1, what="the pool to start filling")  # noqa: B023
        assert agent.stop() == 0
        left = agent.node.wait_clean(timeout=10)
        assert left == {}, left


def _open_files_limit(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/limits") as f:
        line = next(line for line in f if line.startswith("Max open files"))
    soft, hard = line.split()[3:5]
    return int(soft), int(hard)


def test_the_agent_and_its_data_daemon_lift_the_soft_limit_on_descriptors(
    agent: AgentProcess,
) -> None:
    """The agent holds a descriptor per sandbox and one per image held, the data daemon
    three per image in use: under the usual soft limit of 1,024 a node ran out before
    1,000 sandboxes. Started under a soft limit of 256, both run at the hard limit."""
    agent.wrap = ("prlimit", "--nofile=256:", "--")
    agent.start("--warm", "1")
    assert agent.proc is not None
    soft, hard = _open_files_limit(agent.proc.pid)
    assert hard > 256 and soft == hard
    with agent.client() as c:
        c.create("py").exec(["true"])
    (worker,) = workers(Path(agent.node.env["LAZYFS_RUN_DIR"]))
    assert _open_files_limit(worker) == (hard, hard)
