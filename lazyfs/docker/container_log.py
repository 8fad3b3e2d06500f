"""A container's log: its main process's output, kept in files on the node's disk.

The log was a list of pieces in the agent's memory, up to 16 MiB a container and not
charged to its sandbox: a hundred containers whose command prints in a loop (a model's
code does that) held 1.6 GB of the agent, a thousand more than this node's RAM. dockerd
keeps a container's log in files (its json-file driver); so does this now, and the
agent holds no more of it than what waits to be written and one read's batch.

The log is a few segments, each an unlinked file (O_TMPFILE) in the node's sandbox
directory: nothing is left behind when the agent dies, and nothing names them. A
segment is written to its size, then a new one begins; past `segments` of them the
oldest is dropped, as json-file's max-size and max-file rotate. A segment takes a write
only if it stays within its size (an empty one takes any): the log keeps at least the
newest (segments - 1) x segment_bytes less one write, and at most segments x
segment_bytes (writes bigger than a segment, each in one of its own).

Output waits in memory for the log's one writer, which writes it in batches (below):
written piece by piece, each write a thread hop, a chatty container cost the agent 3-10x
the CPU per byte of the log in memory. Once PENDING_BYTES wait, an add waits, and with
it the container's output (its pipe fills; the sandbox waits to write more). Reads of
what waits are answered from memory. Each write and read of a file runs in a thread of the log's
limiter, on a dup of the segment's descriptor: a slow disk stalls that container's
output and the readers of logs, never the agent's event loop; and a segment can be
dropped while a read of it is under way (the dup keeps the file until it is done).

A position in the log is a byte offset into everything ever written to it, so that a
reader of a dropped part goes on at the oldest part kept. Output is cut where the
sandbox's writes were cut, often inside a line; a reader that goes on after a dropped
part skips each stream's output up to its next line, so that it never joins the two
ends of a gap into a line nobody printed (dockerd's json-file drops whole lines). The
records are private to one agent's run (the files die with it):

    stream (u8; + CONTINUES) | time (f64, unix seconds) | size (u32) | size bytes

each at most RECORD_MAX bytes of output; CONTINUES: the record's output goes on a line
that the stream's output before it began. A read of READ_BYTES holds at least one.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import logging
import os
import struct
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import anyio
from anyio.abc import TaskGroup

from lazyfs.agent.files import write_all

log = logging.getLogger("lazyfs.docker")

STDOUT, STDERR = 1, 2  # Docker's numbers for a container's streams
Piece = tuple[int, bytes, float]  # (stream, bytes, when it came: unix seconds)

HEADER = struct.Struct(">BdI")
CONTINUES = 0x80  # in a record's stream byte: it does not begin a line
RECORD_MAX = 64 * 2**10  # output bytes a record holds; a bigger piece is cut into records
READ_BYTES = 256 * 2**10  # what one read takes from a segment
# The writer takes what waits once it is PENDING_BYTES, or WRITE_DELAY after it began to
# wait: a thread hop costs ~75 us of CPU on this VM against ~15 us for writing 64 KiB, so
# a batch is as big as memory allows (an add waits past it), and a trickle of output
# costs a hop per WRITE_DELAY at most.
PENDING_BYTES = 256 * 2**10
WRITE_DELAY = 0.1
# What a record waiting in memory costs besides its output (its tuples, a float, an int
# and list slots: ~150 B in CPython), counted toward PENDING_BYTES: a sandbox that
# writes a byte at a time must not make a 256 KiB wait cost tens of megabytes.
RECORD_COST = 128
IOV_MAX = 1024  # buffers one writev takes (Linux's UIO_MAXIOV)
SEGMENT_BYTES = 8 * 2**20  # the default: two of them, 16 MiB, as the log in memory kept
SEGMENTS = 2


@dataclass
class Cursor:
    """A reader's place in a log: 0, the log's beginning, or an offset it gave."""

    offset: int = 0
    in_line: set[int] = field(default_factory=set)  # streams it has read into a line of
    cut: set[int] = field(default_factory=set)  # streams to go on at their next line


Record = tuple[int, Piece]  # (its offset, (its stream byte as written, output, time))


class Batch:
    """Records in memory, in order, from the offset `start` on."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.end = start  # as they will be in the files
        self.records: list[Record] = []
        self.cost = 0  # their memory, RECORD_COST each included

    def add(self, stream: int, data: bytes, when: float) -> None:
        self.records.append((self.end, (stream, data, when)))
        self.end += HEADER.size + len(data)
        self.cost += RECORD_COST + len(data)

    def since(self, offset: int, end: int, limit: int) -> list[Record]:
        """Its records from offset up to end, about limit bytes of them."""
        first = bisect.bisect_left(self.records, offset, key=lambda record: record[0])
        out: list[Record] = []
        size = 0
        for record in itertools.islice(self.records, first, None):
            if record[0] >= end or size >= limit:
                break
            out.append(record)
            size += HEADER.size + len(record[1][1])
        return out


