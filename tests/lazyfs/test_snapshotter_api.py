"""`lazyfs snapshotter` over its real gRPC socket, driven as containerd drives it.

The mounts it answers are mounted here for real (bind and overlay), and lazy layers come
from the test image converted into a file:// store.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from lazyfs.settings import Settings
from lazyfs.snapshotter import snapshots_pb2 as pb
from lazyfs.snapshotter.remote import (
    LABEL_LAZY_IMAGE,
    LABEL_MANIFEST,
)
from lazyfs.tree.image_mounts import ImageMounts
from testbed.images import TestImages
from testbed.mounts import mounts_below
from testbed.snapshots import (
    ACTIVE,
    COMMITTED,
    code_of,
    cri_labels,
    image_trees,
    lazy_image,
    mounted,
    prepare,
    pull_lazily,
    trees,
)
from testbed.snapshotter import Snapshotter
from tests.treecompare import assert_trees_equal

LAZYFS = str(Path(sys.executable).parent / "lazyfs")


@pytest.fixture
def sn(snapshotter_factory, converted: Path) -> Snapshotter:  # noqa: ANN001
    return snapshotter_factory(f"file://{converted}")


def test_overlay_snapshots_lifecycle(sn: Snapshotter, tmp_path: Path) -> None:
    stub = sn.stub()
    with mounted(prepare(stub, "k/1/a").mounts, tmp_path / "m") as root:
        (root / "one").write_text("1")
    stub.Commit(pb.CommitSnapshotRequest(name="k/2/c1", key="k/1/a", labels={"x": "y"}))
    info = stub.Stat(pb.StatSnapshotRequest(key="k/2/c1")).info
    assert (info.name, info.parent, info.kind, dict(info.labels)) == ("k/2/c1", "", 3, {"x": "y"})
    assert stub.Usage(pb.UsageRequest(key="k/2/c1")).inodes >= 2

    mounts = prepare(stub, "k/3/b", "k/2/c1").mounts
    assert mounts[0].type == "overlay"
    with mounted(mounts, tmp_path / "m") as root:
        assert (root / "one").read_text() == "1"
        (root / "two").write_bytes(b"2" * 100_000)
        (root / "one").unlink()
    usage = stub.Usage(pb.UsageRequest(key="k/3/b"))
    assert usage.size >= 100_000 and usage.inodes >= 3  # two, the whiteout of one, the dir
    stub.Commit(pb.CommitSnapshotRequest(name="k/4/c2", key="k/3/b"))
    assert code_of(stub.Stat, pb.StatSnapshotRequest(key="k/3/b")) == grpc.StatusCode.NOT_FOUND

    view = stub.View(pb.ViewSnapshotRequest(key="k/5/v", parent="k/4/c2"))
    with mounted(view.mounts, tmp_path / "m") as root:
        assert sorted(os.listdir(root)) == ["two"]
        with pytest.raises(OSError):
            (root / "three").write_text("no")
    again = stub.Mounts(pb.MountsRequest(key="k/5/v"))
    assert list(again.mounts) == list(view.mounts)

    all_names = {i.name for r in stub.List(pb.ListSnapshotsRequest()) for i in r.info}
    assert all_names == {"k/2/c1", "k/4/c2", "k/5/v"}
    views = [i.name for r in stub.List(pb.ListSnapshotsRequest(filters=["kind==view"]))
             for i in r.info]  # fmt: skip
    assert views == ["k/5/v"]

    upd = pb.UpdateSnapshotRequest(info=pb.Info(name="k/2/c1", labels={"n": "1"}))
    upd.update_mask.paths.append("labels.n")
    assert dict(stub.Update(upd).info.labels) == {"x": "y", "n": "1"}

    assert code_of(stub.Remove, pb.RemoveSnapshotRequest(key="k/2/c1")) == (
        grpc.StatusCode.FAILED_PRECONDITION
    )
    for key in ("k/5/v", "k/4/c2", "k/2/c1"):
        stub.Remove(pb.RemoveSnapshotRequest(key=key))
    (sn.root / "snapshots" / "999").mkdir()  # what a crash between mkdir and insert leaves
    stub.Cleanup(pb.CleanupRequest())
    assert os.listdir(sn.root / "snapshots") == []


def test_bad_requests_get_containerds_codes(sn: Snapshotter) -> None:
    stub = sn.stub()
    nf, ae = grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS
    fp, ia = grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT
    prepare(stub, "active")
    assert code_of(stub.Stat, pb.StatSnapshotRequest(key="nope")) == nf
    assert code_of(stub.Mounts, pb.MountsRequest(key="nope")) == nf
    assert code_of(stub.Usage, pb.UsageRequest(key="nope")) == nf
    assert code_of(stub.Remove, pb.RemoveSnapshotRequest(key="nope")) == nf
    assert code_of(prepare, stub, "child", "missing-parent") == nf
    assert code_of(prepare, stub, "active") == ae
    assert code_of(prepare, stub, "child", "active") == ia  # parent not committed
    assert code_of(prepare, stub, "") == ia
    assert code_of(stub.Commit, pb.CommitSnapshotRequest(name="c", key="nope")) == nf
    stub.Commit(pb.CommitSnapshotRequest(name="c", key="active"))
    assert code_of(stub.Commit, pb.CommitSnapshotRequest(name="c2", key="c")) == fp
    assert code_of(stub.Mounts, pb.MountsRequest(key="c")) == fp
    prepare(stub, "active2")
    assert code_of(stub.Commit, pb.CommitSnapshotRequest(name="c", key="active2")) == ae
    upd = pb.UpdateSnapshotRequest(info=pb.Info(name="c", parent="x"))
    upd.update_mask.paths.append("parent")
    assert code_of(stub.Update, upd) == ia
    assert code_of(stub.List, pb.ListSnapshotsRequest(filters=["colour==red"])) == ia
    assert code_of(stub.List, pb.ListSnapshotsRequest(filters=["==x"])) == ia


def test_converted_image_is_lazy(sn: Snapshotter, test_images: TestImages, tmp_path: Path):
    stub = sn.stub()
    chain = pull_lazily(stub, test_images, "python")
    assert os.listdir(sn.root / "snapshots" / "1" / "fs") == []  # nothing was unpacked
    mounts = prepare(stub, "default/9/container", chain[-1]).mounts
    (m,) = mounts
    lower = next(o for o in m.options if o.startswith("lowerdir="))[len("lowerdir=") :]
    # The node's layer trees of the image for this cache and store, top first
    # (lazyfs/tree/image_mounts.py): one per layer of the python image.
    layers = image_trees(sn, lazy_image(sn, chain))
    assert lower == ":".join(layers) and len(layers) == len(chain) == 2
    trees_dir = ImageMounts(sn.store_url, sn.cache, Settings.from_env()).trees_dir
    assert all(Path(t).parent == trees_dir for t in layers)
    assert sorted(trees(sn)) == sorted(layers)
    with mounted(mounts, tmp_path / "rootfs") as root:
        out = subprocess.run(
            ["chroot", str(root), "python3", "-c", "print('hello from a lazy layer')"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert out.stdout == "hello from a lazy layer\n"
    # A second container of the image shares the mounts.
    second = prepare(stub, "default/10/container2", chain[-1]).mounts
    assert f"lowerdir={lower}" in second[0].options
    stub.Remove(pb.RemoveSnapshotRequest(key="default/9/container"))
    assert sorted(trees(sn)) == sorted(layers)
    stub.Remove(pb.RemoveSnapshotRequest(key="default/10/container2"))
    assert trees(sn) == []  # released with its last user


def test_an_image_without_layer_trees_stands_on_its_merged_tree(
    converted_merged: Path,
    snapshotter_factory,
    test_images: TestImages,
    tmp_path: Path,  # noqa: ANN001
) -> None:
    sn = snapshotter_factory(f"file://{converted_merged}")
    stub = sn.stub()
    chain = pull_lazily(stub, test_images, "python")
    (m,) = prepare(stub, "default/9/ctr", chain[-1]).mounts
    (tree,) = image_trees(sn, lazy_image(sn, chain))
    assert Path(tree).name == lazy_image(sn, chain)
    assert f"lowerdir={tree}" in m.options and trees(sn) == [tree]
    with mounted([m], tmp_path / "rootfs") as root:
        assert (root / "usr" / "bin" / "python3").stat().st_size > 1_000_000
    stub.Remove(pb.RemoveSnapshotRequest(key="default/9/ctr"))
    assert trees(sn) == []


def test_restart_keeps_state_and_running_mounts(
    sn: Snapshotter, test_images: TestImages, tmp_path: Path
) -> None:
    stub = sn.stub()
    chain = pull_lazily(stub, test_images, "python")
    mounts = prepare(stub, "default/9/ctr", chain[-1]).mounts
    with mounted(mounts, tmp_path / "rootfs") as root:
        sn.kill()
        # The container's filesystem does not depend on the snapshotter process.
        assert (root / "usr" / "bin" / "python3").exists()
        hello = subprocess.run(["chroot", str(root), "python3", "-c", "print(1)"],
                               capture_output=True, text=True, check=True)  # fmt: skip
        assert hello.stdout == "1\n"
        sn.start()
        stub = sn.stub()
        assert stub.Stat(pb.StatSnapshotRequest(key=chain[-1])).info.kind == COMMITTED
        assert list(stub.Mounts(pb.MountsRequest(key="default/9/ctr")).mounts) == list(mounts)
        assert (root / "etc" / "os-release").read_text().startswith("PRETTY_NAME")
    # A second pull of the same image finds every layer already there.
    labels = cri_labels(test_images, "python", 0)
    assert code_of(prepare, stub, "default/11/extract", "", labels) == (
        grpc.StatusCode.ALREADY_EXISTS
    )
    stub.Remove(pb.RemoveSnapshotRequest(key="default/9/ctr"))
    assert mounts_below(sn.root) == [] and trees(sn) == []


def test_restart_remounts_a_dead_lazy_mount(
    sn: Snapshotter, test_images: TestImages, tmp_path: Path
) -> None:
    stub = sn.stub()
    chain = pull_lazily(stub, test_images, "python")
    prepare(stub, "default/9/ctr", chain[-1])
    lazy = sorted(trees(sn))
    assert len(lazy) == 2  # the python image's two layer trees
    sn.stop()
    for tree in lazy:
        subprocess.run(["umount", tree], check=True)  # e.g. the node rebooted
    sn.start()
    assert sorted(trees(sn)) == lazy  # re-created at start for the active snapshot
    with mounted(sn.stub().Mounts(pb.MountsRequest(key="default/9/ctr")).mounts,
                 tmp_path / "rootfs") as root:  # fmt: skip
        assert (root / "usr" / "bin" / "python3").exists()


def test_unconverted_image_stacked_on_a_lazy_base_stands_on_its_layer_tree(
    sn: Snapshotter,
    test_images: TestImages,
    references,
    tmp_path: Path,  # noqa: ANN001
) -> None:
    """An image that was never converted but shares the converted image's base layer:
    containerd finds the base's chain id committed (a placeholder) and applies its own
    next layer on top. The base's layer tree is its lower: nothing is written to disk."""
    stub = sn.stub()
    chain = pull_lazily(stub, test_images, "python")
    mounts = prepare(stub, "default/20/extract-other", chain[0]).mounts
    (m,) = mounts
    lowers = next(o for o in m.options if o.startswith("lowerdir="))[len("lowerdir=") :]
    base_tree = image_trees(sn, lazy_image(sn, chain))[-1]
    assert lowers == base_tree and trees(sn) == [base_tree]
    assert os.listdir(sn.root / "snapshots" / "1" / "fs") == []  # not hydrated
    reference = references("base")
    with mounted(mounts, tmp_path / "rootfs") as root:
        assert sorted(os.listdir(root)) == sorted(os.listdir(reference))
        for path in ("etc/os-release", "usr/bin/env"):
            assert (root / path).read_bytes() == (reference / path).read_bytes()
        assert not (root / "usr" / "bin" / "python3").exists()  # the python layer's
    info = stub.Stat(pb.StatSnapshotRequest(key=chain[0])).info
    assert info.kind == COMMITTED
    # The converted image's own containers stand on both of its layer trees.
    top = prepare(stub, "default/21/ctr", chain[-1]).mounts
    layers = ":".join(image_trees(sn, lazy_image(sn, chain)))
    assert f"lowerdir={layers}" in top[0].options
    stub.Remove(pb.RemoveSnapshotRequest(key="default/20/extract-other"))
    stub.Remove(pb.RemoveSnapshotRequest(key="default/21/ctr"))
    assert trees(sn) == []


