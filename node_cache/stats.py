"""Per-process counters of a node cache (what `NodeCache.stats()` returns)."""

from __future__ import annotations

import threading

FIELDS = (
    "hits",  # chunks served from local disk
    "misses",  # chunks not usable on local disk when asked for
    "chunks_fetched",  # chunks this process fetched from the store (and verified)
    "staged_hits",  # of those, read-ahead chunks a read took from the stage (cache.py)
    "bytes_fetched",  # compressed bytes received from the store, gaps included
    "store_requests",  # ranged GETs sent to the store
    "errors",  # verification failures (store or local file) + failed store requests
    "evictions",  # chunks this process evicted to keep the cache under its size
    "prefetch_chunks",  # chunks fetched ahead of their readers from a start-up trace
    "prefetch_requests",  # ranged GETs the prefetch sent (also counted in store_requests)
)


class Counters:
    """Thread-safe integer counters named by FIELDS."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(FIELDS, 0)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] += delta

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)
