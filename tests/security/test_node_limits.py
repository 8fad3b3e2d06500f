"""A few sandboxes exhaust the node (issue 20, finding 5), and `cpus: 1e9` was a 500
(finding 8).

Attacks: fork bombs in several sandboxes at once; writing past the writable layer, in
bytes and in inodes, in /tmp and in the control directory; a sandbox created without
limits; a CPU count past the node's. Each asserts what holds now: the sandboxes' parent
cgroup is capped below pid_max and the node's RAM (so the host still forks), the
kernel stops writes at --disk (ENOSPC) without the host's disk growing, serve's defaults
apply, the OOM killer's bias puts sandboxes first, and a bad cpus is a 400.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from lazyfs.client import AgentError
from lazyfs.mount_table import entries
from testbed.agent import AgentProcess
from testbed.node import LAZYFS, Node
from testbed.nodecheck import processes_mentioning

CGROUP = Path("/sys/fs/cgroup")
PID_MAX = int(Path("/proc/sys/kernel/pid_max").read_text())
RAM = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0]) * 1024
MiB = 2**20


def _parent_caps(parent: str) -> tuple[int, int]:
    pids = (CGROUP / "pids" / parent / "pids.max").read_text().strip()
    memory = (CGROUP / "memory" / parent / "memory.limit_in_bytes").read_text().strip()
    assert pids != "max", f"the sandboxes' parent cgroup {parent} has no pids cap"
    return int(pids), int(memory)


def _assert_node_reserve(parent: str) -> None:
    """The caps leave the node the default reserves (lazyfs/sandbox/limits.py)."""
    pids, memory = _parent_caps(parent)
    assert pids == PID_MAX - max(1024, PID_MAX // 16) < PID_MAX
    assert RAM - max(2**30, RAM // 8) - 4096 < memory <= RAM - max(2**30, RAM // 8)


def _quiet_daemon(node: Node) -> None:
    node.env["LAZYFS_DAEMON_IDLE"] = "0.2"  # the data daemon is gone before the clean check


# ------------------------------------------------------------------ pids


def test_lazyfs_run_caps_the_sandboxes_parent_cgroup(sandbox_node: Node) -> None:
    _quiet_daemon(sandbox_node)
    sandbox_node.ok("true")
    _assert_node_reserve(sandbox_node.cgroup_parent)


BOMB = """
import os, signal, sys, time
while time.time() < float(sys.argv[1]):  # every bomb's sandbox is up before any forks
    time.sleep(0.05)
children, err = 0, 0
try:
    while children < 400:
        if os.fork() == 0:
            signal.pause()
            os._exit(0)
        children += 1
except OSError as exc:
    err = exc.errno
print(children, err, flush=True)
signal.pause()
"""


def test_fork_bombs_leave_the_node_its_pids(sandbox_node: Node) -> None:
    """Three bombs at the default --pids (4096) and one at --pids 64. The node's reserve
    is set so that the sandboxes' cap is 300 PIDs (the real one, 30720 here, would take
    ~30000 processes to reach on a machine that other test runs share); on the old code
    the parent had no cap, and the bombs took 1262 PIDs."""
    _quiet_daemon(sandbox_node)
    cap = 300
    sandbox_node.env["LAZYFS_PIDS_RESERVE"] = str(PID_MAX - cap)
    go = time.time() + 10  # four `lazyfs run`s start in 2-4 s here
    bombs = [
        sandbox_node.popen("python3", "-c", BOMB, str(go), options=options)
        for options in [(), (), (), ("--pids", "64")]
    ]
    try:
        sandbox_node.wait_for_sandbox(count=4, timeout=20)
        assert time.time() < go, "the sandboxes took too long to start"
        results = [tuple(map(int, b.stdout.readline().split())) for b in bombs]
        parent = CGROUP / "pids" / sandbox_node.cgroup_parent
        in_use = int((parent / "pids.current").read_text())
        # The host forks while the bombs hold every PID the sandboxes may have.
        for _ in range(50):
            subprocess.run(["true"], check=True)
    finally:
        for b in bombs:
            b.terminate()
        for b in bombs:
            b.communicate(timeout=60)
    print(f"bombs: {results}, {in_use} pids in the sandboxes' cgroup (cap {cap})")
    assert int((parent / "pids.max").read_text()) == cap
    assert in_use <= cap
    assert all(err == 11 for _, err in results), results  # EAGAIN: the cap, not 400
    assert results[3][0] <= 62  # the small sandbox's own limit held too


# ------------------------------------------------------------------ disk

WRITE = """
import errno, json, os, sys
def fill(path, limit):
    done = 0
    try:
        with open(path, "wb") as f:
            while done < limit:
                f.write(b"x" * (1 << 20))
                f.flush()
                done += 1 << 20
            os.fsync(f.fileno())
    except OSError as exc:
        return done, errno.errorcode[exc.errno]
    return done, None
