"""A restarted agent finds its sandboxes again.

records.py keeps each sandbox's record on disk. On start, running sandboxes whose owner
died (their lock is free), whose container still runs (or is paused: kept paused) and
whose image tree is this agent's (the same cache and store: image_mounts.py, the key)
and alive (its data daemon did not die with the agent) are adopted; the rest are
cleaned up and reported in /health. Pooled ones are cleaned up too, though their
containers run: the new agent's pools may differ, and their PID 1 is no longer its
child, so it could not tell a dead exec server before handing one out; a refill costs a
fraction of a second. So is a sandbox on another key's tree: that tree is served from a
cache this agent was not given (maybe deleted since), and the agent would hold a tree of
its own key that the sandbox does not use.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from chunker.errors import LazyfsError
from lazyfs.agent.boxes import AgentBox, BoxState, exec_target
from lazyfs.agent.records import BoxRecord, Records
from lazyfs.agent.trees import Trees, unmount_unused_trees
from lazyfs.sandbox.process import root_of, root_text
from lazyfs.sandbox.runtime import Sandbox, SandboxHost, cleanup_stale
from lazyfs.tree.image_mounts import ImageMounts, TreeHold

log = logging.getLogger("lazyfs.agent")


@dataclass
class Recovered:
    boxes: list[AgentBox] = field(default_factory=list)  # adopted, in the records' order
    lost: dict[str, str] = field(default_factory=dict)  # id -> why it was not kept


def recover(
    records: Records, mounts: ImageMounts, trees: Trees, host: SandboxHost, run_dir: Path
) -> Recovered:
    """Adopt the running sandboxes of a dead agent; clean up everything else (blocking:
    run it in a thread)."""
    found = Recovered()
    for record in records.load_all():
        adopted = _adopt(record, mounts, trees, host)
        if isinstance(adopted, AgentBox):
            found.boxes.append(adopted)
            log.info("adopted sandbox %s (%s)", record.id, record.image)
        else:
            found.lost[record.id] = adopted
            records.remove(record.id)
    for box_id in cleanup_stale(host):
        found.lost.setdefault(box_id, "its agent died; cleaned up")
    unmount_unused_trees(run_dir)
    if found.lost:
        log.info("cleaned up %d sandboxes of a previous agent", len(found.lost))
    return found


def _adopt(
    record: BoxRecord, mounts: ImageMounts, trees: Trees, host: SandboxHost
) -> AgentBox | str:
    """The sandbox, ours again, or why not (it is then left to cleanup_stale)."""
    if record.state != BoxState.RUNNING.value:
        return "a pooled sandbox of a previous agent; cleaned up"
    lock_path = host.sandbox_dir / f"{record.id}.lock"
    try:
        fd = os.open(lock_path, os.O_RDWR)
    except FileNotFoundError:
        return "gone before the agent restarted"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return "owned by another process"
    box = Sandbox(record.id, record.runtime, host, fd)
    tree_ids = record.tree_ids  # its layer trees, or its image's tree
    if record.tree != root_text(root_of([mounts.tree_path(t) for t in tree_ids])):
        box.delete()
        return "its image tree is another cache's or store's; cleaned up"
    status = _runtime_status(box)
    if status not in ("running", "paused"):
        box.delete()
        return f"its container was {status or 'gone'} after the restart; cleaned up"
    # Paused (its cgroup frozen) as the runtime sees it, whatever the record says: the
    # agent may have died between a freeze and the record's save.
    record.paused = status == "paused"
    if not all(mounts.tree_alive(t) for t in tree_ids):
        # Its data daemon died too: the sandbox's root is on a tree nothing serves, so
        # every read not cached yet is EIO. A new tree cannot be given to it (its overlay
        # holds the old one): it is lost, and said so (410), not kept half-working.
        box.delete()
        return "its image tree died with the node's data daemon; cleaned up"
    holds: list[TreeHold] = []
    try:
        for tree_id in tree_ids:
            holds.append(mounts.hold(tree_id))
    except (LazyfsError, OSError) as exc:
        for hold in holds:
            hold.release()
        box.delete()
        return f"its image could not be mounted again ({exc}); cleaned up"
    for tree_id, hold in zip(tree_ids, holds, strict=True):
        trees.adopt(tree_id, hold)
    return AgentBox(box, record, exec_target(box, record), BoxState.RUNNING)


def _runtime_status(box: Sandbox) -> str | None:
    """The runtime's status of the container ("running", "paused", "created",
    "stopped"), or None."""
    proc = subprocess.run(
        [box.runtime, "--root", str(box.state), "state", box.id],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if proc.returncode != 0:
        return None
    try:
        return json.loads(proc.stdout).get("status")
    except ValueError:
        return None
