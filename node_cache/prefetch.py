"""Start-up traces on the node side: replay one in the background, or record one.

A mount creates a `StartupTrace` as soon as it knows its image and calls `start()` before
it mounts. A background thread GETs `traces/<image id>` (chunker/trace.py):

- found and valid: the chunks it names are fetched in its order, in large coalesced
  ranged GETs (NodeCache.prefetch), while the mount comes up and its first readers start.
  Their reads then hit the node cache, or wait for the GET already under way.
- missing (or unreadable): this mount records one. Every chunk the mount's readers ask
  the cache for is noted in first-access order for RECORD_WINDOW seconds from the first
  read (or until MAX_RECORD_CHUNKS), and the trace is written when the window closes or
  at unmount (`finish()`), whichever comes first, unless another mount wrote a valid
  one meanwhile.

Who writes: the first mount of an image that finds no trace, on any node, automatically,
unless it was started with record=False: a data daemon's worker that took over a device
from a worker that died saw only part of its start-up (lazyfs/tree/data_daemon.py).
Two first mounts racing both write a complete trace (a PUT is atomic: readers see one
whole trace or the other), and either is a fine hint. A trace is never written from a
mount that could not tell whether one exists (store down), nor when nothing was read.
Nothing here can fail a mount: every error is logged and ends in "no prefetch".
$LAZYFS_PREFETCH=0 turns both replay and recording off.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from chunker.errors import CorruptObjectError, LazyfsError, ObjectNotFound
from chunker.model import ChunkRef
from chunker.store.interface import ObjectStore
from chunker.trace import decode_trace, encode_trace, trace_key
from node_cache.cache import NodeCache

log = logging.getLogger(__name__)

RECORD_WINDOW = 30.0  # seconds after the first read that count as start-up
MAX_RECORD_CHUNKS = 20_000  # ~1 MB of trace; start-ups read far fewer distinct chunks


class TraceRecorder:
    """Chunk refs in first-access order; thread-safe and cheap per call."""

    def __init__(self, max_chunks: int = MAX_RECORD_CHUNKS) -> None:
        self.max_chunks = max_chunks
        self.first_read: float | None = None  # monotonic time of the first note
        self._seen: set[bytes] = set()
        self._refs: list[ChunkRef] = []
        self._lock = threading.Lock()

    def note(self, refs: list[ChunkRef]) -> None:
        with self._lock:
            if self.first_read is None:
                self.first_read = time.monotonic()
            for ref in refs:
                if ref.id not in self._seen and len(self._refs) < self.max_chunks:
                    self._seen.add(ref.id)
                    self._refs.append(ref)

    @property
    def full(self) -> bool:
        return len(self._refs) >= self.max_chunks

    def refs(self) -> list[ChunkRef]:
        with self._lock:
            return list(self._refs)


class StartupTrace:
    def __init__(
        self,
        cache: NodeCache,
        store: ObjectStore,
        image_id: str,
        *,
        window: float = RECORD_WINDOW,
        max_chunks: int = MAX_RECORD_CHUNKS,
        record: bool = True,
    ) -> None:
        self.cache = cache
        self.record = record  # False: replay a stored trace, never record one
        self.store = store
        self.image_id = image_id
        self.window = window
        self.state = "starting"  # -> replaying, replayed, recording, recorded, none, off
        self.trace_chunks = 0  # chunks in the trace replayed or recorded
        self.fetched = 0  # chunks the replay had to fetch (0: all were on local disk)
        self._recorder = TraceRecorder(max_chunks)
        self._stop = threading.Event()
        self._write_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._hooked = False  # recording through cache.on_read
        self._noting = False  # note() records
        self._refs: list[ChunkRef] = []  # the trace, once loaded for a replay or recorded
        self._loaded = threading.Event()  # set once _refs is what it will be for a while
        self._settled = threading.Event()  # set once nothing more will come of it

    def start(self, hook_cache: bool = True) -> None:
        """Start replaying or recording. hook_cache=False: the cache serves other images
        too (the node data daemon), so the image's reads are passed to note() instead."""
        # Record from the very first read: the GET of an existing trace may take a while,
        # and reads before its answer belong to the start-up too.
        self._noting = self.record
        if hook_cache and self.record:
            self._hooked = True
            self.cache.on_read = self._recorder.note
        self._thread = threading.Thread(target=self._run, name="startup-trace", daemon=True)
        self._thread.start()

    def finish(self, timeout: float = 10.0) -> None:
        """At unmount: stop a replay, write a trace still being recorded."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._write_recorded()

    def note(self, refs: list[ChunkRef]) -> None:
        """The image's readers asked for these chunks (see start)."""
        if self._noting:
            self._recorder.note(refs)

    def status(self) -> dict[str, Any]:
        return {"trace": self.state, "trace_chunks": self.trace_chunks}

    @property
    def settled(self) -> bool:
        """Whether the replay (or this mount's recording) is over."""
        return self._settled.is_set()

    def startup_refs(self, timeout: float) -> list[ChunkRef]:
        """The image's start-up chunks in the trace's order: a stored trace's as soon as
        it is loaded (its replay may still be under way), or the one this daemon recorded;
        waits up to `timeout` for the store's answer; [] when there is none (yet)."""
        self._loaded.wait(timeout)
        return self._refs

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        try:
            self._replay_or_record()
        finally:
            self._loaded.set()
            self._settled.set()

    def _replay_or_record(self) -> None:
        try:
            refs = self._load()
        except Exception:  # noqa: BLE001 - a hint must never take the mount down
            log.exception("start-up trace: cannot load; no prefetch")
            self._stop_recording("off")
            return
        if refs is None and not self.record:
            log.info("start-up trace: none stored for %s; not recording one", self.image_id)
            self._stop_recording("none")
        elif refs is None:
            self._loaded.set()  # nothing to warm from until this recording is written
            self._record()
        elif refs:
            self._replay(refs)
        elif self.state != "off":  # a valid, empty trace: nothing to do either way
            self._stop_recording("replayed")

    def _load(self) -> list[ChunkRef] | None:
        """The stored trace; None if this mount should record one; [] to do neither."""
        key = trace_key(self.image_id)
        try:
            blob = self.store.get(key)
        except ObjectNotFound:
            log.info("start-up trace: none stored for %s; recording one", self.image_id)
            return None
        except LazyfsError as exc:  # store down or refusing: do not overwrite blindly
            log.warning("start-up trace: cannot read %s (%s); no prefetch", key, exc)
            self._stop_recording("off")
            return []
        try:
            return decode_trace(blob, self.image_id)
        except CorruptObjectError as exc:
            log.warning("start-up trace: %s; recording a new one", exc)
            return None

    def _replay(self, refs: list[ChunkRef]) -> None:
        self._stop_recording("replaying")
        self.trace_chunks = len(refs)
        self._refs = refs
        self._loaded.set()  # a new tree's warmer follows the replay (tree_warmer.py)
        t0 = time.monotonic()
        n = self.cache.prefetch(refs, stop=self._stop.is_set)
        self.fetched = n
        self.state = "replayed"
        log.info(
            "start-up trace: prefetched %d of %d traced chunks in %.3f s",
            n,
            len(refs),
            time.monotonic() - t0,
        )

    def _record(self) -> None:
        self.state = "recording"
        rec = self._recorder
        while not self._stop.is_set():
            first = rec.first_read
            if rec.full or (first is not None and time.monotonic() - first >= self.window):
                break
            left = self.window if first is None else self.window - (time.monotonic() - first)
            self._stop.wait(max(0.05, min(left, 1.0)))
        self._write_recorded()

    def _stop_recording(self, state: str) -> None:
        self._unhook()
        self.state = state

    def _unhook(self) -> None:
        self._noting = False
        if self._hooked:
            self.cache.on_read = None

    def _write_recorded(self) -> None:
        with self._write_lock:
            if self.state != "recording":
                return
            self._unhook()
            refs = self._recorder.refs()
            self._refs = refs  # this daemon's next mounts warm from it (tree_warmer.py)
            if not refs:
                self.state = "none"
                return  # nothing was read: a later mount may record a useful trace
            key = trace_key(self.image_id)
            try:
                try:
                    decode_trace(self.store.get(key), self.image_id)
                    log.info("start-up trace: another mount wrote %s meanwhile", key)
                    self.state = "none"
                    return
                except (ObjectNotFound, CorruptObjectError):
                    pass
                self.store.put(key, encode_trace(self.image_id, refs))
            except LazyfsError as exc:
                log.warning("start-up trace: cannot write %s: %s", key, exc)
                self.state = "none"
                return
            # Only now: until the PUT is done the state stays "recording", so stats never
            # say "none" for a trace that is being written.
            self.state = "recorded"
            self.trace_chunks = len(refs)
            log.info("start-up trace: recorded %d chunks to %s", len(refs), key)
