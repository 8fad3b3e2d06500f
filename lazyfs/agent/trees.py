"""The image trees the agent holds: one `TreeHold` (lazyfs/tree/image_mounts.py) per
image for as long as the agent has a sandbox of it, plus LAZYFS_AGENT_LINGER seconds,
so that create/delete cycles do not remount.

One linger, the agent's own: a count of the tree's sandboxes here and, once it is 0, the
time since; the tick loop (node.py) releases the hold with no linger of TreeHold's own
(`release()`, which unmounts at once if the agent was the tree's last user node-wide)
when settings.agent_linger has passed. TreeHold.release(linger)'s detached reaper stays
for the users that exit after their release (`lazyfs run --linger`, the containerd
snapshotter); the agent never starts one. Why the count and not the reaper (issue 22):

- a lingering tree is still the agent's: /health's mounted_images and the metrics count
  it, and the node-cache metrics read its stats, as before;
- a clean stop (SIGTERM: Agent.shutdown) unmounts every tree at once, lingering ones
  too, and leaves no reaper process behind it (the tests' leftover check counts them);
- a create/delete cycle costs no process: a reaper is `sh` plus a Python start per
  release, on a node where the agent's refills already compete with claims for 2 cores;
- after `kill -9`, nothing changes either way that matters: the dead agent's locks are
  free, so the next agent's `unmount_unused_trees` unmounts what nobody holds, and its
  adoption (recovery.py) takes up again the trees of the sandboxes it keeps.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio

from lazyfs.mount_table import newest
from lazyfs.sandbox.process import Root, root_of
from lazyfs.tree.image_mounts import (
    KEY_CHARS,
    ImageMounts,
    TreeHold,
    detach_dead_tree,
    tree_kind,
)
from lazyfs.tree.tree_release import (
    LOCK_SUFFIX,
    MOUNT_LOCK_SUFFIX,
    forget_tree,
    lock_unused,
    unmount,
)


@dataclass
class _Tree:
    hold: TreeHold
    users: int = 0  # the agent's sandboxes on it (made, being made, or adopted)
    idle_since: float | None = None  # time.monotonic() when users went to 0


@dataclass
class _TreeLock:
    lock: anyio.Lock
    users: int = 0  # tasks holding it or waiting for it


class Trees:
    def __init__(self, mounts: ImageMounts, linger: float) -> None:
        self.mounts = mounts
        self.linger = linger  # seconds a tree stays after its last sandbox here
        self._trees: dict[str, _Tree] = {}  # by image id
        self._locks: dict[str, _TreeLock] = {}  # one hold or release of a tree at once

    def __len__(self) -> int:
        return len(self._trees)

    def __contains__(self, image_id: str) -> bool:
        """Whether the agent holds the image's tree (mounted, or lingering)."""
        return image_id in self._trees

    def paths(self) -> dict[str, Path]:
        """Image id -> its tree, for each tree held (lingering ones too)."""
        return {image_id: tree.hold.path for image_id, tree in self._trees.items()}

    async def hold_all(self, tree_ids: Sequence[str]) -> Root:
        """The root a sandbox of an image stands on: each of its trees (ImageInfo.trees,
        top first) mounted (again, if it died) and counted as used once more; all or
        none.

        A tree held already is counted at once (so the linger cannot release it) and
        checked without its lock, all of them in one thread hop: an image on layer
        trees has several, every image on a base shares the base's, and a lock or a
        hop per tree would line every claim up behind each new image's mount. A tree
        not held yet is mounted under its lock, one hold of it at once."""
        counted: list[str] = []
        try:
            known = [t for t in tree_ids if t in self._trees]
            for tree_id in known:
                self._count(self._trees[tree_id])
                counted.append(tree_id)
            if known:
                holds = [self._trees[t].hold for t in known]
                await anyio.to_thread.run_sync(_ensure_all, holds)
            for tree_id in tree_ids:
                if tree_id not in counted:
                    await self._hold_new(tree_id)
                    counted.append(tree_id)
        except BaseException:
            self.unhold_all(counted)
            raise
        return root_of([self._trees[t].hold.path for t in tree_ids])

    @asynccontextmanager
    async def _locked(self, tree_id: str) -> AsyncIterator[None]:
        """One hold or release of the tree at once. The lock goes once no task holds or
        waits for it (its users are counted before the first await); kept, there was
        one for every tree the agent ever held."""
        entry = self._locks.setdefault(tree_id, _TreeLock(anyio.Lock()))
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if not entry.users:
                del self._locks[tree_id]

    async def _hold_new(self, tree_id: str) -> None:
        async with self._locked(tree_id):
            tree = self._trees.get(tree_id)
            if tree is None:  # (else another claim mounted it while this one waited)
                hold = await anyio.to_thread.run_sync(self.mounts.hold, tree_id)
                tree = self._trees[tree_id] = _Tree(hold)
            self._count(tree)

    @staticmethod
    def _count(tree: _Tree) -> None:
        tree.users += 1
        tree.idle_since = None

    def unhold_all(self, tree_ids: Sequence[str]) -> None:
        for tree_id in tree_ids:
            self.unhold(tree_id)

    def unhold(self, image_id: str) -> None:
        """One use fewer; at none the linger starts."""
        tree = self._trees.get(image_id)
        if tree is not None:
            tree.users -= 1
            if tree.users <= 0:
                tree.idle_since = time.monotonic()

    def adopt(self, image_id: str, hold: TreeHold) -> None:
        """A restarted agent's sandbox on the tree `hold` holds (recovery.py): counted
        once more, and the agent keeps one hold per tree."""
        tree = self._trees.get(image_id)
        if tree is None:
            self._trees[image_id] = _Tree(hold, users=1)
        else:
            hold.release()
            tree.users += 1

    async def release_idle(self) -> None:
        """Release the trees unused here for the linger (from the tick loop)."""
        for image_id, tree in list(self._trees.items()):
            idle = tree.idle_since
            if tree.users <= 0 and idle is not None and time.monotonic() - idle >= self.linger:
                async with self._locked(image_id):
                    if tree.users <= 0 and self._trees.get(image_id) is tree:
                        del self._trees[image_id]
                        await anyio.to_thread.run_sync(tree.hold.release)

    async def release_all(self) -> None:
        """Release every tree now, lingering or not (the agent stops)."""
        for image_id in list(self._trees):
            tree = self._trees.pop(image_id)
            await anyio.to_thread.run_sync(tree.hold.release)


