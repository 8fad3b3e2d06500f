"""What a sandbox uses now, read from its cgroup (v1 or v2): CPU time, memory, processes;
and from its writable layer's tmpfs, its disk (disk_used).

The agent's `GET /sandboxes/ID/stats` and Docker's `GET /containers/{id}/stats` report
it (lazyfs/agent/api.py, lazyfs/docker/stats.py). A handful of small reads of cgroupfs,
which the kernel answers from memory (~0.1 ms in all).

Memory is what the memory cgroup charges the sandbox: its processes' pages and the pages
of its tmpfs mounts and writable layer, which live in RAM (docs/security.md). On v1,
CPU time comes from cpuacct (cpuacct.usage in ns; the user/system split in cpuacct.stat,
in clock ticks), memory from memory.usage_in_bytes; on v2, from cpu.stat and
memory.current.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

from lazyfs.sandbox.teardown import CGROUP_FS

UNLIMITED = 1 << 62  # v1 shows no memory limit as a number near 2**63


class Usage(NamedTuple):
    cpu_ns: int  # CPU time of all its processes, since it was made
    cpu_user_ns: int
    cpu_system_ns: int
    memory: int  # bytes charged to its memory cgroup now
    memory_limit: int | None  # None: no limit
    memory_stat: dict[str, int]  # its memory.stat, as the kernel names the counters
    pids: int  # tasks in it now
    pids_limit: int | None


def usage(cgroup_parent: str, box_id: str) -> Usage:
    """The sandbox's usage now; OSError if its cgroup is gone."""
    if os.path.exists(f"{CGROUP_FS}/cgroup.controllers"):
        return _v2(f"{CGROUP_FS}/{cgroup_parent}/{box_id}")
    return _v1(cgroup_parent, box_id)


def _v1(parent: str, box_id: str) -> Usage:
    def path(controller: str, name: str) -> str:
        return f"{CGROUP_FS}/{controller}/{parent}/{box_id}/{name}"

    tick_ns = 10**9 // os.sysconf("SC_CLK_TCK")
    ticks = _pairs(_read(path("cpuacct", "cpuacct.stat")))
    limit = int(_read(path("memory", "memory.limit_in_bytes")))
    return Usage(
        cpu_ns=int(_read(path("cpuacct", "cpuacct.usage"))),
        cpu_user_ns=ticks.get("user", 0) * tick_ns,
        cpu_system_ns=ticks.get("system", 0) * tick_ns,
        memory=int(_read(path("memory", "memory.usage_in_bytes"))),
        memory_limit=None if limit >= UNLIMITED else limit,
        memory_stat=_pairs(_read(path("memory", "memory.stat"))),
        pids=int(_read(path("pids", "pids.current"))),
        pids_limit=_limit(_read(path("pids", "pids.max"))),
    )


def _v2(cgroup: str) -> Usage:
    cpu = _pairs(_read(f"{cgroup}/cpu.stat"))
    return Usage(
        cpu_ns=cpu.get("usage_usec", 0) * 1000,
        cpu_user_ns=cpu.get("user_usec", 0) * 1000,
        cpu_system_ns=cpu.get("system_usec", 0) * 1000,
        memory=int(_read(f"{cgroup}/memory.current")),
        memory_limit=_limit(_read(f"{cgroup}/memory.max")),
        memory_stat=_pairs(_read(f"{cgroup}/memory.stat")),
        pids=int(_read(f"{cgroup}/pids.current")),
        pids_limit=_limit(_read(f"{cgroup}/pids.max")),
    )


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _pairs(text: str) -> dict[str, int]:
    """ "key value" lines (memory.stat, cpu.stat, cpuacct.stat)."""
    found = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            found[key] = int(value)
    return found


def _limit(text: str) -> int | None:
    return None if text == "max" else int(text)


def system_cpu_ns() -> int:
    """The host's CPU time of all CPUs, busy or not, since boot (/proc/stat's first
    line): Docker's system_cpu_usage, against which a client takes the sandbox's share."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:8]  # user nice system idle iowait irq softirq
    return sum(map(int, fields)) * (10**9 // os.sysconf("SC_CLK_TCK"))


def disk_used(sandbox_dir: Path) -> int:
    """Bytes its writable layer holds now: the filesystem's own count of the tmpfs of
    its own mounted there (runtime.mount_layer), 0 if there is none. Not a walk of what
    the sandbox made, whose code may swap a directory for a link to "/" under a walker
    (a prune counted 14 MB of the host's files for a 20-byte layer that way)."""
    if not os.path.ismount(sandbox_dir):
        return 0
    st = os.statvfs(sandbox_dir)
    return (st.f_blocks - st.f_bfree) * st.f_frsize
