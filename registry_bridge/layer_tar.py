"""Turn one uncompressed layer tar stream into validated entries.

`iter_layer` reads the tar forwards only (never seeking back) and yields one `LayerEntry`
per member that matters to the merged tree: a new inode, a hard link, a whiteout
(`dir/.wh.NAME` removes `dir/NAME`) or an opaque marker (`dir/.wh..wh..opq` hides
everything lower layers put under `dir`). Paths come out normalized and as bytes, exactly
as they are in the tar (names need not be UTF-8).

The tar format is parsed here, not by Python's tarfile: tarfile spent ~65 us per member
(str decoding of every field, a TarInfo object, two 512-byte checksum sums), about a
quarter of a whole convert's CPU on the test images (bench/results/convert_speed.md).
What is read: ustar/pax headers (name prefix), GNU headers (base-256 numbers, `L`/`K`
long names, old-style `S` sparse files), pax extended records (path, linkpath, size,
uid, gid, nanosecond mtime, `SCHILY.xattr.*`, GNU sparse 0.0/0.1/1.0). pax *global*
headers are dropped, as containerd does; a pax record with an empty value is ignored,
as Go's archive/tar does; pax records win over GNU long names, as in Go.

What a container runtime would refuse, or what could land outside the image root, is
refused here with one line naming the entry: `..` components, absolute paths, absolute or
escaping hard-link targets, entry types that cannot be represented, bad checksums, and
tars that end early (truncated headers, or a size field larger than the data behind it).
"""

from __future__ import annotations

import io
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from enum import IntEnum
from typing import BinaryIO

from chunker.errors import BadInputError, UnsafePathError
from chunker.model import Inode, Kind


class Op(IntEnum):
    INODE = 1
    HARDLINK = 2
    WHITEOUT = 3
    OPAQUE = 4


@dataclass(slots=True)
class LayerEntry:
    op: Op
    # Normalized: relative, no './' prefix, no trailing '/', no '.' or '..' components;
    # b"" is the root directory itself.
    path: bytes
    inode: Inode | None = None  # for INODE (chunks empty here; the converter fills them in)
    link: bytes = b""  # for HARDLINK: normalized target path


WHITEOUT_PREFIX = b".wh."
OPAQUE_MARKER = b".wh..wh..opq"
# `.wh..wh.*` names other than the opaque marker are aufs bookkeeping (`.wh..wh.plnk`,
# `.wh..wh.aufs`): containerd skips them, and what umoci would remove can never exist.
_WHITEOUT_META = b".wh..wh."

BLOCK = 512

# Type flags (POSIX, GNU, Solaris).
_REG, _AREG, _LNK, _SYM, _CHR, _BLK, _DIR, _FIFO, _CONT = (
    b"0",
    b"\0",
    b"1",
    b"2",
    b"3",
    b"4",
    b"5",
    b"6",
    b"7",
)
_GNU_LONGNAME, _GNU_LONGLINK, _GNU_SPARSE = b"L", b"K", b"S"
_PAX, _PAX_GLOBAL, _SOLARIS_PAX = b"x", b"g", b"X"

_KINDS = {
    _REG: Kind.REG,
    _AREG: Kind.REG,
    _CONT: Kind.REG,  # contiguous files are plain files everywhere else
    _GNU_SPARSE: Kind.REG,  # the holes are filled in when reading
    _DIR: Kind.DIR,
    _SYM: Kind.SYMLINK,
    _CHR: Kind.CHR,
    _BLK: Kind.BLK,
    _FIFO: Kind.FIFO,
}
_DATA_TYPES = {_REG, _AREG, _CONT, _GNU_SPARSE}  # members whose size counts data blocks

_MAX_ID = 2**32 - 2  # (uid_t)-1 means "leave unchanged" to chown: not an owner
_XATTR_PREFIX = b"SCHILY.xattr."
_USTAR_MAGIC = b"ustar\x00"  # POSIX ustar and pax; GNU's is "ustar  \0" (no name prefix)

