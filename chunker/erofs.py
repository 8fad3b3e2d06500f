"""A pure-Python writer of EROFS metadata images (docs/FORMATS.md, "EROFS metadata image").

The kernel serves an image's tree from an EROFS filesystem whose "device" is this metadata
image followed by a data area. The writer never sees file bytes: every regular file with
data is one contiguous, uncompressed run of blocks in the data area (EROFS_INODE_FLAT_PLAIN,
`raw_blkaddr`), and the returned `ErofsLayout` says which blocks hold which file, so
whoever serves the device (a FUSE daemon filling the data area lazily from chunks) knows
what to put where.

What the image uses, and why (the kernel's fs/erofs/erofs_fs.h is the reference):
- 4 KiB blocks, no feature bits at all (no compression, no chunk indexes, no shared xattrs,
  no xattr filter, no superblock checksum): every kernel with EROFS and erofs-utils 1.5's
  fsck.erofs read it.
- Extended (64-byte) inodes only: 32-bit uid/gid, 64-bit size, per-inode mtime with
  nanoseconds, 32-bit nlink. The metadata area starts at block 0 (meta_blkaddr = 0); the
  first inode is the root, right after the superblock, so its nid fits the 16-bit field.
- Directories and symlinks keep their last block inline after the inode
  (EROFS_INODE_FLAT_INLINE) when it fits in the inode's block, so a small directory costs
  no block of its own; otherwise their blocks sit in the metadata area after the inodes.
- Xattrs are inline only, one entry per name with EROFS's short prefix indexes.

Limits are the kernel's and are checked before anything is written, so hostile input raises
BadInputError instead of producing an image the kernel rejects or misreads.
"""

from __future__ import annotations

import os
import stat
import struct
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import blake3

from chunker.errors import BadInputError
from chunker.model import Inode, Kind

FORMAT_VERSION = 1
BLOCK_SIZE = 4096
_BLKBITS = 12
_SB_OFFSET = 1024
_MAGIC = 0xE0F5E1E2
_FIRST_INODE = 1152  # right after the 128-byte superblock, 64-byte aligned (nid 36)

# magic, checksum, feature_compat, blkszbits, sb_extslots, root_nid, inos, build_time,
# build_time_nsec, blocks, meta_blkaddr, xattr_blkaddr, uuid, volume_name, feature_incompat;
# the rest of the 128 bytes (compression, devices, long xattr prefixes, 48-bit) stays zero.
_SUPER = struct.Struct("<IIIBBHQQIIII16s16sI")
_SUPER_UUID_AT = 48
# i_format, i_xattr_icount, i_mode, i_nb (startblk_hi: must be 0 without 48-bit addresses),
# i_size, i_u (raw_blkaddr or rdev), i_ino, i_uid, i_gid, i_mtime (signed), i_mtime_nsec,
# i_nlink, 16 reserved bytes
_INODE = struct.Struct("<HHHHQIIIIqII16x")
_INODE_SIZE = 64
_DIRENT = struct.Struct("<QHBB")  # nid, nameoff, file_type, reserved
_DIRENT_SIZE = 12
_XATTR_ENTRY = struct.Struct("<BBH")  # e_name_len, e_name_index, e_value_size
_XATTR_IBODY_HEADER = bytes(12)  # h_name_filter 0 (no filter feature), no shared xattrs

_S_IFLNK_0777 = stat.S_IFLNK | 0o777
_FLAT_PLAIN = 0
_FLAT_INLINE = 2
_FORMAT_EXTENDED = 1  # i_format bit 0; the data layout is bits 1-3

# struct erofs_dirent file_type: the kernel's FT_* values
_FILE_TYPE = {
    Kind.REG: 1,
    Kind.DIR: 2,
    Kind.CHR: 3,
    Kind.BLK: 4,
    Kind.FIFO: 5,
    Kind.SOCK: 6,
    Kind.SYMLINK: 7,
}

