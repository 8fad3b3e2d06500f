"""What an image needs in a store: the objects reachable from it (for push and gc)."""

from __future__ import annotations

from dataclasses import dataclass, field

from chunker import layerrec
from chunker.errors import ObjectNotFound
from chunker.images import opened_manifest
from chunker.keys import EROFS_PREFIX, IMAGES_PREFIX
from chunker.packs import INDEX_PREFIX, PACK_PREFIX
from chunker.store.interface import ObjectStore


@dataclass
class Reachable:
    images: set[str] = field(default_factory=set)
    layers: set[str] = field(default_factory=set)  # layer record keys
    packs: set[str] = field(default_factory=set)  # pack names
    erofs: set[str] = field(default_factory=set)  # EROFS metadata object ids

    def object_keys(self) -> set[str]:
        return (
            {IMAGES_PREFIX + i for i in self.images}
            | {EROFS_PREFIX + e for e in self.erofs}
            | self.layers
            | {PACK_PREFIX + p for p in self.packs}
            | {INDEX_PREFIX + p for p in self.packs}
        )


def image_objects(store: ObjectStore, image_id: str, into: Reachable | None = None) -> Reachable:
    """The manifest, its EROFS metadata image, every pack it reads, its layers' trees
    (each a manifest of its own, with the same), and the records of the layers it was
    made from (so that a store holding them never chunks those layers again) with
    their packs."""
    found = into if into is not None else Reachable()
    found.images.add(image_id)
    with opened_manifest(store, image_id) as manifest:
        found.packs.update(manifest.pack_names())
        if manifest.erofs is not None:
            found.erofs.add(manifest.erofs[0])
        config = manifest.config
        layer_trees = manifest.layer_trees
    for tree_id in layer_trees:
        if tree_id not in found.images:
            image_objects(store, tree_id, found)
    for diff_id in (config.get("rootfs") or {}).get("diff_ids") or []:
        key = layerrec.record_key(diff_id)
        if key in found.layers:
            continue
        try:
            records = layerrec.decode(store.get(key), diff_id)
        except ObjectNotFound:
            continue  # records are a convert-time shortcut; an image works without them
        found.layers.add(key)
        for _, _, inode, _ in records:
            if inode is not None:
                found.packs.update(ref.pack for ref in inode.chunks)
    return found
