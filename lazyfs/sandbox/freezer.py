"""Pausing a sandbox: every process in its cgroup frozen, as `docker pause` does (the
cgroup freezer: v1's freezer.state, v2's cgroup.freeze).

A frozen process takes no CPU and answers nothing, not even SIGKILL, which stays pending
until it is thawed. So whatever ends a sandbox thaws it first (Sandbox.delete,
teardown.remove_cgroups): otherwise the kill of its PID 1 would wait for good, and its
cgroup could not be removed.

Stateless: the cgroup says whether the sandbox is frozen. Imported by teardown.py, so
on os and time alone (its rule: nothing a new Python process has not loaded already).
"""

from __future__ import annotations

import os
import time

CGROUP_FS = "/sys/fs/cgroup"
SETTLE = 5.0  # seconds a freeze may take (tasks in the kernel stop at their next exit to user)


class FreezeFailed(OSError):
    """The sandbox's cgroup could not be frozen or thawed."""


def _files(cgroup_parent: str, box_id: str) -> tuple[str, str] | None:
    """(the file to write, the v1 or v2 word for it), or None without a freezer."""
    v1 = f"{CGROUP_FS}/freezer/{cgroup_parent}/{box_id}/freezer.state"
    if os.path.exists(v1):
        return v1, "v1"
    v2 = f"{CGROUP_FS}/{cgroup_parent}/{box_id}/cgroup.freeze"
    if os.path.exists(v2):
        return v2, "v2"
    return None


def is_frozen(cgroup_parent: str, box_id: str) -> bool:
    found = _files(cgroup_parent, box_id)
    if found is None:
        return False
    path, kind = found
    try:
        with open(path) as f:
            state = f.read().strip()
    except OSError:
        return False
    return state in ("FROZEN", "FREEZING") if kind == "v1" else state == "1"


def _settled(path: str, kind: str, frozen: bool) -> bool:
    if kind == "v1":
        with open(path) as f:
            return f.read().strip() == ("FROZEN" if frozen else "THAWED")
    with open(os.path.join(os.path.dirname(path), "cgroup.events")) as f:
        events = dict(line.split() for line in f if line.strip())
    return events.get("frozen") == ("1" if frozen else "0")


def set_frozen(cgroup_parent: str, box_id: str, frozen: bool) -> None:
    """Freeze (or thaw) every process of the sandbox, and wait until the kernel says it
    is done. FreezeFailed if it has no freezer cgroup or does not settle in time."""
    found = _files(cgroup_parent, box_id)
    if found is None:
        raise FreezeFailed(f"sandbox {box_id} has no freezer cgroup")
    path, kind = found
    word = ("FROZEN" if frozen else "THAWED") if kind == "v1" else ("1" if frozen else "0")
    deadline = time.monotonic() + SETTLE
    try:
        while True:
            with open(path, "w") as f:  # v1 asks again each time: a FREEZING can stall
                f.write(word)
            if _settled(path, kind, frozen):
                return
            if time.monotonic() > deadline:
                break
            time.sleep(0.001)
    except OSError as exc:
        raise FreezeFailed(f"sandbox {box_id}: its freezer: {exc.strerror}") from None
    raise FreezeFailed(f"sandbox {box_id} did not {'freeze' if frozen else 'thaw'} in {SETTLE} s")


def thaw(cgroup_parent: str, box_id: str) -> None:
    """Thaw the sandbox if it is frozen (before it is ended); nothing otherwise."""
    if is_frozen(cgroup_parent, box_id):
        try:  # noqa: SIM105 - contextlib is one import more for `lazyfs run`'s finisher
            set_frozen(cgroup_parent, box_id, False)
        except FreezeFailed:
            pass  # the kill that follows then waits, as before: nothing better to do