@dataclass
class Segment:
    start: int  # the log's offset of its first byte
    file: BinaryIO
    size: int = 0

    @property
    def end(self) -> int:
        return self.start + self.size


class Log:
    """Records appended in order; read from any offset, a batch at a time."""

    def __init__(
        self,
        directory: Path,
        limiter: anyio.CapacityLimiter,
        tasks: TaskGroup,
        segment_bytes: int = SEGMENT_BYTES,
        segments: int = SEGMENTS,
    ) -> None:
        self.directory = directory
        self.limiter = limiter
        self.tasks = tasks  # where the writer runs
        self.segment_bytes = segment_bytes
        self.max_segments = max(segments, 1)
        self.segments: list[Segment] = []
        self.written = 0  # the offset up to which records are in the files (or lost)
        self.changed = anyio.Event()
        self.closed = False
        self._writing = Batch(0)  # the records being written, from `written` on
        self._pending = Batch(0)  # the records after them
        self._writer = False  # whether a writer runs
        self._room = anyio.Event()  # set when the pending records are taken
        self._full = anyio.Event()  # set when PENDING_BYTES wait: the writer takes them
        self._failed = False  # a write failed (logged once)
        self._in_line: set[int] = set()  # streams whose output so far ends inside a line

    @property
    def end(self) -> int:
        """The offset after the last record."""
        return self._pending.end

    @property
    def start(self) -> int:
        """The offset of the oldest record kept."""
        return self.segments[0].start if self.segments else self.written

    def poke(self) -> None:
        """Wake whoever follows the log."""
        self.changed.set()
        self.changed = anyio.Event()

    async def add(self, stream: int, data: bytes) -> None:
        """Append data as stream's output. The records wait in memory for the writer;
        once PENDING_BYTES wait, this waits for it to take them (the sandbox's pipe fills
        meanwhile)."""
        if not data or self.closed:
            return
        now = time.time()
        for i in range(0, len(data), RECORD_MAX):
            part = data[i : i + RECORD_MAX] if len(data) > RECORD_MAX else data
            flag = CONTINUES if stream in self._in_line else 0
            self._pending.add(stream | flag, part, now)
            if part.endswith(b"\n"):
                self._in_line.discard(stream)
            else:
                self._in_line.add(stream)
        if not self._writer:
            self._writer = True
            self.tasks.start_soon(self._write_pending)
        self.poke()
        while self._pending.cost >= PENDING_BYTES and not self.closed:
            self._full.set()
            await self._room.wait()

    async def _write_pending(self) -> None:
        """Write what waits, a batch at a time: once PENDING_BYTES wait, or WRITE_DELAY
        after the writer began to wait for them."""
        try:
            while self._pending.records and not self.closed:
                if self._pending.cost < PENDING_BYTES:
                    with anyio.move_on_after(WRITE_DELAY):
                        await self._full.wait()
                if self.closed:
                    break
                self._writing, self._pending = self._pending, Batch(self._pending.end)
                room, self._room, self._full = self._room, anyio.Event(), anyio.Event()
                room.set()
                try:
                    await self._write(self._writing)
                except OSError as exc:  # the disk is full or failing: the output is lost
                    self._drop(len(self.segments))  # (and what came before: the log
                    if not self._failed:  # stays one run of records), as dockerd
                        log.warning("docker: a container's log lost output: %s", exc)
                    self._failed = True  # loses it; the container goes on
                self.written = self._writing.end
                self._writing = Batch(self.written)
                self._drop(len(self.segments) - self.max_segments)
        finally:
            self._writer = False

    async def _write(self, batch: Batch) -> None:
        """The batch's records, each into the last segment if it stays within its size
        there, or into a new one (an empty segment takes any record)."""
        records = batch.records
        while records and not self.closed:
            last = self.segments[-1] if self.segments else None
            count, size = _fitting(records, self.segment_bytes - last.size if last else 0)
            if last is not None and not last.size and not count:  # bigger than a segment
                count, size = 1, HEADER.size + len(records[0][1][1])
            if last is None or not count:
                file = await anyio.to_thread.run_sync(self._new_file, limiter=self.limiter)
                if self.closed:  # closed while the file was made
                    file.close()
                    return
                self.segments.append(Segment(records[0][0], file))
                continue
            fd = os.dup(last.file.fileno())
            taken, records = records[:count], records[count:]
            await anyio.to_thread.run_sync(_write_closing, fd, taken, limiter=self.limiter)
            last.size += size

    def _new_file(self) -> BinaryIO:
        return tempfile.TemporaryFile(dir=self.directory, buffering=0)

    def _drop(self, count: int) -> None:
        """The oldest count segments."""
        for _ in range(max(count, 0)):
            self.segments.pop(0).file.close()

    async def _read(self, offset: int, end: int) -> tuple[list[Record], int]:
        """Whole records from offset (from the oldest kept, if that one was dropped) up
        to end, about READ_BYTES of them, each with its offset (their stream bytes as
        written, CONTINUES in them); and the offset after them."""
        end = min(end, self.end)
        offset = max(offset, self.start)
        if offset >= end:
            return [], max(offset, end)
        if offset >= self.written:  # still in memory
            records = self._writing.since(offset, end, READ_BYTES)
            if not records:
                records = self._pending.since(offset, end, READ_BYTES)
            last, (_, output, _) = records[-1]
            return records, last + HEADER.size + len(output)
        # The segments hold every record from start to written.
        segment = next(s for s in self.segments if s.start <= offset < s.end)
        length = min(READ_BYTES, segment.end - offset, end - offset)
        fd = os.dup(segment.file.fileno())
        data = await anyio.to_thread.run_sync(
            _read_closing, fd, length, offset - segment.start, limiter=self.limiter
        )
        records, used = _parse(data, offset)
        return records, offset + used

    async def records(self, cursor: Cursor, end: int) -> AsyncIterator[tuple[int, Piece]]:
        """Each record from the cursor's place up to end (an offset this log gave), with
        its offset; the cursor moves past them. Where a part the cursor had not read was
        dropped, each stream goes on from its next line, and a line the cursor had begun
        to read ends there (a newline of the log's own)."""
        while cursor.offset < min(end, self.end):
            if cursor.offset < self.start:
                cursor.cut = {STDOUT, STDERR}
                for stream in sorted(cursor.in_line):
                    yield self.start, (stream, b"\n", time.time())
                cursor.in_line.clear()
            batch, cursor.offset = await self._read(cursor.offset, end)
            for at, (stream, data, when) in batch:
                continues = bool(stream & CONTINUES)
                stream &= ~CONTINUES
                if stream in cursor.cut:
                    if continues:  # the end of a line whose start was dropped: not shown
                        _, newline, data = data.partition(b"\n")
                        if not newline:
                            continue
                    cursor.cut.discard(stream)
                if data:
                    if data.endswith(b"\n"):
                        cursor.in_line.discard(stream)
                    else:
                        cursor.in_line.add(stream)
                    yield at, (stream, data, when)

    def close(self) -> None:
        """Drop the files and what waits to be written; reads under way finish on their
        own descriptors."""
        self.closed = True
        self._drop(len(self.segments))
        self.written = self.end
        self._writing, self._pending = Batch(self.written), Batch(self.written)
        self._room.set()
        self._full.set()
        self.poke()


