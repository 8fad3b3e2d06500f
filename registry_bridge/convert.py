"""The convert pipeline: image source -> layer records -> merged tree -> manifest -> refs.

Order of writes is what keeps the store consistent under `kill -9` and concurrent
converters: packs, then their index objects, then each layer's record, then the image
manifest, then the refs. Nothing points at an object that is not already stored.
"""

from __future__ import annotations

import gc
import json
import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import BinaryIO

from chunker import layerrec
from chunker.chunking import chunk_id, cut, cut_reader
from chunker.errors import ObjectNotFound
from chunker.images import publish_tree, startup_order
from chunker.layer_chains import chain_id, remember, reuse
from chunker.model import Inode, Kind
from chunker.packs import ChunkIndex, PackWriter, compress_chunk
from chunker.refs import publish_refs
from chunker.store.interface import ObjectStore
from registry_bridge.decompress import open_layer_tar
from registry_bridge.layer_tar import LayerEntry, Op, iter_layer
from registry_bridge.layer_trees import layer_tree
from registry_bridge.sources import ImageSource, LayerDescriptor
from registry_bridge.transports import open_source
from registry_bridge.tree import Tree


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
    erofs: str | None = None  # the EROFS metadata image's id; None: FUSE tree only
    erofs_refused: str = ""  # why the image has no EROFS metadata image
    layer_trees: list[str] = field(default_factory=list)  # their ids, bottom first
    layer_trees_refused: str = ""  # why the image has none (a layer EROFS cannot hold)

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
    tls_verify: bool = True,
    layer_trees: bool = True,
) -> ConvertResult:
    """Convert one image into the store and publish it under `name` (default: reference).

    Besides the image's merged tree, each layer's tree is published too, unless
    `layer_trees` is False (registry_bridge/layer_trees.py), and the image's manifest
    names them (meta "layers"), so that a node can stack them: images on one base then
    share its trees. If EROFS cannot hold a layer's tree, the image has none
    (ConvertResult.layer_trees_refused says why) and nodes serve it from its merged tree.
    """
    source = open_source(reference, platform, tls_verify=tls_verify)
    jobs = jobs or os.cpu_count() or 1
    try:
        with _fewer_gc_passes():
            return _convert(source, store, name or reference, jobs, progress, layer_trees)
    finally:
        source.close()


@contextmanager
def _fewer_gc_passes() -> Iterator[None]:
    """Run the cycle collector less often while converting.

    A convert allocates an entry, an inode and a few containers per tar member and keeps
    them all to the end; with the default threshold (700 allocations) the collector ran
    ~200 times per python-image convert and took 3-4 % of its CPU, finding nothing to
    free. 50,000 cuts that to ~30 passes and ~0.01 s.
    """
    old = gc.get_threshold()
    gc.set_threshold(max(old[0], 50_000), *old[1:])
    try:
        yield
    finally:
        gc.set_threshold(*old)


def _convert(
    source: ImageSource,
    store: ObjectStore,
    name: str,
    jobs: int,
    progress: Progress | None,
    layer_trees: bool,
) -> ConvertResult:
    stats = ConvertStats(layers=len(source.layers))
    stats.source_bytes = sum(layer.size for layer in source.layers)
    tree = Tree()
    trees = _LayerTrees(tree) if layer_trees else None
    index: ChunkIndex | None = None
    with ThreadPoolExecutor(jobs) as pool:
        for n, layer in enumerate(source.layers, 1):
            label = f"layer {n}/{len(source.layers)} {layer.digest[:19]}"
            key = layerrec.record_key(layer.diff_id)
            try:
                records = layerrec.decode(store.get(key), layer.diff_id)
            except ObjectNotFound:
                records = None
            if records is not None:
                stats.layers_reused += 1
                if progress:
                    progress(f"{label}: converted before, reused", stats)
                entries = [
                    LayerEntry(Op(op), path, inode, link) for op, path, inode, link in records
                ]
            else:
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
            if trees:
                trees.add(layer.diff_id)
    # (no ids for an image of empty layers only, nor for one a layer tree was refused for)
    layer_ids, refused = trees.publish(store) if trees else ([], "")
    meta = {
        "config": json.dumps(source.config, sort_keys=True, separators=(",", ":")),
        "config_digest": source.config_digest,
        "source_manifest_digest": source.manifest_digest,
    }
    if layer_ids:
        meta["layers"] = json.dumps(layer_ids)
    walk = list(tree.walk())
    nlink = {id(inode): tree.nlink(inode) for _, inode in walk}
    # Lay the data out as the image's previous version started, if it has a trace: the
    # name's image before this convert, or the same source converted before.
    earlier = [name] + ([source.manifest_digest] if source.manifest_digest else [])
    order = startup_order(store, earlier, walk)
    tree_out = publish_tree(store, walk, nlink, meta, order)
    image_id = tree_out.image_id
    image_bytes = sum(i.size for i in {id(i): i for _, i in walk}.values() if i.kind == Kind.REG)
    start = None
    if layer_ids:  # what a node's lookup by name needs: it then fetches no manifest
        start = {
            "layers": layer_ids,
            "config": source.config.get("config") or {},
            "created": source.config.get("created") or "",
            "size": image_bytes,
        }
    publish_refs(store, image_id, name, source.manifest_digest, start)
    if progress:
        progress("published", stats)
    return ConvertResult(
        image_id,
        name,
        source.manifest_digest,
        len(walk),
        image_bytes,
        tree_out.manifest_bytes,
        stats,
        tree_out.erofs,
        tree_out.erofs_refused,
        layer_ids,
        refused,
    )


