"""`lazyfs export` reads the store in few large GETs, and its chunk feed is never wrong.

(That an export is the image's tree, byte for byte against umoci's unpack, is
tests/registry_bridge/test_convert.py's and tests/chunker/test_push_gc.py's, over S3.)"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from chunker.images import opened_manifest
from chunker.manifest import Manifest
from chunker.model import Kind
from chunker.packs import read_chunk
from chunker.refs import resolve_image
from chunker.store.backends import open_store
from chunker.store.interface import ObjectStore
from lazyfs.export import ChunkFeed, Exporter
from testbed.images import TestImages
from tests.counting_store import CountingStore, gets

LAZYFS = str(Path(sys.executable).parent / "lazyfs")


@pytest.fixture(scope="module")
def python_store(test_images: TestImages, tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"file://{tmp_path_factory.mktemp('export-store')}"
    subprocess.run(
        [LAZYFS, "convert", f"oci:{test_images.layout}:python", "--name", "python"]
        + ["--store", url, "--json"],
        check=True,
        capture_output=True,
    )
    return url


def files_in_walk_order(manifest: Manifest) -> list[int]:
    seen: list[int] = []
    for _, ino in manifest.walk():
        attr = manifest.getattr(ino)
        if attr is not None and attr.kind == Kind.REG and ino not in seen:
            seen.append(ino)
    return seen


def contents_one_get_per_chunk(store: ObjectStore, manifest: Manifest, ino: int) -> bytes:
    return b"".join(read_chunk(store, ref) for _, ref in manifest.chunks(ino))


def test_export_reads_the_packs_in_few_large_gets(python_store: str, tmp_path: Path) -> None:
    log = tmp_path / "gets.log"
    store = CountingStore(open_store(python_store), log)
    with opened_manifest(store, resolve_image(store, "python")) as manifest:
        chunks = sum(len(manifest.chunks(ino)) for ino in files_in_walk_order(manifest))
        Exporter(store, manifest).run(tmp_path / "out")
    pack_gets = sum(g["key"].startswith("packs/") for g in gets(log))
    # One GET per chunk before (~4,000 here); now one per coalesced span of a pack.
    assert 0 < pack_gets <= chunks // 20, (pack_gets, chunks)
    proc = subprocess.run(
        [LAZYFS, "export", "python", str(tmp_path / "again"), "--store", python_store],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    usr_bin = sorted(os.listdir(tmp_path / "out/usr/bin"))
    assert usr_bin == sorted(os.listdir(tmp_path / "again/usr/bin")) and "python3" in usr_bin


@pytest.mark.parametrize("order", ["planned", "shuffled", "reversed"])
def test_the_feed_gives_each_file_its_own_bytes_in_any_order(python_store: str, order: str) -> None:
    """Asked out of its plan's order, the feed reads those files chunk by chunk: slower,
    and still each file's own bytes."""
    store = open_store(python_store)
    with (
        opened_manifest(store, resolve_image(store, "python")) as manifest,
        ThreadPoolExecutor(4) as pool,
    ):
        plan = files_in_walk_order(manifest)
        asked = list(plan)
        if order == "shuffled":
            random.Random(7).shuffle(asked)
        elif order == "reversed":
            asked.reverse()
        feed = ChunkFeed(store, manifest, plan, pool)
        sample = set(random.Random(3).sample(plan, 200))
        checked = 0
        for ino in asked:
            data = b"".join(d for _, d in feed.chunks(ino))
            attr = manifest.getattr(ino)
            assert attr is not None and len(data) == attr.size, ino
            if ino in sample:  # the direct path is one GET per chunk: check a sample
                assert data == contents_one_get_per_chunk(store, manifest, ino), ino
                checked += 1
        assert checked == len(sample)
