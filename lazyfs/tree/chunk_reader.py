"""File bytes from the node cache, for the FUSE loop: the one read path both trees use.

Chunks already on local disk are read right on the loop thread: a hop to a worker
thread and back cost more than the reads themselves (warm reads went from ~0.45 to
~0.7 GB/s). Only chunks that need the store go to a worker thread, one of a pool of the
cache policy's read_threads, so the loop never waits on the network. The policy's last
hot_chunks decoded chunks are kept in process: a 128 KiB read often straddles two.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from chunker.model import ChunkRef
from lazyfs.tree.daemon_loop import in_thread
from node_cache.policy import CachePolicy


class ChunkSource(Protocol):
    """What a reader needs from the node cache (node_cache.cache.NodeCache)."""

    policy: CachePolicy

    def read(self, refs: list[ChunkRef], ahead: list[ChunkRef] | None = None) -> list[bytes]: ...
    def read_local(self, refs: list[ChunkRef]) -> tuple[dict[bytes, bytes], list[ChunkRef]]: ...
    def stats(self) -> dict[str, int]: ...


class ChunkReader:
    """Verified chunk bytes for the loop thread. Use from that thread only."""

    def __init__(self, cache: ChunkSource) -> None:
        self.cache = cache
        self._fetchers = ThreadPoolExecutor(cache.policy.read_threads, "chunk-fetch")
        self._hot_chunks = cache.policy.hot_chunks
        self._hot: OrderedDict[bytes, bytes] = OrderedDict()
        self.hot_hits = 0

    async def range(
        self,
        pieces: list[tuple[int, ChunkRef]],
        off: int,
        size: int,
        note: Callable[[list[ChunkRef]], None] | None = None,
    ) -> bytes | memoryview:
        """Bytes [off, off + size) of a file whose chunks overlapping that range are
        `pieces` ((file offset, chunk), in order). note(refs), if given, sees every
        chunk list asked for (a start-up trace recorder)."""
        refs = [ref for _, ref in pieces]
        if note is not None:
            note(refs)
        datas = await self.chunks(refs)
        end = off + size
        if len(pieces) == 1:  # the common case: no copy
            start = pieces[0][0]
            return memoryview(datas[0])[max(off - start, 0) : end - start]
        return b"".join(
            memoryview(data)[max(off - start, 0) : end - start]
            for (start, _), data in zip(pieces, datas, strict=True)
        )

    async def chunks(
        self, refs: list[ChunkRef], ahead: Callable[[], list[ChunkRef]] | None = None
    ) -> list[bytes]:
        """Verified bytes of each chunk: from the hot set, else from the cache.

        ahead(), called only when some chunk must come from the store, names chunks the
        reader will likely want next: they are fetched in the same coalesced GETs, as a
        hint (a chunk of theirs that fails is skipped, never this read's error)."""
        hot = self._hot
        found: dict[bytes, bytes] = {}
        missing: dict[bytes, ChunkRef] = {}
        for ref in refs:
            data = hot.get(ref.id)
            if data is not None:
                hot.move_to_end(ref.id)
                found[ref.id] = data
                self.hot_hits += 1
            else:
                missing[ref.id] = ref
        if missing:
            local, wanted = self.cache.read_local(list(missing.values()))
            found.update(local)
            if wanted:
                more = ahead() if ahead is not None else []
                fetched = await in_thread(self._fetch, wanted, more, executor=self._fetchers)
                found.update(zip((ref.id for ref in wanted), fetched, strict=True))
            for cid in missing:
                hot[cid] = found[cid]
            while len(hot) > self._hot_chunks:
                hot.popitem(last=False)
        return [found[ref.id] for ref in refs]

    def close(self) -> None:
        """Wait for the fetches still running (before the cache they use is closed)."""
        self._fetchers.shutdown(wait=True, cancel_futures=True)

    def _fetch(self, wanted: list[ChunkRef], more: list[ChunkRef]) -> list[bytes]:
        # The read-ahead in the reader's own coalesced GETs: fetched after the reader's
        # chunks (in the background) it cost a cold sympy test run under pytest 3x the
        # GETs (393 instead of 133) and 1.73x local instead of 1.55x (bench/tree_perf.py);
        # the reader waits for it, which is what the policy's readahead bounds.
        return self.cache.read(wanted, more)
