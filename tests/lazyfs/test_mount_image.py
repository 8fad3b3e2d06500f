"""The mount of a real Debian image: identical to umoci's extraction, runs python3, fetches
shared chunks once across mounts, and fails reads with EIO (not hangs) when the store is
down."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from lazyfs.tree.node_files import mount_stats
from node_cache.index import CacheIndex
from testbed.images import TestImages
from testbed.mounted_trees import TREES, mounted_tree
from tests.treecompare import assert_trees_equal

LAZYFS = str(Path(sys.executable).parent / "lazyfs")


def convert(source: str, store_url: str, name: str, env: dict | None = None) -> dict:
    out = subprocess.run(
        [LAZYFS, "convert", source, "--name", name, "--store", store_url, "--json"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def file_store(test_images: TestImages, tmp_path_factory) -> str:
    url = f"file://{tmp_path_factory.mktemp('mount-store')}"
    convert(f"oci:{test_images.layout}:python", url, "python")
    return url


@pytest.fixture(scope="module")
def s3_store(test_images: TestImages, seaweed) -> str:  # noqa: ANN001
    """An S3 store holding the base and python images, converted once for the module's
    S3 tests (each reads it through a node cache of its own)."""
    if not seaweed.running:  # a previous test left it down: bring it back
        seaweed.start()
    url = f"s3://{seaweed.bucket}/test-mount-image-{uuid.uuid4().hex}"
    env = {**os.environ, **seaweed.env}
    convert(f"oci:{test_images.layout}:base", url, "base", env)
    convert(f"oci:{test_images.layout}:python", url, "python", env)
    return url


@pytest.mark.parametrize("tree", TREES)
def test_mounted_tree_is_identical_to_umoci_unpack(references, file_store, tmp_path, tree) -> None:
    reference = references("python")
    (tmp_path / "mnt").mkdir()
    with mounted_tree(tree, "python", tmp_path / "mnt", file_store, tmp_path / "cache"):
        assert_trees_equal(tmp_path / "mnt", reference)
        out = subprocess.run(
            [
                "chroot",
                str(tmp_path / "mnt"),
                "/usr/bin/python3",
                "-c",
                "import json, sys; print(sys.version_info[:2])",
            ],
            capture_output=True,
            text=True,
        )
        assert out.returncode == 0 and out.stdout == "(3, 11)\n", out.stderr
        time.sleep(1.2)  # stats files are rewritten once a second
        (stats,) = mount_stats(tmp_path / "cache")
        assert stats["errors"] == 0 and stats.get("tree", "fuse") == tree


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.usefixtures("s3_url")  # the AWS_* variables, for the mounts
def test_two_images_sharing_a_base_fetch_each_chunk_once(seaweed, s3_store, tmp_path, tree) -> None:
    """Two mounts read the same base files at the same moment: on the FUSE tree, two
    mount processes; on EROFS, one node data daemon serving both images."""
    cache = tmp_path / "cache"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    before = seaweed.request_count()
    with (
        mounted_tree(tree, "base", tmp_path / "a", s3_store, cache),
        mounted_tree(tree, "python", tmp_path / "b", s3_store, cache),
    ):
        # Every file of /usr/lib in both mounts, by two processes at once.
        # (through a pipe: GNU tar skips reading files when it writes to /dev/null)
        readers = [
            subprocess.Popen(
                ["sh", "-c", "find . -type f -print0 | xargs -0 cat | wc -c"],
                cwd=tmp_path / m / "usr" / "lib",
                stdout=subprocess.PIPE,
            )
            for m in ("a", "b")
        ]
        assert [r.wait(300) for r in readers] == [0, 0]
        time.sleep(1.5)  # stats files are rewritten once a second
        stats = mount_stats(cache)
    requests = seaweed.request_count() - before
    if tree == "erofs":  # one process, one set of node cache counters, for both images
        assert len({s["pid"] for s in stats}) == 1
        stats = stats[:1]
    fetched = sum(s["chunks_fetched"] for s in stats)
    index = CacheIndex(cache / "index")  # small chunks have no file: count the index
    try:
        cached = index.usage()[0]
    finally:
        index.close()
    print(
        f"chunks fetched by both mounts: {fetched}, distinct chunks cached: {cached},"
        f" store requests: {requests}"
    )
    assert len(stats) == (2 if tree == "fuse" else 1)
    assert all(s["chunks_fetched"] > 0 for s in stats)
    assert fetched == cached  # no chunk was fetched twice
    assert sum(s["store_requests"] for s in stats) < fetched  # nearby misses coalesced


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.usefixtures("s3_url")  # the AWS_* variables, for the mounts
def test_store_down_gives_eio_in_bounded_time_then_recovers(
    seaweed, s3_store, tmp_path, monkeypatch, tree
) -> None:
    monkeypatch.setenv("LAZYFS_FETCH_TIMEOUT", "5")
    (tmp_path / "mnt").mkdir()
    target = tmp_path / "mnt" / "usr" / "bin" / "python3.11"
    with mounted_tree(tree, "python", tmp_path / "mnt", s3_store, tmp_path / "cache"):
        size = target.stat().st_size  # metadata comes from the manifest: no store needed
        with seaweed.down():
            start = time.monotonic()
            with pytest.raises(OSError) as exc, open(target, "rb") as f:
                f.read()
            took = time.monotonic() - start
            assert exc.value.errno == errno.EIO
            assert took < 30, f"read failed only after {took:.1f} s"
        with open(target, "rb") as f:  # the store is back
            assert len(f.read()) == size
        time.sleep(1.2)  # stats files are rewritten once a second
        (stats,) = mount_stats(tmp_path / "cache")
        assert stats["errors"] >= 1 and stats["last_error"]
