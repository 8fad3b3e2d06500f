"""Start-up traces with real mounts on a real SeaweedFS: the first mount records which
chunks were read first, a later mount on an empty cache fetches them before its reader
asks, and a missing, corrupt or wrong trace never breaks a mount."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from chunker.errors import CorruptObjectError
from chunker.model import ChunkRef
from chunker.store.backends import open_store
from chunker.store.interface import ObjectStore
from chunker.trace import decode_trace, encode_trace, trace_key
from testbed.image_builder import ImageBuilder
from testbed.mounted_trees import running_mount, stats_of
from testbed.processes import wait_until
from tests.lazyfs.conftest import build_test_image

FILES = ("dir/sub/deep.txt", "big.bin", "small.txt")  # read in this order


def read_files(mp: Path, builder: ImageBuilder) -> None:
    for name in FILES:
        assert (mp / name).read_bytes() == builder.data[name]


def unmount_and_wait(mp: Path, proc: subprocess.Popen) -> None:
    """A clean unmount, then the daemon's exit (it writes the trace and final stats)."""
    subprocess.run(["fusermount3", "-u", str(mp)], check=True, capture_output=True)
    assert proc.wait(30) == 0


def file_chunks(store: ObjectStore, image_id: str, builder: ImageBuilder) -> list[ChunkRef]:
    """The chunks of FILES in read order, from the builder's published inodes."""
    inodes = {path.decode(): inode for path, inode in builder.entries}
    return [ref for name in FILES for ref in inodes[name].chunks]


@pytest.fixture
def s3_image(s3_url: str) -> tuple[str, str, ImageBuilder]:
    store = open_store(s3_url)
    try:
        image_id, builder = build_test_image(store, "trace/image")
    finally:
        store.close()
    return s3_url, image_id, builder


def test_first_mount_records_a_trace_and_a_second_mount_replays_it(
    s3_image, seaweed, tmp_path: Path
) -> None:
    url, image_id, builder = s3_image
    store = open_store(url)
    mp = tmp_path / "mnt"
    mp.mkdir()
    # 1. No trace yet: the mount records the order of its first reads, writes it at exit.
    with running_mount(image_id, mp, url, tmp_path / "c1") as proc:
        read_files(mp, builder)
        unmount_and_wait(mp, proc)
    assert stats_of(tmp_path / "c1")["trace"] == "recorded"
    traced = decode_trace(store.get(trace_key(image_id)), image_id)
    expected = file_chunks(store, image_id, builder)
    assert [r.id for r in traced] == list(dict.fromkeys(r.id for r in expected))
    assert traced == list({r.id: r for r in expected}.values())  # locations too

    # 2. A new mount on an empty cache fetches the traced chunks before anyone reads.
    with running_mount(image_id, mp, url, tmp_path / "c2") as proc:
        wait_until(lambda: stats_of(tmp_path / "c2").get("trace") == "replayed", 30, "the replay")
        stats = stats_of(tmp_path / "c2")
        assert stats["prefetch_chunks"] == len(traced)
        assert stats["reads"] == 0 and stats["misses"] == 0
        # Coalesced: big.bin's chunks and the small files share a few GETs.
        assert stats["prefetch_requests"] < len(traced) / 4
        before = seaweed.request_count(bucket=seaweed.bucket)
        read_files(mp, builder)
        assert seaweed.request_count(bucket=seaweed.bucket) == before  # all from the cache
        unmount_and_wait(mp, proc)
    final = stats_of(tmp_path / "c2")
    assert final["misses"] == 0 and final["hits"] >= len(traced)
    assert final["store_requests"] == final["prefetch_requests"]
    # The replaying mount left the stored trace as it was.
    assert decode_trace(store.get(trace_key(image_id)), image_id) == traced
    store.close()


