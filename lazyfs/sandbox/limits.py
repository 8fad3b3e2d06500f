"""Sandbox limits from text (the command line's flags, the agent API's fields), and the
node-wide limits around all sandboxes.

Node-wide (issue 20): every sandbox's cgroup sits under one parent cgroup
($LAZYFS_CGROUP_PARENT, in every hierarchy), and `cap_sandboxes` caps that parent, so
that however many sandboxes run, and whatever each one's own limits, together they leave
the node a reserve of PIDs and memory:

- pids.max = kernel.pid_max - LAZYFS_PIDS_RESERVE (default pid_max/16, at least 1024).
  Measured here: pid_max is 32768 and 8 sandboxes at the default 4096 pids took every
  PID, after which the host could not fork (not even `ls`). The node itself runs ~100
  tasks (agent threads, the data daemon, sshd, a shell); the reserve (2048 here) leaves
  20 times that for an operator's shell and tools, the runtime's own processes and
  `lazyfs run`s.
- memory = the node's RAM - LAZYFS_MEMORY_RESERVE (default RAM/8, at least 1 GiB):
  what the agent, the data daemon, the kernel and the page cache of the node cache need
  outside the sandboxes (the agent's 43 MB and the data daemon's few hundred MB are far
  below 1/8 of any node that runs sandboxes). Sandboxes' writable layers are tmpfs pages
  charged to the sandbox that wrote them (lazyfs/sandbox/runtime.py), so this cap bounds
  them too.

The agent caps at its start, `lazyfs run` before each sandbox (a few writes of small
files, only where the value differs).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from chunker.errors import BadInputError
from lazyfs.sandbox.oci_spec import Limits
from lazyfs.settings import Settings, parse_size

if TYPE_CHECKING:
    import argparse

CGROUP_FS = Path("/sys/fs/cgroup")
MIN_CPUS = 0.01  # the CFS quota's floor: 1 ms per 100 ms period
MIN_SHARES, MAX_SHARES = 2, 262144  # the kernel's range of cpu.shares


def positive(text: object, kind: type, flag: str, what: str) -> float | None:
    """A positive int or float from text (None stays None); BadInputError naming `flag`."""
    if text is None:
        return None
    try:
        value = kind(text)
    except (TypeError, ValueError):
        value = 0
    if not value > 0 or value != value or value == float("inf"):
        raise BadInputError(f"{flag} {text!r} is not {what}")
    return value


def _size(text: object, flag: str) -> int | None:
    """Bytes from 2G / 512M / 1048576 (None stays None); BadInputError naming `flag`."""
    if text is None:
        return None
    try:
        size = parse_size(str(text)) if not isinstance(text, int) else text
    except BadInputError:
        size = 0
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise BadInputError(f"{flag} {text!r} is not a size (bytes, or with K, M, G or T)")
    return size


def _cpus(text: object, flag: str) -> float | None:
    """A CPU count between MIN_CPUS and the node's CPUs, as docker checks it: a quota
    above the node's CPUs means nothing, and one past the kernel's range made the
    runtime fail (a 500 from the agent for `cpus: 1e9`)."""
    n = positive(text, float, flag, "a positive number of CPUs, e.g. 0.5")
    if n is None:  # no limit asked: no sysfs read (0.17 ms of the agent's GIL per create here)
        return None
    node = os.cpu_count() or 1
    if not MIN_CPUS <= n <= node:
        raise BadInputError(
            f"{flag} {text!r}: the range of CPUs is from {MIN_CPUS} to {node:.2f},"
            f" as there are only {node} CPUs on this node"
        )
    return n


def _cpu_shares(value: object, flag: str) -> int | None:
    """A relative CPU weight in the kernel's range for cpu.shares (docker's --cpu-shares)."""
    if value is None:
        return None
    try:
        shares = int(value) if not isinstance(value, (bool, float)) else 0
    except (TypeError, ValueError):
        shares = 0
    if not MIN_SHARES <= shares <= MAX_SHARES:
        raise BadInputError(
            f"{flag} {value!r} is not a CPU weight from {MIN_SHARES} to {MAX_SHARES}"
            " (1024 is the default's)"
        )
    return shares


def node_cpus() -> set[int]:
    """The node's online CPUs (/sys/devices/system/cpu/online: "0-1")."""
    with open("/sys/devices/system/cpu/online") as f:
        return cpu_list(f.read().strip())


