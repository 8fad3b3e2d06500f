"""The images' own files in the node cache (manifests, configs, EROFS metadata images)
are kept under their share of $LAZYFS_CACHE_SIZE by the node data daemon: those of
images no tree uses go, least recently used first, and come back from the store when an
image is mounted again, also when they go between their fetch and the mount."""

from __future__ import annotations

import os
import time
from contextlib import suppress
from pathlib import Path

import pytest

from lazyfs.settings import Settings
from lazyfs.tree.image_files import SUBDIRS, sweep
from lazyfs.tree.image_mounts import ImageMounts
from lazyfs.tree.node_files import mount_stats
from testbed.image_builder import publish_one_file_images
from testbed.processes import wait_until

IMAGES = 24


def image_files(cache: Path) -> dict[str, int]:
    """Each image file in the cache (temporaries aside) and the bytes of disk it holds."""
    found = {}
    for sub in SUBDIRS:
        for entry in os.scandir(cache / sub):
            if not entry.name.startswith("."):
                with suppress(FileNotFoundError):  # swept between the listing and the stat
                    found[f"{sub}/{entry.name}"] = entry.stat().st_blocks * 512
    return found


@pytest.mark.usefixtures("no_leftovers")
def test_image_files_of_images_not_in_use_are_kept_under_their_share_of_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, every image a node ever mounted left its files for good, outside the
    cache's size: here 24 images' files would take ~6x their share of a 1 MiB cache."""
    url = f"file://{tmp_path}/store"
    content = publish_one_file_images(url, IMAGES)
    ids = list(content)
    monkeypatch.setenv("LAZYFS_CACHE_SIZE", "1M")  # the data daemon reads it at its start
    settings = Settings.from_env()
    budget = settings.cache.image_files_bytes()
    cache = tmp_path / "cache"
    mounts = ImageMounts(url, cache, settings)
    hold = mounts.hold_data_daemon()  # as the node agent does: the daemon stays up
    hold.ensure()
    anchor = mounts.hold(ids[0])  # in use throughout
    try:
        assert (anchor.path / "which").read_bytes() == content[ids[0]]
        one_image = sum(image_files(cache).values())
        assert IMAGES * one_image > 4 * budget  # else this test would show nothing
        for image_id in ids[1:]:
            with mounts.use(image_id) as tree:
                assert (tree / "which").read_bytes() == content[image_id]
        wait_until(
            lambda: sum(image_files(cache).values()) <= budget, 10, "the sweep to the budget"
        )
        files = image_files(cache)
        assert f"manifests/{ids[0]}.db" in files  # in use: kept
        assert len([f for f in files if f.endswith(".db")]) < IMAGES // 2
        # ... as the data daemon's node-wide figures say
        wait_until(
            lambda: any(s.get("image_files_removed", 0) > 0 for s in mount_stats(cache)),
            10,
            "the removals in the published stats",
        )
        # ... and the stats files of their devices with them
        wait_until(
            lambda: (
                {s["image"] for s in mount_stats(cache)}
                <= {f[10:-3] for f in image_files(cache) if f.endswith(".db")}
            ),
            10,
            "the stats files of images whose files went",
        )
        assert (anchor.path / "which").read_bytes() == content[ids[0]]
        # An image whose files went is mounted again from the store's copies.
        gone = next(i for i in ids[1:] if f"manifests/{i}.db" not in files)
        with mounts.use(gone) as tree:
            assert (tree / "which").read_bytes() == content[gone]
            assert f"manifests/{gone}.db" in image_files(cache)  # (in use: kept)
    finally:
        anchor.release()
        hold.release()


@pytest.mark.usefixtures("no_leftovers")
def test_a_mount_whose_files_were_swept_after_their_fetch_fetches_them_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sweep leaves files used in the last $LAZYFS_DAEMON_IDLE seconds, which is far
    longer than a fetch takes to reach its mount; should it come between them all the
    same (a stalled manager), the mount fetches them again instead of failing. The
    sweep's timing cannot be forced, so its removal is done here, where it would land."""
    url = f"file://{tmp_path}/store"
    content = publish_one_file_images(url, 1)
    ids = list(content)
    cache = tmp_path / "cache"
    mounts = ImageMounts(url, cache, Settings.from_env())
    prepare = mounts._prepare_erofs
    prepared: list[Path] = []

    def prepare_then_swept(image_id: str) -> Path | None:
        path = prepare(image_id)
        assert path is not None
        prepared.append(path)
        if len(prepared) == 1:
            path.unlink()
            (cache / "manifests" / f"{image_id}.db").unlink()
        return path

    monkeypatch.setattr(mounts, "_prepare_erofs", prepare_then_swept)
    with mounts.use(ids[0]) as tree:
        assert (tree / "which").read_bytes() == content[ids[0]]
    assert len(prepared) == 2


def test_a_sweep_takes_the_least_recently_used_first_and_spares_the_rest(tmp_path: Path) -> None:
    """Oldest use first (an image's manifest and config as one), never an id in use nor
    one used within the grace, never a temporary being written (one left by a fetch
    killed an hour ago, yes); nothing while the files fit their budget."""
    cache = tmp_path / "cache"
    for sub in SUBDIRS:
        (cache / sub).mkdir(parents=True)
    now = time.time()

    def put(name: str, age: float) -> None:
        path = cache / name
        path.write_bytes(b"x" * 4096)
        os.utime(path, (now - age, now - 10_000))

    put("manifests/a.db", 900)  # the oldest use of an id: its manifest's
    put("manifests/a.config.json", 950)
    put("manifests/b.db", 800)  # in use
    put("erofs/c", 700)
    put("erofs/d", 600)
    put("manifests/d.config.json", 1_000)  # its config is older, its id's use is not
    put("manifests/e.db", 5)  # within the grace
    put("manifests/.f.db.123.tmp", 10)  # being written
    os.utime(cache / "manifests/.f.db.123.tmp", (now, now))
    put("erofs/.g.456.tmp", 10_000)  # a killed fetch's
    size = image_files(cache)["erofs/c"]
    assert sweep(cache, 7 * size, 0, 60, lambda: {"b"}) == (1, size, 7 * size, ())  # fits; g goes
    swept = sweep(cache, 6 * size, 4 * size, 60, lambda: {"b"})
    assert swept == (3, 3 * size, 4 * size, ("a", "c"))
    assert sorted(image_files(cache)) == [
        "erofs/d",
        "manifests/b.db",
        "manifests/d.config.json",
        "manifests/e.db",
    ]
    assert (cache / "manifests/.f.db.123.tmp").exists()
    # e: in the grace
    assert sweep(cache, 0, 0, 60, lambda: {"b"}) == (2, 2 * size, 2 * size, ("d",))
