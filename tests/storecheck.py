"""Consistency of a store: nothing reachable points at a missing object."""

from __future__ import annotations

import tempfile
from pathlib import Path

import msgpack

from chunker import layerrec
from chunker.images import fetch_manifest
from chunker.keys import IMAGES_PREFIX
from chunker.manifest import Manifest
from chunker.packs import INDEX_PREFIX, PACK_PREFIX
from chunker.refs import list_images
from chunker.store.interface import ObjectStore


def store_problems(store: ObjectStore) -> list[str]:
    """Every dangling reference in the store (empty list = consistent)."""
    problems = []
    packs = {i.key[len(PACK_PREFIX) :] for i in store.list(PACK_PREFIX)}
    for info in store.list(INDEX_PREFIX):
        pack = info.key[len(INDEX_PREFIX) :]
        if pack not in packs:
            problems.append(f"index {pack} has no pack")
        msgpack.unpackb(store.get(info.key))  # parses
    for info in store.list(layerrec.PREFIX):
        algo, hexdigest = info.key[len(layerrec.PREFIX) :].split("/")
        for _, _, inode, _ in layerrec.decode(store.get(info.key), f"{algo}:{hexdigest}"):
            for ref in inode.chunks if inode else ():
                if ref.pack not in packs:
                    problems.append(f"layer {hexdigest[:12]} names missing pack {ref.pack}")
    images = {i.key[len(IMAGES_PREFIX) :] for i in store.list(IMAGES_PREFIX)}
    for ref in list_images(store):
        if ref.image not in images:
            problems.append(f"ref {ref.name} points at missing image {ref.image}")
    with tempfile.TemporaryDirectory() as tmp:
        for image in images:
            m = Manifest(fetch_manifest(store, image, Path(tmp) / image))
            problems += [
                f"image {image[:12]} names missing pack {p}"
                for p in m.pack_names()
                if p not in packs
            ]
            m.close()
    return problems
