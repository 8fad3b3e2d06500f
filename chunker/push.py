"""`lazyfs push`: copy a converted image to another store, uploading only what is missing.

Objects go up in the same order a convert writes them (packs, their indexes, layer
records, the manifest) and the refs last, so the destination never names an object it
does not hold, even if the push is interrupted.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from chunker.images import list_images, publish_refs
from chunker.reach import image_objects
from chunker.store import ObjectStore


@dataclass
class PushResult:
    image_id: str
    objects_copied: int
    bytes_copied: int
    objects_present: int


def push(src: ObjectStore, dst: ObjectStore, image_id: str, *, jobs: int = 8) -> PushResult:
    need = image_objects(src, image_id)
    present = {
        i.key for prefix in ("packs/", "index/", "layers/", "images/") for i in dst.list(prefix)
    }
    copied = [0, 0]

    def copy(key: str) -> None:
        data = src.get(key)
        dst.put(key, data)
        copied[0] += 1
        copied[1] += len(data)

    def copy_all(keys: set[str]) -> None:
        with ThreadPoolExecutor(jobs) as pool:
            list(pool.map(copy, sorted(keys - present)))

    copy_all({f"packs/{p}" for p in need.packs})
    copy_all({f"index/{p}" for p in need.packs})
    copy_all(need.layers)
    copy_all({f"images/{image_id}"})
    # Refs last: every name and digest that points at this image in the source.
    for ref in list_images(src):
        if ref.image == image_id:
            publish_refs(dst, image_id, ref.name, ref.source_digest)
    total = len(need.object_keys())
    return PushResult(image_id, copied[0], copied[1], total - copied[0])
