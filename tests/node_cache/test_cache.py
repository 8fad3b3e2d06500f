"""The node cache against a real file:// store holding real packs.

Store requests are counted by `CountingStore` (tests/counting_store.py), which delegates
every call to the real FileStore and appends one line per GET to a log shared by all
processes: it instruments the store, it does not imitate it. Cross-process tests start
real Python processes (this module's `child_main`) on one cache directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import blake3
import pytest

from chunker.errors import BadInputError, CorruptObjectError, StoreError
from chunker.model import ChunkRef
from chunker.packs import PACK_PREFIX, ChunkIndex, PackWriter, compress_chunk
from chunker.store.backends import open_store
from chunker.store.interface import ObjectStore
from node_cache.cache import NodeCache
from node_cache.fetch import coalesce
from node_cache.index import INLINE_DB, INLINE_MAX, charge
from node_cache.locks import FLOCK, LOCK_FILE
from node_cache.policy import CachePolicy
from tests.counting_store import CountingStore, gets

REPO = Path(__file__).resolve().parents[2]
MAX_GAP, MAX_SPAN = CachePolicy().coalesce_gap, CachePolicy().coalesce_span


def times_fetched(log: Path, ref: ChunkRef) -> int:
    """How many logged GETs covered this chunk's bytes."""
    n = 0
    for g in gets(log):
        end = None if g["length"] is None else g["offset"] + g["length"]
        if g["key"] == PACK_PREFIX + ref.pack and g["offset"] <= ref.offset:
            n += end is None or ref.offset + ref.clen <= end
    return n


def file_store(root: Path) -> ObjectStore:
    return open_store(f"file://{root}", retry=False)


