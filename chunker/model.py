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
from dataclasses import dataclass, field
from enum import IntEnum


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


@dataclass(frozen=True, slots=True)
class ChunkRef:
    id: bytes  # blake3-256 of the uncompressed bytes (32 bytes)
    size: int  # uncompressed length
    pack: str  # pack name (hex blake3 of the pack object)
    offset: int  # byte offset of the compressed chunk inside the pack
    clen: int  # compressed length


@dataclass(slots=True, eq=False)
class Inode:
    kind: Kind
    mode: int  # permission bits including setuid/setgid/sticky (& 0o7777)
    uid: int = 0
    gid: int = 0
    size: int = 0
    mtime_ns: int = 0
    rdev: int = 0  # os.makedev(major, minor) for devices
    target: bytes = b""  # symlink target, stored verbatim and never followed
    xattrs: dict[bytes, bytes] = field(default_factory=dict)
    chunks: list[ChunkRef] = field(default_factory=list)

    @property
    def st_mode(self) -> int:
        return self.kind.s_ifmt | (self.mode & 0o7777)
