"""cgroup limits hold (issue 11): memory (OOM kill of that sandbox alone), pids, cpu."""

from __future__ import annotations

import signal
import threading

from testbed.node import Node


def test_memory_limit_oom_kills_only_that_sandbox(sandbox_node: Node) -> None:
    neighbour: list = []

    def other() -> None:  # another sandbox (another image) running at the same time
        neighbour.append(sandbox_node.run("sh", "-c", "sleep 3; echo alive", image="base"))

    t = threading.Thread(target=other)
    t.start()
    proc = sandbox_node.run(
        "python3",
        "-c",
        "blocks = [bytearray(8 << 20) for _ in range(40)]; print('allocated 320 MiB')",
        options=("--memory", "64M"),
    )
    t.join()
    assert proc.returncode == 128 + signal.SIGKILL
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "out of memory" in lines[0] and "64 MiB" in lines[0], proc.stderr
    (other_proc,) = neighbour
    assert (other_proc.returncode, other_proc.stdout) == (0, "alive\n")
    # The same allocation fits without the limit: the limit, not the program, killed it.
    unlimited = sandbox_node.run(
        "python3", "-c", "blocks = [bytearray(8 << 20) for _ in range(40)]; print('ok')"
    )
    assert unlimited.stdout == "ok\n"


def test_fork_loop_stops_at_pids_limit(sandbox_node: Node) -> None:
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
    out = sandbox_node.ok("python3", "-c", script, options=("--pids", "64")).split()
    # 64 tasks: tini, python3 and 62 children; the 63rd fork gets EAGAIN (11).
    assert out == ["62", "11"], out


def test_cpus_half_keeps_a_busy_loop_to_half_a_core(sandbox_node: Node) -> None:
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
    out = sandbox_node.ok("python3", "-c", script, options=("--cpus", "0.5"))
    share, quota, throttled = float(out.split()[0]), int(out.split()[1]), int(out.split()[2])
    print(f"busy loop with --cpus 0.5: {share:.2f} of a core, throttled {throttled} times")
    assert quota == 50_000 and throttled > 0
    assert 0.15 <= share <= 0.6, share
