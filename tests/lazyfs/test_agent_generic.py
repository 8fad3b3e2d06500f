"""Warm sandboxes that no image is bound to yet (issue 23): `lazyfs serve --warm N`.

A create of any image whose user is root takes a ready generic sandbox when the image's
own pool has none: the agent mounts the image's tree (if it is not mounted), makes the
private overlay and gives it to the sandbox as the root of all its processes
(lazyfs/sandbox/attach_root.c). Each test has its own agent; the node is checked clean
after it stops (running_agent)."""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
from pathlib import Path

import pytest

from lazyfs.client import AgentError, Client
from lazyfs.mount_table import mounts
from testbed.agent import AgentProcess, generic_ready
from testbed.waiting import wait_for

PROBE = """
import os
print(os.getcwd(), os.environ.get("PATH"), os.environ.get("HOME"), os.getuid())
print(sorted(os.listdir("/"))[:40])
print(os.path.exists("/newroot"), os.path.exists("/usr/bin/python3"))
print(sorted(os.listdir("/proc/self/root")) == sorted(os.listdir("/")))
try:
    os.listdir("/proc/1/root")
    print("PID 1's root is open to the sandbox")
except PermissionError:
    print("PID 1's root: denied")
"""


def claims(c: Client, source: str) -> float:
    found = re.search(rf'lazyfs_claims_total{{source="{source}"}} (\S+)', c.metrics())
    assert found, c.metrics()
    return float(found.group(1))


def test_any_image_takes_a_generic_sandbox_and_runs_on_its_root(agent: AgentProcess) -> None:
    agent.start("--warm", "2")
    with agent.client() as c:
        wait_for(lambda: generic_ready(c) == 2, what="the generic pool to fill")
        ready_ids = {b["id"] for b in c.list() if b["state"] == "ready"}
        pools = [p for p in c.pools() if p["generic"]]
        assert pools[0]["image"] is None and pools[0]["target"] == 2
        with c.create("py", env=["GREETING=hi"]) as py, c.create("base") as base:
            assert {py.id, base.id} == ready_ids, "both claims took a generic sandbox"
            assert py.info["from_pool"] and py.info["image"] == "py"
            out = py.exec(["python3", "-c", PROBE]).stdout.decode().splitlines()
            # the image's WorkingDir, Env and user, as for a sandbox made for the image
            cold = c.create("py", network=True)
            try:
                assert cold.exec(["python3", "-c", PROBE]).stdout.decode().splitlines() == out
            finally:
                cold.delete()
            assert out[2] == "False True", out  # the image's root; no start-up root
            assert out[3:] == ["True", "PID 1's root: denied"], out
            assert py.exec(["sh", "-c", "echo $GREETING"]).stdout == b"hi\n"
            r = base.exec(["sh", "-c", "ls /usr/bin/python3 2>&1; echo $?"])
            assert r.stdout.endswith(b"\n2\n") or b"No such file" in r.stdout, r
            # writes stay in the sandbox's own layer, readable through the file API
            assert py.changes() == []  # the claim itself changed nothing of the image
            py.exec(["sh", "-c", "echo mine > /root/note"])
            assert py.read_file("/root/note") == b"mine\n"
            assert base.exec(["cat", "/root/note"]).exit_code != 0
            assert py.changes() == [
                {"path": "/root", "kind": "changed"},
                {"path": "/root/note", "kind": "added"},
            ]
            assert claims(c, "generic") == 2
            wait_for(lambda: generic_ready(c) == 2, what="the generic pool to refill")
        c.set_warm(0)
        wait_for(lambda: generic_ready(c) == 0, what="the generic pool to shrink")
        with c.create("py") as late:  # none ready: a cold create, as before
            assert not late.info["from_pool"]
        assert claims(c, "cold") == 2  # the --network one and this one


def test_an_image_whose_user_is_not_root_is_made_cold(
    agent: AgentProcess, user_store: Path
) -> None:
    """The generic sandbox's exec server runs as root, and every command inherits its
    user: an image with another User (nobody-py: nobody:tty) must not get one."""
    agent.start("--warm", "1")
    with agent.client() as c:
        wait_for(lambda: generic_ready(c) == 1, what="the generic pool to fill")
        with c.create("nobody-py") as sb:
            assert not sb.info["from_pool"]
            assert sb.exec(["id", "-u"]).stdout == b"65534\n"
        assert generic_ready(c) == 1 and claims(c, "generic") == 0
        with c.create("py", pids=64, memory="512M", disk="64M") as sb:
            assert sb.info["from_pool"] and claims(c, "generic") == 1
            assert sb.info["limits"]["memory"] == 512 * 2**20
            parent = agent.node.cgroup_parent
            cgroups = Path("/sys/fs/cgroup")
            limit = cgroups / "memory" / parent / sb.id / "memory.limit_in_bytes"
            assert int(limit.read_text()) == 512 * 2**20
            assert int((cgroups / "pids" / parent / sb.id / "pids.max").read_text()) == 64
            assert sb.exec(["id", "-u"]).stdout == b"0\n"
            # the claim's disk: the layer was resized, and its writes stop there
            r = sb.exec(["dd", "if=/dev/zero", "of=/tmp/fill", "bs=1M", "count=80"])
            assert r.exit_code != 0 and b"No space left" in r.stderr, r


