"""push copies only what is missing (refs last); gc deletes exactly what no ref reaches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import pytest

from chunker.gc import gc
from chunker.keys import NAMES_PREFIX
from chunker.layer_chains import tree_of
from chunker.push import push
from chunker.reach import Reachable, image_objects
from chunker.refs import digest_ref_key, list_images, publish_refs, resolve_image
from chunker.store.backends import open_store
from testbed.images import TestImages
from tests.counting_store import CountingStore
from tests.storecheck import store_problems
from tests.treecompare import assert_trees_equal

LAZYFS = str(Path(sys.executable).parent / "lazyfs")


def lazyfs(*args: str, env: dict | None = None) -> dict:
    proc = subprocess.run(
        [LAZYFS, *args, "--json"], capture_output=True, text=True, env={**os.environ, **(env or {})}
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def local_store(test_images: TestImages, tmp_path_factory) -> str:
    """base and python converted into a local store (python reuses base's layer)."""
    url = f"file://{tmp_path_factory.mktemp('local-store')}"
    for tag in ("base", "python"):
        lazyfs("convert", f"oci:{test_images.layout}:{tag}", "--name", tag, "--store", url)
    return url


def all_keys(url: str) -> set[str]:
    return {i.key for i in open_store(url).list("")}


def test_push_to_s3_copies_only_missing_objects_and_converts_nothing_twice(
    test_images, references, local_store, seaweed, s3_url, tmp_path
) -> None:
    env = seaweed.env
    first = lazyfs("push", "python", "--to", s3_url, "--store", local_store, env=env)
    assert first["objects_copied"] > 0 and first["objects_present"] == 0
    again = lazyfs("push", "python", "--to", s3_url, "--store", local_store, env=env)
    assert again["objects_copied"] == 0
    # base's layer record, packs and layer tree came with python: only base's manifest is
    # new (its EROFS image is its one layer tree's, the same bytes).
    base = lazyfs("push", "base", "--to", s3_url, "--store", local_store, env=env)
    assert base["objects_copied"] == 1
    # Converting the same image straight into S3 finds every layer converted already.
    conv = lazyfs(
        "convert",
        f"oci:{test_images.layout}:python",
        "--name",
        "python2",
        "--store",
        s3_url,
        env=env,
    )
    assert conv["stats"]["layers_reused"] == 2 and conv["stats"]["chunks_new"] == 0
    assert conv["image_id"] == first["image_id"]
    # The pushed image is complete: export it from S3 and compare with umoci.
    subprocess.run(
        [LAZYFS, "export", "python", str(tmp_path / "out"), "--store", s3_url],
        env={**os.environ, **env},
        check=True,
        capture_output=True,
    )
    assert_trees_equal(tmp_path / "out", references("python"))


def test_push_asks_the_destination_for_the_images_objects_only(local_store, tmp_path) -> None:
    """No listing of the destination: it grows with every image a fleet's store holds,
    and each push listed it all again. Asked object by object, a push costs requests in
    proportion to its own image."""
    src = open_store(local_store)
    dst = CountingStore(open_store(f"file://{tmp_path / 'dst'}"), tmp_path / "gets.log")
    python = resolve_image(src, "python")
    first = push(src, dst, python)
    assert first.objects_copied > 0 and first.objects_present == 0
    again = push(src, dst, python)
    assert (again.objects_copied, again.objects_present) == (0, first.objects_copied)
    base = push(src, dst, resolve_image(src, "base"))
    assert base.objects_copied == 1  # its manifest: the rest came with python (as above)
    assert dst.listed == []
    assert store_problems(dst) == []


def test_gc_deletes_exactly_the_unreachable_objects(
    test_images, local_store, tmp_path, seaweed, s3_url
) -> None:
    for url in (f"file://{tmp_path / 'store'}", s3_url):
        lazyfs("push", "base", "--to", url, "--store", local_store, env=seaweed.env)
        lazyfs("push", "python", "--to", url, "--store", local_store, env=seaweed.env)
        store = open_store(url)
        # Drop python's refs: its manifest, its own layer record and packs become garbage.
        (python,) = [r for r in list_images(store) if r.name == "python"]
        store.delete(NAMES_PREFIX + quote("python", safe=""))
        store.delete(digest_ref_key(python.source_digest))
        live = image_objects(store, next(r.image for r in list_images(store)), Reachable())
        before = all_keys(url)
        # (and a layer tree's pointer lives with its tree: chunker/layer_chains.py)
        kept = live.object_keys() | {k for k in before if tree_of(k) in live.images}
        expected = {k for k in before if not k.startswith("refs/")} - kept
        assert expected, "the test must leave something to collect"
        assert gc(store).deleted == []  # everything is younger than the grace period
        result = lazyfs("gc", "--grace", "0", "--store", url, env=seaweed.env)
        # (retired packs' trash entries come and go within the run when grace is 0)
        assert {k for k in result["deleted_keys"] if not k.startswith("trash/")} == expected
        assert all_keys(url) == before - expected
        assert store_problems(store) == []


def test_gc_deletes_nothing_when_a_names_manifest_is_missing(local_store, tmp_path) -> None:
    """A name whose image lost its manifest: gc stops with one line naming it, and every
    other object stays (the name still promises the image's packs)."""
    url = f"file://{tmp_path / 'store'}"
    lazyfs("push", "python", "--to", url, "--store", local_store)
    store = open_store(url)
    (ref,) = list_images(store)
    store.delete(f"images/{ref.image}")
    before = all_keys(url)
    proc = subprocess.run(
        [LAZYFS, "gc", "--grace", "0", "--store", url], capture_output=True, text=True
    )
    assert proc.returncode == 3 and proc.stdout == "", proc
    (line,) = proc.stderr.splitlines()
    assert "'python'" in line and "gc deleted nothing" in line and ref.image in line
    assert all_keys(url) == before


def test_gc_restores_a_retired_pack_that_a_late_convert_reaches(local_store, tmp_path) -> None:
    url = f"file://{tmp_path / 'store'}"
    lazyfs("push", "base", "--to", url, "--store", local_store)
    store = open_store(url)
    (ref,) = list_images(store)
    store.delete(NAMES_PREFIX + quote("base", safe=""))
    store.delete(digest_ref_key(ref.source_digest))
    # A gc an hour later retires the packs, but keeps them for another grace period...
    hour_ago = time.time() - 3600
    for path in (tmp_path / "store").rglob("*"):
        os.utime(path, (hour_ago, hour_ago))
    result = gc(store, grace=600)
    assert result.retired_packs > 0 and not any(k.startswith("packs/") for k in result.deleted)
    assert not any(k.startswith("index/") for k in all_keys(url))
    # ...during which a convert that had loaded the old index publishes an image using them
    # (its manifests, its layer trees' too, and their EROFS images).
    src = open_store(local_store)
    for key in image_objects(src, ref.image).object_keys():
        if key.startswith(("images/", "erofs/")):
            store.put(key, src.get(key))
    publish_refs(store, ref.image, "base", ref.source_digest)
    result = gc(store, grace=600)
    assert result.restored_packs > 0 and result.deleted == []
    assert store_problems(store) == []
