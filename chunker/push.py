"""`lazyfs push`: copy a converted image to another store, uploading only what is missing.

Objects go up in the same order a convert writes them (packs, their indexes, layer
records, the manifest), then the image's start-up trace if the source has one (so mounts
on the destination's nodes prefetch from their first start), and the refs last, so the
destination never names an object it does not hold, even if the push is interrupted.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from chunker.errors import ObjectNotFound
from chunker.keys import EROFS_PREFIX, IMAGES_PREFIX
from chunker.packs import INDEX_PREFIX, PACK_PREFIX
from chunker.reach import image_objects
from chunker.refs import copy_refs
from chunker.store.interface import ObjectStore
from chunker.trace import trace_key


@dataclass
class PushResult:
    image_id: str
    objects_copied: int
    bytes_copied: int
    objects_present: int


def push(src: ObjectStore, dst: ObjectStore, image_id: str, *, jobs: int = 8) -> PushResult:
    need = image_objects(src, image_id)
    # What the destination holds already, asked object by object (HEAD on S3): a listing
    # of its prefixes, as push made first, grows with every image the store holds (a
    # fleet's store holds thousands, and each push listed them all again); this grows
    # only with the image.
    wanted = sorted(need.object_keys())
    with ThreadPoolExecutor(jobs) as pool:
        held = pool.map(dst.exists, wanted)
        present = {key for key, there in zip(wanted, held, strict=True) if there}
    sizes: list[int] = []  # bytes of each object copied

    def copy(key: str) -> int:
        data = src.get(key)
        dst.put(key, data)
        return len(data)

    def copy_all(keys: set[str]) -> None:
        with ThreadPoolExecutor(jobs) as pool:
            sizes.extend(pool.map(copy, sorted(keys - present)))

    copy_all({PACK_PREFIX + p for p in need.packs})
    copy_all({INDEX_PREFIX + p for p in need.packs})
    copy_all(need.layers)
    copy_all({EROFS_PREFIX + e for e in need.erofs})
    copy_all({IMAGES_PREFIX + i for i in need.images - {image_id}})  # its layer trees
    copy_all({IMAGES_PREFIX + image_id})
    total = len(need.object_keys())
    # A trace is optional: copied when the source has one and the destination has none
    # (the first trace written for an image stays, as it does on a mount's store).
    for tree_id in sorted(need.images):
        key = trace_key(tree_id)
        if not dst.exists(key):
            try:
                trace = src.get(key)
            except ObjectNotFound:
                trace = None
            if trace is not None:
                dst.put(key, trace)
                sizes.append(len(trace))
                total += 1
        elif src.exists(key):
            total += 1
    # Refs last: every name and digest that points at this image in the source.
    copy_refs(src, dst, image_id)
    return PushResult(image_id, len(sizes), sum(sizes), total - len(sizes))
