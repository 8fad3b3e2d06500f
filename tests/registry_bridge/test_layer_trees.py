"""Layer trees (registry_bridge/layer_trees.py): the trees of an image's layers, mounted
as the kernel mounts any image tree and stacked read-only with overlayfs, look exactly
like the image's merged tree, for every layer feature the convert tests cover."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from urllib.parse import quote

import pytest

from chunker.errors import BadInputError, CorruptObjectError
from chunker.gc import gc
from chunker.images import PublishedTree, opened_manifest, publish_tree
from chunker.keys import IMAGES_PREFIX, NAMES_PREFIX
from chunker.layer_chains import CHAINS_PREFIX, tree_of
from chunker.manifest import Manifest
from chunker.push import push
from chunker.reach import image_objects
from chunker.refs import digest_ref_key, lookup_ref
from chunker.store.backends import open_store
from chunker.store.interface import ObjectStore
from registry_bridge import convert as convert_module
from testbed import layerbuild as lb
from testbed.mounted_trees import mounted_tree
from testbed.mounts import stacked
from tests.registry_bridge.layer_features import FEATURES
from tests.treecompare import diff_snapshots, snapshot

# Cases of their own: what a layer tree must get right beyond the features above.
LAYERED: dict[str, list[list[lb.Entry]]] = {
    "a-directory-removed-and-made-again": [
        [
            lb.directory("d", mode=0o750),
            lb.file("d/old", b"o"),
            lb.directory("d/s"),
            lb.file("d/s/x"),
        ],
        [lb.whiteout("d"), lb.directory("d", mode=0o711), lb.file("d/new", b"n")],
    ],
    "metadata-only-changes": [
        [lb.file("f", b"same", mode=0o644), lb.directory("dir", mode=0o755, uid=7)],
        [lb.file("f", b"same", mode=0o600, uid=3), lb.directory("dir", mode=0o700, uid=8)],
    ],
    "a-missing-parent-keeps-the-lower-metadata": [
        [lb.directory("p", mode=0o700, uid=5, xattrs={"user.k": b"v"})],
        [lb.file("p/q/r", b"r")],
    ],
    "an-empty-layer-has-no-tree": [
        [lb.file("a", b"a")],
        [],
        [lb.file("b", b"b")],
    ],
    "three-layers-deep": [
        [lb.directory("usr"), lb.directory("usr/lib"), lb.file("usr/lib/a", b"1")],
        [lb.file("usr/lib/b", b"2"), lb.whiteout("usr/lib/a")],
        [lb.file("usr/lib/a", b"3"), lb.opaque("usr"), lb.file("usr/top", b"t")],
    ],
}

LAZYFS = str(Path(sys.executable).parent / "lazyfs")


def convert(source: str, store: Path, *extra: str) -> dict:
    done = subprocess.run(
        [LAZYFS, "convert", source, "--json", "--store", f"file://{store}", *extra],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def two_images_on_one_base(tmp_path: Path) -> list[Path]:
    """OCI layouts of two images: one base layer, and a task layer of each's own."""
    base = [lb.directory("etc"), lb.file("etc/os-release", b"debian\n")]
    return [
        lb.make_oci_layout(
            tmp_path / f"oci{n}",
            [lb.build_layer(base), lb.build_layer([lb.file("task", b"%d" % n)])],
        )
        for n in range(2)
    ]


def without_links(entries: dict) -> dict:
    """A hard link between layers is a copy in the upper layer's tree (as in a containerd
    snapshot), so link counts are not part of the comparison."""
    return {p: replace(e, nlink=None, links=None) for p, e in entries.items()}