def test_a_generic_sandbox_rejects_what_a_normal_one_does(agent: AgentProcess) -> None:
    agent.start("--warm", "1")
    with agent.client() as c:
        wait_for(lambda: generic_ready(c) == 1, what="the generic pool to fill")
        with pytest.raises(AgentError) as err:
            c.create("no-such-image")
        assert err.value.status == 404
        assert generic_ready(c) == 1  # nothing was taken


STARTUP_PROBE = """
import os
mounts = [line.split() for line in open("/proc/self/mountinfo")]
print([m[4] for m in mounts if m[4] == "/newroot" or "startup" in m[3]])
root = next(m for m in mounts if m[4] == "/")
print(root[4])
fds = []
for n in os.listdir("/proc/self/fd"):
    try:
        fds.append(os.readlink(f"/proc/self/fd/{n}"))
    except FileNotFoundError:  # the descriptor listdir had open
        pass
print(sorted(t for t in fds if not t.startswith(("pipe:", "socket:"))))
try:
    os.listdir("/proc/1/fd")
    print([os.readlink(f"/proc/1/fd/{n}") for n in os.listdir("/proc/1/fd")])
except PermissionError:
    print("PID 1's descriptors: denied")
os.chdir("/")
for _ in range(64):
    os.chdir("..")
print(os.getcwd(), sorted(os.listdir(".")) == sorted(os.listdir("/")))
seen = set()
for pid in (p for p in os.listdir("/proc") if p.isdigit()):
    try:
        seen.add(tuple(sorted(os.listdir(f"/proc/{pid}/root"))))
    except OSError:
        pass
print(seen == {tuple(sorted(os.listdir("/")))})
"""


def _generic_box(c: Client) -> str:
    return next(b["id"] for b in c.list() if b["state"] == "ready" and not b["image"])


def test_the_start_up_root_is_read_only_and_unreachable_after_the_claim(
    agent: AgentProcess,
) -> None:
    """Before the claim the sandbox stands on the start-up root: read-only, holding only
    mount points. After it, nothing in the sandbox leads back there: no mount of it, no
    descriptor (the command's are pipes and /dev/null; PID 1's are closed to it), no
    `..` walk past /, and every /proc/*/root is the image's root."""
    agent.start("--warm", "1")
    with agent.client() as c:
        wait_for(lambda: generic_ready(c) == 1, what="the generic pool to fill")
        box_id = _generic_box(c)
        init = int((agent.node.sandboxes / box_id / "init.pid").read_text())
        root = next(
            line.split()
            for line in Path(f"/proc/{init}/mountinfo").read_text().splitlines()
            if line.split()[4] == "/"
        )
        assert "ro" in root[5].split(","), root  # the start-up root, read-only
        startup = sorted(os.listdir(f"/proc/{init}/root"))
        assert startup == ["dev", "newroot", "proc", "run", "sys"], startup
        with c.create("py") as sb:
            assert sb.id == box_id
            r = sb.exec(["python3", "-c", STARTUP_PROBE])
            out = r.stdout.decode().splitlines()
            assert r.exit_code == 0, r
            assert out[0] == "[]", out  # no mount of the start-up root, nothing at /newroot
            assert out[1] == "/", out
            assert out[2] in ("[]", "['/dev/null']"), out
            assert out[3] == "PID 1's descriptors: denied", out
            assert out[4:] == ["/ True", "True"], out
            assert "lazyfs-exec" in os.listdir(f"/proc/{init}/root/dev")
            assert "usr" in os.listdir(f"/proc/{init}/root"), "PID 1 is on the image's root"


def test_another_generic_sandboxs_files_and_processes_are_invisible(agent: AgentProcess) -> None:
    agent.start("--warm", "2")
    secret = secrets.token_hex(8)
    digits = secrets.randbelow(10**8)
    with agent.client() as c:
        wait_for(lambda: generic_ready(c) == 2, what="the generic pool to fill")
        with c.create("py") as a, c.create("base") as b:
            a.exec(["sh", "-c", f"echo {secret} > /tmp/a-{secret}; sleep 60.{digits} &"])
            assert a.read_file(f"/tmp/a-{secret}") == f"{secret}\n".encode()
            script = (
                f"test -e /tmp/a-{secret} && echo A-file;"
                f"ls /proc/*/root/tmp/a-{secret} /proc/*/cwd/tmp/a-{secret} 2>/dev/null;"
                f"cat /proc/[0-9]*/cmdline | tr '\\0' ' ' | grep -c 60[.]{digits}; echo done"
            )
            assert b.exec(["sh", "-c", script]).stdout == b"0\ndone\n"
            seen = a.exec(["sh", "-c", f"cat /proc/[0-9]*/cmdline | grep -c 60[.]{digits}"])
            assert seen.stdout == b"1\n"  # the probe can tell: A sees its own