@pytest.mark.parametrize("damage", ["garbage", "other-image", "wrong-chunks"])
def test_a_bad_trace_never_breaks_a_mount(s3_image, tmp_path: Path, damage: str) -> None:
    url, image_id, builder = s3_image
    store = open_store(url)
    key = trace_key(image_id)
    good = file_chunks(store, image_id, builder)
    if damage == "garbage":
        store.put(key, b"\x28\xb5\x2f\xfd not really a trace")
    elif damage == "other-image":
        store.put(key, encode_trace("0" * 64, good))
    else:  # a well-formed trace whose chunks are not what it says: ids fail verification
        wrong = [
            ChunkRef(bytes(32 - len(str(i))) + str(i).encode(), r.size, r.pack, r.offset, r.clen)
            for i, r in enumerate(good)
        ]
        store.put(key, encode_trace(image_id, wrong))
    mp = tmp_path / "mnt"
    mp.mkdir()
    with running_mount(image_id, mp, url, tmp_path / "cache") as proc:
        read_files(mp, builder)  # right bytes, whatever the trace said
        unmount_and_wait(mp, proc)
    stats = stats_of(tmp_path / "cache")
    assert stats["read_errors"] == 0
    if damage == "wrong-chunks":
        # Replayed: every prefetched chunk failed verification and was never admitted.
        assert stats["trace"] == "replayed" and stats["prefetch_chunks"] == 0
        assert stats["cache_errors"] > 0
    else:
        # Unreadable: this mount recorded a good trace in its place.
        assert stats["trace"] == "recorded"
        assert [r.id for r in decode_trace(store.get(key), image_id)] == list(
            dict.fromkeys(r.id for r in good)
        )
    store.close()


def test_prefetch_off_records_nothing(s3_image, tmp_path: Path, monkeypatch) -> None:
    url, image_id, builder = s3_image
    monkeypatch.setenv("LAZYFS_PREFETCH", "0")
    mp = tmp_path / "mnt"
    mp.mkdir()
    with running_mount(image_id, mp, url, tmp_path / "cache") as proc:
        read_files(mp, builder)
        unmount_and_wait(mp, proc)
    assert stats_of(tmp_path / "cache")["trace"] == "off"
    assert not open_store(url).exists(trace_key(image_id))


def test_trace_format_rejects_damage() -> None:
    ref = ChunkRef(b"\x01" * 32, 10, "a" * 64, 0, 12)
    blob = encode_trace("f" * 64, [ref, ref])
    assert decode_trace(blob, "f" * 64) == [ref, ref]
    for bad, image in [
        (blob[:-3], "f" * 64),  # truncated: the zstd checksum catches it
        (blob, "e" * 64),  # another image's trace
        (encode_trace("f" * 64, [ChunkRef(b"\x01" * 31, 1, "a" * 64, 0, 1)]), "f" * 64),
        (encode_trace("f" * 64, [ChunkRef(b"\x01" * 32, 1, "../x", 0, 1)]), "f" * 64),
        (b"", "f" * 64),
    ]:
        with pytest.raises(CorruptObjectError):
            decode_trace(bad, image)


def test_gc_keeps_a_live_images_trace_and_push_copies_it(tmp_path: Path) -> None:
    from chunker.gc import gc
    from chunker.keys import NAMES_PREFIX
    from chunker.push import push

    src = open_store(f"file://{tmp_path / 'src'}")
    image_id, builder = build_test_image(src, "kept")
    trace = encode_trace(image_id, file_chunks(src, image_id, builder))
    src.put(trace_key(image_id), trace)
    src.put(trace_key("9" * 64), encode_trace("9" * 64, []))  # no image: unreachable
    dst = open_store(f"file://{tmp_path / 'dst'}")
    push(src, dst, image_id)
    assert dst.get(trace_key(image_id)) == trace
    result = gc(src, grace=0)
    assert trace_key("9" * 64) in result.deleted
    assert src.get(trace_key(image_id)) == trace
    # Once no ref reaches the image, its trace goes with its manifest.
    for info in list(src.list(NAMES_PREFIX)):
        src.delete(info.key)
    time.sleep(0.01)
    result = gc(src, grace=0)
    assert trace_key(image_id) in result.deleted
    assert not src.exists(trace_key(image_id))