# The ustar header: name, mode, uid, gid, size, mtime, chksum, typeflag, linkname, magic,
# version, uname, gname, devmajor, devminor, prefix (GNU keeps other things there).
_HEADER = struct.Struct("100s8s8s8s12s12s8sc100s6s2s32s32s8s8s155s12x")
_SIGNED = struct.Struct("148b8x356b")  # some old tars summed signed chars
_PAX_RECORD = re.compile(rb"(\d+) ([^=]+)=")


class _HeaderError(Exception):
    """A header that cannot be read; iter_layer turns it into one BadInputError line."""


def show_path(path: bytes) -> str:
    """A path for a one-line message: quoted, bytes that are not UTF-8 as \\xNN."""
    return repr(path.decode("utf-8", "backslashreplace"))


def normalize(raw: bytes, what: str = "entry") -> bytes:
    """A tar name as a clean relative path; `..` or an absolute path is unsafe."""
    if b"\0" in raw:
        raise BadInputError(f"layer {what} {show_path(raw)}: NUL byte in name")
    if raw.startswith(b"/"):
        raise UnsafePathError(f"layer {what} {show_path(raw)}: absolute path")
    parts = [p for p in raw.split(b"/") if p and p != b"."]
    if b".." in parts:
        raise UnsafePathError(f"layer {what} {show_path(raw)}: path has a '..' component")
    return b"/".join(parts)


def parse_pax_time(value: str | bytes) -> int:
    """A pax time ("1700000000.123456789", maybe negative) as integer nanoseconds.

    A float cannot hold nanoseconds for today's dates. Like Go's archive/tar, digits past
    the ninth are cut off, not rounded.
    """
    text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
    text = text.strip()
    sign = -1 if text.startswith("-") else 1
    secs, _, frac = text.lstrip("+-").partition(".")
    if not (secs.isdigit() and secs.isascii()) or (
        frac and not (frac.isdigit() and frac.isascii())
    ):
        raise ValueError(value)
    return sign * (int(secs) * 10**9 + int((frac + "000000000")[:9]))


def _number(field: bytes, what: str) -> int:
    """A numeric header field: octal text, or GNU base-256 (first byte 0x80 or 0xff)."""
    first = field[0]
    if first == 0x80 or first == 0xFF:
        n = int.from_bytes(field[1:], "big")
        return n - 256 ** (len(field) - 1) if first == 0xFF else n
    text = field.split(b"\0", 1)[0].strip()
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise _HeaderError(f"invalid header: bad {what} field {field!r}") from None


