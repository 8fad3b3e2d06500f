"""The node data daemon forgets the devices the kernel forgot (FUSE forget): it outlives
thousands of images (the agent keeps it up), and kept a record of every device it ever
closed, and whether it had pushed its metadata, for good. An inode the kernel evicted
took its pages with it, so the device's next open pushes its metadata again."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from lazyfs.settings import Settings
from lazyfs.tree.image_mounts import ImageMounts
from lazyfs.tree.node_files import state_path
from testbed.image_builder import publish_one_file_images
from testbed.processes import wait_until


@pytest.mark.usefixtures("no_leftovers")
def test_a_device_the_kernel_evicted_is_forgotten_and_pushed_again(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store"
    content = publish_one_file_images(url, 2)
    ids = list(content)
    cache = tmp_path / "cache"
    mounts = ImageMounts(url, cache, Settings.from_env())
    hold = mounts.hold_data_daemon()  # as the agent does: the daemon outlives its trees
    hold.ensure()
    log = state_path(cache, mounts.data_dir, ".log")
    try:
        with mounts.use(ids[0]) as tree:
            assert (tree / "which").read_bytes() == content[ids[0]]
        with mounts.use(ids[1]) as tree:  # its device stays open through the eviction
            wait_until(
                lambda: _closed(log, ids[0]),
                10,
                "the first image's device closed for idleness",
            )
            # Evict unused dentries and inodes, the first device's among them (the
            # kernel then sends its FUSE forget); page caches of files in use stay.
            subprocess.run(["sh", "-c", "echo 2 > /proc/sys/vm/drop_caches"], check=True)
            wait_until(
                lambda: f"image {ids[0]}: device forgotten by the kernel" in log.read_text(),
                10,
                "the daemon to forget the evicted device",
            )
            assert f"image {ids[1]}: device forgotten" not in log.read_text()  # open
            assert (tree / "which").read_bytes() == content[ids[1]]
        with mounts.use(ids[0]) as tree:  # opened again: served, and pushed again
            assert (tree / "which").read_bytes() == content[ids[0]]
            wait_until(lambda: _pushes(log, ids[0]) == 2, 10, "the second push")
    finally:
        hold.release()


def _closed(log: Path, image_id: str) -> bool:
    return f"image {image_id}: closed" in log.read_text()


def _pushes(log: Path, image_id: str) -> int:
    return log.read_text().count(f"image {image_id}: metadata pushed")