def test_kill_9_of_the_agent_adopts_claimed_generic_sandboxes_and_cleans_the_rest(
    agent: AgentProcess,
) -> None:
    agent.start("--warm", "2")
    with agent.client() as c:
        wait_for(lambda: generic_ready(c) == 2, what="the generic pool to fill")
        kept = c.create("py")
        kept.exec(["sh", "-c", "echo before > /tmp/mark"])
        wait_for(lambda: generic_ready(c) == 2, what="the generic pool to refill")
        ready = {b["id"] for b in c.list() if b["state"] == "ready"}
    agent.kill9()
    # One ready sandbox as a claim cut off by the kill leaves it: its overlay mounted on
    # the host (over the image's trees, as the kept one's), the root not yet given, its
    # record still `ready`.
    lower = _lowerdir(agent.node.sandboxes / kept.id / "rootfs")
    half = agent.node.sandboxes / sorted(ready)[0]
    for sub in ("upper", "work", "rootfs"):
        (half / sub).mkdir()
    options = f"lowerdir={lower},upperdir={half / 'upper'},workdir={half / 'work'}"
    subprocess.run(
        ["mount", "-t", "overlay", "overlay", "-o", options, str(half / "rootfs")], check=True
    )
    agent.start("--warm", "1")
    with agent.client() as c:
        health = c.health()
        assert health["adopted_on_start"] == [kept.id]
        assert ready <= set(health["cleaned_on_start"]), health
        r = c.sandbox(kept.id).exec(["cat", "/tmp/mark"])
        assert (r.stdout, r.channel) == (b"before\n", "server")
        assert c.sandbox(kept.id).exec(["test", "-e", "/usr/bin/python3"]).exit_code == 0
        for box_id in ready:  # the half-claimed one too: its overlay unmounted
            assert not (agent.node.sandboxes / box_id).exists()
        assert str(half / "rootfs") not in mounts()
        wait_for(lambda: generic_ready(c) == 1, what="the new agent's generic pool")
        with c.create("base") as sb:
            assert sb.info["from_pool"] and claims(c, "generic") == 1
        c.sandbox(kept.id).delete()


def _lowerdir(overlay: Path) -> str:
    """The lowerdir option of the overlay mounted at `overlay` (/proc/self/mountinfo)."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == str(overlay):
                options = fields[fields.index("-") + 3].split(",")
                return next(o for o in options if o.startswith("lowerdir=")).split("=", 1)[1]
    raise AssertionError(f"no overlay at {overlay}")


def test_a_claim_that_fails_half_way_deletes_that_sandbox_and_the_next_works(
    agent: AgentProcess,
) -> None:
    """The fault: the start-up root lost /newroot (removed from the host), so the helper
    fails after the overlay is mounted. The claim answers one clear error, the sandbox
    and its overlay are gone, and the next claim gets a new generic sandbox."""
    agent.start("--warm", "1")
    with agent.client() as c:
        wait_for(lambda: generic_ready(c) == 1, what="the generic pool to fill")
        box_id = _generic_box(c)
        (agent.node.sandboxes / box_id / "startup" / "newroot").rmdir()
        with pytest.raises(AgentError) as err:
            c.create("py")
        assert (err.value.status, err.value.code) == (500, "runtime_failed"), err.value
        assert "taking the image's root" in str(err.value) and "\n" not in str(err.value)
        assert box_id not in {b["id"] for b in c.list()}
        assert not (agent.node.sandboxes / box_id).exists()
        wait_for(lambda: generic_ready(c) == 1, what="the generic pool to refill")
        with c.create("py") as sb:
            assert sb.info["from_pool"]
            assert sb.exec(["python3", "-c", "print(6 * 7)"]).stdout == b"42\n"
        assert c.health()["status"] == "ok"


def test_generic_sandboxes_ending_every_way_leave_the_node_clean(agent: AgentProcess) -> None:
    """Deleted, deleted in the middle of a command, their TTL passed, their PID 1 killed
    from the host, still claimed when the agent stops, and never claimed: the fixture
    then checks that no mount, cgroup, runtime state, process or directory is left."""
    agent.start("--warm", "3", "--max-sandboxes", "40")
    with agent.client() as c:
        for _ in range(3):
            wait_for(lambda: generic_ready(c) == 3, what="the generic pool to fill")
            plain = c.create("py")
            plain.exec(["sh", "-c", "echo x > /tmp/x"])
            plain.delete()
            busy = c.create("base")
            busy.exec(["sh", "-c", "sleep 30 > /dev/null 2>&1 &"])
            busy.delete()
            c.create("py", ttl=0.5)
            wait_for(lambda: generic_ready(c) >= 1, what="a generic sandbox")
            killed = c.create("base")
            init = int((agent.node.sandboxes / killed.id / "init.pid").read_text())
            os.kill(init, signal.SIGKILL)
            wait_for(lambda i=killed.id: {b["id"]: b["state"] for b in c.list()}[i] == "exited")
            killed.delete()
        wait_for(lambda: len(c.list()) == 3, timeout=10, what="the TTLs to pass")
        c.create("py").exec(["true"])  # still claimed at the stop
    assert agent.stop() == 0
