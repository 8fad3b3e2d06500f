"""Converted-layer records: a layer's entries with their chunk lists, stored once per layer.

Keyed by the layer's uncompressed digest (its diff_id), so converting any later image that
shares the layer skips reading and chunking it. A record is written only after every pack
its chunks live in is in the store. Format (docs/FORMATS.md): zstd-compressed msgpack
    {"format": "lazyfs-layer", "version": 1, "diff_id": str, "entries": [entry, ...]}
with each entry one of
    [1, path, kind, mode, uid, gid, size, mtime_ns, rdev, target, {xattr: value},
        [[chunk_id, size, pack, offset, clen], ...]]          (an inode)
    [2, path, link_target]                                     (a hard link)
    [3, path]                                                  (a whiteout: path removed)
    [4, path]                                                  (an opaque directory)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import msgpack
import zstandard

from chunker.errors import CorruptObjectError
from chunker.model import ChunkRef, Inode, Kind

FORMAT = "lazyfs-layer"
FORMAT_VERSION = 1
PREFIX = "layers/"

OP_INODE, OP_HARDLINK, OP_WHITEOUT, OP_OPAQUE = 1, 2, 3, 4


class EntryLike(Protocol):
    op: int
    path: bytes
    inode: Inode | None
    link: bytes


Record = tuple[int, bytes, Inode | None, bytes]  # (op, path, inode, link)


def record_key(diff_id: str) -> str:
    algo, _, hexdigest = diff_id.partition(":")
    return f"{PREFIX}{algo}/{hexdigest}"


def encode(diff_id: str, entries: Iterable[EntryLike]) -> bytes:
    out = []
    for e in entries:
        if e.op == OP_INODE:
            i = e.inode
            assert i is not None
            out.append(
                [
                    OP_INODE,
                    e.path,
                    int(i.kind),
                    i.mode,
                    i.uid,
                    i.gid,
                    i.size,
                    i.mtime_ns,
                    i.rdev,
                    i.target,
                    i.xattrs,
                    [[c.id, c.size, c.pack, c.offset, c.clen] for c in i.chunks],
                ]
            )
        elif e.op == OP_HARDLINK:
            out.append([OP_HARDLINK, e.path, e.link])
        else:
            out.append([int(e.op), e.path])
    body = {"format": FORMAT, "version": FORMAT_VERSION, "diff_id": diff_id, "entries": out}
    return zstandard.ZstdCompressor(level=3).compress(msgpack.packb(body, use_bin_type=True))


def decode(blob: bytes, diff_id: str) -> list[Record]:
    try:
        body = msgpack.unpackb(
            zstandard.ZstdDecompressor().decompress(blob, max_output_size=1 << 31),
            raw=False,
            strict_map_key=False,
        )
        if body["format"] != FORMAT or body["version"] != FORMAT_VERSION:
            raise ValueError(f"format {body['format']} version {body['version']}")
        if body["diff_id"] != diff_id:
            raise ValueError(f"record is for {body['diff_id']}")
        records: list[Record] = []
        for e in body["entries"]:
            op, path = e[0], e[1]
            if op == OP_INODE:
                inode = Inode(
                    Kind(e[2]),
                    e[3],
                    e[4],
                    e[5],
                    e[6],
                    e[7],
                    e[8],
                    e[9],
                    dict(e[10]),
                    [ChunkRef(*c) for c in e[11]],
                )
                records.append((op, path, inode, b""))
            elif op == OP_HARDLINK:
                records.append((op, path, None, e[2]))
            elif op in (OP_WHITEOUT, OP_OPAQUE):
                records.append((op, path, None, b""))
            else:
                raise ValueError(f"unknown entry op {op}")
        return records
    except (zstandard.ZstdError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise CorruptObjectError(f"layer record for {diff_id} is unreadable: {exc}") from None
