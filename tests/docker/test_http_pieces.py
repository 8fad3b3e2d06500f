"""The Docker API's HTTP server writes a big reply a piece per send (lazyfs/docker/http.py):
written in one send, a 100 MB archive or log held the agent's event loop while its
client read it (lazyfs/serving.py's PiecewiseResponse says what that cost the agent's own
API). No agent here: the connection's framing, over a stream that records each send."""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from pathlib import Path

import anyio
import pytest

from lazyfs.docker.http import Reply, Router, _Connection, serve
from lazyfs.serving import PIECE


class RecordingStream:
    """The connection's byte stream: keeps what each send got, in order."""

    def __init__(self) -> None:
        self.sends: list[bytes] = []

    async def send(self, data: bytes) -> None:
        self.sends.append(bytes(data))


def test_a_big_reply_goes_out_a_piece_per_send() -> None:
    stream = RecordingStream()
    connection = _Connection(stream, router=None, headers=[])  # type: ignore[arg-type]
    connection.conn.receive_data(b"GET /containers/x/archive HTTP/1.1\r\nHost: docker\r\n\r\n")
    connection.conn.next_event()  # the request
    connection.conn.next_event()  # its end
    body = bytes(range(256)) * (3 * PIECE // 256) + b"tail!"

    anyio.run(connection._answer, False, Reply(body=body, content_type="application/x-tar"))

    head, *pieces = stream.sends
    assert head.startswith(b"HTTP/1.1 200") and f"{len(body)}".encode() in head
    assert b"".join(pieces) == body
    assert len(pieces) == 4 and max(len(p) for p in pieces) <= PIECE


def test_a_small_reply_is_one_send() -> None:
    stream = RecordingStream()
    connection = _Connection(stream, router=None, headers=[])  # type: ignore[arg-type]
    connection.conn.receive_data(b"GET /version HTTP/1.1\r\nHost: docker\r\n\r\n")
    connection.conn.next_event()
    connection.conn.next_event()

    anyio.run(connection._answer, False, Reply(body=b'{"Version": "x"}'))

    assert [s[-16:] for s in stream.sends[1:]] == [b'{"Version": "x"}']


def test_a_reply_of_ours_that_breaks_http_is_an_error_and_a_clients_is_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """h11 raises LocalProtocolError for what we send wrong and RemoteProtocolError for
    what a client does: the first is a bug of ours (an error, with its traceback), the
    second the client's (one info line). A reply whose status was not an int was logged
    as "a client broke HTTP" (session 51, POST /containers/{id}/update)."""
    where = Path(tempfile.mkdtemp(dir="/tmp")) / "docker.sock"

    async def bad(request: object) -> Reply:
        return Reply(status="200")  # type: ignore[arg-type]  # a bug of ours

    async def main() -> None:
        router = Router()
        router.add("GET", "/bad", bad)
        listener = await anyio.create_unix_listener(where)
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(serve, listener, router, [])
            for raw in (b"GET /bad HTTP/1.1\r\nHost: d\r\n\r\n", b"GET / HTTP/1.1\r\n\x00\r\n\r\n"):
                async with await anyio.connect_unix(where) as client:
                    await client.send(raw)
                    with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
                        while await client.receive():
                            pass
            tasks.cancel_scope.cancel()

    try:
        with caplog.at_level(logging.INFO, logger="lazyfs.docker"):
            anyio.run(main)
    finally:
        shutil.rmtree(where.parent)
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert [m for level, m in said if level == logging.ERROR and "status code" in m], said
    assert not [m for _, m in said if "client broke HTTP" in m and "status code" in m], said
    assert [m for level, m in said if level == logging.INFO and "illegal header" in m], said
