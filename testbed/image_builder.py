"""An image written straight into a store, no converter: paths and inodes in, a
published image out (the mount tests' synthetic images, bench/mount_perf.py's big ones)."""

from __future__ import annotations

from dataclasses import dataclass, field

from chunker.chunking import chunk_id, cut
from chunker.images import publish_tree
from chunker.model import Inode, Kind
from chunker.packs import ChunkIndex, PackWriter, compress_chunk
from chunker.refs import publish_refs
from chunker.store.backends import open_store
from chunker.store.interface import ObjectStore


@dataclass
class ImageBuilder:
    """Builds a manifest directly (no converter): paths in, image published in the store."""

    store: ObjectStore
    entries: list[tuple[bytes, Inode]] = field(default_factory=list)
    data: dict[str, bytes] = field(default_factory=dict)  # path -> expected content
    writer: PackWriter | None = None
    pending: list[tuple[Inode, list[bytes]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.writer = PackWriter(self.store, ChunkIndex())
        self.add(b"", Inode(Kind.DIR, 0o755, mtime_ns=1_500_000_000_000_000_001))

    def add(self, path: bytes, inode: Inode) -> Inode:
        self.entries.append((path, inode))
        return inode

    def file(self, path: str, content: bytes, mode: int = 0o644, **kw) -> Inode:  # noqa: ANN003
        assert self.writer is not None
        cids = []
        for view in cut(content):
            cid = chunk_id(view)
            self.writer.add(cid, compress_chunk(view), len(view))
            cids.append(cid)
        self.data[path] = content
        inode = self.add(path.encode(), Inode(Kind.REG, mode, size=len(content), **kw))
        self.pending.append((inode, cids))
        return inode

    def seal_pack(self) -> None:
        """End the current pack (to keep one file's chunks in a pack of their own)."""
        assert self.writer is not None
        self.writer.flush()

    def publish(self, name: str) -> str:
        assert self.writer is not None
        self.writer.flush()
        for inode, cids in self.pending:
            inode.chunks = [self.writer.index.ref(c) for c in cids]
        nlink: dict[int, int] = {}
        for _, inode in self.entries:
            nlink[id(inode)] = nlink.get(id(inode), 0) + 1
        for path, inode in self.entries:  # a directory: 2 + its subdirectories
            if inode.kind == Kind.DIR:
                prefix = path + b"/" if path else b""
                nlink[id(inode)] = 2 + sum(
                    1
                    for p, i in self.entries
                    if i.kind == Kind.DIR
                    and p.startswith(prefix)
                    and p != path
                    and b"/" not in p[len(prefix) :]
                )
        image_id = publish_tree(self.store, self.entries, nlink, {"config": "{}"}).image_id
        publish_refs(self.store, image_id, name, "")
        return image_id


def publish_one_file_images(store_url: str, count: int) -> dict[str, bytes]:
    """`count` images img0, img1, ... in the store, each holding one file, /which: its
    own line repeated past a block, so that it is read from the data area. Image id ->
    that file's content, in the images' order."""
    store = open_store(store_url)
    try:
        images = {}
        for n in range(count):
            builder = ImageBuilder(store)
            content = b"image %d\n" % n * 2000
            builder.file("which", content)
            images[builder.publish(f"img{n}")] = content
        return images
    finally:
        store.close()
