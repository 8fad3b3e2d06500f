"""A layer's tree found by the chain of layers up to it, so that a convert reuses the tree
an earlier convert built instead of building it again (docs/FORMATS.md, "Store layout").

A layer's tree is the difference between the merged trees before and after the layer
(registry_bridge/layer_trees.py), so the diff ids of the layers up to it, in order (its
chain, as OCI's ChainID), decide it, for one version of the rules that make it and of the
manifest and EROFS formats; all of them are in the pointer's key. A pointer is an empty
object whose key names the tree, so that neither a convert nor gc reads it: gc deletes
the pointers whose tree it does not keep (chunker/gc.py).

Building a tree is its manifest and EROFS image made and compressed: 0.25 s of a sympy
convert whose layers were all converted before, against 0.36 s for the rest of it
(docs/design-changes.md, session 43).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import blake3

from chunker import erofs, manifest
from chunker.errors import LazyfsError
from chunker.images import fetch_erofs, fetch_manifest
from chunker.keys import EROFS_PREFIX, IMAGE_ID, IMAGES_PREFIX
from chunker.manifest import Manifest
from chunker.store.interface import ObjectStore

CHAINS_PREFIX = "layer-trees/"
# Bump when registry_bridge/layer_trees.py makes other trees from the same layers.
RULES_VERSION = 1


def chain_id(below: str, diff_id: str) -> str:
    """The chain of a layer: `below` is the chain of the layers under it ("" for none)."""
    return blake3.blake3(f"{below} {diff_id}".encode()).hexdigest()


def _prefix(chain: str) -> str:
    versions = f"v{RULES_VERSION}-m{manifest.FORMAT_VERSION}-e{erofs.FORMAT_VERSION}"
    return f"{CHAINS_PREFIX}{versions}/{chain}/"


def tree_of(key: str) -> str | None:
    """The tree a pointer's key names (None if the key is not a pointer's)."""
    if not key.startswith(CHAINS_PREFIX):
        return None
    tree = key.rpartition("/")[2]
    return tree if IMAGE_ID.fullmatch(tree) else None


def remember(store: ObjectStore, chain: str, tree_id: str) -> None:
    """Point the chain at its tree (published already: a pointer never names a tree that
    is not stored yet)."""
    store.put(_prefix(chain) + tree_id, b"")


def reuse(store: ObjectStore, chain: str, diff_id: str) -> str | None:
    """The id of the tree a pointer of `chain` names, its manifest and EROFS image checked
    (their ids, and that it is the tree of layer `diff_id`) and put again, so that gc's
    grace period covers them as it covers a tree built now; None if there is none, or
    none whose objects are whole (the caller builds it then)."""
    prefix = _prefix(chain)
    for info in store.list(prefix):
        tree_id = tree_of(info.key)
        if tree_id is None or info.key != prefix + tree_id:
            continue
        try:
            if _put_again(store, tree_id, diff_id):
                return tree_id
        except LazyfsError:  # gone (gc) or damaged: not this one
            continue
    return None


def _put_again(store: ObjectStore, tree_id: str, diff_id: str) -> bool:
    """Each object read once: checked from the bytes read, and those bytes put back."""
    manifest_blob = store.get(IMAGES_PREFIX + tree_id)
    with tempfile.TemporaryDirectory(prefix="lazyfs-chain-") as tmp:
        path = fetch_manifest(store, tree_id, Path(tmp) / "manifest.db", manifest_blob)
        tree = Manifest(path)
        try:
            metadata, layer = tree.erofs, tree.meta.get("layer_diff_id")
        finally:
            tree.close()
        if metadata is None or layer != diff_id:
            return False
        erofs_blob = store.get(EROFS_PREFIX + metadata[0])
        fetch_erofs(store, metadata[0], Path(tmp) / "erofs", erofs_blob)
    # In the order a convert writes them: the EROFS image, then the manifest naming it.
    store.put(EROFS_PREFIX + metadata[0], erofs_blob)
    store.put(IMAGES_PREFIX + tree_id, manifest_blob)
    return True