@pytest.mark.parametrize("case", sorted({**FEATURES, **LAYERED}))
def test_stacked_layer_trees_look_like_the_merged_tree(tmp_path: Path, case: str) -> None:
    layers = [lb.build_layer(layer) for layer in {**FEATURES, **LAYERED}[case]]
    layout = lb.make_oci_layout(tmp_path / "oci", layers)
    result = convert(f"oci:{layout}:latest", tmp_path / "store")  # layer trees by default
    trees = result["layer_trees"]
    assert len(trees) == sum(1 for entries in {**FEATURES, **LAYERED}[case] if entries)
    url, cache = f"file://{tmp_path / 'store'}", tmp_path / "cache"
    with opened_manifest(open_store(url), result["image_id"]) as manifest:
        assert manifest.layer_trees == trees
    with ExitStack() as stack:
        merged = tmp_path / "merged"
        merged.mkdir()
        stack.enter_context(mounted_tree("erofs", result["image_id"], merged, url, cache))
        lowers = []
        for n, tree_id in enumerate(trees):
            mp = tmp_path / f"layer{n}"
            mp.mkdir()
            stack.enter_context(mounted_tree("erofs", tree_id, mp, url, cache))
            lowers.insert(0, mp)
        if len(lowers) == 1:
            view = lowers[0]
        else:
            view = tmp_path / "stacked"
            view.mkdir()
            stack.enter_context(stacked(lowers, view))
        assert diff_snapshots(without_links(snapshot(view)), without_links(snapshot(merged))) == []


def test_layer_trees_are_the_same_whatever_converts_them_and_live_with_their_image(
    tmp_path: Path,
) -> None:
    """Shared by images on one base: a base's tree is one object however many images
    are built on it; gc keeps it with its images, push copies it with them."""
    layouts = two_images_on_one_base(tmp_path)
    a, b = (convert(f"oci:{x}:latest", tmp_path / "store") for x in layouts)
    assert a["layer_trees"][0] == b["layer_trees"][0]
    assert a["layer_trees"][1] != b["layer_trees"][1]
    again = convert(f"oci:{layouts[0]}:latest", tmp_path / "store", "--layer-trees")
    assert again["image_id"] == a["image_id"] and again["layer_trees"] == a["layer_trees"]
    plain = convert(f"oci:{layouts[0]}:latest", tmp_path / "plain", "--no-layer-trees")
    assert plain["layer_trees"] == [] and plain["image_id"] != a["image_id"]

    store = open_store(f"file://{tmp_path / 'store'}")
    reach = image_objects(store, a["image_id"])
    assert reach.images == {a["image_id"], *a["layer_trees"]}
    dst = open_store(f"file://{tmp_path / 'copy'}")
    push(store, dst, a["image_id"])
    assert image_objects(dst, a["image_id"]).object_keys() == reach.object_keys()
    # The ref carries what a node's lookup needs (no manifest), and push keeps it.
    found = lookup_ref(store, a["name"])
    assert found is not None and found[1] is not None
    start = found[1]
    assert (start.image, start.layers, start.size) == (a["image_id"], a["layer_trees"], 7 + 1)
    assert lookup_ref(dst, a["name"]) == found
    assert lookup_ref(open_store(f"file://{tmp_path / 'plain'}"), plain["name"]) == (
        plain["image_id"],
        None,
    )


