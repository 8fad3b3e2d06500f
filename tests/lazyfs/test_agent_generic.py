"""Warm sandboxes that no image is bound to yet (issue 23): `lazyfs serve --warm N`.

A create of any image whose user is root takes a ready generic sandbox when the image's
own pool has none: the agent mounts the image's tree (if it is not mounted), makes the
private overlay and gives it to the sandbox as the root of all its processes
(lazyfs/sandbox/attach_root.c). Each test has its own agent; the node is checked clean
after it stops (running_agent)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from lazyfs.client import AgentError, Client
from testbed.agent import AgentProcess

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


def wait_for(cond, timeout: float = 20, what: str = "") -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def generic_ready(c: Client) -> int:
    return sum(p["ready"] for p in c.pools() if p["generic"])


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
            py.exec(["sh", "-c", "echo mine > /root/note"])
            assert py.read_file("/root/note") == b"mine\n"
            assert base.exec(["cat", "/root/note"]).exit_code != 0
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