def _fitting(records: list[Record], room: int) -> tuple[int, int]:
    """How many of the first records fit in room bytes, and their size."""
    count = size = 0
    for _, (_, output, _) in records:
        if size + HEADER.size + len(output) > room:
            break
        count, size = count + 1, size + HEADER.size + len(output)
    return count, size


def _parse(data: bytes, offset: int) -> tuple[list[Record], int]:
    """The whole records at the start of data, and how many bytes they take."""
    records: list[Record] = []
    at = 0
    while at + HEADER.size <= len(data):
        stream, when, size = HEADER.unpack_from(data, at)
        end = at + HEADER.size + size
        if end > len(data):
            break
        records.append((offset + at, (stream, data[at + HEADER.size : end], when)))
        at = end
    return records, at


def _write_closing(fd: int, records: list[Record]) -> None:
    """The records, at the file's end (the dup shares its position), with one writev per
    IOV_MAX buffers: the output is not copied on the way."""
    try:
        buffers: list[bytes | memoryview] = []
        for _, (stream, data, when) in records:
            buffers += (HEADER.pack(stream, when, len(data)), data)
        for first in range(0, len(buffers), IOV_MAX):
            chunk = buffers[first : first + IOV_MAX]
            written = os.writev(fd, chunk)
            for i, buffer in enumerate(chunk):  # a short write: the rest, as it is
                if written < len(buffer):
                    write_all(fd, b"".join([memoryview(buffer)[written:], *chunk[i + 1 :]]))
                    break
                written -= len(buffer)
    finally:
        os.close(fd)


def _read_closing(fd: int, length: int, at: int) -> bytes:
    try:
        return os.pread(fd, length, at)
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