def cpu_list(text: str) -> set[int]:
    """The CPUs of the kernel's list form ("0-2,4"); ValueError if it is not one."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(text)
        low, high = int(first), int(last) if dash else int(first)
        if low > high:
            raise ValueError(text)
        cpus.update(range(low, high + 1))
    return cpus


def _cpuset(value: object, flag: str) -> str | None:
    """CPUs a sandbox may run on ("0-1,3", as docker's --cpuset-cpus), each one of the
    node's: the kernel refuses others at the write, which for a pooled sandbox is its
    claim (a 500 there, not the user's mistake named)."""
    if value is None:
        return None
    text = value.strip() if isinstance(value, str) else ""
    try:
        asked = cpu_list(text)
    except ValueError:
        raise BadInputError(f"{flag} {value!r} is not a list of CPUs, e.g. 0-1,3") from None
    node = node_cpus()
    if not asked <= node:
        missing = ",".join(str(c) for c in sorted(asked - node))
        raise BadInputError(f"{flag} {value!r}: CPU {missing} is not one of this node's")
    return text


def parse_limits(
    cpus: object = None,
    memory: object = None,
    pids: object = None,
    disk: object = None,
    prefix: str = "--",
    defaults: Limits | None = None,
    *,
    cpu_shares: object = None,
    cpuset: object = None,
) -> Limits:
    """Limits from `--cpus 0.5 --memory 2G --pids 100 --disk 10G --cpu-shares 512
    --cpuset-cpus 0-1` (or the API's fields, with prefix "" and cpu_shares, cpuset_cpus);
    what is not given is the default's (the agent's `serve` defaults, else Limits()).
    A value that does not parse is one BadInputError line."""
    base = defaults or Limits()
    n_cpus = _cpus(cpus, f"{prefix}cpus")
    size = _size(memory, f"{prefix}memory")
    n_pids = positive(pids, int, f"{prefix}pids", "a whole number of processes, 1 or more")
    n_disk = _size(disk, f"{prefix}disk")
    dash = "-" if prefix == "--" else "_"
    shares = _cpu_shares(cpu_shares, f"{prefix}cpu{dash}shares")
    cpu_set = _cpuset(cpuset, f"{prefix}cpuset{dash}cpus")
    return Limits(
        cpus=n_cpus if n_cpus is not None else base.cpus,
        memory=size if size is not None else base.memory,
        pids=int(n_pids) if n_pids else base.pids,
        disk=n_disk if n_disk is not None else base.disk,
        cpu_shares=shares if shares is not None else base.cpu_shares,
        cpuset=cpu_set if cpu_set is not None else base.cpuset,
    )


def flag_limits(args: argparse.Namespace) -> Limits:
    """Limits from a command line's --cpus, --memory, --pids and --disk, and its
    --cpu-shares and --cpuset-cpus where it has them (`lazyfs serve` has not)."""
    return parse_limits(
        args.cpus,
        args.memory,
        args.pids,
        args.disk,
        cpu_shares=getattr(args, "cpu_shares", None),
        cpuset=getattr(args, "cpuset_cpus", None),
    )


# ------------------------------------------------------------------ node-wide


def pid_max() -> int:
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read())


def node_memory() -> int:
    """The node's RAM in bytes (MemTotal)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise OSError("no MemTotal in /proc/meminfo")


def sandbox_caps(settings: Settings) -> tuple[int, int]:
    """(pids, memory bytes) that all sandboxes together may use (see the top)."""
    pids, ram = pid_max(), node_memory()
    pids_reserve = settings.pids_reserve
    if pids_reserve is None:
        pids_reserve = max(1024, pids // 16)
    memory_reserve = settings.memory_reserve
    if memory_reserve is None:
        memory_reserve = max(2**30, ram // 8)
    if pids_reserve >= pids or memory_reserve >= ram:
        raise BadInputError(
            f"LAZYFS_PIDS_RESERVE ({pids_reserve}) or LAZYFS_MEMORY_RESERVE"
            f" ({memory_reserve}) leaves the sandboxes nothing on this node"
            f" (pid_max {pids}, {ram} bytes of RAM)"
        )
    page = os.sysconf("SC_PAGE_SIZE")  # the kernel keeps a limit in whole pages
    return pids - pids_reserve, (ram - memory_reserve) // page * page


def cap_sandboxes(settings: Settings) -> tuple[int, int]:
    """Cap the sandboxes' parent cgroup (made if missing) at sandbox_caps(); returns
    them. cgroup v1 (pids and memory hierarchies) or v2 (the unified one)."""
    pids, memory = sandbox_caps(settings)
    parent = settings.cgroup_parent
    if (CGROUP_FS / "cgroup.controllers").exists():  # v2
        path = CGROUP_FS / parent
        _write_if_changed(path, "pids.max", pids)
        _write_if_changed(path, "memory.max", memory)
    else:
        _write_if_changed(CGROUP_FS / "pids" / parent, "pids.max", pids)
        _write_if_changed(CGROUP_FS / "memory" / parent, "memory.limit_in_bytes", memory)
    return pids, memory


def _write_if_changed(directory: Path, name: str, value: int) -> None:
    directory.mkdir(exist_ok=True)
    path = directory / name
    if path.read_text().strip() != str(value):
        with open(path, "w") as f:  # one write(2), as cgroup files want
            f.write(str(value))
