"""Start-up traces: the chunks an image's mount read first, in the order it read them.

One optional object per image, `traces/<image id>` (docs/FORMATS.md, "Start-up trace"):
written by the first mount of the image that finds none, replayed by later mounts on any
node to fetch those chunks in the background before their readers ask
(node_cache/prefetch.py). A trace is only a hint: every chunk it names is verified
against its blake3 id when fetched, and a missing or unreadable trace means "no prefetch",
never a failed mount. It names packs of its image only, so gc keeps it exactly as long as
the image's manifest, and push copies it along.
"""

from __future__ import annotations

import re

import msgpack
import zstandard

from chunker.errors import CorruptObjectError
from chunker.model import ChunkRef

TRACES_PREFIX = "traces/"
FORMAT = "lazyfs-trace"
VERSION = 1
MAX_TRACE_BYTES = 64 << 20  # decompressed; a trace of 100k chunks is ~6 MB
_PACK_NAME = re.compile(r"[0-9a-f]{64}")


def trace_key(image_id: str) -> str:
    return TRACES_PREFIX + image_id


def encode_trace(image_id: str, refs: list[ChunkRef]) -> bytes:
    """The stored form of a trace (zstd with a content checksum, of a msgpack map)."""
    packs: dict[str, int] = {}
    rows = [[r.id, r.size, packs.setdefault(r.pack, len(packs)), r.offset, r.clen] for r in refs]
    body = {
        "format": FORMAT,
        "version": VERSION,
        "image": image_id,
        "packs": list(packs),
        "chunks": rows,
    }
    raw = msgpack.packb(body, use_bin_type=True)
    return zstandard.ZstdCompressor(level=3, write_checksum=True).compress(raw)


def decode_trace(blob: bytes, image_id: str) -> list[ChunkRef]:
    """The chunk refs of a stored trace; CorruptObjectError for anything malformed."""
    what = f"start-up trace of image {image_id}"
    try:
        raw = zstandard.ZstdDecompressor().decompress(blob, max_output_size=MAX_TRACE_BYTES)
        body = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (zstandard.ZstdError, ValueError, msgpack.UnpackException) as exc:
        raise CorruptObjectError(f"{what} does not decode: {exc}") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise CorruptObjectError(f"{what} is not a lazyfs trace")
    if body.get("version") != VERSION:
        raise CorruptObjectError(f"{what} has unsupported version {body.get('version')!r}")
    if body.get("image") != image_id:
        raise CorruptObjectError(f"{what} belongs to another image")
    try:
        packs = body["packs"]
        if not all(isinstance(p, str) and _PACK_NAME.fullmatch(p) for p in packs):
            raise ValueError("bad pack name")
        refs = []
        for cid, size, pack, offset, clen in body["chunks"]:
            if not (
                isinstance(cid, bytes)
                and len(cid) == 32
                and all(type(v) is int and v >= 0 for v in (size, pack, offset, clen))
                and pack < len(packs)
            ):
                raise ValueError("bad chunk row")
            refs.append(ChunkRef(cid, size, packs[pack], offset, clen))
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise CorruptObjectError(f"{what} is malformed: {exc}") from None
    return refs
