"""A container's log in the agent's memory (lazyfs/docker/containers.py `Log`): the
sandbox decides how its output is cut into pieces, so the log's cost and its work must
not depend on that. Session 55's review: a main process that wrote a byte at a time
(each byte its own frame, so its own piece) had 1 MB of log cost the agent 110 MB, and
one 17 MiB write after a million such pieces held the agent's event loop 57 s (each
dropped piece a list.pop(0), O(pieces)); a bystander's create waited as long."""

from __future__ import annotations

import time

from lazyfs.docker.containers import LOG_BYTES, PIECE_COST, Log

MiB = 2**20


def test_one_byte_pieces_are_counted_at_what_they_cost() -> None:
    log = Log()
    for _ in range(300_000):
        log.add(1, b"x")
    assert len(log.pieces) <= LOG_BYTES // (PIECE_COST + 1)
    assert log.size <= LOG_BYTES
    assert log.end == 300_000 and log.first == 300_000 - len(log.pieces)


def test_a_big_piece_drops_many_small_ones_at_once() -> None:
    log = Log()
    for _ in range(130_000):
        log.add(1, b"x")
    t0 = time.monotonic()
    log.add(2, b"y" * 17 * MiB)
    assert time.monotonic() - t0 < 2.0  # 130,000 drops; O(pieces) each took minutes
    assert [(stream, len(data)) for stream, data, _ in log.pieces] == [(2, 17 * MiB)]
    assert log.first == 130_000 and log.end == 130_001


def test_since_gives_what_is_kept_from_an_index_on() -> None:
    log = Log()
    for i in range(10):
        log.add(1, str(i).encode())
    assert [d for _, d, _ in log.since(7)[0]] == [b"7", b"8", b"9"]
    assert log.since(10) == ([], 10)
    log.add(2, b"z" * LOG_BYTES)  # drops every older piece
    pieces, end = log.since(3)  # an index of a dropped piece: from the oldest kept one
    assert [(s, len(d)) for s, d, _ in pieces] == [(2, LOG_BYTES)] and end == 11
    assert log.since(11) == ([], 11)
