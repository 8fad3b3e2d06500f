"""containerd's side of the snapshotter's gRPC protocol, as the tests drive it: a
Prepare, a lazy pull with the labels containerd's CRI plugin sets, mounting what the
snapshotter answers, and the image trees it mounted."""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc

from lazyfs.snapshotter import snapshots_pb2 as pb
from lazyfs.snapshotter.remote import (
    LABEL_IMAGE_REF,
    LABEL_LAYER,
    LABEL_LAYERS,
    LABEL_LAZY_IMAGE,
    LABEL_MANIFEST,
    LABEL_REF,
    chain_ids,
)
from testbed.images import TestImages
from testbed.mounts import mounts_below
from testbed.snapshotter import Snapshotter

ACTIVE, VIEW, COMMITTED = 2, 1, 3  # containerd's snapshot kinds


def trees(sn: Snapshotter) -> list[str]:
    """The shared image trees mounted in the snapshotter's run dir."""
    return mounts_below(sn.run_dir / "images")


def code_of(call, *args) -> grpc.StatusCode:  # noqa: ANN001
    """The gRPC status code the call fails with; AssertionError if it does not fail."""
    try:
        result = call(*args)
        if hasattr(result, "__next__"):
            list(result)
    except grpc.RpcError as exc:
        return exc.code()
    raise AssertionError(f"{getattr(call, '__name__', call)} did not fail")


@contextmanager
def mounted(mounts, target: Path) -> Iterator[Path]:  # noqa: ANN001
    """Mount what the snapshotter answered, as containerd would, and unmount after."""
    (m,) = mounts
    target.mkdir(parents=True, exist_ok=True)
    opts = ",".join(o for o in m.options if o not in ("rbind", "bind"))
    if m.type == "bind":
        cmd = ["mount", "--rbind", m.source, str(target)]
        subprocess.run(cmd, check=True)
        if "ro" in m.options:
            subprocess.run(["mount", "-o", "remount,bind,ro", str(target)], check=True)
    else:
        subprocess.run(["mount", "-t", m.type, m.source, "-o", opts, str(target)], check=True)
    try:
        yield target
    finally:
        subprocess.run(["umount", str(target)], check=True)


def prepare(stub, key: str, parent: str = "", labels: dict | None = None):  # noqa: ANN001, ANN201
    return stub.Prepare(pb.PrepareSnapshotRequest(key=key, parent=parent, labels=labels or {}))


def manifest_digest(layout: Path, tag: str) -> str:
    index = json.loads((layout / "index.json").read_text())
    for m in index["manifests"]:
        if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag:
            return m["digest"]
    raise AssertionError(f"no tag {tag} in {layout}")


def cri_labels(images: TestImages, tag: str, index: int) -> dict[str, str]:
    """The labels containerd's CRI plugin and unpacker put on layer `index`'s Prepare."""
    layers = images.layers[tag]
    return {
        LABEL_REF: chain_ids([layer.diff_id for layer in layers])[index],
        LABEL_IMAGE_REF: f"registry.test/{tag}:latest",
        LABEL_MANIFEST: manifest_digest(images.layout, tag),
        LABEL_LAYER: layers[index].digest,
        LABEL_LAYERS: ",".join(layer.digest for layer in layers[index:]),
    }


def pull_lazily(stub, images: TestImages, tag: str) -> list[str]:  # noqa: ANN001
    """containerd's unpack of a converted image: every layer answers ALREADY_EXISTS and
    a committed placeholder is found by containerd's List filter. Returns the chain."""
    parent = ""
    chain = []
    for i in range(len(images.layers[tag])):
        labels = cri_labels(images, tag, i)
        code = code_of(prepare, stub, f"default/{i}/extract-{tag}", parent, labels)
        assert code == grpc.StatusCode.ALREADY_EXISTS
        ref = labels[LABEL_REF]
        query = f'labels."containerd.io/snapshot.ref"=={ref},parent=="{parent}"'
        found = [i for r in stub.List(pb.ListSnapshotsRequest(filters=[query])) for i in r.info]
        assert [(f.name, f.parent, f.kind) for f in found] == [(ref, parent, COMMITTED)]
        assert found[0].labels[LABEL_LAZY_IMAGE]
        parent = ref
        chain.append(ref)
    return chain


def lazy_image(sn: Snapshotter, chain: list[str]) -> str:
    info = sn.stub().Stat(pb.StatSnapshotRequest(key=chain[-1])).info
    return info.labels[LABEL_LAZY_IMAGE]


def image_trees(sn: Snapshotter, image_id: str) -> list[str]:
    """Where the trees a container of the converted image stands on are mounted, top
    first: its layer trees (read from its manifest in the store, docs/FORMATS.md), or
    its merged tree if it was converted without them."""
    from chunker.images import fetch_manifest
    from chunker.manifest import Manifest
    from chunker.store.backends import open_store
    from lazyfs.settings import Settings
    from lazyfs.tree.image_mounts import ImageMounts

    store = open_store(sn.store_url)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            manifest = Manifest(fetch_manifest(store, image_id, Path(tmp) / "manifest.db"))
            try:
                ids = manifest.layer_trees[::-1] or [image_id]
            finally:
                manifest.close()
    finally:
        store.close()
    mounts = ImageMounts(sn.store_url, sn.cache, Settings.from_env())
    return [str(mounts.tree_path(i)) for i in ids]
