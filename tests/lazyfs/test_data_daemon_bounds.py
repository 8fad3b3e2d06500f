"""What the node data daemon keeps stays bounded over the weeks an agent keeps it up.

- It forgets the devices the kernel forgot (FUSE forget): it kept a record of every
  device it ever closed, and whether it had pushed its metadata, for good. An inode the
  kernel evicted took its pages with it, so the device's next open pushes it again.
- Its log file moves to <log>.1 past LOG_KEEP bytes (lazyfs/tree/daemon_log.py).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import anyio
import pytest

from chunker.store.backends import open_store
from lazyfs.settings import Settings
from lazyfs.tree.daemon_log import LOG_KEEP
from lazyfs.tree.data_daemon import DataOperations
from lazyfs.tree.image_mounts import ImageMounts
from lazyfs.tree.node_files import state_path
from node_cache.cache import NodeCache
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
        with mounts.use(ids[0]) as tree:  # looked up and opened again
            assert (tree / "which").read_bytes() == content[ids[0]]
    finally:
        hold.release()


def _closed(log: Path, image_id: str) -> bool:
    return f"image {image_id}: closed" in log.read_text()


def test_a_device_is_forgotten_once_every_lookup_of_it_is(tmp_path: Path) -> None:
    """The kernel's lookups of a device's inode are counted, and its forgets taken off:
    only with none left does the daemon drop what it kept, the mark of its push with it
    (its next open pushes its metadata again: the kernel's pages went with the inode)."""
    ops = DataOperations(
        tmp_path,
        NodeCache(tmp_path / "cache", open_store(f"file://{tmp_path}/s")),
        None,
        str(tmp_path / "mnt"),
    )
    ino = 1234
    ops.lookups[ino] = 3  # three lookups, as lookup() counts them
    ops.forgotten[ino] = ("f" * 64, {"reads": 1}, "")
    ops.pushed.add(ino)
    anyio.run(ops.forget, [(ino, 2)])
    assert ino in ops.forgotten and ino in ops.pushed and ops.lookups[ino] == 1
    anyio.run(ops.forget, [(ino, 1), (99, 1)])  # 99: looked up by a worker before a restart
    assert ino not in ops.forgotten and ino not in ops.pushed and ops.lookups == {}
    ops.reader.close()
    ops.cache.close()


@pytest.mark.usefixtures("no_leftovers")
def test_the_data_daemons_log_file_stays_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its log file, in the node cache, grew for as long as the daemon lived (weeks,
    under an agent). Past LOG_KEEP its lines move to <log>.1 and it starts again, and
    the daemon goes on writing to it."""
    url = f"file://{tmp_path}/store"
    content = publish_one_file_images(url, 1)
    (image_id,) = content
    cache = tmp_path / "cache"
    mounts = ImageMounts(url, cache, Settings.from_env())
    log = state_path(cache, mounts.data_dir, ".log")
    log.parent.mkdir(parents=True)
    with open(log, "wb") as f:  # a daemon's weeks of lines, before this one starts
        f.write(b"the first line\n")
        f.truncate(LOG_KEEP + (1 << 20))
    hold = mounts.hold_data_daemon()
    hold.ensure()
    try:
        wait_until(lambda: log.stat().st_size < LOG_KEEP, 15, "the log file to be moved")
        before = log.with_name(log.name + ".1")
        with open(before, "rb") as f:
            assert f.read(15) == b"the first line\n"
        assert before.stat().st_size > LOG_KEEP
        with mounts.use(image_id) as tree:  # the daemon still logs to the file
            assert (tree / "which").read_bytes() == content[image_id]
        wait_until(lambda: f"serving image {image_id}" in log.read_text(), 10, "its next line")
    finally:
        hold.release()