def files(directory, limit):
    os.makedirs(directory, exist_ok=True)
    for n in range(limit):
        try:
            open(f"{directory}/{n}", "w").close()
        except OSError as exc:
            return n, errno.errorcode[exc.errno]
    return limit, None
out = {"tmp": fill("/tmp/big", 64 << 20)}
os.unlink("/tmp/big")
out["inodes"] = files("/tmp/many", 5000)
st = os.statvfs("/dev/shm")
out["shm"] = st.f_blocks * st.f_frsize
print(json.dumps(out))
"""


def test_writes_stop_at_disk_through_lazyfs_run(sandbox_node: Node) -> None:
    """--disk 16M: 16 MiB of bytes and 1024 inodes; /dev/shm is a 64 MiB tmpfs."""
    _quiet_daemon(sandbox_node)
    out = json.loads(sandbox_node.ok("python3", "-c", WRITE, options=("--disk", "16M")))
    written, err = out["tmp"]
    assert err == "ENOSPC" and 12 * MiB <= written <= 16 * MiB, out
    made, err = out["inodes"]
    assert err == "ENOSPC" and 900 <= made <= 1024, out
    assert out["shm"] <= 64 * MiB


def _disk_used(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_a_full_sandbox_does_not_grow_the_hosts_disk(sandbox_node: Node) -> None:
    """300 MiB written in /tmp (the old code put them in the upper dir on the host's
    disk: 1 GiB in /tmp grew it by 1 GiB) leave the host's disk as it was (other test
    runs on the machine may write meanwhile: 64 MiB of slack)."""
    _quiet_daemon(sandbox_node)
    # Once first, so that the node cache (on the host's disk) holds what it reads.
    script = "dd if=/dev/urandom of=/tmp/big bs=1M count={} 2>/dev/null && sync && echo done"
    sandbox_node.ok("sh", "-c", script.format(1))
    before = _disk_used(sandbox_node.sandboxes)
    script = script.format(300)
    proc = sandbox_node.popen("sh", "-c", f"{script} && sleep 60", options=("--disk", "1G"))
    try:
        assert proc.stdout.readline() == "done\n"
        grown = _disk_used(sandbox_node.sandboxes) - before
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
    print(f"the host's disk grew by {grown / MiB:.1f} MiB while the sandbox held 300 MiB")
    assert grown < 64 * MiB


# ------------------------------------------------------------------ the agent

IN_BOTH = """
import errno, os
def fill(path, size):
    try:
        with open(path, "wb") as f:
            f.write(b"x" * size)
            os.fsync(f.fileno())
        return "ok"
    except OSError as exc:
        return errno.errorcode[exc.errno]
