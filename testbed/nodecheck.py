"""What a node's sandboxes must not leave behind once they are gone: one checker for the
sandbox tests (testbed/node.py) and the agent benchmark (bench/agent_scale.py).

A node here is a scratch directory holding its run dir (`run/`, the runtime's state in
`run/oci/`) and its sandbox dir, as the tests' and benchmarks' private nodes lay them out.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection
from pathlib import Path

from testbed.mounts import mounts_below

CGROUP_FS = Path("/sys/fs/cgroup")


def cgroup_parents(name: str) -> list[Path]:
    """The cgroup `name` (a LAZYFS_CGROUP_PARENT) in every hierarchy where it exists."""
    return [h / name for h in [CGROUP_FS, *CGROUP_FS.iterdir()] if (h / name).is_dir()]


def sandbox_cgroups(parent: str, ids: Collection[str] | None = None) -> list[Path]:
    """Every sandbox cgroup under the cgroup `parent`, in every hierarchy; with `ids`,
    only those sandboxes'. Each test node and benchmark has a parent of its own, so
    other nodes' sandboxes on the machine (other tests, benchmarks) are never counted."""
    return [
        p
        for d in cgroup_parents(parent)
        for p in d.iterdir()
        if p.is_dir() and (ids is None or p.name in ids)
    ]


def processes_mentioning(text: str) -> list[int]:
    """Pids of processes whose command line contains text (e.g. this test's tmp dir)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if text.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
    return pids


def _net_ns(pid: int | str) -> str | None:
    with contextlib.suppress(OSError):
        return os.readlink(f"/proc/{pid}/ns/net")
    return None


def sandbox_net_namespaces(cgroups: list[Path], pids: list[int]) -> list[str]:
    """Network namespaces other than the host's held by a sandbox's leftover process
    (in one of `cgroups`, or one of `pids`). A network namespace lives as long as a
    process or a bind mount (nsfs) holds it; the mounts are counted with the others."""
    host = _net_ns("self")  # the checker runs in the host's (pid 1's may not be readable)
    holders = set(pids)
    for path in cgroups:
        with contextlib.suppress(OSError):
            holders.update(int(p) for p in (path / "cgroup.procs").read_text().split())
    found = {ns for pid in holders if (ns := _net_ns(pid)) is not None and ns != host}
    return sorted(found)


def leftovers(
    tmp: Path, sandbox_dir: Path, cgroup_parent: str, ids: Collection[str] | None = None
) -> dict[str, list]:
    """Everything finished sandboxes of the node under `tmp` (its sandboxes' cgroups
    under `cgroup_parent`) must not leave behind: mounts, cgroups, runtime state (runc's
    --root), upper directories (the sandbox dir), processes and network namespaces."""
    state = tmp / "run" / "oci"
    cgroups = sandbox_cgroups(cgroup_parent, ids)
    processes = processes_mentioning(str(tmp))
    return {
        "mounts": mounts_below(tmp),
        "cgroups": cgroups,
        "runtime state": [p for p in state.glob("*/*")] if state.is_dir() else [],
        "sandbox dirs": list(sandbox_dir.iterdir()) if sandbox_dir.is_dir() else [],
        "processes": processes,
        "network namespaces": sandbox_net_namespaces(cgroups, processes),
    }