def _pax_int(value: bytes, key: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise _HeaderError(f"bad pax number ({key}={value!r})") from None


@dataclass(slots=True)
class _Member:
    """One member's header, with every extension header before it applied."""

    type: bytes
    name: bytes
    linkname: bytes
    mode: int
    uid: int
    gid: int
    size: int  # bytes of data in the archive (sparse files: the stored pieces)
    mtime: int
    devmajor: int
    devminor: int
    pax: dict[bytes, bytes]
    realsize: int = -1  # sparse files: the file's size with its holes
    sparse: list[tuple[int, int]] | None = None  # sparse files: (offset, length) pieces


class _Reader:
    """The tar stream read forwards, with its position (for the members' data blocks)."""

    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream
        self.pos = 0

    def read(self, n: int) -> bytes:
        """n bytes; fewer only at the stream's end (the inner stream may be raw)."""
        data = self.stream.read(n)
        if len(data) < n and data:
            rest = bytearray(data)
            while len(rest) < n and (more := self.stream.read(n - len(rest))):
                rest += more
            data = bytes(rest)
        self.pos += len(data)
        return data

    def readinto(self, view: memoryview) -> int:
        n = 0
        while n < len(view) and (got := self.stream.readinto(view[n:])):  # type: ignore[attr-defined]
            n += got
        self.pos += n
        return n

    def skip(self, n: int) -> int:
        """Pass over n bytes; returns how many were there."""
        done = 0
        while done < n:
            got = len(self.stream.read(min(n - done, _SKIP_BLOCK)))
            if not got:
                break
            done += got
        self.pos += done
        return done


_SKIP_BLOCK = 1024 * 1024


def _padding(size: int) -> int:
    return -size % BLOCK


def _read_header(tar: _Reader) -> _Member | None:
    """The next member's header with its extension headers applied; None at the end."""
    pax: dict[bytes, bytes] = {}
    longname: bytes | None = None
    longlink: bytes | None = None
    sparse_pax: bytes = b""  # the raw records of a pax header with GNU sparse 0.0 entries
    while True:
        buf = tar.read(BLOCK)
        if not buf:
            return None  # no end-of-archive blocks: Go and tarfile read that as the end
        if len(buf) != BLOCK:
            raise _HeaderError("truncated header")
        if not buf.strip(b"\0"):
            return None  # a zero block ends the archive
        (
            name,
            mode,
            uid,
            gid,
            size,
            mtime,
            chksum,
            typeflag,
            linkname,
            magic,
            _version,
            _uname,
            _gname,
            devmajor,
            devminor,
            prefix,
        ) = _HEADER.unpack(buf)
        stored = _number(chksum, "checksum")
        unsigned = 256 + sum(buf) - sum(chksum)
        if stored != unsigned and stored != 256 + sum(_SIGNED.unpack(buf)):
            raise _HeaderError("bad checksum")
        size_n = _number(size, "size")
        if size_n < 0:
            raise _HeaderError("invalid header: negative size")
        if typeflag in (_PAX, _SOLARIS_PAX, _PAX_GLOBAL, _GNU_LONGNAME, _GNU_LONGLINK):
            data = tar.read(size_n)
            if len(data) != size_n or tar.skip(_padding(size_n)) != _padding(size_n):
                raise _HeaderError(f"truncated extension header {typeflag!r}")
            if typeflag == _PAX_GLOBAL:
                continue  # dropped, like containerd (tarfile would apply it to every member)
            if typeflag in (_PAX, _SOLARIS_PAX):
                records = _pax_records(data)
                if b"GNU.sparse.offset" in records and not sparse_pax:
                    sparse_pax = data
                for key, value in records.items():
                    pax.setdefault(key, value)  # an earlier header wins
            elif typeflag == _GNU_LONGNAME:
                longname = data.split(b"\0", 1)[0] if longname is None else longname
            else:
                longlink = data.split(b"\0", 1)[0] if longlink is None else longlink
            continue
        name = name.split(b"\0", 1)[0]
        if typeflag == _AREG and name.endswith(b"/"):
            typeflag = _DIR
        if magic == _USTAR_MAGIC and prefix[0]:
            name = prefix.split(b"\0", 1)[0] + b"/" + name
        member = _Member(
            type=typeflag,
            name=longname if longname is not None else name,
            linkname=longlink if longlink is not None else linkname.split(b"\0", 1)[0],
            mode=_number(mode, "mode"),
            uid=_number(uid, "uid"),
            gid=_number(gid, "gid"),
            size=size_n,
            mtime=_number(mtime, "mtime"),
            devmajor=_number(devmajor, "devmajor") if typeflag in (_CHR, _BLK) else 0,
            devminor=_number(devminor, "devminor") if typeflag in (_CHR, _BLK) else 0,
            pax=pax,
        )
        if typeflag == _GNU_SPARSE:
            _gnu_sparse(tar, member, buf)
        _apply_pax(tar, member, sparse_pax)
        return member


def _pax_records(data: bytes) -> dict[bytes, bytes]:
    """`LEN KEY=VALUE\\n` records; a later record for a key replaces an earlier one, and
    a key whose (last) value is empty is dropped (POSIX: it deletes the keyword)."""
    out: dict[bytes, bytes] = {}
    pos = 0
    while match := _PAX_RECORD.match(data, pos):
        length = int(match.group(1))
        if length == 0:
            raise _HeaderError("invalid header: pax record of length 0")
        out[match.group(2)] = data[match.end(2) + 1 : match.start(1) + length - 1]
        pos += length
    return {key: value for key, value in out.items() if value}


def _apply_pax(tar: _Reader, m: _Member, sparse_pax: bytes) -> None:
    pax = m.pax
    if not pax:
        return
    if b"path" in pax:
        m.name = pax[b"path"]
    if b"linkpath" in pax:
        m.linkname = pax[b"linkpath"]
    if b"size" in pax:
        m.size = _pax_int(pax[b"size"], "size")
    # GNU sparse files written as pax (tar --sparse --format=posix), versions 0.0-1.0.
    if b"GNU.sparse.map" in pax:  # 0.1
        numbers = [_pax_int(n, "GNU.sparse.map") for n in pax[b"GNU.sparse.map"].split(b",")]
        m.sparse = list(zip(numbers[::2], numbers[1::2], strict=False))
        m.realsize = _pax_int(pax.get(b"GNU.sparse.size", b""), "GNU.sparse.size")
    elif b"GNU.sparse.size" in pax:  # 0.0: repeated offset/numbytes records
        offsets = re.findall(rb"\d+ GNU\.sparse\.offset=(\d+)\n", sparse_pax)
        lengths = re.findall(rb"\d+ GNU\.sparse\.numbytes=(\d+)\n", sparse_pax)
        m.sparse = list(zip(map(int, offsets), map(int, lengths), strict=False))
        m.realsize = _pax_int(pax[b"GNU.sparse.size"], "GNU.sparse.size")
    elif pax.get(b"GNU.sparse.major") == b"1" and pax.get(b"GNU.sparse.minor") == b"0":
        m.sparse = _sparse_map_in_data(tar, m)
        m.realsize = _pax_int(pax.get(b"GNU.sparse.realsize", b""), "GNU.sparse.realsize")
    if m.sparse is not None and b"GNU.sparse.name" in pax:
        m.name = pax[b"GNU.sparse.name"]


def _sparse_map_in_data(tar: _Reader, m: _Member) -> list[tuple[int, int]]:
    """GNU sparse 1.0: the map is decimal lines in whole blocks at the data's start."""
    buf = b""
    numbers: list[int] = []
    count = -1
    while count < 0 or len(numbers) < 2 * count:
        if b"\n" not in buf:
            block = tar.read(BLOCK)
            if len(block) != BLOCK or m.size < BLOCK:
                raise _HeaderError("truncated sparse map")
            m.size -= BLOCK
            buf += block
            continue
        line, buf = buf.split(b"\n", 1)
        if count < 0:
            count = _pax_int(line, "sparse map")
        else:
            numbers.append(_pax_int(line, "sparse map"))
    return list(zip(numbers[::2], numbers[1::2], strict=True))


def _gnu_sparse(tar: _Reader, m: _Member, header: bytes) -> None:
    """Old GNU sparse ('S'): 4 map entries in the header, 21 more per extension block."""
    pieces = [_sparse_piece(header, pos) for pos in range(386, 386 + 4 * 24, 24)]
    extended = header[482]
    m.realsize = _number(header[483:495], "sparse size")
    while extended:
        block = tar.read(BLOCK)
        if len(block) != BLOCK:
            raise _HeaderError("truncated sparse header")
        pieces += [_sparse_piece(block, pos) for pos in range(0, 21 * 24, 24)]
        extended = block[504]
    m.sparse = [(offset, length) for offset, length in pieces if length]


def _sparse_piece(block: bytes, pos: int) -> tuple[int, int]:
    return _number(block[pos : pos + 12], "sparse"), _number(block[pos + 12 : pos + 24], "sparse")


class _MemberReader(io.RawIOBase):
    """Exactly one regular file's bytes; a short tar shows up as BadInputError here too.

    Reads straight from the tar stream (no copy through a member object); `left` is what
    is still unread of the member's data in the archive, which iter_layer skips.
    """

    def __init__(self, tar: _Reader, size: int, name: str) -> None:
        super().__init__()
        self._tar = tar
        self.left = size
        self._name = name
        self.stale = False

    def readable(self) -> bool:
        return True

    def _guard(self) -> None:
        if self.stale:
            raise ValueError(f"layer entry {self._name}: read after the next entry was asked for")

    def read(self, size: int | None = -1) -> bytes:
        self._guard()
        want = self.left if size is None or size < 0 else min(size, self.left)
        data = self._tar.read(want)
        self._advance(want, len(data))
        return data

    def readall(self) -> bytes:
        return self.read(-1)

    def readinto(self, buf: memoryview | bytearray) -> int:  # type: ignore[override]
        self._guard()
        view = memoryview(buf).cast("B")[: self.left]
        n = self._tar.readinto(view)
        self._advance(len(view), n)
        return n

    def _advance(self, want: int, got: int) -> None:
        if got < want:  # the stream gives short data only at its end
            raise self.cut_short(f"{self.left - got} bytes missing")
        self.left -= got

    def cut_short(self, why: str) -> BadInputError:
        return BadInputError(f"layer entry {self._name}: file data cut short ({why})")


class _SparseReader(_MemberReader):
    """A sparse file: its stored pieces at their offsets, zeros in the holes."""

    def __init__(
        self, tar: _Reader, stored: int, name: str, pieces: list[tuple[int, int]], size: int
    ) -> None:
        super().__init__(tar, stored, name)
        self._pieces = pieces
        self._index = 0
        self._pos = 0  # position in the expanded file
        self._size = size

    def read(self, size: int | None = -1) -> bytes:
        self._guard()
        want = self._size - self._pos if size is None or size < 0 else size
        out = bytearray()
        while len(out) < want and self._pos < self._size:
            out += self._next(want - len(out))
        return bytes(out)

    def readinto(self, buf: memoryview | bytearray) -> int:  # type: ignore[override]
        data = self.read(len(memoryview(buf).cast("B")))
        memoryview(buf).cast("B")[: len(data)] = data
        return len(data)

    def _next(self, want: int) -> bytes:
        if self._index < len(self._pieces):
            offset, length = self._pieces[self._index]
            if self._pos < offset:  # a hole
                n = min(want, offset - self._pos)
                self._pos += n
                return bytes(n)
            n = min(want, offset + length - self._pos)
            data = super().read(n)
            self._pos += n
            if self._pos == offset + length:
                self._index += 1
            return data
        n = min(want, self._size - self._pos)  # the hole at the end
        self._pos += n
        return bytes(n)


def _check_sparse(m: _Member, shown: str) -> None:
    end = 0
    for offset, length in m.sparse or ():
        if offset < end or length < 0:
            raise BadInputError(f"layer entry {shown}: bad sparse map")
        end = offset + length
    if m.realsize < end or sum(length for _, length in m.sparse or ()) != m.size:
        raise BadInputError(f"layer entry {shown}: sparse map does not match the data")


def iter_layer(stream: BinaryIO) -> Iterator[tuple[LayerEntry, BinaryIO | None]]:
    """Entries of one uncompressed layer tar, in tar order.

    For a regular file the second item reads exactly `inode.size` bytes of its content;
    the caller may read all, some or none of it, but only before asking for the next
    entry. For everything else it is None.
    """
    tar = _Reader(stream)
    last: str | None = None
    while True:
        try:
            m = _read_header(tar)
        except _HeaderError as exc:
            if last is None:
                raise BadInputError(f"layer tar unreadable at its first header: {exc}") from None
            raise BadInputError(f"layer tar broken after entry {last}: {exc}") from None
        if m is None:
            return
        last = show_path(m.name)
        entry = _entry(m)
        data = m.size if m.type in _DATA_TYPES else 0
        reader: _MemberReader | None = None
        if entry is not None:
            if entry.inode is not None and entry.inode.kind == Kind.REG:
                if m.sparse is not None:
                    _check_sparse(m, last)
                    reader = _SparseReader(tar, m.size, last, m.sparse, m.realsize)
                else:
                    reader = _MemberReader(tar, m.size, last)
            yield entry, reader
        left = data if reader is None else reader.left
        if reader is not None:
            reader.stale = True
        want = left + _padding(data)
        got = tar.skip(want)
        if got < want and left:  # the data is short: padding may end with the stream
            raise BadInputError(
                f"layer entry {last}: file data cut short ({want - got} bytes missing)"
            )


def _entry(m: _Member) -> LayerEntry | None:
    """One tar member as a LayerEntry (None for members that change nothing)."""
    raw = m.name
    path = normalize(raw)
    base = path.rpartition(b"/")[2]
    parent = path.rpartition(b"/")[0]
    if base.startswith(WHITEOUT_PREFIX):
        if base == OPAQUE_MARKER:
            return LayerEntry(Op.OPAQUE, parent)
        if base.startswith(_WHITEOUT_META):
            return None
        name = base[len(WHITEOUT_PREFIX) :]
        if name in (b"", b".", b".."):
            raise UnsafePathError(f"layer entry {show_path(raw)}: whiteout names no file")
        return LayerEntry(Op.WHITEOUT, parent + b"/" + name if parent else name)
    if m.type == _LNK:
        if not m.linkname:
            raise BadInputError(f"layer entry {show_path(raw)}: hard link with an empty target")
        link = normalize(m.linkname, f"hard link {show_path(raw)} ->")
        return LayerEntry(Op.HARDLINK, path, link=link)
    kind = _KINDS.get(m.type)
    if kind is None:
        raise BadInputError(f"layer entry {show_path(raw)}: unsupported tar entry type {m.type!r}")
    if path == b"" and kind != Kind.DIR:
        raise UnsafePathError(f"layer entry {show_path(raw)}: the image root must be a directory")
    return LayerEntry(Op.INODE, path, _inode(m, kind, raw))


def _inode(m: _Member, kind: Kind, raw: bytes) -> Inode:
    pax = m.pax
    uid, gid, mtime_ns = m.uid, m.gid, m.mtime * 10**9
    if pax:
        try:
            if b"uid" in pax:
                uid = int(pax[b"uid"])
            if b"gid" in pax:
                gid = int(pax[b"gid"])
            if b"mtime" in pax:
                mtime_ns = parse_pax_time(pax[b"mtime"])
        except ValueError as exc:
            raise BadInputError(f"layer entry {show_path(raw)}: bad pax number ({exc})") from None
    for what, value in (("uid", uid), ("gid", gid)):
        if not 0 <= value <= _MAX_ID:
            raise BadInputError(f"layer entry {show_path(raw)}: {what} {value} out of range")
    xattrs = {
        key[len(_XATTR_PREFIX) :]: value
        for key, value in pax.items()
        if key.startswith(_XATTR_PREFIX)
    }
    inode = Inode(
        kind=kind, mode=m.mode & 0o7777, uid=uid, gid=gid, mtime_ns=mtime_ns, xattrs=xattrs
    )
    if kind == Kind.REG:
        inode.size = m.realsize if m.sparse is not None else m.size
    elif kind == Kind.SYMLINK:
        inode.target = m.linkname
        if not inode.target:
            raise BadInputError(f"layer entry {show_path(raw)}: symlink with an empty target")
        inode.size = len(inode.target)  # what lstat reports for a symlink
    elif kind in (Kind.CHR, Kind.BLK):
        try:
            inode.rdev = os.makedev(m.devmajor, m.devminor)
        except (OverflowError, ValueError):
            raise BadInputError(
                f"layer entry {show_path(raw)}: bad device {m.devmajor}:{m.devminor}"
            ) from None
    return inode
