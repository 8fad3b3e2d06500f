"""The kernel's counters that sandboxes share with the host, raised so that a sandbox's
own memory cgroup is what bounds it.

A sandbox has no user namespace: root in it is uid 0 of the host. The kernel keeps
some limits per uid (epoll watches, inotify instances and watches, pipe pages) and
some for the whole node (open files, the AIO events); nothing of them is per cgroup.
With the kernel's defaults one sandbox took all of root's 128 inotify instances (the
agent's, containerd's and systemd's), every open file of the node (another sandbox's
`echo ok` then failed with "Too many open files in system"), every AIO event, or
every epoll watch of root (the agent's event loop could then take no connection, not
even the one that would delete it): docs/security.md, finding 20.

Each object these count is charged to the memory cgroup of the process that makes it
(struct file, epoll items, inotify groups and marks, AIO rings and pipe buffers are
accounted allocations), and all sandboxes together sit under a parent capped below
the node's RAM (lazyfs/sandbox/limits.py). So the counters are raised past anything
memory allows, where systemd sets fs.file-max too, and a sandbox that opens them in a
loop runs into its own memory limit instead of the host's counter. They are only
ever raised, never lowered, and stay raised after lazyfs stops (a node's setting, as
kubelet's kernel defaults are).

Not here: ptys (each sandbox's devpts instance has its own `max`,
lazyfs/sandbox/oci_spec.py) and the per-uid pending signals and message-queue bytes,
which the kernel checks against the caller's own rlimit (a sandbox's are lower than
the host's: lazyfs/sandbox/ulimits.py).
"""

from __future__ import annotations

from pathlib import Path

SYSCTL = Path("/proc/sys")
LONG_MAX = 2**63 - 1
INT_MAX = 2**31 - 1
# What each counter must be at least: past what any memory limit lets a sandbox take.
FLOORS = {
    "fs/file-max": LONG_MAX,  # as systemd sets it
    "fs/epoll/max_user_watches": LONG_MAX,
    "fs/inotify/max_user_instances": INT_MAX,
    "fs/inotify/max_user_watches": INT_MAX,
    "fs/aio-max-nr": LONG_MAX,
}
# Counters where 0 means no limit: past its soft limit a uid's new pipes get two pages
# (and F_SETPIPE_SZ fails), whichever process of that uid made the others.
NO_LIMIT = ("fs/pipe-user-pages-soft",)


def shared_counters_left() -> list[str]:
    """The counters not yet raised, as "name = value" (names as sysctl spells them)."""
    return [f"{name.replace('/', '.')} = {value}" for name, value, _ in _short()]


def raise_shared_counters() -> list[str]:
    """Raise each counter that is short of its target; what could not be raised (a
    read-only /proc/sys, a kernel without it), as shared_counters_left names it."""
    for name, _value, target in _short():
        _write(name, target)
    return shared_counters_left()


def _short() -> list[tuple[str, int, int]]:
    """(name, value, target) of each counter this kernel has that is short of its
    target: below its floor, or limited where NO_LIMIT wants 0."""
    short = []
    for name, floor in FLOORS.items():
        value = _read(name)
        if value is not None and value < floor:
            short.append((name, value, floor))
    for name in NO_LIMIT:
        value = _read(name)
        if value:
            short.append((name, value, 0))
    return short


def _read(name: str) -> int | None:
    try:
        return int((SYSCTL / name).read_text())
    except (OSError, ValueError):  # not in this kernel
        return None


def _write(name: str, value: int) -> None:
    try:
        with open(SYSCTL / name, "w") as f:
            f.write(str(value))
    except OSError:  # read-only /proc/sys (a node in a container): named by the caller
        pass