def _ensure_all(holds: list[TreeHold]) -> None:
    for hold in holds:
        hold.ensure()


def unmount_unused_trees(run_dir: Path) -> None:
    """Unmount the image trees nobody holds (a dead agent's holds died with it): the
    last-user step of image_mounts' protocol, done for the users that are gone.

    Every key's (RUN_DIR/images/<key>/), not only ours: the trees of a previous agent
    with another cache or store would otherwise stay mounted for good, and keep their
    data daemon up, once its sandboxes are cleaned up (recovery.py); a tree in use is
    held, so it is left alone. Also trees from before trees were keyed
    (RUN_DIR/images/<image id>)."""
    images = run_dir / "images"
    if not images.is_dir():
        return
    keys = [d for d in images.iterdir() if len(d.name) == KEY_CHARS]  # not a tree
    # One read of the mount table for them all: a read per lock file (two, for a tree
    # not mounted) made an agent's restart take 32 s with 2,000 of them on a node of
    # 2,000 mounts. A tree mounted after this read is held by its mounter.
    table = newest()
    for lock_path in [*images.glob("*.lock"), *(p for d in keys for p in d.glob("*.lock"))]:
        if lock_path.name.endswith(MOUNT_LOCK_SUFFIX):
            continue
        point = lock_path.with_name(lock_path.name.removesuffix(LOCK_SUFFIX))
        fd = lock_unused(str(lock_path))
        if fd is None:
            continue  # in use
        try:
            if str(point) in table:
                if tree_kind(point) is not None:
                    unmount(point)
                else:  # a tree whose data daemon died too (a kill -9 of both, a crash)
                    detach_dead_tree(point)
            # Not mounted (any more): its files go too, as its last user would have
            # removed them; those of earlier versions, which kept them, with them.
            forget_tree(str(lock_path), str(point))
        finally:
            os.close(fd)
