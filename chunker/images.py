"""Publishing an image's objects in a store, and fetching them back verified: its
manifest and its EROFS metadata image (their keys: chunker/keys.py). The refs that name
images are chunker/refs.py's.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import blake3
import zstandard

from chunker.errors import (
    BadInputError,
    CorruptObjectError,
    LazyfsError,
    NotFoundError,
    ObjectNotFound,
)
from chunker.keys import EROFS_PREFIX, IMAGES_PREFIX
from chunker.manifest import ErofsTree, Manifest, build_manifest, temp_manifest_path
from chunker.model import Inode, Kind
from chunker.refs import resolve_image
from chunker.store.interface import ObjectStore

MAX_EROFS_BYTES = 1 << 32  # an inflated EROFS metadata image larger than this is refused
MAX_MANIFEST_BYTES = 1 << 32  # an inflated manifest larger than this is refused
MANIFEST_PIECE = 1 << 20
# zstd level of manifests and EROFS metadata images. 3, zstd's default: the sympy image's
# four manifests (6.4 MB) took 188 ms at level 10 and 33 ms at 3, for 6.5 % more bytes
# (2.17 against 2.31 MB); its EROFS images 44 against 7 ms, 424 against 482 kB. With a
# tree per layer a convert publishes each twice over, and level 10 was ~17 % of a
# re-convert (docs/design-changes.md, session 43). A node fetches them once.
METADATA_ZSTD_LEVEL = 3


def upload_manifest(store: ObjectStore, image_id: str, manifest: Path) -> int:
    """Put the manifest object (before any ref names it); returns its stored size."""
    blob = zstandard.ZstdCompressor(level=METADATA_ZSTD_LEVEL).compress(manifest.read_bytes())
    store.put(IMAGES_PREFIX + image_id, blob)
    return len(blob)


# A NamedTuple, not a dataclass: `lazyfs run` imports this module to fetch a manifest,
# and the dataclasses module (inspect, ast, dis, tokenize) is ~6 ms of a cold start.
class PublishedTree(NamedTuple):
    image_id: str
    manifest_bytes: int  # stored (compressed) size of the manifest
    erofs: str | None  # id of the EROFS metadata image, None if the tree could not have one
    erofs_refused: str = ""  # why not, in one line


def publish_tree(
    store: ObjectStore,
    entries: list[tuple[bytes, Inode]],
    nlink: dict[int, int],
    meta: dict[str, str],
    data_order: list[Inode] | None = None,
) -> PublishedTree:
    """Store an image's merged tree: its EROFS metadata image, then the manifest that
    names it (refs are the caller's last step).

    entries and nlink as build_manifest takes them. The EROFS data area holds the files
    of data_order first (a start-up's read order, see startup_order), then the rest in
    tree order. A tree that EROFS cannot hold
    as the kernel would accept it (chunker/erofs.py refuses it: a 4 KiB symlink target,
    an xattr namespace EROFS has no prefix for, ...) is published without one: nodes
    serve it with the FUSE tree, which has none of those limits.
    """
    from chunker.erofs import build_erofs

    path = temp_manifest_path()
    try:
        erofs, refused = None, ""
        try:
            layout = build_erofs(entries, nlink, path, data_order=data_order or ())
        except BadInputError as exc:
            refused = str(exc)
        else:
            object_id, _ = upload_erofs(store, path)
            erofs = ErofsTree(object_id, layout.meta_blocks, layout.total_blocks, layout.extents)
        image_id = build_manifest(entries, nlink, meta, path, erofs)
        return PublishedTree(
            image_id,
            upload_manifest(store, image_id, path),
            erofs.object_id if erofs else None,
            refused,
        )
    finally:
        path.unlink(missing_ok=True)


def startup_order(
    store: ObjectStore, earlier: list[str], entries: list[tuple[bytes, Inode]]
) -> list[Inode]:
    """The files of a tree in the order a start-up of an earlier version of the image
    read them: from the start-up trace of the first of `earlier` (names or source
    digests that pointed at an image before this convert) that has a valid one.

    An image's own trace is recorded by its first mount, after convert, so a fresh
    image has none; the image a name pointed at before usually starts the same way
    (same base, a changed task layer). [] when there is no such trace: tree order.
    """
    from chunker.trace import decode_trace, trace_key

    for ref in earlier:
        try:
            image_id = resolve_image(store, ref)
            chunks = decode_trace(store.get(trace_key(image_id)), image_id)
        except (LazyfsError, ObjectNotFound):
            continue
        by_chunk: dict[bytes, Inode] = {}
        for _, inode in entries:
            if inode.kind == Kind.REG:
                for c in inode.chunks:
                    by_chunk.setdefault(c.id, inode)
        order: dict[int, Inode] = {}
        for c in chunks:
            inode = by_chunk.get(c.id)
            if inode is not None:
                order.setdefault(id(inode), inode)
        return list(order.values())
    return []


def upload_erofs(store: ObjectStore, image: Path) -> tuple[str, int]:
    """Put an EROFS metadata image (before the manifest names it); (its id, stored size)."""
    data = image.read_bytes()
    object_id = blake3.blake3(data).hexdigest()
    blob = zstandard.ZstdCompressor(level=METADATA_ZSTD_LEVEL).compress(data)
    store.put(EROFS_PREFIX + object_id, blob)
    return object_id, len(blob)


def fetch_manifest(
    store: ObjectStore, image_id: str, dest: Path, blob: bytes | None = None
) -> Path:
    """Download and verify an image's manifest into dest (`blob`: its stored bytes, if
    the caller has read them already)."""
    return _fetch_verified(
        store,
        IMAGES_PREFIX + image_id,
        image_id,
        dest,
        f"manifest of image {image_id}",
        MAX_MANIFEST_BYTES,
        blob,
    )


def fetch_erofs(store: ObjectStore, object_id: str, dest: Path, blob: bytes | None = None) -> Path:
    """Download and verify an EROFS metadata image into dest: the kernel never sees
    metadata whose blake3 is not the id the (verified) manifest names. `blob` as for
    fetch_manifest."""
    return _fetch_verified(
        store,
        EROFS_PREFIX + object_id,
        object_id,
        dest,
        f"EROFS metadata {object_id}",
        MAX_EROFS_BYTES,
        blob,
    )


def _fetch_verified(
    store: ObjectStore,
    key: str,
    object_id: str,
    dest: Path,
    what: str,
    max_bytes: int,
    blob: bytes | None = None,
) -> Path:
    """Inflate a zstd object (`blob`, else read from the store) to dest piece by piece,
    hashing as it goes, and check that the bytes' blake3 is object_id; a damaged object
    leaves no file. dest appears by rename, complete, or not at all.

    Piece by piece: the whole inflated manifest in memory (next to the compressed one)
    was the mount daemon's peak RSS, ~3x the manifest. Into one reused buffer: the
    stream reader's read() took 5.0 ms for a 2 MB manifest here, readinto() 1.9 ms.
    """
    if blob is None:
        try:
            blob = store.get(key)
        except ObjectNotFound:
            raise NotFoundError(f"{what} is missing from {store.url}") from None
    dest.parent.mkdir(parents=True, exist_ok=True)
    # A temporary name of this call's own: two fetches of one object may run at once
    # (processes, or threads of the node agent); the last rename wins, same bytes.
    fd, name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    tmp = Path(name)
    digest = blake3.blake3()
    size = 0
    try:
        buf = bytearray(MANIFEST_PIECE)
        with open(fd, "wb") as out, zstandard.ZstdDecompressor().stream_reader(blob) as src:
            while n := src.readinto(buf):
                size += n
                if size > max_bytes:
                    raise CorruptObjectError(f"{what} is too large")
                piece = memoryview(buf)[:n]
                digest.update(piece)
                out.write(piece)
        # A truncated or altered blob inflates to other bytes: the id check catches both.
        if digest.hexdigest() != object_id:
            raise CorruptObjectError(f"{what} does not match its id")
    except zstandard.ZstdError:
        tmp.unlink(missing_ok=True)
        raise CorruptObjectError(f"{what} is corrupt") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(dest)
    return dest


@contextmanager
def opened_manifest(store: ObjectStore, image_id: str) -> Iterator[Manifest]:
    """An image's manifest, fetched into a temporary file for the duration of a with."""
    with tempfile.TemporaryDirectory(prefix="lazyfs-") as tmp:
        manifest = Manifest(fetch_manifest(store, image_id, Path(tmp) / "manifest.db"))
        try:
            yield manifest
        finally:
            manifest.close()
