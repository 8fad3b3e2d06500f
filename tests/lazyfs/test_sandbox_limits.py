"""cgroup limits hold (issue 11): memory (OOM kill of that sandbox alone), pids, cpu, cpu
shares and the CPUs it may use; in
`lazyfs run`'s sandboxes and in the agent's generic ones (the `boundary` fixture)."""

from __future__ import annotations

import os
import signal
import threading

from testbed.agent_boundary import Boundary


def test_memory_limit_oom_kills_only_that_sandbox(boundary: Boundary) -> None:
    neighbour: list = []

    def other() -> None:  # another sandbox (another image) running at the same time
        neighbour.append(boundary.run("sh", "-c", "sleep 3; echo alive", image="base"))

    t = threading.Thread(target=other)
    t.start()
    proc = boundary.run(
        "python3",
        "-c",
        "blocks = [bytearray(8 << 20) for _ in range(40)]; print('allocated 320 MiB')",
        options=("--memory", "64M"),
    )
    t.join()
    assert proc.returncode == 128 + signal.SIGKILL
    assert proc.stdout == ""
    if boundary.says_oom:
        lines = proc.stderr.splitlines()
        assert len(lines) == 1 and "out of memory" in lines[0] and "64 MiB" in lines[0], proc.stderr
    (other_proc,) = neighbour
    assert (other_proc.returncode, other_proc.stdout) == (0, "alive\n")
    # The same allocation fits without the limit: the limit, not the program, killed it.
    unlimited = boundary.run(
        "python3", "-c", "blocks = [bytearray(8 << 20) for _ in range(40)]; print('ok')"
    )
    assert unlimited.stdout == "ok\n"


def test_fork_loop_stops_at_pids_limit(boundary: Boundary) -> None:
    script = """
import os, time
children = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        children += 1
except OSError as exc:
    print(children, exc.errno)
"""
    out = boundary.ok("python3", "-c", script, options=("--pids", "64")).split()
    # 64 tasks: what runs beside the command (tini; or the agent's exec server and its
    # child), python3 and the children; the next fork gets EAGAIN (11).
    assert out == [str(63 - boundary.tasks_beside_command), "11"], out


def test_cpus_half_keeps_a_busy_loop_to_half_a_core(boundary: Boundary) -> None:
    """The loop gets at most half a core, and it is the quota that holds it there (the
    kernel throttled the sandbox's cgroup), not other load on the machine, which can
    only push the share lower."""
    script = """
import time
wall0, cpu0 = time.monotonic(), time.process_time()
while time.monotonic() - wall0 < 4:
    pass
share = (time.process_time() - cpu0) / (time.monotonic() - wall0)
cpu = "/sys/fs/cgroup/cpu/"  # the sandbox's own cgroup, as the runtime mounts it
stat = dict(line.split() for line in open(cpu + "cpu.stat"))
print(share, open(cpu + "cpu.cfs_quota_us").read().strip(), stat["nr_throttled"])
"""
    out = boundary.ok("python3", "-c", script, options=("--cpus", "0.5"))
    share, quota, throttled = float(out.split()[0]), int(out.split()[1]), int(out.split()[2])
    print(f"busy loop with --cpus 0.5: {share:.2f} of a core, throttled {throttled} times")
    assert quota == 50_000 and throttled > 0
    assert 0.15 <= share <= 0.6, share


def test_cpu_shares_and_cpuset_are_the_sandboxs_own(boundary: Boundary) -> None:
    """--cpu-shares and --cpuset-cpus (docker's) reach the sandbox's cgroup, and the
    CPUs are all its processes may run on: asked of a generic sandbox at its claim, and
    of `lazyfs run`'s in the spec it is created from."""
    last = max(os.sched_getaffinity(0))
    script = (
        "cat /sys/fs/cgroup/cpu/cpu.shares /sys/fs/cgroup/cpuset/cpuset.cpus;"
        " grep Cpus_allowed_list /proc/self/status; nproc"
    )
    out = boundary.ok(
        "sh", "-c", script, options=("--cpu-shares", "512", "--cpuset-cpus", str(last))
    )
    assert out.split() == ["512", str(last), "Cpus_allowed_list:", str(last), "1"], out
    # Without them: the default weight, and every CPU of the node.
    out = boundary.ok("sh", "-c", script)
    assert out.split()[0] == "1024" and out.split()[-1] == str(os.cpu_count()), out