class _LayerTrees:
    """Each layer's tree, made as the layers are applied (the trees before and after a
    layer are all it needs, so no more than two are kept) and published at the end, once
    every layer converted: a layer that fails leaves no tree in the store. Until then each
    tree is a list of paths and of inodes the merged tree mostly holds anyway."""

    def __init__(self, tree: Tree) -> None:
        self._tree = tree
        self._before = tree.snapshot()
        self._chain = ""  # of the layers applied so far (chunker/layer_chains.py)
        self._made: list[tuple[str, str, list[tuple[bytes, Inode]], dict[int, int]]] = []

    def add(self, diff_id: str) -> None:
        self._chain = chain_id(self._chain, diff_id)
        after = self._tree.snapshot()
        made = layer_tree(self._before, after)
        self._before = after
        if made is not None:  # (an empty layer has no tree)
            self._made.append((diff_id, self._chain, *made))

    def publish(self, store: ObjectStore) -> tuple[list[str], str]:
        """(the trees' ids, bottom first; why there are none, if EROFS cannot hold one).
        Nodes stack layer trees only as EROFS mounts, so then the image goes without
        them (the trees published before are unreferenced, and gc takes them)."""
        ids: list[str] = []
        for diff_id, chain, entries, nlink in self._made:
            tree_id = reuse(store, chain, diff_id)  # built by an earlier convert
            if tree_id is None:
                published = publish_tree(store, entries, nlink, {"layer_diff_id": diff_id})
                if published.erofs is None:
                    return [], f"layer {diff_id}: {published.erofs_refused}"
                tree_id = published.image_id
                remember(store, chain, tree_id)
            ids.append(tree_id)
        return ids, ""


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
    chunker = _Chunker(pool, writer, stats)
    entries: list[LayerEntry] = []
    files: list[tuple[Inode, list[bytes]]] = []
    with open_layer_tar(source, layer) as stream:
        for entry, reader in iter_layer(stream):
            entries.append(entry)
            if reader is not None and entry.inode is not None:
                stats.files += 1
                files.append((entry.inode, chunker.add_file(reader, entry.inode.size)))
                if stats.files % 256 == 0:
                    progress(stats)
    chunker.finish()
    writer.flush()
    for inode, cids in files:
        inode.chunks = [index.ref(cid) for cid in cids]
    progress(stats)
    return entries


# One chunk as the pool gives it back: id, zstd bytes (None: stored already), size.
_Result = tuple[bytes, bytes | None, int]


class _Chunker:
    """Hands file contents to the pool in batches and adds the chunks to packs in order.

    The main thread only reads the tar; cutting, hashing and compressing run on the pool,
    about BATCH_BYTES per task (one task per chunk costs more in futures than the work).
    Results are added to the pack writer in submission order, so pack contents (and so
    image ids) do not depend on thread timing.
    """

    BATCH_BYTES = 1024 * 1024
    IN_FLIGHT = 16  # batches submitted and not yet added to packs
    # Files up to this size are read whole and cut on the pool; bigger ones are cut while
    # streaming (FastCDC gives the same boundaries either way), so memory stays bounded.
    READ_WHOLE = 8 * 1024 * 1024

    def __init__(self, pool: ThreadPoolExecutor, writer: PackWriter, stats: ConvertStats) -> None:
        self._pool, self._writer, self._stats = pool, writer, stats
        # The batch being filled: (data, cut it?, the file's chunk id list) per piece.
        self._batch: list[tuple[bytes, bool, list[bytes]]] = []
        self._batch_bytes = 0
        self._pending: deque[tuple[Future[list[list[_Result]]], list[list[bytes]]]] = deque()

    def add_file(self, reader: BinaryIO, size: int) -> list[bytes]:
        """Queue one file's content; the returned chunk id list is complete after finish()."""
        cids: list[bytes] = []
        if size <= self.READ_WHOLE:
            self._add(reader.read(size), True, cids)
        else:
            for chunk in cut_reader(reader, size):
                self._add(chunk, False, cids)
        return cids

    def finish(self) -> None:
        self._submit()
        self._drain(0)

    def _add(self, data: bytes, whole: bool, cids: list[bytes]) -> None:
        self._stats.bytes_read += len(data)
        if data:
            self._batch.append((data, whole, cids))
            self._batch_bytes += len(data)
        if self._batch_bytes >= self.BATCH_BYTES:
            self._submit()
            self._drain(self.IN_FLIGHT)

    def _submit(self) -> None:
        if not self._batch:
            return
        batch, self._batch, self._batch_bytes = self._batch, [], 0
        pieces = [(data, whole) for data, whole, _ in batch]
        future = self._pool.submit(_chunk_batch, pieces, self._writer)
        self._pending.append((future, [cids for _, _, cids in batch]))

    def _drain(self, limit: int) -> None:
        stats = self._stats
        while len(self._pending) > limit:
            future, owners = self._pending.popleft()
            for results, cids in zip(future.result(), owners, strict=True):
                for cid, blob, size in results:
                    cids.append(cid)
                    if blob is None or not self._writer.add(cid, blob, size):
                        stats.chunks_known += 1
                    else:
                        stats.chunks_new += 1
                        stats.bytes_stored += len(blob)


def _chunk_batch(pieces: list[tuple[bytes, bool]], writer: PackWriter) -> list[list[_Result]]:
    """On the pool: cut whole files into chunks, then hash and compress every chunk."""
    out = []
    for data, whole in pieces:
        chunks = cut(data) if whole else (data,)
        out.append([_hash_and_compress(chunk, writer) for chunk in chunks])
    return out


def _hash_and_compress(data: bytes | memoryview, writer: PackWriter) -> _Result:
    cid = chunk_id(data)
    if writer.is_known(cid):
        return cid, None, len(data)  # stored already: skip the compression
    return cid, compress_chunk(data), len(data)
