"""Turn one uncompressed layer tar stream into validated entries.

`iter_layer` reads the tar with Python's tarfile in stream mode (never seeking back) and
yields one `LayerEntry` per member that matters to the merged tree: a new inode, a hard
link, a whiteout (`dir/.wh.NAME` removes `dir/NAME`) or an opaque marker
(`dir/.wh..wh..opq` hides everything lower layers put under `dir`). Paths come out
normalized and as bytes, exactly as they are in the tar (names need not be UTF-8).

What a container runtime would refuse, or what could land outside the image root, is
refused here with one line naming the entry: `..` components, absolute paths, absolute or
escaping hard-link targets, entry types that cannot be represented, bad checksums, and
tars that end early (truncated headers, or a size field larger than the data behind it).
"""

from __future__ import annotations

import io
import os
import tarfile
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

_KINDS = {
    tarfile.REGTYPE: Kind.REG,
    tarfile.AREGTYPE: Kind.REG,
    tarfile.CONTTYPE: Kind.REG,  # contiguous files are plain files everywhere else
    tarfile.GNUTYPE_SPARSE: Kind.REG,  # tarfile expands the holes when reading
    tarfile.DIRTYPE: Kind.DIR,
    tarfile.SYMTYPE: Kind.SYMLINK,
    tarfile.CHRTYPE: Kind.CHR,
    tarfile.BLKTYPE: Kind.BLK,
    tarfile.FIFOTYPE: Kind.FIFO,
}

_MAX_ID = 2**32 - 2  # (uid_t)-1 means "leave unchanged" to chown: not an owner
_XATTR_PREFIX = "SCHILY.xattr."


def _raw(name: str) -> bytes:
    """The bytes tarfile decoded (utf-8 + surrogateescape round-trips any byte string)."""
    return name.encode("utf-8", "surrogateescape")


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


def parse_pax_time(value: str) -> int:
    """A pax time ("1700000000.123456789", maybe negative) as integer nanoseconds.

    tarfile turns it into a float, which cannot hold nanoseconds for today's dates. Like
    Go's archive/tar, digits past the ninth are cut off, not rounded.
    """
    text = value.strip()
    sign = -1 if text.startswith("-") else 1
    secs, _, frac = text.lstrip("+-").partition(".")
    if not (secs.isdigit() and secs.isascii()) or (
        frac and not (frac.isdigit() and frac.isascii())
    ):
        raise ValueError(value)
    return sign * (int(secs) * 10**9 + int((frac + "000000000")[:9]))


