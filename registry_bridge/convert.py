"""The convert pipeline: image source -> layer records -> merged tree -> manifest -> refs.

Order of writes is what keeps the store consistent under `kill -9` and concurrent
converters: packs, then their index objects, then each layer's record, then the image
manifest, then the refs. Nothing points at an object that is not already stored.
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import BinaryIO

from chunker import layerrec
from chunker.chunking import chunk_id, cut_reader
from chunker.errors import ObjectNotFound
from chunker.images import publish_refs, upload_manifest
from chunker.manifest import build_manifest, temp_manifest_path
from chunker.model import Inode, Kind
from chunker.packs import ChunkIndex, PackWriter, compress_chunk
from chunker.store import ObjectStore
from registry_bridge.decompress import open_layer_tar
from registry_bridge.layer_tar import LayerEntry, Op, iter_layer
from registry_bridge.sources import ImageSource, LayerDescriptor, open_source
from registry_bridge.tree import Tree

IN_FLIGHT = 64  # chunks being hashed/compressed ahead of the writer


@dataclass
class ConvertStats:
    layers: int = 0
    layers_reused: int = 0
    bytes_read: int = 0  # uncompressed layer bytes chunked (reused layers count 0)
    files: int = 0
    chunks_new: int = 0
    chunks_known: int = 0
    bytes_stored: int = 0  # compressed bytes of new chunks uploaded
    source_bytes: int = 0  # compressed size of the source layers


@dataclass
class ConvertResult:
    image_id: str
    name: str
    source_digest: str
    entries: int
    image_bytes: int
    manifest_bytes: int
    stats: ConvertStats = field(default_factory=ConvertStats)

    def as_dict(self) -> dict:
        return asdict(self)


Progress = Callable[[str, ConvertStats], None]


def convert(
    reference: str,
    store: ObjectStore,
    *,
    name: str | None = None,
    platform: str | None = None,
    jobs: int | None = None,
    progress: Progress | None = None,
) -> ConvertResult:
    """Convert one image into the store and publish it under `name` (default: reference)."""
    source = open_source(reference, platform)
    try:
        return _convert(source, store, name or reference, jobs or os.cpu_count() or 1, progress)
    finally:
        source.close()


def _convert(
    source: ImageSource, store: ObjectStore, name: str, jobs: int, progress: Progress | None
) -> ConvertResult:
    stats = ConvertStats(layers=len(source.layers))
    stats.source_bytes = sum(layer.size for layer in source.layers)
    tree = Tree()
    index: ChunkIndex | None = None
    with ThreadPoolExecutor(jobs) as pool:
        for n, layer in enumerate(source.layers, 1):
            label = f"layer {n}/{len(source.layers)} {layer.digest[:19]}"
            key = layerrec.record_key(layer.diff_id)
            try:
                records = layerrec.decode(store.get(key), layer.diff_id)
                stats.layers_reused += 1
                if progress:
                    progress(f"{label}: converted before, reused", stats)
                tree.apply(
                    LayerEntry(Op(op), path, inode, link) for op, path, inode, link in records
                )
                continue
            except ObjectNotFound:
                pass
            if index is None:
                index = ChunkIndex.load(store)
            entries = _convert_layer(
                source,
                layer,
                store,
                index,
                pool,
                stats,
                lambda s, label=label: progress and progress(label, s),
            )
            store.put(key, layerrec.encode(layer.diff_id, entries))
            tree.apply(entries)
    meta = {
        "config": json.dumps(source.config, sort_keys=True, separators=(",", ":")),
        "config_digest": source.config_digest,
        "source_manifest_digest": source.manifest_digest,
    }
    path = temp_manifest_path()
    try:
        walk = list(tree.walk())
        nlink = {id(inode): tree.nlink(inode) for _, inode in walk}
        image_id = build_manifest(walk, nlink, meta, path)
        manifest_bytes = upload_manifest(store, image_id, path)
    finally:
        path.unlink(missing_ok=True)
    publish_refs(store, image_id, name, source.manifest_digest)
    image_bytes = sum(i.size for i in {id(i): i for _, i in walk}.values() if i.kind == Kind.REG)
    if progress:
        progress("published", stats)
    return ConvertResult(
        image_id, name, source.manifest_digest, len(walk), image_bytes, manifest_bytes, stats
    )


def _convert_layer(
    source: ImageSource,
    layer: LayerDescriptor,
    store: ObjectStore,
    index: ChunkIndex,
    pool: ThreadPoolExecutor,
    stats: ConvertStats,
    progress: Callable[[ConvertStats], object],
) -> list[LayerEntry]:
    """Read one layer, store its new chunks, and return its entries with chunk lists."""
    writer = PackWriter(store, index)
    entries: list[LayerEntry] = []
    # Hashing and compression run on the pool; results are added to packs in submission
    # order so that pack contents (and so image ids) do not depend on thread timing.
    pending: deque[Future[tuple[bytes, bytes | None, int]]] = deque()

    def drain(limit: int) -> None:
        while len(pending) > limit:
            cid, blob, size = pending.popleft().result()
            if blob is None or not writer.add(cid, blob, size):
                stats.chunks_known += 1
            else:
                stats.chunks_new += 1
                stats.bytes_stored += len(blob)

    file_chunks: list[tuple[Inode, list[Future[tuple[bytes, bytes | None, int]]]]] = []

    def submit_file(inode: Inode, reader: BinaryIO) -> None:
        futs = []
        for data in cut_reader(reader, inode.size):
            fut = pool.submit(_hash_and_compress, data, writer)
            pending.append(fut)
            futs.append(fut)
            stats.bytes_read += len(data)
            drain(IN_FLIGHT)
        file_chunks.append((inode, futs))

    with open_layer_tar(source, layer) as stream:
        for entry, reader in iter_layer(stream):
            entries.append(entry)
            if reader is not None and entry.inode is not None:
                stats.files += 1
                submit_file(entry.inode, reader)
                if stats.files % 256 == 0:
                    progress(stats)
    drain(0)
    writer.flush()
    for inode, futs in file_chunks:
        inode.chunks = [index.ref(f.result()[0]) for f in futs]
    progress(stats)
    return entries


def _hash_and_compress(data: bytes, writer: PackWriter) -> tuple[bytes, bytes | None, int]:
    cid = chunk_id(data)
    if writer.is_known(cid):
        return cid, None, len(data)  # stored already: skip the compression
    return cid, compress_chunk(data), len(data)
