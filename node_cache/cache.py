"""The node-wide chunk cache: verified chunk bytes on local disk, shared by every mount.

A read looks every chunk up in the LMDB index (node_cache/index.py), which holds the
bytes of chunks up to INLINE_MAX itself (all that lazyfs's chunker makes), and reads
larger ones from their files (node_cache/files.py). Misses are grouped into ranged
GETs of nearby chunks (node_cache/fetch.py); each group is fetched while holding its
chunks' single-flight stripes (node_cache/locks.py), after checking again whether
another process or thread fetched them meanwhile. A fetched chunk is inflated and
checked against its blake3 id before it is written (its inline value with its index
entry, or its file) and indexed: wrong bytes are never cached nor returned. Read-ahead
chunks a read's GET brought are staged instead: kept compressed in the process, and
inflated, checked and indexed only when a read asks for them (_stage says why).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import blake3
import lmdb

from chunker.errors import BadInputError, CorruptObjectError, StoreError
from chunker.model import ChunkRef
from chunker.packs import decompress_chunk
from chunker.store.interface import ObjectStore
from node_cache.fetch import Fetcher, Span, coalesce
from node_cache.files import ChunkFiles, Identity, prepare
from node_cache.index import INLINE_MAX, CacheIndex, Located
from node_cache.locks import LockTimeout, StripeLocks
from node_cache.policy import CachePolicy
from node_cache.stats import Counters

log = logging.getLogger(__name__)


class NodeCache:
    """Verified chunk bytes, cached on local disk for every process on the node.

    Thread-safe. Open after any fork. Several NodeCache objects may use one directory,
    in one process or many; each process counts its own stats.
    """

    def __init__(
        self,
        cache_dir: Path,
        store: ObjectStore,
        policy: CachePolicy = CachePolicy(),  # noqa: B008 - frozen, so one is shared safely
        *,
        verify_hits: bool = True,
    ) -> None:
        self.cache_dir = Path(cache_dir)
        self.store = store
        self.policy = policy
        self.verify_hits = verify_hits  # blake3 on every hit: ~15 us per 64 KiB here
        try:
            prepare(self.cache_dir)
            self.index = CacheIndex(self.cache_dir / "index")
            self._identity = Identity(self.cache_dir)
        except (OSError, lmdb.Error) as exc:
            reason = getattr(exc, "strerror", None) or str(exc)
            raise BadInputError(f"cannot use cache directory {self.cache_dir}: {reason}") from None
        self.files = ChunkFiles(self.cache_dir)
        self._locks = StripeLocks(self.cache_dir / "locks")
        self._fetcher = Fetcher(store, policy.max_outstanding)
        self._counters = Counters()
        self._touches: set[bytes] = set()  # hits whose access time is to be rewritten
        self._touch_lock = threading.Lock()
        self._touched_at = 0
        # Called with every list of refs asked for (a start-up trace recorder); None: off.
        self.on_read: Callable[[list[ChunkRef]], None] | None = None
        # Read-ahead chunks as the store sent them (compressed, not yet checked), by id:
        # inflated, checked and cached only if a read asks for them (see _stage).
        self._staged: OrderedDict[bytes, bytes] = OrderedDict()
        self._staged_bytes = 0
        self._stage_lock = threading.Lock()

    def close(self) -> None:
        self._touch((), time.time_ns(), flush=True)
        self._locks.close()
        self.index.close()
        self._identity.close()

    def __enter__(self) -> NodeCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def directory_state(self) -> str:
        """Whether the cache directory at our path is still the one we opened: "same",
        "gone" or "replaced" (node_cache/files.py, Identity). Not checked on reads: a
        long-lived process (the node data daemon) asks when a read failed, and once a
        second."""
        return self._identity.state()

    def stats(self) -> dict[str, int]:
        """This process's counters (see node_cache/stats.py)."""
        return self._counters.snapshot()

    def read_local(self, refs: list[ChunkRef]) -> tuple[dict[bytes, bytes], list[ChunkRef]]:
        """The chunks this node already holds (verified), and the refs it does not.

        Never touches the store: only the index and local chunk files, so a caller may
        run it where it must not wait on the network (the FUSE loop), and hand the
        missing refs to `read` in a worker thread.
        """
        if self.on_read is not None:
            self.on_read(refs)
        unique = list({ref.id: ref for ref in refs}.values())
        found: dict[bytes, bytes] = {}
        missing = self._read_hits(unique, found)
        self._counters.add(hits=len(found))
        if missing and self._staged:
            missing = self._take_staged(missing, found)
        return found, missing

    def read(self, refs: list[ChunkRef], ahead: list[ChunkRef] | None = None) -> list[bytes]:
        """Verified bytes of each chunk, in order.

        `ahead`: chunks a reader will likely want next (the data area's read-ahead),
        fetched in the same coalesced GETs as this read's misses, if it has any, and
        cached; a hint only: one that fails is skipped, never this read's error. One
        pass, in the caller's thread: fetching them through prefetch() first and then
        reading cost a thread pool per miss and a second lookup, load and hash of the
        read's own chunks (sympy's tests, cold, no trace: 137 misses, ~0.3 s of the data
        daemon's CPU more than the same run's bytes with a trace).

        Raises CorruptObjectError if a fetched chunk of `refs` fails verification (after
        caching the chunks that passed), StoreError if the store does not deliver within
        fetch_timeout.
        """
        if self.on_read is not None:
            self.on_read(refs)
        deadline = time.monotonic() + self.policy.fetch_timeout
        unique = list({ref.id: ref for ref in refs}.values())
        found: dict[bytes, bytes] = {}
        missing = self._read_hits(unique, found)
        self._counters.add(hits=len(found), misses=len(missing))
        if missing:
            extra: list[ChunkRef] = []
            if ahead:
                wanted = {ref.id for ref in missing}
                candidates = {
                    r.id: r
                    for r in ahead
                    if r.id not in wanted and r.id not in found and r.id not in self._staged
                }
                present = self.index.lookup(candidates)
                extra = [r for cid, r in candidates.items() if cid not in present]
            self._fetch(missing, found, deadline, extra)
        return [found[ref.id] for ref in refs]

    def prefetch(self, refs: list[ChunkRef], stop: Callable[[], bool] = lambda: False) -> int:
        """Fetch the chunks of `refs` that are not on local disk, in their order, ahead of
        any reader; returns how many chunks it fetched.

        A hint only: a chunk that cannot be fetched or verified is logged, counted and
        skipped (a reader that needs it later fetches it itself); nothing is raised for
        store or verification errors. It takes the same single-flight stripes as a read,
        so a reader asking for a chunk being prefetched waits for that GET rather than
        sending its own. `stop()` is checked between batches.
        """
        budget = int(self.policy.chunk_bytes() * self.policy.prefetch_max_share)
        seen: set[bytes] = set()
        todo: list[ChunkRef] = []
        for ref in refs:
            if ref.id not in seen and budget >= ref.size:
                seen.add(ref.id)
                budget -= ref.size
                todo.append(ref)
        fetched = 0
        with ThreadPoolExecutor(
            self.policy.prefetch_threads, thread_name_prefix="prefetch"
        ) as pool:
            for batch in _batches(todo, self.policy.prefetch_batch_bytes):
                if stop():
                    break
                present = self.index.lookup(ref.id for ref in batch)
                missing = [ref for ref in batch if ref.id not in present]
                spans = coalesce(missing, self.policy.coalesce_gap, self.policy.coalesce_span)
                # The span holding the trace's earliest chunk first: pool.map starts in order.
                pos = {r.id: i for i, r in enumerate(missing)}
                spans.sort(key=lambda sp: min(pos[r.id] for r in sp.refs))
                fetched += sum(pool.map(self._prefetch_span, spans))
        return fetched

    def _prefetch_span(self, span: Span) -> int:
        """One GET for a span the prefetch coalesced (with its wider gap: not re-split)."""
        deadline = time.monotonic() + self.policy.fetch_timeout
        try:
            with self._locks.hold((r.id for r in span.refs), deadline):
                # A reader may have fetched some meanwhile; the index is enough to know.
                present = self.index.lookup(r.id for r in span.refs)
                todo = [r for r in span.refs if r.id not in present]
                if not todo:
                    return 0
                err, admitted, verified, sent = self._fetch_span(todo, {}, deadline)
        except LockTimeout:
            log.warning("node cache: prefetch of %d chunks skipped: stripes busy", len(span.refs))
            return 0
        except StoreError as exc:
            log.warning("node cache: prefetch of %d chunks skipped: %s", len(span.refs), exc)
            return 0
        if admitted:
            self._evict_if_full()
        if err is not None:
            log.warning("node cache: prefetch skipped a chunk: %s", err)
        self._counters.add(prefetch_chunks=verified, prefetch_requests=sent)
        return verified

    def _read_hits(
        self, refs: list[ChunkRef], found: dict[bytes, bytes], report: bool = True
    ) -> list[ChunkRef]:
        """Fill `found` from local disk; return the refs it could not serve.

        `report=False` on the re-check under the stripe locks: damage seen there
        was already logged and counted by the first look.
        """
        located = self.index.locate(ref.id for ref in refs)
        now = time.time_ns()
        stale: list[bytes] = []
        missing: list[ChunkRef] = []
        for ref in refs:
            entry = located.get(ref.id)
            data = self._load(ref, entry, report) if entry is not None else None
            if data is None:
                missing.append(ref)
                continue
            found[ref.id] = data
            if now - entry.atime_ns > self.policy.touch_interval_ns:
                stale.append(ref.id)
        if stale:
            self._touch(stale, now)
        return missing

    def _touch(self, ids: Iterable[bytes], now: int, flush: bool = False) -> None:
        with self._touch_lock:
            self._touches.update(ids)
            if not self._touches or (
                not flush and now - self._touched_at < self.policy.touch_flush_ns
            ):
                return
            pending, self._touches, self._touched_at = self._touches, set(), now
        self.index.touch(pending, now)

    def _load(self, ref: ChunkRef, entry: Located, report: bool) -> bytes | None:
        """An indexed chunk's bytes (inline, else from its file), if they are whole and,
        with verify_hits, have the right hash. A missing or short file is a plain miss (an
        eviction or a kill -9 can leave one); a bad inline value can only be damage."""
        data = self.files.load(ref.id, ref.size) if entry.inline is None else entry.inline
        if data is None:
            return None
        if len(data) != ref.size or (self.verify_hits and blake3.blake3(data).digest() != ref.id):
            if report:
                log.error("node cache: cached chunk %s is damaged; fetching again", ref.id.hex())
                self._counters.add(errors=1)
            return None
        return data

    def _fetch(
        self,
        refs: list[ChunkRef],
        found: dict[bytes, bytes],
        deadline: float,
        extra: Sequence[ChunkRef] = (),
    ) -> None:
        """Fetch `refs` (and `extra`, a hint, in the same GETs) into `found`; raise the
        first verification failure if a chunk of `refs` failed."""
        corrupt: CorruptObjectError | None = None
        admitted = 0
        wanted = {ref.id for ref in refs}
        try:
            for span in coalesce(
                [*refs, *extra], self.policy.coalesce_gap, self.policy.coalesce_span
            ):
                if not any(r.id in wanted for r in span.refs):
                    continue  # read-ahead alone: only in the GETs this read sends anyway
                with self._locks.hold((r.id for r in span.refs), deadline):
                    # Another process or thread may have fetched them while we waited.
                    todo = self._read_hits(span.refs, found, report=False)
                    if todo:
                        err, n, _, _ = self._fetch_span(todo, found, deadline, wanted)
                        corrupt = corrupt or err
                        admitted += n
        except LockTimeout:
            self._counters.add(errors=1)
            raise StoreError(
                f"a fetch of the same chunks by another process or thread did not finish "
                f"within {self.policy.fetch_timeout:g}s (store {self.store.url})"
            ) from None
        finally:
            if admitted:
                self._evict_if_full()
        if corrupt is not None and not wanted <= found.keys():
            raise corrupt  # else only a read-ahead chunk failed (logged and counted)

    def _fetch_span(
        self,
        refs: list[ChunkRef],
        found: dict[bytes, bytes],
        deadline: float,
        wanted: set[bytes] | None = None,
    ) -> tuple[CorruptObjectError | None, int, int, int]:
        """Get `refs` (one pack, sorted): from the staged read-ahead, else with one ranged
        GET; verify, write, index the chunks in `wanted` (None: all). Chunks outside it
        (read-ahead) that the GET brought are staged, not inflated (see _stage).
        Returns (the first verification failure, chunks admitted, chunks verified, GETs
        sent: 0 or 1).

        Runs with the chunks' stripes held and no LMDB transaction open.
        """
        staged = self._unstage(refs)
        corrupt, good, verified = self._inflate(refs, staged, found)
        self._counters.add(staged_hits=verified)
        # Not staged, or staged and damaged: the store's bytes again, once.
        rest = [r for r in refs if r.id not in found]
        if wanted is not None and not any(r.id in wanted for r in rest):
            rest = []  # what is still wanted came from the stage: no GET for read-ahead alone
        sent = 0
        if rest:
            span = Span(rest[0].pack, rest[0].offset, max(r.offset + r.clen for r in rest), rest)
            try:
                blob = self._fetcher.get(span.pack, span.start, span.end, deadline)
            except StoreError:
                self._counters.add(store_requests=1, errors=1)
                raise
            sent = 1
            self._counters.add(store_requests=1, bytes_fetched=len(blob))
            view = memoryview(blob)
            compressed: dict[bytes, bytes | memoryview] = {}
            for ref in rest:
                at = ref.offset - span.start
                piece = view[at : at + ref.clen]
                if wanted is None or ref.id in wanted or not self._stage(ref, piece):
                    compressed[ref.id] = piece
            corrupt, fetched, n = self._inflate(rest, compressed, found)
            good += fetched
            verified += n
        if good and not self._admit(good):
            good = []
        return corrupt, len(good), verified, sent

    def _inflate(
        self,
        refs: list[ChunkRef],
        compressed: Mapping[bytes, bytes | memoryview],
        found: dict[bytes, bytes],
    ) -> tuple[CorruptObjectError | None, list[tuple[bytes, int, bytes | None]], int]:
        """Inflate and check the refs whose bytes `compressed` holds into `found`, and
        write the large ones' files. Returns (the first verification failure, what to
        index, chunks verified); a failure is logged and counted, and its chunk left out."""
        corrupt: CorruptObjectError | None = None
        good: list[tuple[bytes, int, bytes | None]] = []
        verified = 0
        for ref in refs:
            piece = compressed.get(ref.id)
            if piece is None:
                continue  # staged read-ahead, or not this call's
            try:
                data = decompress_chunk(piece, ref.size, ref.id)
            except CorruptObjectError as exc:
                log.error("node cache: %s (pack %s offset %d)", exc, ref.pack, ref.offset)
                self._counters.add(errors=1)
                corrupt = corrupt or exc
                continue
            verified += 1
            found[ref.id] = data
            if ref.size <= INLINE_MAX:  # no file: the index holds it (see INLINE_MAX)
                good.append((ref.id, ref.size, data))
            elif self.files.store(ref.id, data):
                good.append((ref.id, ref.size, None))
        self._counters.add(chunks_fetched=verified)
        return corrupt, good, verified

    def _stage(self, ref: ChunkRef, piece: memoryview) -> bool:
        """Keep a read-ahead chunk compressed, as the store sent it, until a read asks
        for it; False if staging is off (then it is inflated and cached at once).

        A cold run without a trace reads only about a third of the chunks its read-ahead
        fetches (sympy's tests: ~1,000 of 3,488), and every read that missed waited for
        all of them to be inflated, hashed and indexed. Staged, they cost a copy; the
        ones a read then asks for are checked and cached as they are taken, and the rest
        leave the process-local stage, oldest first, past policy.staged_bytes.
        """
        limit = self.policy.staged_bytes
        if limit <= 0:
            return False
        with self._stage_lock:
            if ref.id not in self._staged:
                self._staged[ref.id] = bytes(piece)
                self._staged_bytes += len(piece)
                while self._staged_bytes > limit:
                    _, old = self._staged.popitem(last=False)
                    self._staged_bytes -= len(old)
        return True

    def _take_staged(self, refs: list[ChunkRef], found: dict[bytes, bytes]) -> list[ChunkRef]:
        """Serve what the stage holds of `refs` into `found` (inflated, checked, indexed),
        with no GET, if their stripes are free right now; returns the refs still missing.

        For read_local, on the FUSE loop, which must never wait: if another fetch holds
        one of the stripes, nothing is taken, and the read goes to a fetch thread, whose
        fetch waits for the stripes and takes the staged chunks under them (_fetch_span).
        Taking them without the stripes let another thread, finding them neither staged
        nor indexed yet, fetch them from the store a second time. It does not evict: an
        eviction pass must not run on the loop; the next fetch evicts (the cache is over
        its size by at most the stage meanwhile). A damaged one stays missing: the fetch
        thread's read gets it from the store again, and so does one that another thread
        took between our look and our stripes."""
        taken = [ref for ref in refs if ref.id in self._staged]
        if not taken:
            return refs
        with self._locks.hold_if_free(ref.id for ref in taken) as free:
            if free:
                _, good, verified = self._inflate(taken, self._unstage(taken), found)
                self._counters.add(staged_hits=verified)
                if good:
                    self._admit(good)
        return [ref for ref in refs if ref.id not in found]

    def _unstage(self, refs: list[ChunkRef]) -> dict[bytes, bytes]:
        """Take the staged bytes of these refs (they leave the stage)."""
        if not self._staged:
            return {}
        out: dict[bytes, bytes] = {}
        with self._stage_lock:
            for ref in refs:
                piece = self._staged.pop(ref.id, None)
                if piece is not None:
                    self._staged_bytes -= len(piece)
                    out[ref.id] = piece
        return out

    def _admit(self, items: list[tuple[bytes, int, bytes | None]]) -> bool:
        """Index verified chunks; False if LMDB refused (disk full): serve, do not cache.

        Files written for them stay unindexed until a later fetch indexes them, as after
        a kill -9 between the rename and the commit.
        """
        try:
            self.index.admit(items, time.time_ns())
        except lmdb.Error as exc:
            log.warning("node cache: cannot index %d chunks: %s", len(items), exc)
            return False
        return True

    def _evict_if_full(self) -> None:
        policy = self.policy
        _, total = self.index.usage()
        if total <= policy.chunk_bytes():
            return
        self._touch((), time.time_ns(), flush=True)  # evict by the latest use
        n = self.index.evict(int(policy.chunk_bytes() * policy.evict_to), self._remove_if_idle)
        self._counters.add(evictions=n)

    def _remove_if_idle(self, cid: bytes) -> bool:
        """Delete a chunk's file unless a fetch holds its stripe (called by evict for
        chunks in files; inline ones go with their entry)."""
        if not self._locks.try_hold(cid):
            return False
        try:
            self.files.remove(cid)
        finally:
            self._locks.release(cid)
        return True


def _batches(refs: list[ChunkRef], max_bytes: int) -> list[list[ChunkRef]]:
    """Consecutive runs of refs of about max_bytes compressed bytes each."""
    out: list[list[ChunkRef]] = []
    size = max_bytes
    for ref in refs:
        if size >= max_bytes:
            out.append([])
            size = 0
        out[-1].append(ref)
        size += ref.clen
    return out
