"""The in-memory vocabulary shared by the converter and the manifest writer.

- A *chunk* is a piece of one file's content, named by the blake3-256 of its bytes.
- A *pack* is an immutable store object holding many separately zstd-compressed chunks.
- A `ChunkRef` says where one chunk of a file lives: which pack, at which byte offset,
  how many compressed bytes, and how many bytes it inflates to.
- An `Inode` is one filesystem object (a file, directory, link, device ...). Hard links
  are several paths pointing at the same `Inode` object.
"""

from __future__ import annotations

import stat
from enum import IntEnum
from typing import NamedTuple


class Kind(IntEnum):
    """File type; values are part of the manifest format (docs/FORMATS.md)."""

    REG = 1
    DIR = 2
    SYMLINK = 3
    CHR = 4
    BLK = 5
    FIFO = 6
    SOCK = 7

    @property
    def s_ifmt(self) -> int:
        return _S_IFMT[self]


_S_IFMT = {
    Kind.REG: stat.S_IFREG,
    Kind.DIR: stat.S_IFDIR,
    Kind.SYMLINK: stat.S_IFLNK,
    Kind.CHR: stat.S_IFCHR,
    Kind.BLK: stat.S_IFBLK,
    Kind.FIFO: stat.S_IFIFO,
    Kind.SOCK: stat.S_IFSOCK,
}


# A NamedTuple and a plain class, not dataclasses: every `lazyfs run` imports this module
# (through the manifest), and dataclasses with inspect is ~5 ms of its imports
# (docs/design-changes.md, session 29).


class ChunkRef(NamedTuple):
    id: bytes  # blake3-256 of the uncompressed bytes (32 bytes)
    size: int  # uncompressed length
    pack: str  # pack name (hex blake3 of the pack object)
    offset: int  # byte offset of the compressed chunk inside the pack
    clen: int  # compressed length


class Inode:
    """One file of a tree, as a convert builds it (mutable: layers change it) and a
    manifest stores it. Compared by identity: hard links are one Inode under two names."""

    __slots__ = (
        "kind", "mode", "uid", "gid", "size", "mtime_ns", "rdev", "target", "xattrs", "chunks"
    )  # fmt: skip

    def __init__(
        self,
        kind: Kind,
        mode: int,  # permission bits including setuid/setgid/sticky (& 0o7777)
        uid: int = 0,
        gid: int = 0,
        size: int = 0,
        mtime_ns: int = 0,
        rdev: int = 0,  # os.makedev(major, minor) for devices
        target: bytes = b"",  # symlink target, stored verbatim and never followed
        xattrs: dict[bytes, bytes] | None = None,
        chunks: list[ChunkRef] | None = None,
    ) -> None:
        self.kind, self.mode, self.uid, self.gid = kind, mode, uid, gid
        self.size, self.mtime_ns, self.rdev, self.target = size, mtime_ns, rdev, target
        self.xattrs = {} if xattrs is None else xattrs
        self.chunks = [] if chunks is None else chunks

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__)
        return f"Inode({fields})"

    @property
    def st_mode(self) -> int:
        return self.kind.s_ifmt | (self.mode & 0o7777)
