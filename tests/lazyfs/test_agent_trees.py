"""A restarted agent unmounts the image trees nobody holds (unmount_unused_trees), with
one read of the mount table however many images the node mounted since boot: each left
its lock files in the run dir, and a read per file made a restart take 32 s with 2,000
of them on a node of 2,000 mounts (docs/design-changes.md, session 47)."""

from __future__ import annotations

from pathlib import Path

import pytest

import lazyfs.mount_table
from chunker.store.backends import open_store
from lazyfs.agent.trees import unmount_unused_trees
from lazyfs.mount_table import is_mount_point
from lazyfs.settings import Settings
from lazyfs.tree.image_mounts import ImageMounts
from testbed.image_builder import ImageBuilder

STALE = 300


@pytest.mark.usefixtures("no_leftovers")
def test_a_restart_unmounts_what_nobody_holds_with_one_read_of_the_mount_table(
    tmp_path: Path, private_run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"file://{tmp_path}/store"
    store = open_store(url)
    builder = ImageBuilder(store)
    builder.file("which", b"the image\n" * 1000)
    image_id = builder.publish("img")
    store.close()
    mounts = ImageMounts(url, tmp_path / "cache", Settings.from_env())
    held = mounts.hold(image_id)
    assert (held.path / "which").read_bytes() == b"the image\n" * 1000
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
