"""The manifest answers tree queries in place and is deterministic."""

import sqlite3
from pathlib import Path

import pytest

from chunker.errors import BadInputError
from chunker.manifest import ROOT_INO, Manifest, build_manifest
from chunker.model import ChunkRef, Inode, Kind


def sample_tree() -> tuple[list[tuple[bytes, Inode]], dict[int, int]]:
    root = Inode(Kind.DIR, 0o755)
    etc = Inode(Kind.DIR, 0o755, mtime_ns=1_700_000_000_123_456_789)
    ref1 = ChunkRef(b"\x01" * 32, 10, "p" * 64, 0, 7)
    ref2 = ChunkRef(b"\x02" * 32, 5, "q" * 64, 100, 9)
    f = Inode(
        Kind.REG,
        0o4755,
        uid=1000,
        gid=2**31 - 2,
        size=15,
        chunks=[ref1, ref2],
        xattrs={b"security.capability": b"\x01\x00\x00\x02"},
    )
    link = Inode(Kind.SYMLINK, 0o777, target=b"../\xffbin")
    dev = Inode(Kind.CHR, 0o666, rdev=(1 << 8) | 3)
    entries = [
        (b"", root),
        (b"etc", etc),
        (b"etc/a", f),
        (b"etc/b", f),
        (b"l\xff", link),
        (b"null", dev),
    ]
    nlink = {id(root): 3, id(etc): 2, id(f): 2, id(link): 1, id(dev): 1}
    return entries, nlink


def test_queries(tmp_path: Path) -> None:
    entries, nlink = sample_tree()
    build_manifest(entries, nlink, {"config": "{}"}, tmp_path / "m.db")
    m = Manifest(tmp_path / "m.db")
    assert [name for _, name, _ in m.readdir(ROOT_INO)] == [b"etc", b"l\xff", b"null"]
    etc = m.lookup(ROOT_INO, b"etc")
    a, b = m.lookup(etc, b"a"), m.lookup(etc, b"b")
    assert a == b  # hard links share an inode
    attr = m.getattr(a)
    assert (attr.kind, attr.mode, attr.uid, attr.gid, attr.size, attr.nlink) == (
        Kind.REG,
        0o4755,
        1000,
        2**31 - 2,
        15,
        2,
    )
    assert m.getattr(etc).mtime_ns == 1_700_000_000_123_456_789
    assert m.xattrs(a) == {b"security.capability": b"\x01\x00\x00\x02"}
    assert [off for off, _ in m.chunks(a, 12, 1)] == [10]
    assert [off for off, _ in m.chunks(a)] == [0, 10]
    assert m.chunks(a, 0, 10)[0][1].pack == "p" * 64
    assert m.getattr(m.lookup(ROOT_INO, b"l\xff")).target == b"../\xffbin"
    assert m.getattr(m.lookup(ROOT_INO, b"null")).rdev == (1 << 8) | 3
    assert m.lookup(ROOT_INO, b"missing") is None
    assert [p for p, _ in m.walk()] == [b"etc", b"etc/a", b"etc/b", b"l\xff", b"null"]
    m.close()


def test_listings_repeat_the_inodes(tmp_path: Path) -> None:
    """Each directory's packed listing (what readdirplus sends) says what getattr says."""
    entries, nlink = sample_tree()
    old = Inode(Kind.REG, 0o600, uid=2**32 - 2, gid=2**32 - 3, mtime_ns=-1_500_000_000)
    entries.append((b"old", old))
    nlink[id(old)] = 1
    build_manifest(entries, nlink, {}, tmp_path / "m.db")
    m = Manifest(tmp_path / "m.db")
    dirs = [ROOT_INO, m.lookup(ROOT_INO, b"etc")]
    for d in dirs:
        listed = list(m.listing(d))
        assert [name for _, name, _ in listed] == [name for _, name, _ in m.readdir(d)]
        assert [pos for pos, _, _ in listed] == list(range(1, len(listed) + 1))
        for _, name, record in listed:
            attr = m.getattr(m.lookup(d, name))
            size = len(attr.target) if attr.kind == Kind.SYMLINK else attr.size
            assert record[:8] == (
                attr.ino, size, attr.rdev, attr.mtime_ns, attr.st_mode, attr.nlink,
                attr.uid, attr.gid,
            )  # fmt: skip
        for start in range(len(listed) + 2):  # readdir resumes at any position
            assert list(m.listing(d, start)) == listed[start:]
    assert list(m.listing(m.lookup(ROOT_INO, b"null"))) == []  # not a directory
    m.close()


def test_same_tree_gives_same_id(tmp_path: Path) -> None:
    ids = set()
    for n in range(2):
        entries, nlink = sample_tree()
        ids.add(build_manifest(entries, nlink, {"config": "{}"}, tmp_path / f"{n}.db"))
    assert len(ids) == 1


