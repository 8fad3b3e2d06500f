"""Fetching chunks from the store: coalescing nearby chunks, and a hard deadline.

Object stores charge and throttle per request, and a ranged GET costs a round trip
whatever its size, so misses that sit close together in one pack are fetched with one
GET and the gaps are thrown away.

The store's own timeouts and retries bound each attempt, but their sum is not this
cache's concern to compute for every backend: each GET runs on a daemon thread and the
caller waits for it at most until its deadline. A GET that outlives its deadline is
abandoned (its result dropped); at most max_outstanding (CachePolicy) run at once, so a store that
hangs forever costs a bounded number of threads, and reads work again once it answers.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from chunker.errors import LazyfsError, ObjectNotFound, StoreError
from chunker.model import ChunkRef
from chunker.packs import PACK_PREFIX
from chunker.store.interface import ObjectStore


@dataclass(slots=True)
class Span:
    """One ranged GET: bytes [start, end) of a pack, covering `refs` (sorted by offset)."""

    pack: str
    start: int
    end: int
    refs: list[ChunkRef] = field(default_factory=list)


def coalesce(refs: list[ChunkRef], max_gap: int, max_span: int) -> list[Span]:
    """Group chunks into as few GETs as the gap and span limits allow."""
    spans: list[Span] = []
    by_pack: dict[str, list[ChunkRef]] = {}
    for ref in refs:
        by_pack.setdefault(ref.pack, []).append(ref)
    for pack, group in by_pack.items():
        group.sort(key=lambda r: r.offset)
        cur: Span | None = None
        for ref in group:
            end = ref.offset + ref.clen
            if cur and ref.offset - cur.end < max_gap and max(end, cur.end) - cur.start <= max_span:
                cur.end = max(cur.end, end)
                cur.refs.append(ref)
            else:
                cur = Span(pack, ref.offset, end, [ref])
                spans.append(cur)
    return spans


class Fetcher:
    """Ranged GETs with a deadline each, whatever the store does."""

    def __init__(self, store: ObjectStore, max_outstanding: int) -> None:
        self.store = store
        self._slots = threading.BoundedSemaphore(max_outstanding)

    def get(self, pack: str, start: int, end: int, deadline: float) -> bytes:
        """Bytes [start, end) of a pack; StoreError if they do not arrive by `deadline`."""
        key = PACK_PREFIX + pack
        if not self._slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise StoreError(f"store {self.store.url} is not answering ({key}: no free slot)")
        result: list[bytes] = []
        failure: list[BaseException] = []
        done = threading.Event()

        def run() -> None:
            try:
                result.append(self.store.get(key, start, end - start))
            except BaseException as exc:  # handed to the waiting caller
                failure.append(exc)
            finally:
                self._slots.release()
                done.set()

        threading.Thread(target=run, name="node-cache-fetch", daemon=True).start()
        if not done.wait(max(0.0, deadline - time.monotonic())):
            raise StoreError(f"store {self.store.url} did not answer in time ({key})")
        if failure:
            exc = failure[0]
            if isinstance(exc, ObjectNotFound):
                raise StoreError(f"{key} is missing from store {self.store.url}") from None
            if isinstance(exc, LazyfsError):
                raise exc
            if isinstance(exc, OSError):
                raise StoreError(f"store {self.store.url}: cannot read {key}: {exc}") from None
            raise exc
        return result[0]
