"""Content-defined chunking of one file's bytes, and chunk ids.

Boundaries come from FastCDC (pyfastcdc, the 2020 paper's algorithm with normalized
chunking level 1 and the default gear table). They are pinned by
tests/chunker/test_chunking.py (test_boundaries_are_pinned): changing any constant here
changes the chunks of every file ever converted, which would stop new images from
deduplicating against old ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import BinaryIO

import blake3
from pyfastcdc.cy import FastCDC

# Chosen by bench/chunk_params.py on the test images (see docs/FORMATS.md).
MIN_SIZE = 16 * 1024
AVG_SIZE = 64 * 1024
MAX_SIZE = 256 * 1024

_cdc = FastCDC(avg_size=AVG_SIZE, min_size=MIN_SIZE, max_size=MAX_SIZE)


def chunk_id(data: bytes | memoryview) -> bytes:
    """blake3-256 of the uncompressed bytes: a chunk's name everywhere."""
    return blake3.blake3(data).digest()


def cut(data: bytes | memoryview) -> Iterator[memoryview]:
    """Split one file's content into chunks; a file below MIN_SIZE is one chunk."""
    view = memoryview(data)
    if len(view) <= MIN_SIZE:
        if len(view):
            yield view
        return
    for c in _cdc.cut_buf(view):
        yield view[c.offset : c.offset + c.length]


def cut_reader(reader: BinaryIO, size: int) -> Iterator[bytes]:
    """Chunks of a file read from a stream that ends where the file ends.

    Small files are read whole; larger ones go through FastCDC's streaming cutter, which
    gives the same boundaries as cutting the whole file at once, in bounded memory.
    """
    if size <= 8 * MAX_SIZE:
        data = reader.read(size)
        for view in cut(data):
            yield bytes(view) if len(view) != len(data) else data
        return
    for c in _cdc.cut_stream(reader):
        yield bytes(c.data)