def test_unconverted_image_stacked_on_a_lazy_base_without_layer_trees_hydrates_it(
    converted_merged: Path,
    snapshotter_factory,
    test_images: TestImages,
    references,
    tmp_path: Path,  # noqa: ANN001
) -> None:
    """As above, on an image converted without layer trees: the placeholder must then
    hold the real base layer, written from the store's layer records."""
    sn = snapshotter_factory(f"file://{converted_merged}")
    stub = sn.stub()
    chain = pull_lazily(stub, test_images, "python")
    mounts = prepare(stub, "default/20/extract-other", chain[0]).mounts
    (m,) = mounts
    lowers = next(o for o in m.options if o.startswith("lowerdir="))[len("lowerdir=") :]
    base_fs = sn.root / "snapshots" / "1" / "fs"
    assert lowers == str(base_fs)
    reference = references("base")
    assert_trees_equal(reference, base_fs, check_root_mtime=False)
    info = stub.Stat(pb.StatSnapshotRequest(key=chain[0])).info
    assert info.kind == COMMITTED
    assert stub.Usage(pb.UsageRequest(key=chain[0])).size > 10_000_000
    # The converted image's own containers still use the lazy mount.
    top = prepare(stub, "default/21/ctr", chain[-1]).mounts
    assert f"lowerdir={sn.run_dir / 'images'}" in ",".join(top[0].options)