class _TarInfo(tarfile.TarInfo):
    """tarfile's member parser, minus three behaviours a layer reader cannot accept.

    - tarfile silently ends the archive at a bad checksum or a half header after the
      first member; the header error is remembered here so `iter_layer` can refuse it.
    - pax *global* headers are dropped, as containerd does: tarfile would apply their
      path/mtime/xattr records to every following member.
    - a pax record with an empty value is ignored (POSIX: it deletes the keyword), as
      Go's archive/tar does: tarfile would set an empty path, and umoci sets no xattr
      for `SCHILY.xattr.NAME=`.
    """

    def _apply_pax_info(self, pax_headers: dict[str, str], encoding: str, errors: str) -> None:
        kept = {key: value for key, value in pax_headers.items() if value != ""}
        super()._apply_pax_info(kept, encoding, errors)

    @classmethod
    def fromtarfile(cls, tar: tarfile.TarFile) -> tarfile.TarInfo:
        try:
            return super().fromtarfile(tar)
        except tarfile.HeaderError as exc:
            tar._lazyfs_end = exc  # type: ignore[attr-defined]
            raise

    def _proc_pax(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type != tarfile.XGLTYPE:
            return super()._proc_pax(tar)
        want = self._block(self.size)
        if len(tar.fileobj.read(want)) != want:
            raise tarfile.SubsequentHeaderError("truncated pax global header")
        try:
            return self.fromtarfile(tar)
        except tarfile.HeaderError as exc:
            raise tarfile.SubsequentHeaderError(str(exc)) from None


class _MemberReader(io.RawIOBase):
    """Exactly one regular file's bytes; a short tar shows up as BadInputError here too.

    `inner` is either tarfile's member reader (sparse files, whose holes tarfile fills
    in) or the tar stream itself, positioned at the member's data: reading that
    directly saves tarfile's extra copy of every file byte. `size` bytes are given out.
    """

    def __init__(self, inner: BinaryIO, size: int, name: str) -> None:
        super().__init__()
        self._inner = inner
        self._left = size
        self._name = name
        self._stale = False

    def readable(self) -> bool:
        return True

    def _guard(self) -> None:
        if self._stale:
            raise ValueError(f"layer entry {self._name}: read after the next entry was asked for")

    def read(self, size: int | None = -1) -> bytes:
        self._guard()
        want = self._left if size is None or size < 0 else min(size, self._left)
        try:
            data = self._inner.read(want)
        except (tarfile.TarError, EOFError) as exc:
            raise self._cut_short(exc) from None
        self._advance(want, len(data))
        return data

    def readall(self) -> bytes:
        return self.read(-1)

    def readinto(self, buf: memoryview | bytearray) -> int:  # type: ignore[override]
        self._guard()
        view = memoryview(buf).cast("B")[: self._left]
        try:
            n = self._inner.readinto(view)  # type: ignore[attr-defined]
        except (tarfile.TarError, EOFError) as exc:
            raise self._cut_short(exc) from None
        self._advance(len(view), n)
        return n

    def _advance(self, want: int, got: int) -> None:
        # Both inners give short data only at the stream's end.
        if got < want:
            raise self._cut_short(EOFError(f"{self._left - got} bytes missing"))
        self._left -= got

    def _cut_short(self, exc: Exception) -> BadInputError:
        return BadInputError(f"layer entry {self._name}: file data cut short ({exc})")


def iter_layer(stream: BinaryIO) -> Iterator[tuple[LayerEntry, BinaryIO | None]]:
    """Entries of one uncompressed layer tar, in tar order.

    For a regular file the second item reads exactly `inode.size` bytes of its content;
    the caller may read all, some or none of it, but only before asking for the next
    entry. For everything else it is None.
    """
    tar = _open(stream)
    if tar is None:
        return
    reader: _MemberReader | None = None
    last = "(none: the first one)"
    with tar:
        while True:
            if reader is not None:
                reader._stale = True
                reader = None
            try:
                info = tar.next()
            except (tarfile.TarError, EOFError) as exc:
                raise BadInputError(f"layer tar broken after entry {last}: {exc}") from None
            # tarfile keeps every member it has read in a list; a 200k-entry layer
            # should not.
            tar.members.clear()
            if info is None:
                end = getattr(tar, "_lazyfs_end", None)
                if not isinstance(end, tarfile.EOFHeaderError | tarfile.EmptyHeaderError):
                    raise BadInputError(f"layer tar broken after entry {last}: {end}")
                return
            last = show_path(_raw(info.name))
            entry = _entry(info)
            if entry is None:
                continue
            if entry.inode is not None and entry.inode.kind == Kind.REG:
                inner: BinaryIO | None = tar.fileobj  # type: ignore[assignment]
                if info.issparse() or tar.fileobj.tell() != info.offset_data:
                    inner = tar.extractfile(info)
                assert inner is not None
                reader = _MemberReader(inner, info.size, last)
            yield entry, reader


class _Forward(io.RawIOBase):
    """A stream that can only go forwards, made "seekable" forwards (skipping = reading).

    tarfile's random-access mode ("r:") reads headers and file data straight from the
    caller's buffered stream; its stream mode ("r|") copies everything through a Python
    buffer and runs about half as fast. "r:" only ever seeks forwards over a stream it
    reads in order, so seeking by reading is enough.
    """

    def __init__(self, inner: BinaryIO) -> None:
        super().__init__()
        self._inner = inner
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence != io.SEEK_SET or offset < self._pos:
            raise io.UnsupportedOperation("layer tar streams only seek forwards")
        while self._pos < offset:
            skipped = len(self._inner.read(min(offset - self._pos, _SKIP_BLOCK)))
            if not skipped:
                break  # at EOF: tarfile's next read sees the short data
            self._pos += skipped
        return self._pos

    # Both reads are short only at the stream's end (the inner stream may be raw).

    def read(self, size: int | None = -1) -> bytes:
        data = self._inner.read(-1 if size is None else size)
        if size is not None and 0 <= size != len(data) and data:
            rest = bytearray(data)
            while len(rest) < size and (more := self._inner.read(size - len(rest))):
                rest += more
            data = bytes(rest)
        self._pos += len(data)
        return data

    def readinto(self, buf: memoryview | bytearray) -> int:  # type: ignore[override]
        view = memoryview(buf).cast("B")
        n = 0
        while n < len(view) and (got := self._inner.readinto(view[n:])):  # type: ignore[attr-defined]
            n += got
        self._pos += n
        return n


_SKIP_BLOCK = 1024 * 1024


def _open(stream: BinaryIO) -> tarfile.TarFile | None:
    """tarfile over the stream (None for a zero-byte stream: Go reads that as no entries)."""
    try:
        return tarfile.open(  # noqa: SIM115 -- iter_layer closes it
            fileobj=_Forward(stream),  # type: ignore[arg-type]
            mode="r:",
            encoding="utf-8",
            errors="surrogateescape",
            tarinfo=_TarInfo,
        )
    except tarfile.ReadError as exc:
        if str(exc) == "empty file":
            return None
        raise BadInputError(f"layer tar unreadable at its first header: {exc}") from None
    except (tarfile.TarError, EOFError) as exc:
        raise BadInputError(f"layer tar unreadable: {exc}") from None


def _entry(info: tarfile.TarInfo) -> LayerEntry | None:
    """One tar member as a LayerEntry (None for members that change nothing)."""
    raw = _raw(info.name)
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
    if info.type == tarfile.LNKTYPE:
        target_raw = _raw(info.linkname)
        if not target_raw:
            raise BadInputError(f"layer entry {show_path(raw)}: hard link with an empty target")
        link = normalize(target_raw, f"hard link {show_path(raw)} ->")
        return LayerEntry(Op.HARDLINK, path, link=link)
    kind = _KINDS.get(info.type)
    if kind is None:
        raise BadInputError(
            f"layer entry {show_path(raw)}: unsupported tar entry type {info.type!r}"
        )
    if path == b"" and kind != Kind.DIR:
        raise UnsafePathError(f"layer entry {show_path(raw)}: the image root must be a directory")
    return LayerEntry(Op.INODE, path, _inode(info, kind, raw))


def _inode(info: tarfile.TarInfo, kind: Kind, raw: bytes) -> Inode:
    pax = info.pax_headers
    try:
        uid = int(pax["uid"]) if "uid" in pax else info.uid
        gid = int(pax["gid"]) if "gid" in pax else info.gid
        mtime_ns = parse_pax_time(pax["mtime"]) if "mtime" in pax else int(info.mtime) * 10**9
    except ValueError as exc:
        raise BadInputError(f"layer entry {show_path(raw)}: bad pax number ({exc})") from None
    for what, value in (("uid", uid), ("gid", gid)):
        if not 0 <= value <= _MAX_ID:
            raise BadInputError(f"layer entry {show_path(raw)}: {what} {value} out of range")
    xattrs = {
        _raw(key[len(_XATTR_PREFIX) :]): _raw(value)
        for key, value in pax.items()
        if key.startswith(_XATTR_PREFIX)
    }
    inode = Inode(
        kind=kind,
        mode=info.mode & 0o7777,
        uid=uid,
        gid=gid,
        mtime_ns=mtime_ns,
        xattrs=xattrs,
    )
    if kind == Kind.REG:
        inode.size = info.size
    elif kind == Kind.SYMLINK:
        inode.target = _raw(info.linkname)
        if not inode.target:
            raise BadInputError(f"layer entry {show_path(raw)}: symlink with an empty target")
        inode.size = len(inode.target)  # what lstat reports for a symlink
    elif kind in (Kind.CHR, Kind.BLK):
        try:
            inode.rdev = os.makedev(info.devmajor, info.devminor)
        except (OverflowError, ValueError):
            raise BadInputError(
                f"layer entry {show_path(raw)}: bad device {info.devmajor}:{info.devminor}"
            ) from None
    return inode
