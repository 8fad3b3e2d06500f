"""Every knob of the node cache's policy, in one object: how big it is kept, how it evicts,
how hits are remembered, how misses are fetched, and what the readers above it read
ahead and keep hot. lazyfs.settings builds one from the environment (LAZYFS_CACHE_SIZE,
LAZYFS_FETCH_TIMEOUT, LAZYFS_PREFETCH); the rest are measured defaults, each with its
reason, and tests or benchmarks give their own by `_replace`.

A NamedTuple, not a dataclass: `lazyfs run` reads its settings (and so this) before it
starts the node data daemon, and the dataclasses module imports inspect (and ast, dis,
tokenize): ~15 ms of a cold start, on its critical path (docs/design-changes.md, session
28). Class attributes are then the fields, not their defaults: CachePolicy().readahead.
"""

from __future__ import annotations

from typing import NamedTuple


class CachePolicy(NamedTuple):
    # Size: the cache is kept under max_bytes, chunks and image files together; every
    # process on the node evicts down to its own limit, so give them all the same
    # LAZYFS_CACHE_SIZE.
    max_bytes: int = 10 * 2**30
    # Evicting down to 95 % of max_bytes spares an eviction per admission.
    evict_to: float = 0.95
    # The share of max_bytes kept for the images' own files (manifests, configs, EROFS
    # metadata images: lazyfs/tree/image_files.py), the chunks getting the rest. A tenth
    # of the default 10G holds the files of ~130-800 images (1.3-7.8 MB each, session
    # 46): more than a node serves at once.
    image_files_share: float = 0.1
    # A read waits this long for the store, then fails with EIO instead of hanging.
    fetch_timeout: float = 30.0
    # A hit rewrites its LMDB entry only if its access time is older than this: LRU order
    # at 10 s resolution is as good as exact for eviction, and most hits then write nothing.
    touch_interval_ns: int = 10 * 10**9
    # ... and those rewrites are gathered and written at most this often, in one write
    # transaction: one per read was 6 % of the data daemon's CPU on a warm sequential read.
    touch_flush_ns: int = 10**9
    # Coalescing: fetch through a gap smaller than this rather than send a second GET,
    # but never more than coalesce_span in one GET.
    coalesce_gap: int = 1 << 20
    coalesce_span: int = 16 << 20
    # Store GETs in flight per process, abandoned ones included (node_cache/fetch.py).
    max_outstanding: int = 16
    # Start-up traces (node_cache/prefetch.py): False turns them off (no replay, no
    # recording). A replay fetches the trace in order, a batch of about this many
    # compressed bytes at a time, each batch's coalesced GETs in parallel (GETs are
    # latency-bound: a few in flight fill a link that one leaves idle), through gaps of
    # coalesce_gap (wider gaps doubled the bytes for ~no time gained), and never fills
    # more than prefetch_max_share of the chunks' share (chunk_bytes).
    prefetch: bool = True
    prefetch_batch_bytes: int = 8 << 20
    prefetch_threads: int = 4
    prefetch_max_share: float = 0.5
    # The readers above the cache (lazyfs/tree/): the last hot_chunks decoded chunks kept
    # in memory (chunk_reader.py), the data area read ahead with a read that misses
    # (data_daemon.py), and how many cache reads may wait on the store at once.
    hot_chunks: int = 64
    readahead: int = 1 << 20
    # Read-ahead chunks a GET brought are kept compressed in the process, up to this many
    # bytes, and inflated only if a read asks for them (node_cache/cache.py, _stage).
    staged_bytes: int = 32 << 20
    read_threads: int = 16

    def chunk_bytes(self) -> int:
        """The bytes of chunks the cache is kept under."""
        return int(self.max_bytes * (1 - self.image_files_share))

    def image_files_bytes(self) -> int:
        """The bytes of image files the node data daemon keeps them under."""
        return self.max_bytes - self.chunk_bytes()
