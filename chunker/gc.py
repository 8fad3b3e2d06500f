"""`lazyfs gc`: delete what no ref reaches, safely while converters are running.

Mark: every image a ref names, its packs, and the records of its layers (chunker.reach).
Sweep, in two steps so that a converter that already loaded the chunk index and is about
to reuse a chunk of an unreachable pack is never left with a dangling reference:

1. An unreachable pack older than the grace period is *retired*: its index object moves
   to `trash/<pack>` (so no new converter dedups against it); the pack itself stays.
2. A retired pack whose trash entry is older than the grace period, and that is still
   unreachable, is deleted. If something reaches it again (a convert that started before
   step 1 published an image using it), its index object is restored instead.

Unreachable manifests, layer records and start-up traces (chunker/trace.py: live with
their image) older than the grace period are deleted directly, and so are the pointers to
layer trees (chunker/layer_chains.py) whose tree is unreachable. Objects younger than the
grace period are never touched: they may belong to a convert still in progress.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from chunker import layerrec
from chunker.errors import NotFoundError
from chunker.keys import EROFS_PREFIX, IMAGES_PREFIX
from chunker.layer_chains import CHAINS_PREFIX, tree_of
from chunker.packs import INDEX_PREFIX, PACK_PREFIX
from chunker.reach import Reachable, image_objects
from chunker.refs import list_images
from chunker.store.interface import ObjectInfo, ObjectStore
from chunker.trace import TRACES_PREFIX

TRASH_PREFIX = "trash/"
DEFAULT_GRACE = 6 * 3600.0  # seconds; longer than any convert


@dataclass
class GcResult:
    deleted: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    retired_packs: int = 0
    restored_packs: int = 0
    live_objects: int = 0


def gc(store: ObjectStore, *, grace: float = DEFAULT_GRACE) -> GcResult:
    live = Reachable()
    for ref in list_images(store):
        try:
            image_objects(store, ref.image, live)
        except NotFoundError as exc:
            # A name whose image (or one of its layer trees) lost its manifest. Passing
            # over the name would free the rest of the image, which the name still
            # promises; so gc stops here, before it deletes anything, and says which.
            raise NotFoundError(
                f"image {ref.name!r}: {exc}; gc deleted nothing (convert the image"
                " again under that name to publish its manifest again)"
            ) from None
    objects = {
        i.key: i
        for prefix in (
            PACK_PREFIX,
            INDEX_PREFIX,
            layerrec.PREFIX,
            IMAGES_PREFIX,
            EROFS_PREFIX,
            TRASH_PREFIX,
            TRACES_PREFIX,
            CHAINS_PREFIX,
        )
        for i in store.list(prefix)
    }
    # A trace is live with its image (it names only that image's packs).
    live_keys = live.object_keys() | {TRACES_PREFIX + i for i in live.images}
    result = GcResult(live_objects=len(live_keys & objects.keys()))

    def old(info: ObjectInfo) -> bool:
        return time.time() - info.mtime >= grace

    def delete(info: ObjectInfo) -> None:
        store.delete(info.key)
        result.deleted.append(info.key)
        result.freed_bytes += info.size

    def unreachable(key: str) -> bool:
        if key.startswith(CHAINS_PREFIX):  # a layer tree's pointer goes with its tree
            return tree_of(key) not in live.images
        direct = (IMAGES_PREFIX, EROFS_PREFIX, layerrec.PREFIX, TRACES_PREFIX)
        return key.startswith(direct) and key not in live_keys

    for key, info in objects.items():
        if unreachable(key) and old(info):
            delete(info)
    # Step 1: retire unreachable packs (their index object goes to the trash).
    for key, info in objects.items():
        if key.startswith(INDEX_PREFIX) and key[len(INDEX_PREFIX) :] not in live.packs:
            pack_info = objects.get(PACK_PREFIX + key[len(INDEX_PREFIX) :])
            if old(info) and (pack_info is None or old(pack_info)):
                store.put(TRASH_PREFIX + key[len(INDEX_PREFIX) :], store.get(key))
                store.delete(key)
                result.deleted.append(key)  # moved to the trash; freed when the pack goes
                result.retired_packs += 1
    # Step 2: delete retired packs whose grace has passed, or restore those reached again.
    for info in list(store.list(TRASH_PREFIX)):
        pack = info.key[len(TRASH_PREFIX) :]
        if pack in live.packs:
            store.put(INDEX_PREFIX + pack, store.get(info.key))
            store.delete(info.key)
            result.restored_packs += 1
        elif old(info):
            pack_info = objects.get(PACK_PREFIX + pack)
            if pack_info is not None:
                delete(pack_info)
            delete(info)
    # Packs with no index and no trash entry (a convert killed between the two puts).
    indexed = {k[len(INDEX_PREFIX) :] for k in objects if k.startswith(INDEX_PREFIX)}
    trashed = {k[len(TRASH_PREFIX) :] for k in objects if k.startswith(TRASH_PREFIX)}
    for key, info in objects.items():
        pack = key[len(PACK_PREFIX) :]
        if (
            key.startswith(PACK_PREFIX)
            and pack not in indexed
            and pack not in trashed
            and pack not in live.packs
            and old(info)
        ):
            delete(info)
    return result