def test_a_lazy_image_that_cannot_mount_fails_prepare_and_leaves_nothing(
    sn: Snapshotter, test_images: TestImages, converted: Path
) -> None:
    stub = sn.stub()
    chain = pull_lazily(stub, test_images, "python")
    image_id = stub.Stat(pb.StatSnapshotRequest(key=chain[-1])).info.labels[LABEL_LAZY_IMAGE]
    manifest = converted / "images" / image_id
    saved = manifest.read_bytes()
    manifest.unlink()  # the store lost the image, and this node never mounted it
    (sn.cache / "manifests" / f"{image_id}.db").unlink()
    try:
        code = code_of(prepare, stub, "default/9/ctr", chain[-1])
    finally:
        manifest.write_bytes(saved)
    assert code != grpc.StatusCode.OK
    assert code_of(stub.Stat, pb.StatSnapshotRequest(key="default/9/ctr")) == (
        grpc.StatusCode.NOT_FOUND
    )
    assert mounts_below(sn.root) == [] and trees(sn) == []
    assert sorted(os.listdir(sn.root / "snapshots")) == ["1", "2"]  # the placeholders only


def test_lazy_mount_starts_with_the_pull_and_lingers_after_its_containers(
    snapshotter_factory,
    converted: Path,
    test_images: TestImages,  # noqa: ANN001
) -> None:
    sn = snapshotter_factory(f"file://{converted}", linger=2.0)
    stub = sn.stub()
    chain = pull_lazily(stub, test_images, "python")
    lazy = sorted(image_trees(sn, lazy_image(sn, chain)))
    deadline = time.monotonic() + 20
    while sorted(trees(sn)) != lazy:  # mounted by the pull, before any container
        assert time.monotonic() < deadline, sn.log()
        time.sleep(0.05)
    prepare(stub, "default/9/ctr", chain[-1])
    stub.Remove(pb.RemoveSnapshotRequest(key="default/9/ctr"))
    assert sorted(trees(sn)) == lazy  # linger for the next container
    prepare(stub, "default/10/ctr", chain[-1])
    stub.Remove(pb.RemoveSnapshotRequest(key="default/10/ctr"))
    released = time.monotonic()
    while trees(sn):  # their reaper (lazyfs/tree/image_mounts.py) unmounts them after 2 s
        assert time.monotonic() < released + 15, sn.log()
        time.sleep(0.1)
    assert time.monotonic() - released >= 1.5


def test_unconverted_image_unpacks_normally(sn: Snapshotter, test_images: TestImages) -> None:
    stub = sn.stub()
    labels = cri_labels(test_images, "python", 0)
    labels[LABEL_MANIFEST] = "sha256:" + hashlib.sha256(b"never converted").hexdigest()
    mounts = prepare(stub, "default/1/extract", "", labels).mounts
    assert mounts[0].type == "bind"
    info = stub.Stat(pb.StatSnapshotRequest(key="default/1/extract")).info
    assert info.kind == ACTIVE