print(fill("/tmp/a", 20 << 20), fill("/root/b", 20 << 20), os.path.exists("/dev/lazyfs"))
"""


def _oom_score_adj(pid: int) -> int:
    return int(Path(f"/proc/{pid}/oom_score_adj").read_text())


def _node_bias(pid: int) -> int:
    """-500, where the process may lower its bias (CAP_SYS_RESOURCE); this VM withholds
    that capability from everyone, root included, so the node's processes stay at 0
    there (and the agent says so in its log: lazyfs/oom.py)."""
    status = Path(f"/proc/{pid}/status").read_text()
    effective = int(status.split("CapEff:")[1].split()[0], 16)
    return -500 if effective & (1 << 24) else 0


def _cgroup_value(controller: str, parent: str, box_id: str, name: str) -> str:
    return (CGROUP / controller / parent / box_id / name).read_text().strip()


def test_serve_caps_the_node_and_applies_its_defaults(agent: AgentProcess) -> None:
    node = agent.node
    agent.start("--memory", "512M", "--pids", "77", "--disk", "32M")
    _assert_node_reserve(node.cgroup_parent)  # at start, before any sandbox
    assert _oom_score_adj(agent.proc.pid) == _node_bias(agent.proc.pid)
    daemons = [p for p in processes_mentioning(str(node.tmp)) if p != agent.proc.pid]
    daemons = [p for p in daemons if b"data_daemon" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert daemons and all(_oom_score_adj(p) == _node_bias(p) for p in daemons)
    with agent.client() as c:
        box = c.create("py")
        limits = {"cpus": None, "memory": 512 * MiB, "pids": 77, "disk": 32 * MiB}
        limits |= {"cpu_shares": None, "cpuset_cpus": None}
        assert box.info["limits"] == limits
        parent = node.cgroup_parent
        assert _cgroup_value("memory", parent, box.id, "memory.limit_in_bytes") == str(512 * MiB)
        assert _cgroup_value("pids", parent, box.id, "pids.max") == "77"
        assert box.exec(["cat", "/proc/self/oom_score_adj"]).stdout == b"500\n"
        assert _oom_score_adj(int((node.sandboxes / box.id / "init.pid").read_text())) == 500
        # /tmp and the rest of the writable layer share the 32 MiB; there is no control
        # directory on the host's disk any more (the exec socket is mounted nowhere).
        first, second, control = box.exec(["python3", "-c", IN_BOTH]).stdout.decode().split()
        assert (first, second, control) == ("ok", "ENOSPC", "False")
        # Full: the file API says so (507), and a command can still free the space.
        box.exec(["sh", "-c", "cat /dev/zero > /tmp/fill"])
        try:
            box.write_file("/tmp/more", b"x" * (8 * MiB))
            raise AssertionError("a write to a full sandbox succeeded")
        except AgentError as exc:
            assert (exc.status, exc.code) == (507, "disk_full"), exc
        assert box.exec(["rm", "/tmp/fill", "/tmp/a", "/root/b"]).exit_code == 0
        box.write_file("/tmp/more", b"x" * (8 * MiB))
        box.delete()
    made = agent.cli("create", "py", "--disk", "8M")
    assert made.returncode == 0, made.stderr
    box_id = made.stdout.decode().strip()
    assert _layer_size(node.sandboxes / box_id) == "size=8192k"
    assert agent.cli("rm", box_id).returncode == 0


def _layer_size(box_dir: Path) -> str:
    """The size= of the sandbox's writable layer, as the kernel shows it."""
    for m in entries():
        if m.point == str(box_dir):
            return next(o for o in m.super_options.split(",") if o.startswith("size="))
    raise AssertionError(f"no writable layer mounted at {box_dir}")


def test_a_pooled_sandbox_takes_the_claims_disk(agent: AgentProcess) -> None:
    agent.start("--pool", "py=1", "--disk", "32M")
    with agent.client() as c:
        for disk, size in ((None, "size=32768k"), ("8M", "size=8192k")):
            deadline = time.monotonic() + 60
            while c.pools()[0]["ready"] < 1:
                assert time.monotonic() < deadline, c.pools()
                time.sleep(0.05)
            box = c.create("py", disk=disk)
            assert box.info["from_pool"] and _layer_size(agent.node.sandboxes / box.id) == size
            out = box.exec(["sh", "-c", "head -c 16M /dev/zero > /tmp/x; echo $?"]).stdout
            assert out == (b"0\n" if disk is None else b"1\n"), (disk, out)
            box.delete()


def test_cpus_past_the_node_is_one_clear_refusal(agent: AgentProcess) -> None:
    agent.start()
    with agent.client() as c:
        try:
            c.create("py", cpus=1e9)
            raise AssertionError("cpus 1e9 made a sandbox")
        except AgentError as exc:
            assert exc.status == 400 and "range of CPUs is from 0.01" in str(exc), exc
        assert c.list() == []
    proc = agent.cli("create", "py", "--cpus", "1e9")
    lines = proc.stderr.decode().splitlines()
    assert proc.returncode != 0 and len(lines) == 1 and "range of CPUs" in lines[0], proc
    run = subprocess.run(
        [LAZYFS, "run", "--cpus", "1e9", "py", "--", "true"],
        env=agent.node.env,
        capture_output=True,
        text=True,
    )
    lines = run.stderr.splitlines()
    assert run.returncode != 0 and len(lines) == 1 and "range of CPUs" in lines[0], run
