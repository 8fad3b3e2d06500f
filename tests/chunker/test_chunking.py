"""Chunk boundaries and ids are part of the store format: pin them."""

import io
import random

import blake3

from chunker.chunking import MAX_SIZE, MIN_SIZE, chunk_id, cut, cut_reader

GOLDEN_DATA_SEED = 20261129
# Boundaries of 4 MB of seeded pseudo-random bytes. If this test fails, the chunker now
# cuts files differently from every store already written: new images would no longer
# deduplicate against old ones. Change it only with a new store format version.
GOLDEN_FIRST = [207668, 128320, 32486, 66285, 52492, 23215, 78130, 23158, 67575, 105661]
GOLDEN_COUNT = 51
GOLDEN_LENGTHS_BLAKE3 = "979c5b1c39f01b430f84df023056e9d71e69edc4368157f7fa56d7d55909d05b"


def golden_data() -> bytes:
    return random.Random(GOLDEN_DATA_SEED).randbytes(4_000_000)


def test_boundaries_are_pinned() -> None:
    lengths = [len(c) for c in cut(golden_data())]
    assert lengths[:10] == GOLDEN_FIRST
    assert len(lengths) == GOLDEN_COUNT
    assert blake3.blake3(repr(lengths).encode()).hexdigest() == GOLDEN_LENGTHS_BLAKE3


def test_chunk_id_is_blake3_of_the_bytes() -> None:
    assert chunk_id(b"lazyfs").hex() == (
        "9f7f808aaac823e20b0e2cdfed282990db3e94bd336fc46333f91e1927f380cd"
    )


def test_streaming_cut_matches_whole_file_cut() -> None:
    data = golden_data()
    whole = [bytes(c) for c in cut(data)]
    streamed = list(cut_reader(io.BytesIO(data), len(data)))
    assert streamed == whole
    assert b"".join(streamed) == data


def test_sizes_respect_bounds_and_small_files_are_one_chunk() -> None:
    lengths = [len(c) for c in cut(golden_data())]
    assert all(MIN_SIZE <= n <= MAX_SIZE for n in lengths[:-1])
    assert [bytes(c) for c in cut(b"x" * MIN_SIZE)] == [b"x" * MIN_SIZE]
    assert list(cut(b"")) == []
    assert list(cut_reader(io.BytesIO(b"abc"), 3)) == [b"abc"]


def test_an_insertion_only_changes_nearby_chunks() -> None:
    data = golden_data()
    edited = data[:1_000_000] + b"inserted bytes" + data[1_000_000:]
    before = {chunk_id(c) for c in cut(data)}
    after = [chunk_id(c) for c in cut(edited)]
    changed = [c for c in after if c not in before]
    assert 1 <= len(changed) <= 3
