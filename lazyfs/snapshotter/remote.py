"""Which layers containerd asks for are already in the store as a converted image.

containerd's CRI plugin labels each layer's Prepare (with `disable_snapshot_annotations =
false`) with the image's manifest digest and the layer's digest, and containerd's unpacker
adds `containerd.io/snapshot.ref`: the chain id the layer will be committed as. A convert
publishes `refs/digests/<manifest digest>` (chunker/images.py), and the manifest keeps the
image config, whose `rootfs.diff_ids` give every layer's chain id. A layer is remote when
its chain id is one of the converted image's: then its index is known exactly, whatever
the labels say about the other layers.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path

from chunker.errors import LazyfsError, NotFoundError
from chunker.manifest import Manifest
from chunker.refs import image_of_digest
from chunker.store.interface import ObjectStore
from lazyfs.snapshotter.state import LazyLayer
from lazyfs.tree.node_files import cached_manifest

LABEL_REF = "containerd.io/snapshot.ref"
LABEL_IMAGE_REF = "containerd.io/snapshot/cri.image-ref"
LABEL_MANIFEST = "containerd.io/snapshot/cri.manifest-digest"
LABEL_LAYER = "containerd.io/snapshot/cri.layer-digest"
LABEL_LAYERS = "containerd.io/snapshot/cri.image-layers"
# Ours, on placeholders: what an operator looks at to tell a lazy layer from a pulled one.
LABEL_LAZY_IMAGE = "containerd.io/snapshot/lazyfs.image"

log = logging.getLogger("lazyfs.snapshotter")


def chain_ids(diff_ids: list[str]) -> list[str]:
    """The OCI chain id of every layer prefix: C0 = D0, Cn = sha256(C(n-1) + " " + Dn)."""
    out: list[str] = []
    for d in diff_ids:
        if out:
            d = "sha256:" + hashlib.sha256(f"{out[-1]} {d}".encode()).hexdigest()
        out.append(d)
    return out


def image_diff_ids(store: ObjectStore, cache_dir: Path, image_id: str) -> list[str]:
    """The converted image's layers (uncompressed digests, bottom first), from the source
    config its manifest keeps."""
    manifest = Manifest(cached_manifest(store, image_id, cache_dir))
    try:
        return _diff_ids(manifest)
    finally:
        manifest.close()


def _diff_ids(manifest: Manifest) -> list[str]:
    return [str(d) for d in manifest.config.get("rootfs", {}).get("diff_ids", [])]


def image_layer_trees(store: ObjectStore, cache_dir: Path, image_id: str) -> list[str | None]:
    """The converted image's layer tree for each of its layers (bottom first): a tree id,
    or None for a layer that changed nothing and so has none (docs/FORMATS.md, "Layer
    trees"). [] if the image has no layer trees, or if they do not match its layers one
    for one: each tree's manifest names the layer it is (`layer_diff_id`), and every
    tree must be some layer's, in order."""
    manifest = Manifest(cached_manifest(store, image_id, cache_dir))
    try:
        trees, diff_ids = manifest.layer_trees, _diff_ids(manifest)
    finally:
        manifest.close()
    if not trees:
        return []
    layer_of = []
    for tree_id in trees:
        tree = Manifest(cached_manifest(store, tree_id, cache_dir))
        try:
            layer_of.append(tree.meta.get("layer_diff_id"))
        finally:
            tree.close()
    out: list[str | None] = []
    for diff_id in diff_ids:
        taken = len(out) - out.count(None)
        out.append(trees[taken] if taken < len(trees) and layer_of[taken] == diff_id else None)
    if len(out) - out.count(None) != len(trees):
        return []
    return out


class RemoteImages:
    """Looks up converted images by manifest digest; remembers what it found."""

    def __init__(self, store: ObjectStore, cache_dir: Path) -> None:
        self.store = store
        self.cache_dir = cache_dir
        self._chains: dict[str, tuple[str, list[str]]] = {}  # manifest digest -> (id, chains)
        self._trees: dict[str, list[str | None]] = {}  # image id -> image_layer_trees
        self._lock = threading.Lock()

    def layer_trees(self, image_id: str) -> list[str | None]:
        """image_layer_trees of a converted image, remembered."""
        with self._lock:
            if image_id in self._trees:
                return self._trees[image_id]
        found = image_layer_trees(self.store, self.cache_dir, image_id)
        with self._lock:
            self._trees[image_id] = found
        return found

    def layer(self, labels: dict[str, str]) -> LazyLayer | None:
        """The converted layer a Prepare asks for, or None to unpack it as usual."""
        target, digest = labels.get(LABEL_REF), labels.get(LABEL_MANIFEST)
        if not target or not digest or LABEL_LAYER not in labels:
            return None
        found = self._image(digest)
        if found is None:
            return None
        image_id, chains = found
        if target not in chains:
            log.warning("image %s (%s) has no layer chain %s", image_id, digest, target)
            return None
        index = chains.index(target)
        return LazyLayer(image_id, index, index == len(chains) - 1)

    def _image(self, digest: str) -> tuple[str, list[str]] | None:
        with self._lock:
            if digest in self._chains:
                return self._chains[digest]
        try:
            image_id = image_of_digest(self.store, digest)
            if image_id is None:
                return None  # never converted: not cached, a convert may come later
            diff_ids = image_diff_ids(self.store, self.cache_dir, image_id)
        except NotFoundError:
            return None  # a ref whose manifest is gone (gc): as never converted, not cached
        except (LazyfsError, ValueError, KeyError, TypeError) as exc:
            # Only a hint: an unreadable ref must not stop the image from being pulled.
            log.warning("cannot use converted image for %s: %s", digest, exc)
            return None
        found = (image_id, chain_ids(diff_ids))
        with self._lock:
            self._chains[digest] = found
        return found