NAME_MAX = 255  # EROFS_NAME_LEN
SYMLINK_MAX = BLOCK_SIZE - 1  # page_get_link reads one page and keeps a NUL: PATH_MAX - 1
XATTR_NAME_MAX = 255  # the VFS refuses longer names (ERANGE), so such an xattr is unreachable
XATTR_VALUE_MAX = 0xFFFF  # e_value_size is 16 bits
XATTR_LIST_MAX = 65536  # listxattr cannot return more names than this (E2BIG)
# i_xattr_icount is 16 bits: the inline area is 12 + 4 * (icount - 1) bytes
XATTR_IBODY_MAX = 12 + 4 * (0xFFFF - 1)
MAX_BLOCKS = (1 << 32) - 1  # raw_blkaddr and the superblock's block count are 32 bits
_MAX_SIZE = (1 << 63) - 1  # the kernel refuses a negative (signed 64-bit) i_size

# Short xattr name prefixes (EROFS_XATTR_INDEX_*). The two ACL names are whole names with an
# empty suffix; lustre (5) has no handler in the kernel, so it is refused like any other.
_XATTR_PREFIXES = ((b"user.", 1), (b"trusted.", 4), (b"security.", 6))
_XATTR_ACL = {b"system.posix_acl_access": 2, b"system.posix_acl_default": 3}
_ACL_TAGS = frozenset((0x01, 0x02, 0x04, 0x08, 0x10, 0x20))  # USER_OBJ .. OTHER


@dataclass(frozen=True)
class ErofsLayout:
    """Where things are on the device: the metadata image, then the data area."""

    meta_blocks: int  # the metadata image is blocks [0, meta_blocks) (superblock at byte 1024)
    total_blocks: int  # size of the whole device in blocks (metadata + data area)
    # (first block, block count, inode) per regular-file extent, sorted by first block; an
    # extent shared by identical files is listed once, with one of them
    extents: list[tuple[int, int, Inode]]

    @property
    def total_bytes(self) -> int:
        return self.total_blocks * BLOCK_SIZE