def test_a_layer_tree_is_built_once_for_its_chain_of_layers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A convert reuses the tree an earlier one built for the same layers up to a layer
    (chunker/layer_chains.py); a pointer whose tree is gone is passed over and the tree
    built again; gc takes a pointer with its tree."""
    built: list[str] = []  # the layer trees convert built (their layers' diff ids)

    def counted(
        store: ObjectStore, entries: list, nlink: dict, meta: dict[str, str], *rest: list
    ) -> PublishedTree:
        if "layer_diff_id" in meta:
            built.append(meta["layer_diff_id"])
        return publish_tree(store, entries, nlink, meta, *rest)

    monkeypatch.setattr(convert_module, "publish_tree", counted)
    layouts = two_images_on_one_base(tmp_path)
    store = open_store(f"file://{tmp_path / 'store'}")
    a = convert_module.convert(f"oci:{layouts[0]}:latest", store, name="a")
    assert len(built) == 2
    b = convert_module.convert(f"oci:{layouts[1]}:latest", store, name="b")
    assert len(built) == 3 and b.layer_trees[0] == a.layer_trees[0]  # the base's reused
    store.delete(IMAGES_PREFIX + a.layer_trees[0])  # its pointer is left dangling
    again = convert_module.convert(f"oci:{layouts[1]}:latest", store, name="b2")
    assert len(built) == 4 and again.layer_trees == b.layer_trees
    assert store.get(IMAGES_PREFIX + a.layer_trees[0])  # built again

    def pointed() -> set[str | None]:
        return {tree_of(info.key) for info in store.list(CHAINS_PREFIX)}

    assert pointed() == {*a.layer_trees, *b.layer_trees}
    store.delete(NAMES_PREFIX + quote("a", safe=""))
    store.delete(digest_ref_key(a.source_digest))
    gc(store, grace=0)
    assert pointed() == set(b.layer_trees)


def test_a_layer_erofs_cannot_hold_leaves_the_image_on_its_merged_tree(tmp_path: Path) -> None:
    """lustre.* has no EROFS xattr prefix. A layer whose file has one, deleted again by
    the next layer, leaves a merged tree EROFS holds but a layer tree it cannot: the
    image is published without layer trees, with one warning line, not refused."""
    layers = [
        [lb.file("odd", b"o", xattrs={"lustre.lov": b"x"}), lb.file("keep", b"k")],
        [lb.whiteout("odd"), lb.file("top", b"t")],
    ]
    layout = lb.make_oci_layout(tmp_path / "oci", [lb.build_layer(x) for x in layers])
    url = f"file://{tmp_path / 'store'}"
    done = subprocess.run(
        [LAZYFS, "convert", f"oci:{layout}:latest", "--json", "--store", url],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("\n") == 1 and "no layer trees for this image" in done.stderr
    assert "lustre" in done.stderr
    result = json.loads(done.stdout)
    assert result["layer_trees"] == [] and result["erofs"] is not None
    assert "lustre" in result["layer_trees_refused"]
    store = open_store(url)
    with opened_manifest(store, result["image_id"]) as manifest:
        assert manifest.layer_trees == []
    assert lookup_ref(store, result["name"]) == (result["image_id"], None)


def test_a_ref_with_malformed_start_information_is_refused(tmp_path: Path) -> None:
    layout = lb.make_oci_layout(tmp_path / "oci", [lb.build_layer([lb.file("f", b"f")])])
    result = convert(f"oci:{layout}:latest", tmp_path / "store")
    store = open_store(f"file://{tmp_path / 'store'}")
    key = NAMES_PREFIX + quote(result["name"], safe="")
    body = json.loads(store.get(key))
    for bad in (
        {"layers": ["../x"]},
        {**body["start"], "layers": []},
        {**body["start"], "size": "1"},
    ):
        store.put(key, json.dumps({**body, "start": bad}).encode())
        with pytest.raises(CorruptObjectError, match="malformed start information"):
            lookup_ref(store, result["name"])


def test_a_manifest_naming_bad_layer_trees_is_refused(tmp_path: Path) -> None:
    layout = lb.make_oci_layout(tmp_path / "oci", [lb.build_layer([lb.file("f", b"f")])])
    result = convert(f"oci:{layout}:latest", tmp_path / "store")
    store = open_store(f"file://{tmp_path / 'store'}")
    with opened_manifest(store, result["image_id"]) as manifest:
        path = manifest.path
        data = path.read_bytes()
    for bad in ("[]", '["../x"]', "{}", "not json"):
        copy = tmp_path / "bad.db"
        copy.write_bytes(data)
        db = sqlite3.connect(copy)
        db.execute("UPDATE meta SET value = ? WHERE key = 'layers'", (bad,))
        db.commit()
        db.close()
        m = Manifest(copy)
        try:
            with pytest.raises(BadInputError, match="not a list of image ids"):
                _ = m.layer_trees
        finally:
            m.close()


def test_an_image_of_empty_layers_has_no_layer_trees(tmp_path: Path) -> None:
    layout = lb.make_oci_layout(tmp_path / "oci", [lb.build_layer([])])
    result = convert(f"oci:{layout}:latest", tmp_path / "store")
    assert result["layer_trees"] == []
    store = open_store(f"file://{tmp_path / 'store'}")
    with opened_manifest(store, result["image_id"]) as manifest:
        assert manifest.layer_trees == []
    assert lookup_ref(store, result["name"]) == (result["image_id"], None)
