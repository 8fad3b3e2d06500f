"""A restarted agent unmounts the image trees nobody holds (unmount_unused_trees), with
one read of the mount table however many images the node mounted since boot: each left
its lock files in the run dir, and a read per file made a restart take 32 s with 2,000
of them on a node of 2,000 mounts (docs/design-changes.md, session 47). And its books keep
nothing of a tree it let go."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

import lazyfs.mount_table
from lazyfs.agent.trees import Trees, unmount_unused_trees
from lazyfs.mount_table import is_mount_point
from lazyfs.settings import Settings
from lazyfs.tree.image_mounts import ImageMounts
from testbed.image_builder import publish_one_file_images

STALE = 300


@pytest.mark.usefixtures("no_leftovers")
def test_a_restart_unmounts_what_nobody_holds_with_one_read_of_the_mount_table(
    tmp_path: Path, private_run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"file://{tmp_path}/store"
    [(image_id, content)] = publish_one_file_images(url, 1).items()
    mounts = ImageMounts(url, tmp_path / "cache", Settings.from_env())
    held = mounts.hold(image_id)
    assert (held.path / "which").read_bytes() == content
    held.close()  # its user died: the tree stays mounted, held by nobody
    for n in range(STALE):  # what earlier images left: lock files, empty mount points
        stale = mounts.trees_dir / f"{n:064x}"
        stale.mkdir()
        stale.with_name(f"{stale.name}.lock").touch()
        stale.with_name(f"{stale.name}.mount.lock").touch()
    reads = []
    entries = lazyfs.mount_table.entries

    def counted() -> list:
        reads.append(1)
        return entries()

    monkeypatch.setattr(lazyfs.mount_table, "entries", counted)
    unmount_unused_trees(private_run_dir)
    assert not is_mount_point(held.path)
    assert len(reads) <= 3  # one for them all, and the mounted tree's own checks


@pytest.mark.usefixtures("no_leftovers")
def test_the_agent_keeps_no_lock_of_a_tree_it_let_go(tmp_path: Path) -> None:
    """A lock per tree serialises its holds and releases; each was kept for good, one
    for every tree the agent ever held. Two claims of a new image at once still mount
    it once."""
    url = f"file://{tmp_path}/store"
    content = publish_one_file_images(url, 4)
    ids = list(content)
    trees = Trees(ImageMounts(url, tmp_path / "cache", Settings.from_env()), linger=0)

    async def claims() -> None:
        async with anyio.create_task_group() as tasks:
            for image_id in [*ids, ids[0]]:  # the first one twice at once
                tasks.start_soon(trees.hold_all, [image_id])
        assert len(trees) == len(ids) and trees._trees[ids[0]].users == 2
        assert not trees._locks  # nobody holds or waits for one
        paths = trees.paths()
        assert (paths[ids[1]] / "which").read_bytes() == content[ids[1]]
        trees.unhold_all([*ids, ids[0]])
        await trees.release_idle()
        assert len(trees) == 0 and not trees._locks
        assert not any(is_mount_point(p) for p in paths.values())

    anyio.run(claims)