def test_rejects_other_files_and_versions(tmp_path: Path) -> None:
    junk = tmp_path / "junk"
    junk.write_bytes(b"not sqlite at all" * 100)
    with pytest.raises(BadInputError, match="not a lazyfs manifest"):
        Manifest(junk)
    entries, nlink = sample_tree()
    build_manifest(entries, nlink, {}, tmp_path / "m.db")
    with sqlite3.connect(tmp_path / "m.db") as db:
        db.execute("UPDATE meta SET value = '99' WHERE key = 'version'")
    with pytest.raises(BadInputError, match="version 99"):
        Manifest(tmp_path / "m.db")


def test_chunks_must_cover_the_file(tmp_path: Path) -> None:
    root = Inode(Kind.DIR, 0o755)
    f = Inode(Kind.REG, 0o644, size=99)
    with pytest.raises(BadInputError):
        build_manifest([(b"", root), (b"f", f)], {id(root): 2, id(f): 1}, {}, tmp_path / "m.db")


def test_chunk_lookup_matches_a_plain_overlap_query(tmp_path: Path) -> None:
    """chunks() starts its range scan at the chunk holding the offset; same rows as a scan."""
    import random

    rng = random.Random(7)
    sizes = [rng.randint(1, 1000) for _ in range(300)]
    refs = [ChunkRef(bytes([i % 256]) * 32, n, "p" * 64, i, n) for i, n in enumerate(sizes)]
    root, f = Inode(Kind.DIR, 0o755), Inode(Kind.REG, 0o644, size=sum(sizes), chunks=refs)
    build_manifest([(b"", root), (b"f", f)], {id(root): 2, id(f): 1}, {}, tmp_path / "m.db")
    m = Manifest(tmp_path / "m.db")
    for _ in range(1000):
        off, length = rng.randint(0, sum(sizes) + 10), rng.randint(0, 3000)
        want = [
            r[0]
            for r in m.db.execute(
                "SELECT file_offset FROM chunks WHERE ino = 2 AND file_offset < ?"
                " AND file_offset + size > ? ORDER BY file_offset",
                (off + length, off),
            )
        ]
        assert [o for o, _ in m.chunks(2, off, length)] == want
    m.close()


def test_whole_file_chunks_are_every_chunk_of_many_files(tmp_path: Path) -> None:
    """One query for many files (a read-ahead's): the same chunks as chunks() of each,
    past the ids one IN (...) takes, and none of a file not asked for."""
    root = Inode(Kind.DIR, 0o755)
    files = []
    for i in range(1203):  # more than two batches
        n = i % 3  # empty files too
        refs = [
            ChunkRef(i.to_bytes(4, "big") + bytes([k]) * 28, 10, "p" * 64, i, 5) for k in range(n)
        ]
        files.append((f"f{i}".encode(), Inode(Kind.REG, 0o644, size=10 * n, chunks=refs)))
    nlink = {id(root): 2, **{id(f): 1 for _, f in files}}
    build_manifest([(b"", root), *files], nlink, {}, tmp_path / "m.db")
    m = Manifest(tmp_path / "m.db")
    inos = [m.lookup(ROOT_INO, name) for name, _ in files]
    asked = inos[:-1]  # not the last file
    want = sorted(ref for ino in asked for _, ref in m.chunks(ino))
    assert len(want) == sum(len(f.chunks) for _, f in files[:-1]) > 1000
    assert sorted(m.whole_file_chunks(asked)) == want
    assert m.whole_file_chunks([]) == []
    m.close()


def test_fetch_manifest_verifies_while_inflating(tmp_path: Path) -> None:
    """A manifest is inflated to disk piece by piece; only the bytes that hash to the image
    id end up at dest, and a bad blob leaves no file behind."""
    import zstandard

    from chunker.errors import CorruptObjectError
    from chunker.images import MANIFEST_PIECE, fetch_manifest
    from chunker.keys import IMAGES_PREFIX
    from chunker.store.backends import open_store

    entries, nlink = sample_tree()
    entries += [(f"f{i:05d}".encode(), Inode(Kind.FIFO, 0o600)) for i in range(20_000)]
    nlink.update({id(inode): 1 for _, inode in entries[-20_000:]})
    image_id = build_manifest(entries, nlink, {}, tmp_path / "m.db")
    data = (tmp_path / "m.db").read_bytes()
    assert len(data) > 2 * MANIFEST_PIECE  # inflated in several pieces
    store = open_store(f"file://{tmp_path}/store")
    blob = zstandard.ZstdCompressor().compress(data)
    store.put(IMAGES_PREFIX + image_id, blob)
    dest = tmp_path / "out" / "m.db"
    assert fetch_manifest(store, image_id, dest).read_bytes() == data
    assert Manifest(dest).lookup(ROOT_INO, b"f00007") is not None
    dest.unlink()

    other = zstandard.ZstdCompressor().compress(data[:-1] + b"x")
    for bad, message in (
        (blob[: len(blob) // 2], "does not match its id|corrupt"),  # truncated
        (other, "does not match its id"),  # inflates fine, to other bytes
        (b"not zstd at all" * 10, "corrupt"),
    ):
        store.put(IMAGES_PREFIX + image_id, bad)
        with pytest.raises(CorruptObjectError, match=message):
            fetch_manifest(store, image_id, dest)
        assert list(dest.parent.iterdir()) == []