def make_chunks(
    store: ObjectStore, n: int, size: int = 64 * 1024, seed: int = 1, min_size: int | None = None
):
    """n random chunks of min_size (default size // 2) to size bytes, written into real
    packs; returns (refs in pack order, {id: bytes})."""
    rng = random.Random(seed)
    index = ChunkIndex()
    writer = PackWriter(store, index)
    datas = {}
    order = []
    for _ in range(n):
        data = rng.randbytes(rng.randint(size // 2 if min_size is None else min_size, size))
        cid = blake3.blake3(data).digest()
        writer.add(cid, compress_chunk(data), len(data))
        datas[cid] = data
        order.append(cid)
    writer.flush()
    return [index.ref(cid) for cid in order], datas


def _env(tmp_path: Path, n: int = 64, **chunks: int) -> dict:
    root = tmp_path / "store"
    real = file_store(root)
    refs, datas = make_chunks(real, n, **chunks)
    log = tmp_path / "gets.log"
    return {
        "root": root,
        "store": CountingStore(real, log),
        "refs": refs,
        "datas": datas,
        "log": log,
        "cache_dir": tmp_path / "cache",
    }


@pytest.fixture
def env(tmp_path: Path) -> dict:
    """A store with 64 chunks (32-64 KiB: kept inline) in one pack, a request log and a
    cache directory."""
    return _env(tmp_path)


@pytest.fixture
def big(tmp_path: Path) -> dict:
    """The same with 32 chunks over INLINE_MAX (another chunker's): kept in files."""
    return _env(tmp_path, 32, size=INLINE_MAX + 64 * 1024, min_size=INLINE_MAX + 1)


@pytest.fixture
def small(tmp_path: Path) -> dict:
    """The same with 64 chunks of 1 byte to INLINE_MAX: all kept inline."""
    return _env(tmp_path, size=INLINE_MAX, min_size=1)


def inline_db(c: NodeCache):
    """The LMDB environment and the inline database of a cache, to inspect or damage."""
    env = c.index._env
    return env, env.open_db(INLINE_DB)


def chunk_files(cache_dir: Path) -> list[Path]:
    return list((cache_dir / "chunks").glob("*/*")) + list((cache_dir / "tmp").iterdir())


def check_cache_consistent(cache_dir: Path) -> int:
    """No wrong bytes anywhere, and the total adds up. Returns the number of usable chunks.

    Every file under chunks/ hashes to its name; every inline value belongs to an entry
    and is whole (written with it in one transaction). An indexed chunk's file may be missing
    (a process killed while evicting it: the read path treats that as a miss) but is
    never short or long. Files nobody indexed yet (killed between rename and commit) are
    allowed: they are whole, and the next fetch of that chunk indexes them.
    """
    for path in (cache_dir / "chunks").glob("*/*"):
        assert blake3.blake3(path.read_bytes()).hexdigest() == path.name
    with NodeCache(cache_dir, file_store(cache_dir.parent / "unused")) as c:
        entries = c.index.entries()
        usable = 0
        for cid, size, inline in entries:
            if inline is not None:
                assert len(inline) == size and blake3.blake3(inline).digest() == cid
                usable += 1
                continue
            path = Path(c.files.path(cid))
            if path.exists():
                assert path.stat().st_size == size
                usable += 1
        env, db = inline_db(c)
        with env.begin() as txn:
            assert txn.stat(db)["entries"] == sum(v is not None for _, _, v in entries)
        count, total = c.index.usage()
        assert count == len(entries)
        assert total == sum(charge(size, inline is not None) for _, size, inline in entries)
        return usable


# -- basic behaviour ---------------------------------------------------------------


def test_miss_then_hit(env) -> None:
    refs, datas = env["refs"][:10], env["datas"]
    with NodeCache(env["cache_dir"], env["store"]) as c:
        assert c.read(refs) == [datas[r.id] for r in refs]
        first = c.stats()
        assert first["misses"] == 10 and first["hits"] == 0
        assert first["chunks_fetched"] == 10
        assert first["store_requests"] == len(gets(env["log"])) == 1
        assert first["bytes_fetched"] == refs[-1].offset + refs[-1].clen - refs[0].offset
        # Same chunks again, in another order and with a duplicate: local disk only.
        again = [refs[3], refs[0], refs[3]]
        assert c.read(again) == [datas[r.id] for r in again]
        assert c.stats()["hits"] == 2  # unique chunks
        assert c.stats()["store_requests"] == 1 == len(gets(env["log"]))
        assert c.read([]) == []
    # Another NodeCache on the same directory (a second mount) sees the chunks.
    with NodeCache(env["cache_dir"], env["store"]) as c2:
        assert c2.read(refs) == [datas[r.id] for r in refs]
        assert c2.stats()["hits"] == 10 and len(gets(env["log"])) == 1


def test_read_local_serves_only_what_is_on_disk_and_never_asks_the_store(env) -> None:
    refs, datas = env["refs"][:6], env["datas"]
    with NodeCache(env["cache_dir"], env["store"]) as c:
        c.read(refs[:3])
        requests = len(gets(env["log"]))
        found, missing = c.read_local(refs)
        assert found == {r.id: datas[r.id] for r in refs[:3]}
        assert missing == refs[3:]
        assert len(gets(env["log"])) == requests
        assert c.stats()["hits"] == 3


def test_chunk_files_hold_uncompressed_bytes(big) -> None:
    ref = big["refs"][5]
    with NodeCache(big["cache_dir"], big["store"]) as c:
        c.read([ref])
        assert Path(c.files.path(ref.id)).read_bytes() == big["datas"][ref.id]
        assert c.files.path(ref.id).endswith(f"/chunks/{ref.id.hex()[:2]}/{ref.id.hex()}")


def test_a_new_cache_makes_each_chunk_directory_with_its_first_chunk(big) -> None:
    # not all 256 up front: that was ~15 ms of a data daemon's start on a new node
    refs = big["refs"][:12]
    with NodeCache(big["cache_dir"], big["store"]) as c:
        assert list((big["cache_dir"] / "chunks").iterdir()) == []
        with ThreadPoolExecutor(4) as pool:  # concurrent first chunks of one directory too
            list(pool.map(lambda ref: c.read([ref]), refs + refs))
        made = {p.name for p in (big["cache_dir"] / "chunks").iterdir()}
        assert made == {ref.id.hex()[:2] for ref in refs}
        for ref in refs:
            assert Path(c.files.path(ref.id)).read_bytes() == big["datas"][ref.id]


def test_small_chunks_are_kept_inline_without_any_file(small) -> None:
    refs, datas = small["refs"], small["datas"]
    with NodeCache(small["cache_dir"], small["store"]) as c:
        assert c.read(refs) == [datas[r.id] for r in refs]
        assert chunk_files(small["cache_dir"]) == []  # no file, not even a temp file
        entries = c.index.entries()
        assert sorted((cid, v) for cid, _, v in entries) == sorted(datas.items())
        total = sum(charge(r.size, True) for r in refs)
        assert c.index.usage() == (len(refs), total)
        assert len(gets(small["log"])) == 1
    with NodeCache(small["cache_dir"], small["store"]) as c2:  # another mount: all hits
        found, missing = c2.read_local(refs)
        assert found == datas and missing == []
        assert c2.read(refs[::-1]) == [datas[r.id] for r in refs[::-1]]
        assert len(gets(small["log"])) == 1


def test_inline_max_is_the_largest_inline_chunk(tmp_path: Path) -> None:
    root = tmp_path / "store"
    refs, datas = [], {}
    for seed, n in ((5, INLINE_MAX), (6, INLINE_MAX + 1)):
        r, d = make_chunks(file_store(root), 1, size=n, min_size=n, seed=seed)
        refs += r
        datas |= d
    with NodeCache(tmp_path / "cache", file_store(root)) as c:
        assert c.read(refs) == [datas[r.id] for r in refs]
        assert [v is not None for _, _, v in sorted(c.index.entries(), key=lambda e: e[1])] == [
            True,
            False,
        ]
        assert [p.name for p in chunk_files(tmp_path / "cache")] == [refs[1].id.hex()]
        assert c.index.usage()[1] == charge(INLINE_MAX, True) + charge(INLINE_MAX + 1, False)


def _put_inline(c: NodeCache, cid: bytes, value: bytes) -> None:
    env, db = inline_db(c)
    with env.begin(write=True) as txn:
        txn.put(cid, value, db=db)


def test_damaged_inline_value_is_fetched_again_never_returned(small) -> None:
    ref = small["refs"][7]
    data = small["datas"][ref.id]
    with NodeCache(small["cache_dir"], small["store"]) as c:
        c.read([ref])
        _put_inline(c, ref.id, bytes(b ^ 1 for b in data))  # same size, wrong content
        assert c.read_local([ref]) == ({}, [ref])  # not served from the node
        assert c.read([ref]) == [data]  # fetched again
        assert c.stats()["errors"] == 2 and len(gets(small["log"])) == 2
        assert c.index.entries() == [(ref.id, len(data), data)]  # repaired
        assert c.index.usage() == (1, charge(len(data), True))  # counted once
    # Without verify-on-hit, a value of the wrong length is still caught.
    with NodeCache(small["cache_dir"], small["store"], verify_hits=False) as c:
        _put_inline(c, ref.id, data[:-1])
        assert c.read([ref]) == [data]
        assert c.stats()["errors"] == 1 and len(gets(small["log"])) == 3
    # A damaged value in a store read (not a hit) is never admitted: see
    # test_corrupt_chunk_in_store_is_never_admitted; here for an inline-sized chunk.
    check_cache_consistent(small["cache_dir"])


def test_corrupt_small_chunk_in_store_is_never_admitted(small) -> None:
    bad = small["refs"][3]
    pack_file = small["root"] / PACK_PREFIX / bad.pack
    blob = bytearray(pack_file.read_bytes())
    blob[bad.offset + bad.clen // 2] ^= 0xFF
    pack_file.write_bytes(blob)
    with NodeCache(small["cache_dir"], small["store"]) as c:
        with pytest.raises(CorruptObjectError):
            c.read(small["refs"][:6])
        assert bad.id not in c.index.lookup([bad.id])
        assert len(c.index.entries()) == 5
    check_cache_consistent(small["cache_dir"])


# -- coalescing --------------------------------------------------------------------


def _ref(pack: str, offset: int, clen: int) -> ChunkRef:
    return ChunkRef(os.urandom(32), clen, pack, offset, clen)


def test_coalesce_limits() -> None:
    a = [_ref("p", 0, 100), _ref("p", 100, 100), _ref("p", 200 + MAX_GAP - 1, 10)]
    assert [len(s.refs) for s in coalesce(a, MAX_GAP, MAX_SPAN)] == [
        3
    ]  # just under the gap: one GET
    b = [_ref("p", 0, 100), _ref("p", 100 + MAX_GAP, 100)]
    assert [len(s.refs) for s in coalesce(b, MAX_GAP, MAX_SPAN)] == [
        1,
        1,
    ]  # at the gap: two
    big = MAX_SPAN // 4
    c = [_ref("p", i * big, big) for i in range(5)]  # contiguous, 1.25 x the span cap
    spans = coalesce(c, MAX_GAP, MAX_SPAN)
    assert [len(s.refs) for s in spans] == [4, 1]
    assert all(s.end - s.start <= MAX_SPAN for s in spans)
    d = [_ref("p", 500, 10), _ref("q", 0, 10), _ref("p", 0, 10)]  # packs never mix
    assert sorted((s.pack, len(s.refs)) for s in coalesce(d, MAX_GAP, MAX_SPAN)) == [
        ("p", 2),
        ("q", 1),
    ]


def test_nearby_misses_share_one_get_far_ones_do_not(env) -> None:
    refs = env["refs"]
    with NodeCache(env["cache_dir"], env["store"]) as c:
        # Every other chunk: small gaps, still one GET.
        picked = refs[0:20:2]
        assert c.read(picked) == [env["datas"][r.id] for r in picked]
        assert len(gets(env["log"])) == 1
        assert c.stats()["chunks_fetched"] == 10
    # A pack with a >1 MiB gap between two wanted chunks: two GETs.
    root2 = env["root"].parent / "store2"
    real2 = file_store(root2)
    refs2, datas2 = make_chunks(real2, 40, seed=2)
    log2 = env["root"].parent / "gets2.log"
    far = [refs2[0], refs2[-1]]
    assert far[1].offset - (far[0].offset + far[0].clen) > MAX_GAP
    with NodeCache(env["cache_dir"], CountingStore(real2, log2)) as c:
        assert c.read(far) == [datas2[r.id] for r in far]
        assert len(gets(log2)) == 2


# -- verification ------------------------------------------------------------------


def test_corrupt_chunk_in_store_is_never_admitted(env) -> None:
    refs, datas = env["refs"][:6], env["datas"]
    bad = refs[2]
    pack_file = env["root"] / PACK_PREFIX / bad.pack
    blob = bytearray(pack_file.read_bytes())
    pos = bad.offset + bad.clen // 2
    blob[pos] ^= 0xFF
    pack_file.write_bytes(blob)
    with NodeCache(env["cache_dir"], env["store"]) as c:
        with pytest.raises(CorruptObjectError) as exc:
            c.read(refs)
        assert bad.id.hex() in str(exc.value)
        assert c.stats()["errors"] == 1
        assert c.stats()["chunks_fetched"] == 5
        assert bad.id not in c.index.lookup([bad.id])
        assert not os.path.exists(c.files.path(bad.id))
        # The good neighbours fetched by the same GET were verified and cached.
        good = [r for r in refs if r is not bad]
        assert set(c.index.lookup([r.id for r in good])) == {r.id for r in good}
        # Still corrupt on the next read: a wrong chunk is never served from anywhere.
        with pytest.raises(CorruptObjectError):
            c.read([bad])
        assert c.stats()["errors"] == 2
        # Repaired store: the chunk is fetched (nothing negative was cached).
        blob[pos] ^= 0xFF
        pack_file.write_bytes(blob)
        assert c.read(refs) == [datas[r.id] for r in refs]
    check_cache_consistent(env["cache_dir"])


def test_read_ahead_comes_in_the_reads_own_get_staged_and_never_fails_it(env) -> None:
    """read(refs, ahead): the read-ahead chunks come in the read's own coalesced GET and
    are staged, compressed: not inflated, checked nor cached until a read asks for them.
    A read of a staged chunk sends no GET and caches it; a damaged one is counted, never
    served, and fetched again; a read that misses nothing sends no GET for read-ahead."""
    refs, datas = env["refs"][:8], env["datas"]
    bad = refs[5]
    pack_file = env["root"] / PACK_PREFIX / bad.pack
    blob = bytearray(pack_file.read_bytes())
    blob[bad.offset + bad.clen // 2] ^= 0xFF
    pack_file.write_bytes(blob)
    with NodeCache(env["cache_dir"], env["store"]) as c:
        assert c.read(refs[:2], ahead=refs[2:]) == [datas[r.id] for r in refs[:2]]
        assert c.stats()["store_requests"] == 1
        assert c.stats()["chunks_fetched"] == 2  # only the read's own were inflated
        assert c.stats()["errors"] == 0  # the damaged one is staged, not checked yet
        assert set(c.index.lookup([r.id for r in refs])) == {r.id for r in refs[:2]}
        # Staged chunks are served without a GET, through either read, and cached then.
        assert c.read(refs[2:4]) == [datas[r.id] for r in refs[2:4]]
        found, missing = c.read_local(refs[4:5])
        assert found == {refs[4].id: datas[refs[4].id]} and missing == []
        assert c.stats()["store_requests"] == 1
        assert c.stats()["staged_hits"] == 3 and c.stats()["chunks_fetched"] == 5
        assert set(c.index.lookup([r.id for r in refs[:5]])) == {r.id for r in refs[:5]}
        # The damaged one: counted, not served from the stage, fetched again, still bad.
        with pytest.raises(CorruptObjectError):
            c.read([bad], ahead=refs[6:])
        assert c.stats()["errors"] == 2 and c.stats()["store_requests"] == 2
        assert bad.id not in c.index.lookup([bad.id])
        assert c.read(refs[:2], ahead=[bad]) == [datas[r.id] for r in refs[:2]]
        assert c.stats()["store_requests"] == 2  # all hits: the read-ahead waits
    check_cache_consistent(env["cache_dir"])


def test_the_stage_is_bounded_and_optional(env) -> None:
    """The oldest staged chunks leave past policy.staged_bytes (a later read fetches
    them); with staged_bytes 0 read-ahead is inflated and cached at once, as before."""
    refs, datas = env["refs"][:8], env["datas"]
    bound = sum(r.clen for r in refs[4:8])  # room for the last four read-ahead chunks
    with NodeCache(env["cache_dir"], env["store"], CachePolicy(staged_bytes=bound)) as c:
        c.read(refs[:1], ahead=refs[1:])
        assert c.read(refs[4:8]) == [datas[r.id] for r in refs[4:8]]
        assert c.stats()["store_requests"] == 1 and c.stats()["staged_hits"] == 4
        assert c.read(refs[1:4]) == [datas[r.id] for r in refs[1:4]]  # left the stage
        assert c.stats()["store_requests"] == 2 and c.stats()["staged_hits"] == 4
    check_cache_consistent(env["cache_dir"])
    other = env["cache_dir"].parent / "unstaged"
    with NodeCache(other, env["store"], CachePolicy(staged_bytes=0)) as c:
        c.read(refs[:1], ahead=refs[1:])
        assert c.stats()["chunks_fetched"] == 8
        assert set(c.index.lookup([r.id for r in refs])) == {r.id for r in refs}
    check_cache_consistent(other)


def test_chunks_taken_from_the_stage_are_evicted_by_a_fetch_thread(env) -> None:
    """read_local (the FUSE loop's) indexes what it takes from the stage but leaves the
    eviction pass to read (a fetch thread's), which brings the cache back to its size."""
    refs, datas = env["refs"][:8], env["datas"]
    limit = sum(charge(r.size, True) for r in refs[:3])
    with NodeCache(env["cache_dir"], env["store"], CachePolicy(max_bytes=limit)) as c:
        c.read(refs[:1], ahead=refs[1:])
        found, missing = c.read_local(refs[1:6])
        assert missing == [] and found == {r.id: datas[r.id] for r in refs[1:6]}
        assert c.index.usage()[1] > limit and c.stats()["evictions"] == 0
        assert c.read(refs[6:7]) == [datas[refs[6].id]]
        assert c.index.usage()[1] <= limit and c.stats()["evictions"] > 0
        assert c.stats()["store_requests"] == 1
    check_cache_consistent(env["cache_dir"])


def test_the_loop_takes_a_staged_chunk_only_under_its_free_stripe(env) -> None:
    """read_local never waits: while another fetch holds a staged chunk's stripe it takes
    nothing (that fetch may be taking the chunk itself), and the chunk stays staged; with
    the stripe free it takes it. Taking it without the stripe let a second thread fetch
    the same chunk from the store meanwhile (found by
    test_two_images_sharing_a_base_fetch_each_chunk_once)."""
    refs, datas = env["refs"][:4], env["datas"]
    with NodeCache(env["cache_dir"], env["store"]) as c:
        c.read(refs[:1], ahead=refs[1:])
        fd = os.open(env["cache_dir"] / "locks" / LOCK_FILE, os.O_RDWR)
        try:  # another process's fetch holds the stripe
            lock = FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, refs[1].id[0], 1, 0)
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, lock)
            t = time.monotonic()
            assert c.read_local(refs[1:2]) == ({}, refs[1:2])
            # a read that waited for the stripe would take the fetch timeout (30 s); 1 s
            # leaves a loaded machine's stalls out of it
            assert time.monotonic() - t < 1.0 and c.stats()["staged_hits"] == 0
        finally:
            os.close(fd)
        assert c.read_local(refs[1:2]) == ({refs[1].id: datas[refs[1].id]}, [])
        assert c.stats()["staged_hits"] == 1 and c.stats()["store_requests"] == 1
    check_cache_consistent(env["cache_dir"])


def test_prefetch_takes_staged_chunks_without_a_get(env) -> None:
    """A start-up trace's prefetch of chunks a read staged inflates them from the stage."""
    refs, datas = env["refs"][:8], env["datas"]
    with NodeCache(env["cache_dir"], env["store"]) as c:
        c.read(refs[:1], ahead=refs[1:])
        assert c.prefetch(refs) == 7
        assert c.stats()["store_requests"] == 1
        assert c.read(refs) == [datas[r.id] for r in refs]
        assert c.stats()["store_requests"] == 1
    check_cache_consistent(env["cache_dir"])


def test_damaged_cache_file_is_fetched_again(big) -> None:
    ref, data = big["refs"][7], big["datas"][big["refs"][7].id]
    with NodeCache(big["cache_dir"], big["store"]) as c:
        c.read([ref])
        path = Path(c.files.path(ref.id))
        path.write_bytes(bytes(b ^ 1 for b in data))  # same size, wrong content
        assert c.read([ref]) == [data]  # verify-on-hit caught it
        assert c.stats()["errors"] == 1 and len(gets(big["log"])) == 2
        assert path.read_bytes() == data
        path.write_bytes(data[:-1])  # truncated
        assert c.read([ref]) == [data]
        path.unlink()  # gone
        assert c.read([ref]) == [data]
        assert len(gets(big["log"])) == 4
        assert c.index.usage() == (1, charge(len(data), False))  # re-admission counted once
    # Without verify-on-hit, the size check alone still catches a short file.
    with NodeCache(big["cache_dir"], big["store"], verify_hits=False) as c:
        Path(c.files.path(ref.id)).write_bytes(data[:100])
        assert c.read([ref]) == [data]
        assert len(gets(big["log"])) == 5


# -- single flight -----------------------------------------------------------------


def windows(refs: list[ChunkRef], size: int, step: int) -> list[list[ChunkRef]]:
    """Runs of neighbouring chunks, overlapping but none inside another: what is left of a
    window after others fetched theirs is one run, so each GET covers only chunks that
    were really wanted, and counting GETs per chunk counts fetches per chunk."""
    return [refs[k : k + size] for k in range(0, len(refs) - size + 1, step)]


def test_single_flight_across_threads(env) -> None:
    refs, datas = env["refs"], env["datas"]
    slow = CountingStore(env["store"].inner, env["log"], delay=0.05)
    wins = windows(refs, 16, 8)
    wins.append(wins[3])  # two threads wanting exactly the same chunks
    with NodeCache(env["cache_dir"], slow) as c:
        barrier = threading.Barrier(len(wins))
        results: list[bool] = []

        def reader(mine: list[ChunkRef]) -> None:
            barrier.wait()
            results.append(c.read(mine) == [datas[r.id] for r in mine])

        threads = [threading.Thread(target=reader, args=(w,)) for w in wins]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [True] * len(wins)
        for ref in refs:
            assert times_fetched(env["log"], ref) == 1, ref.id.hex()
        assert c.stats()["chunks_fetched"] == len(refs)
        assert c.stats()["misses"] > len(refs)  # the threads did miss the same chunks


CHILD = "import sys; from tests.node_cache.test_cache import child_main; child_main(sys.argv[1])"


def child_main(arg: str) -> None:
    """A separate process: read chunks through a NodeCache, print its stats as JSON."""
    a = json.loads(arg)
    store = CountingStore(file_store(Path(a["root"])), Path(a["log"]), a.get("delay", 0.0))
    refs: list[ChunkRef] = pickle.loads(Path(a["refs"]).read_bytes())
    with NodeCache(
        Path(a["cache_dir"]),
        store,
        CachePolicy(max_bytes=a.get("max_bytes", 2**30)),
        verify_hits=a.get("verify_hits", True),
    ) as c:
        go = Path(a["go"]) if a.get("go") else None
        while go is not None and not go.exists():
            time.sleep(0.001)
        if a.get("windows"):
            batches = windows(refs, *a["windows"])
        else:
            step = a.get("batch", len(refs))
            batches = [refs[i : i + step] for i in range(0, len(refs), step)]
        for _ in range(a.get("rounds", 1)):
            if a.get("shuffle"):
                random.shuffle(batches)
            for batch in batches:
                out = c.read(batch)
                for ref, data in zip(batch, out, strict=True):
                    assert blake3.blake3(data).digest() == ref.id
        print(json.dumps(c.stats()), flush=True)


def spawn(args: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(args)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_until(cond, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen]]:
    """Child processes started by a test; killed (by PID) whatever the test's outcome."""
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


def racing_children(setup: dict, tmp_path: Path, delay: float) -> dict:
    """The arguments of child processes that read setup's refs through its cache at once,
    after `go` appears, each GET taking `delay` seconds."""
    refs_file = tmp_path / "refs.pickle"
    refs_file.write_bytes(pickle.dumps(setup["refs"]))
    return {
        "root": str(setup["root"]),
        "log": str(setup["log"]),
        "refs": str(refs_file),
        "cache_dir": str(setup["cache_dir"]),
        "go": str(tmp_path / "go"),
        "delay": delay,
        "windows": [8, 4],
    }


def race(procs: list[subprocess.Popen], go: str) -> list[dict]:
    """Start the spawned children together; their final stats."""
    time.sleep(1.5)  # let them import and open the cache
    Path(go).touch()
    stats = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        stats.append(json.loads(out.splitlines()[-1]))
    return stats


def test_single_flight_across_processes(env, tmp_path: Path, procs) -> None:
    refs = env["refs"]
    # Each GET takes 50 ms: every child misses while others fetch.
    common = racing_children(env, tmp_path, delay=0.05)
    for i in range(4):
        procs.append(spawn({**common, "shuffle": i > 0}))
    stats = race(procs, common["go"])
    pids = {g["pid"] for g in gets(env["log"])}
    for ref in refs:
        assert times_fetched(env["log"], ref) == 1, ref.id.hex()
    assert sum(s["chunks_fetched"] for s in stats) == len(refs)
    # Coalescing: batches of 8 chunks cost far fewer GETs than chunks.
    assert len(gets(env["log"])) <= len(refs) // 4
    assert sum(s["misses"] for s in stats) > len(refs)  # they really did race
    assert len(pids) >= 2  # and the fetching was shared out
    assert check_cache_consistent(env["cache_dir"]) == len(refs)


def test_processes_share_inline_chunks(small, tmp_path: Path, procs) -> None:
    """Four processes admitting, reading and evicting inline chunks at once."""
    refs = small["refs"]
    common = {**racing_children(small, tmp_path, delay=0.02), "rounds": 3}
    for i in range(4):
        # Two trust lengths only: a torn or foreign value would reach their own check.
        procs.append(spawn({**common, "shuffle": i > 0, "verify_hits": i % 2 == 0}))
    stats = race(procs, common["go"])
    for ref in refs:
        assert times_fetched(small["log"], ref) == 1, ref.id.hex()
    assert sum(s["chunks_fetched"] for s in stats) == len(refs)
    assert sum(s["hits"] for s in stats) > len(refs)
    assert sum(s["errors"] for s in stats) == 0
    assert check_cache_consistent(small["cache_dir"]) == len(refs)
    assert chunk_files(small["cache_dir"]) == []
    # Now with a cache too small for them: evictions race admissions and reads.
    small_cache = tmp_path / "cache2"
    max_bytes = sum(charge(r.size, True) for r in refs) // 3
    again = [
        spawn({**common, "cache_dir": str(small_cache), "go": "", "max_bytes": max_bytes})
        for _ in range(3)
    ]
    procs.extend(again)
    evictions = 0
    for p in again:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        evictions += json.loads(out.splitlines()[-1])["evictions"]
    assert evictions > 0
    check_cache_consistent(small_cache)
    with NodeCache(small_cache, small["store"]) as c:
        assert c.index.usage()[1] <= max_bytes


# -- crash safety ------------------------------------------------------------------


def test_kill_9_never_leaves_wrong_bytes(tmp_path: Path, procs) -> None:
    root = tmp_path / "store"
    real = file_store(root)
    # 1 byte to 32 KiB: about half inline, half in files, both admitted and evicted.
    refs, datas = make_chunks(real, 300, size=32 * 1024, seed=3, min_size=1)
    refs_file = tmp_path / "refs.pickle"
    refs_file.write_bytes(pickle.dumps(refs))
    cache_dir = tmp_path / "cache"
    log = tmp_path / "gets.log"
    args = {
        "root": str(root),
        "log": str(log),
        "refs": str(refs_file),
        "cache_dir": str(cache_dir),
        "batch": 3,
        "shuffle": True,  # random batches of 3 neighbours
        "rounds": 1000,  # runs until killed
        "max_bytes": 3 * 2**20,  # ~1/3 of the chunks: evictions run all the time too
    }
    rng = random.Random(7)
    kills = 0
    for _ in range(12):
        # Two processes (kills land mid-lock, mid-transaction, mid-eviction ...); one
        # trusts file sizes alone, so it would return a torn file if one were indexed.
        started = len(gets(log)) + 5
        pair = [spawn(args), spawn({**args, "verify_hits": False})]
        procs.extend(pair)
        wait_until(lambda n=started: len(gets(log)) > n)  # started reading (imports are slow)
        time.sleep(rng.random() * 0.8)
        for p in pair:
            assert p.poll() is None, p.communicate()[1]
            p.send_signal(signal.SIGKILL)
            p.wait()
            kills += 1
        # Checked after every round: later readers repair what they find damaged.
        check_cache_consistent(cache_dir)
    assert kills == 24
    assert check_cache_consistent(cache_dir) > 0
    # A fresh reader that trusts sizes only (no verify-on-hit) still gets right bytes.
    with NodeCache(cache_dir, real, CachePolicy(max_bytes=3 * 2**20), verify_hits=False) as c:
        assert c.read(refs[:50]) == [datas[r.id] for r in refs[:50]]
        assert c.stats()["errors"] == 0
        assert c.index.usage()[1] <= 3 * 2**20


# -- eviction ----------------------------------------------------------------------


def test_lru_eviction_keeps_the_chunks_under_their_share_of_max_bytes(big) -> None:
    """The chunks get all of max_bytes but the images' files' share (image_files_share,
    lazyfs/tree/image_files.py): here a tenth, so 20 chunks' worth keeps 18."""
    refs, datas = big["refs"], big["datas"]
    chunk_bytes = sum(charge(r.size, False) for r in refs[:18])
    policy = CachePolicy(max_bytes=chunk_bytes * 10 // 9 + 1, touch_interval_ns=0)
    assert policy.image_files_share == 0.1 and policy.chunk_bytes() == chunk_bytes
    with NodeCache(big["cache_dir"], big["store"], policy) as c:
        for r in refs[:18]:
            c.read([r])
        assert c.stats()["evictions"] == 0
        c.read([refs[0]])  # refs[0] becomes the most recently used
        for r in refs[18:30]:
            c.read([r])
            assert c.index.usage()[1] <= chunk_bytes
        present = set(c.index.lookup(r.id for r in refs))
        assert refs[0].id in present  # recently used: kept
        assert refs[1].id not in present and refs[2].id not in present  # oldest: gone
        assert all(r.id in present for r in refs[20:30])  # newest: kept
        assert c.stats()["evictions"] == 30 - len(present)
        for r in refs:
            assert os.path.exists(c.files.path(r.id)) == (r.id in present)
        assert c.read(refs[1:3]) == [datas[r.id] for r in refs[1:3]]  # fetched again
    check_cache_consistent(big["cache_dir"])


def test_eviction_removes_inline_values_with_their_entries(tmp_path: Path) -> None:
    root = tmp_path / "store"
    refs, datas = make_chunks(file_store(root), 64, size=2 * INLINE_MAX, min_size=1, seed=8)
    kinds = {r.size <= INLINE_MAX for r in refs}
    assert kinds == {True, False}  # both kinds, evicted by one LRU order
    max_bytes = sum(charge(r.size, r.size <= INLINE_MAX) for r in refs[:20])
    with NodeCache(
        tmp_path / "cache", file_store(root), CachePolicy(max_bytes=max_bytes, touch_interval_ns=0)
    ) as c:
        for r in refs:
            assert c.read([r]) == [datas[r.id]]
            assert c.index.usage()[1] <= max_bytes
        present = set(c.index.lookup(r.id for r in refs))
        assert refs[0].id not in present and refs[-1].id in present
        assert c.stats()["evictions"] == len(refs) - len(present)
        env, db = inline_db(c)
        with env.begin(db=db) as txn:
            inline = {bytes(k) for k, _ in txn.cursor()}
        assert inline == {r.id for r in refs if r.id in present and r.size <= INLINE_MAX}
        files = {bytes.fromhex(p.name) for p in chunk_files(tmp_path / "cache")}
        assert files == {r.id for r in refs if r.id in present and r.size > INLINE_MAX}
    assert check_cache_consistent(tmp_path / "cache") == len(present)


# -- bounded time ------------------------------------------------------------------


def test_hung_store_fails_in_bounded_time_then_recovers(env) -> None:
    """A file store whose pack is a FIFO with no writer: open() blocks forever, a real hang."""
    refs, datas = env["refs"][:4], env["datas"]
    pack_file = env["root"] / PACK_PREFIX / refs[0].pack
    saved = pack_file.with_suffix(".saved")
    os.rename(pack_file, saved)
    os.mkfifo(pack_file)
    try:
        with NodeCache(env["cache_dir"], env["store"], CachePolicy(fetch_timeout=1.0)) as c:
            t = time.monotonic()
            with pytest.raises(StoreError, match="did not answer"):
                c.read(refs)
            assert 0.9 < time.monotonic() - t < 3.0
            assert c.stats()["errors"] == 1
            assert c.index.usage() == (0, 0)
            # The store answers again.
            _unblock_fifo(pack_file)
            os.rename(saved, pack_file)
            assert c.read(refs) == [datas[r.id] for r in refs]
    finally:
        if pack_file.is_fifo():
            _unblock_fifo(pack_file)
            os.rename(saved, pack_file)


def _unblock_fifo(path: Path) -> None:
    """Open the FIFO for writing and close it: a blocked reader sees EOF and returns."""
    with contextlib.suppress(OSError):  # ENXIO: no reader waiting
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


def test_waiting_for_another_fetcher_is_bounded_too(env) -> None:
    """Another process holds the chunk's stripe and never finishes: StoreError in time."""
    ref = env["refs"][0]
    with NodeCache(env["cache_dir"], env["store"], CachePolicy(fetch_timeout=0.5)) as c:
        fd = os.open(env["cache_dir"] / "locks" / LOCK_FILE, os.O_RDWR | os.O_CREAT)
        try:
            # The stripe's byte, locked through a separate open file: conflicts like a
            # process (an open file description lock).
            lock = FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, ref.id[0], 1, 0)
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, lock)
            t = time.monotonic()
            with pytest.raises(StoreError, match="another process or thread"):
                c.read([ref])
            assert 0.4 < time.monotonic() - t < 2.0
        finally:
            os.close(fd)
        assert c.read([ref]) == [env["datas"][ref.id]]
        assert len(gets(env["log"])) == 1


def test_missing_pack_is_a_store_error(env) -> None:
    ref = env["refs"][0]
    (env["root"] / PACK_PREFIX / ref.pack).unlink()
    with NodeCache(env["cache_dir"], env["store"]) as c:
        with pytest.raises(StoreError, match="missing"):
            c.read([ref])
        assert c.stats()["errors"] == 1


# -- reboot ------------------------------------------------------------------------


def test_cache_is_wiped_after_a_reboot(env) -> None:
    refs = env["refs"][:5]
    with NodeCache(env["cache_dir"], env["store"]) as c:
        c.read(refs)
        assert c.index.usage()[0] == 5
    (env["cache_dir"] / "manifests").mkdir()  # other users of the directory are left alone
    (env["cache_dir"] / "boot_id").write_text("0000-an-earlier-boot\n")
    with NodeCache(env["cache_dir"], env["store"]) as c:
        assert c.index.usage() == (0, 0)
        assert not os.path.exists(c.files.path(refs[0].id))
        assert c.read(refs) == [env["datas"][r.id] for r in refs]
    assert (env["cache_dir"] / "manifests").is_dir()
    assert not list(env["cache_dir"].glob("trash-*"))


def test_unusable_cache_directory_is_a_clear_error(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(BadInputError, match="cannot use cache directory .*file"):
        NodeCache(not_a_dir, file_store(tmp_path / "store"))


# -- a real S3 server that goes away -------------------------------------------------


def test_s3_store_down_or_hung_fails_in_bounded_time_then_recovers(
    seaweed, s3_url, tmp_path: Path
) -> None:
    """SeaweedFS stopped (connections refused: the retry wrapper would retry for 30 s) and
    frozen with SIGSTOP (connections accepted, never answered: boto3 would wait 30 s per
    attempt): read() gives up at fetch_timeout either way, and works once it is back."""
    store = open_store(s3_url)  # with the retry wrapper, as the mount opens it
    refs, datas = make_chunks(store, 30, seed=4)
    with NodeCache(tmp_path / "cache", store, CachePolicy(fetch_timeout=3.0)) as c:
        assert c.read(refs[:5]) == [datas[r.id] for r in refs[:5]]
        with seaweed.down():
            t = time.monotonic()
            with pytest.raises(StoreError):
                c.read(refs[10:12])
            assert time.monotonic() - t < 5.0
            assert c.read(refs[:5]) == [datas[r.id] for r in refs[:5]]  # hits still work
        assert c.read(refs[10:12]) == [datas[r.id] for r in refs[10:12]]
        os.killpg(seaweed.proc.pid, signal.SIGSTOP)
        try:
            t = time.monotonic()
            with pytest.raises(StoreError, match="did not answer"):
                c.read(refs[20:22])
            assert 2.9 < time.monotonic() - t < 5.0
        finally:
            os.killpg(seaweed.proc.pid, signal.SIGCONT)
        assert c.read(refs[20:22]) == [datas[r.id] for r in refs[20:22]]
        assert c.stats()["errors"] == 2