def build_erofs(
    entries: Iterable[tuple[bytes, Inode]],
    nlink: dict[int, int],
    dest: Path,
    *,
    data_order: Sequence[Inode] = (),
    build_time_ns: int = 0,
) -> ErofsLayout:
    """Write the EROFS metadata image of a merged tree to dest; return the device layout.

    entries: every (path, inode), root (b"") first, parents before children; hard links are
    several paths sharing one Inode. nlink: link count by id(inode) (a missing count is
    computed from the tree). data_order: inodes whose data goes first in the data area, in
    this order (a start-up trace); other regular files follow in tree order. Inodes in it
    that are not regular files with data in this tree are ignored.

    Nothing is left at dest if the input is refused (BadInputError).
    """
    dest = Path(dest)
    dest.unlink(missing_ok=True)
    image, layout = _Builder(nlink).build(entries, data_order, build_time_ns)
    fd, tmp = tempfile.mkstemp(prefix=".erofs-", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(image)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return layout


class _Builder:
    """One build: per-inode state lives in parallel lists indexed by inode number - 1,
    not in an object per entry (a 200,000-entry tree must build in seconds)."""

    def __init__(self, nlink: dict[int, int]) -> None:
        self.nlink_in = nlink
        self.inodes: list[Inode] = []
        self.index: dict[int, int] = {}  # id(inode) -> index
        self.children: dict[int, list[tuple[bytes, int]]] = {}  # dir index -> (name, index)
        self.parent: dict[int, int] = {}  # dir index -> parent dir index
        self.paths: list[int] = []  # index -> number of paths (hard links)
        self.subdirs: dict[int, int] = {}  # dir index -> number of subdirectories

    def build(
        self, entries: Iterable[tuple[bytes, Inode]], data_order: Sequence[Inode], time_ns: int
    ) -> tuple[bytearray, ErofsLayout]:
        self._collect(entries)
        n = len(self.inodes)
        xattrs = [_xattr_body(inode) if inode.xattrs else b"" for inode in self.inodes]
        dirs = {i: self._dir_blocks(i) for i in self.children}

        # Place the inodes: nid = byte offset / 32. Inline tails must not cross a block.
        nids = [0] * n
        layouts = [_FLAT_PLAIN] * n
        meta_blocks_of: dict[int, int] = {}  # index -> blocks it needs after the inodes
        pos = _FIRST_INODE
        for i, inode in enumerate(self.inodes):
            core = _INODE_SIZE + len(xattrs[i])
            tail, plain_blocks = 0, 0
            if inode.kind == Kind.DIR:
                nblocks, last = len(dirs[i]), dirs[i][-1][1]
                tail, plain_blocks = (last, nblocks - 1) if last < BLOCK_SIZE else (0, nblocks)
            elif inode.kind == Kind.SYMLINK:
                tail = len(inode.target)
            pos = (pos + 31) & ~31
            off = pos % BLOCK_SIZE
            if tail and core + tail > BLOCK_SIZE:
                tail, plain_blocks = 0, plain_blocks + 1  # can never be inline
            if tail and off + core + tail > BLOCK_SIZE:
                # pad to the next block, or give the tail a block of its own after the
                # inodes: whichever wastes less
                if BLOCK_SIZE - off <= BLOCK_SIZE - tail:
                    pos, off = pos + BLOCK_SIZE - off, 0
                else:
                    tail, plain_blocks = 0, plain_blocks + 1
            if off + _INODE_SIZE > BLOCK_SIZE:
                pos += BLOCK_SIZE - off  # keep the 64-byte core in one block
            if tail:
                layouts[i] = _FLAT_INLINE
            if plain_blocks:
                meta_blocks_of[i] = plain_blocks
            nids[i] = pos >> 5
            pos += core + tail
        raw = [0] * n
        block = -(-pos // BLOCK_SIZE)
        for i, count in meta_blocks_of.items():
            raw[i] = block
            block += count
        meta_blocks = block

        extents = self._place_data(data_order, raw, meta_blocks)
        total_blocks = extents[-1][0] + extents[-1][1] if extents else meta_blocks
        if total_blocks > MAX_BLOCKS:
            raise BadInputError(
                f"erofs: the image needs {total_blocks} blocks of {BLOCK_SIZE} bytes; EROFS"
                f" addresses at most {MAX_BLOCKS} (16 TiB)"
            )

        buf = bytearray(meta_blocks * BLOCK_SIZE)
        for i, inode in enumerate(self.inodes):
            at = nids[i] << 5
            blocks: list[bytes] = []
            size = inode.size if inode.kind == Kind.REG else 0
            if inode.kind == Kind.DIR:
                blocks = [self._dir_block(ents, nids) for ents, _ in dirs[i]]
                size = (len(blocks) - 1) * BLOCK_SIZE + len(blocks[-1])
            elif inode.kind == Kind.SYMLINK:
                blocks = [inode.target]
                size = len(inode.target)
            self._write_inode(buf, at, i, layouts[i], raw[i], size, xattrs[i])
            at += _INODE_SIZE + len(xattrs[i])
            if layouts[i] == _FLAT_INLINE:
                buf[at : at + len(blocks[-1])] = blocks[-1]
                blocks.pop()
            for k, data in enumerate(blocks):
                start = (raw[i] + k) * BLOCK_SIZE
                buf[start : start + len(data)] = data

        sec, nsec = divmod(time_ns, 1_000_000_000)
        if not 0 <= sec < 1 << 64:
            raise BadInputError(f"erofs: build time {time_ns} ns is out of range")
        _SUPER.pack_into(
            buf, _SB_OFFSET, _MAGIC, 0, 0, _BLKBITS, 0, nids[0], n, sec, nsec,
            total_blocks, 0, 0, bytes(16), bytes(16), 0,
        )  # fmt: skip
        # A uuid derived from the content: different images get different ids, the same
        # image always the same bytes.
        uuid = blake3.blake3(buf).digest()[:16]
        buf[_SB_OFFSET + _SUPER_UUID_AT : _SB_OFFSET + _SUPER_UUID_AT + 16] = uuid
        return buf, ErofsLayout(meta_blocks, total_blocks, extents)

    def _collect(self, entries: Iterable[tuple[bytes, Inode]]) -> None:
        """Number the inodes in tree order and record every directory's entries."""
        dirs: dict[bytes, int] = {}  # path -> index, directories only
        for path, inode in entries:
            if not self.inodes:
                if path != b"" or inode.kind != Kind.DIR:
                    raise BadInputError("erofs: the tree must start with its root directory")
                self._add(inode)
                dirs[b""] = 0
                self.parent[0] = 0
                self.children[0] = []
                continue
            parent_path, sep, name = path.rpartition(b"/")
            if sep and not parent_path:
                raise BadInputError(f"erofs: {show(path)}: path is not relative")
            _check_name(path, name)
            parent = dirs.get(parent_path)
            if parent is None:
                raise BadInputError(f"erofs: {show(path)}: parent is not a directory in the tree")
            i = self.index.get(id(inode))
            if i is None:
                i = self._add(inode)
                if inode.kind == Kind.DIR:
                    if path in dirs:
                        raise BadInputError(f"erofs: {show(path)}: duplicate path")
                    dirs[path] = i
                    self.parent[i] = parent
                    self.children[i] = []
                    self.subdirs[parent] = self.subdirs.get(parent, 0) + 1
            elif inode.kind == Kind.DIR:
                raise BadInputError(f"erofs: {show(path)}: a hard link to a directory")
            else:
                self.paths[i] += 1
            self.children[parent].append((name, i))
        if not self.inodes:
            raise BadInputError("erofs: the tree has no root directory")

    def _add(self, inode: Inode) -> int:
        _check_inode(inode)
        i = len(self.inodes)
        self.index[id(inode)] = i
        self.inodes.append(inode)
        self.paths.append(1)
        return i

    def _dir_blocks(self, i: int) -> list[tuple[list[tuple[bytes, int]], int]]:
        """A directory's entries (with "." and ".."), sorted by name as the kernel's binary
        search needs, split into blocks: (entries, bytes used) per block."""
        ents = self.children[i]
        ents.append((b".", i))
        ents.append((b"..", self.parent[i]))
        ents.sort()
        blocks: list[tuple[list[tuple[bytes, int]], int]] = []
        current: list[tuple[bytes, int]] = []
        used = 0
        prev = None
        for ent in ents:
            name = ent[0]
            if name == prev:
                raise BadInputError(f"erofs: duplicate name {show(name)} in a directory")
            prev = name
            need = _DIRENT_SIZE + len(name)
            if used + need > BLOCK_SIZE:
                blocks.append((current, used))
                current, used = [], 0
            current.append(ent)
            used += need
        blocks.append((current, used))
        return blocks

    def _place_data(
        self, data_order: Sequence[Inode], raw: list[int], first_block: int
    ) -> list[tuple[int, int, Inode]]:
        """Give every regular file with data its extent: trace order first, then tree
        order; files with the same chunks share one extent."""
        extents: list[tuple[int, int, Inode]] = []
        placed: set[int] = set()
        by_content: dict[tuple[int, tuple[bytes, ...]], int] = {}
        block = first_block

        def place(i: int) -> None:
            nonlocal block
            inode = self.inodes[i]
            if inode.kind != Kind.REG or not inode.size or i in placed:
                return
            placed.add(i)
            key = (inode.size, tuple(c.id for c in inode.chunks)) if inode.chunks else None
            if key is not None and key in by_content:
                raw[i] = by_content[key]
                return
            count = -(-inode.size // BLOCK_SIZE)
            raw[i] = block
            if key is not None:
                by_content[key] = block
            extents.append((block, count, inode))
            block += count

        for inode in data_order:
            i = self.index.get(id(inode))
            if i is not None:
                place(i)
        for i in range(len(self.inodes)):
            place(i)
        return extents

    def _write_inode(
        self, buf: bytearray, at: int, i: int, layout: int, raw: int, size: int, xattrs: bytes
    ) -> None:
        inode = self.inodes[i]
        kind = inode.kind
        i_u = raw
        if kind in (Kind.CHR, Kind.BLK):
            i_u = _new_encode_dev(inode.rdev)
        nlink = self.nlink_in.get(id(inode))
        if nlink is None:  # not given: what a real filesystem would show
            nlink = 2 + self.subdirs.get(i, 0) if kind == Kind.DIR else self.paths[i]
        if not 1 <= nlink <= 0xFFFFFFFF:
            raise BadInputError(f"erofs: link count {nlink} is out of range")
        # floor division: a negative mtime keeps 0 <= nsec < 1e9, as the kernel's timespec
        sec, nsec = divmod(inode.mtime_ns, 1_000_000_000)
        icount = (len(xattrs) - 12) // 4 + 1 if xattrs else 0
        # symlinks show 0777 whatever the source said, as after a real unpack
        mode = _S_IFLNK_0777 if kind == Kind.SYMLINK else inode.st_mode
        _INODE.pack_into(
            buf, at, _FORMAT_EXTENDED | layout << 1, icount, mode, 0, size,
            i_u, (i + 1) & 0xFFFFFFFF, inode.uid, inode.gid, sec, nsec, nlink,
        )  # fmt: skip
        if xattrs:
            buf[at + _INODE_SIZE : at + _INODE_SIZE + len(xattrs)] = xattrs

    def _dir_block(self, ents: list[tuple[bytes, int]], nids: list[int]) -> bytes:
        """One directory block: the dirents, then the names back to back with no NULs (a
        name ends where the next begins, the last one at the end of the data or at the
        block's zero padding)."""
        inodes = self.inodes
        nameoff = _DIRENT_SIZE * len(ents)
        head = bytearray(nameoff)
        for k, (name, c) in enumerate(ents):
            _DIRENT.pack_into(
                head, k * _DIRENT_SIZE, nids[c], nameoff, _FILE_TYPE[inodes[c].kind], 0
            )
            nameoff += len(name)
        return bytes(head) + b"".join(name for name, _ in ents)


def _check_name(path: bytes, name: bytes) -> None:
    if not name or name in (b".", b".."):
        raise BadInputError(f"erofs: {show(path)}: empty, '.' or '..' name")
    if len(name) > NAME_MAX:
        raise BadInputError(f"erofs: {show(path)}: name longer than {NAME_MAX} bytes")
    if b"\0" in name:
        raise BadInputError(f"erofs: {show(path)}: name contains a NUL byte")


def _check_inode(inode: Inode) -> None:
    """Refuse what the format cannot hold or the kernel would reject or misread."""
    kind = inode.kind
    if not isinstance(kind, Kind):
        raise BadInputError(f"erofs: unknown entry type {kind!r}")
    if not (0 <= inode.uid <= 0xFFFFFFFF and 0 <= inode.gid <= 0xFFFFFFFF):
        raise BadInputError(f"erofs: uid/gid {inode.uid}/{inode.gid} out of 32-bit range")
    if not -(1 << 63) <= inode.mtime_ns // 1_000_000_000 < 1 << 63:
        raise BadInputError(f"erofs: mtime {inode.mtime_ns} ns out of range")
    if kind == Kind.REG:
        if not 0 <= inode.size <= _MAX_SIZE:
            raise BadInputError(f"erofs: file size {inode.size} out of range")
        if inode.chunks and sum(c.size for c in inode.chunks) != inode.size:
            raise BadInputError(f"erofs: chunks cover a size other than the file's {inode.size}")
    elif kind == Kind.SYMLINK:
        target = inode.target
        if not target:
            raise BadInputError("erofs: empty symlink target")
        if len(target) > SYMLINK_MAX:
            raise BadInputError(f"erofs: symlink target longer than {SYMLINK_MAX} bytes")
        if b"\0" in target:
            raise BadInputError("erofs: symlink target contains a NUL byte")
    elif kind in (Kind.CHR, Kind.BLK):
        major, minor = os.major(inode.rdev), os.minor(inode.rdev)
        if major >= 1 << 12 or minor >= 1 << 20:
            raise BadInputError(
                f"erofs: device number {major}:{minor} exceeds the kernel's 12:20 bits"
            )


def _new_encode_dev(rdev: int) -> int:
    """The kernel's new_encode_dev: what erofs stores and new_decode_dev reads back."""
    major, minor = os.major(rdev), os.minor(rdev)
    return (minor & 0xFF) | (major << 8) | ((minor & ~0xFF) << 12)


def _xattr_body(inode: Inode) -> bytes:
    """The inline xattr area: the 12-byte ibody header, then one entry per xattr (sorted,
    for determinism), each padded to 4 bytes."""
    parts = [_XATTR_IBODY_HEADER]
    listed = 0
    for name, value in sorted(inode.xattrs.items()):
        index = _XATTR_ACL.get(name)
        suffix = b""
        if index is None:
            for prefix, idx in _XATTR_PREFIXES:
                if name.startswith(prefix):
                    index, suffix = idx, name[len(prefix) :]
                    break
            if index is None:
                raise BadInputError(f"erofs: xattr {show(name)}: no EROFS name prefix for it")
            if not suffix:
                raise BadInputError(f"erofs: xattr {show(name)}: empty name after the prefix")
        else:
            _check_acl(name, value)
        if len(name) > XATTR_NAME_MAX:
            raise BadInputError(
                f"erofs: xattr {show(name[:40])}...: name over {XATTR_NAME_MAX} bytes"
            )
        if b"\0" in name:
            raise BadInputError(f"erofs: xattr {show(name)}: name contains a NUL byte")
        if len(value) > XATTR_VALUE_MAX:
            raise BadInputError(f"erofs: xattr {show(name)}: value over {XATTR_VALUE_MAX} bytes")
        listed += len(name) + 1
        entry = _XATTR_ENTRY.pack(len(suffix), index, len(value)) + suffix + value
        parts.append(entry + bytes(-len(entry) % 4))
    body = b"".join(parts)
    if len(body) > XATTR_IBODY_MAX or listed > XATTR_LIST_MAX:
        raise BadInputError(
            f"erofs: xattrs of one inode too large ({len(body)} bytes inline, at most"
            f" {XATTR_IBODY_MAX}; {listed} bytes of names, at most {XATTR_LIST_MAX})"
        )
    return body


def _check_acl(name: bytes, value: bytes) -> None:
    """The kernel parses ACL xattrs (posix_acl_from_xattr) on every permission check: a
    malformed one would make the file unusable, so refuse it here."""
    if len(value) < 4 or (len(value) - 4) % 8 or int.from_bytes(value[:4], "little") != 2:
        raise BadInputError(f"erofs: xattr {show(name)}: not a version 2 POSIX ACL")
    for (tag,) in struct.iter_unpack("<H6x", value[4:]):
        if tag not in _ACL_TAGS:
            raise BadInputError(f"erofs: xattr {show(name)}: unknown ACL tag {tag:#x}")


def show(raw: bytes) -> str:
    """A name for messages: undecodable bytes shown as \\xNN."""
    return raw.decode("utf-8", "backslashreplace")
