"""The Docker API's HTTP server writes a big reply a piece per send (lazyfs/docker/http.py):
written in one send, a 100 MB archive or log held the agent's event loop while its
client read it (lazyfs/serving.py's PiecewiseResponse says what that cost the agent's own
API). No agent here: the connection's framing, over a stream that records each send."""

from __future__ import annotations

import anyio

from lazyfs.docker.http import Reply, _Connection
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
