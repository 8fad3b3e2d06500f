"""The gateway's calls to one node agent, over keep-alive connections (aiohttp).

aiohttp and not httpx (the async client's library): through the gateway, every call
pays one more request, and on this 2-core machine an httpx request to an agent took 1.45
ms at the median against aiohttp's 0.74 ms (GET /health, 400 of each in turn, uvloop);
the gateway's goal is 2 ms added to a claim + exec, which is two requests.

Failures come in two kinds, because the gateway acts on them differently:
- Unreached: no connection could be made (refused, no route, the connect timed out):
  nothing reached the node, so a create may go to the next one;
- BrokeOff: the request may have reached it (reset, closed, read timed out): not tried
  elsewhere (a create may have made its sandbox there).
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

CONNECT_TIMEOUT = 3.0  # seconds to connect to a node, for any call
CONNECTIONS = 512  # per node: one per call in flight (an exec holds one while it runs)


class Unreached(Exception):
    """No connection to the node: the request did not reach it."""


class BrokeOff(Exception):
    """The node took the request (maybe) and failed to answer it whole."""


@dataclass
class Answer:
    status: int
    content_type: str | None
    body: bytes

    def json(self) -> Any:
        import json

        return json.loads(self.body)


class NodeHttp:
    def __init__(self, url: str, token: str | None, verify: ssl.SSLContext | bool) -> None:
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._ssl: ssl.SSLContext | bool = verify if isinstance(verify, ssl.SSLContext) else True
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        # Made on first use: a session belongs to the event loop it is made in.
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=CONNECTIONS, ssl=self._ssl)
            self._session = aiohttp.ClientSession(
                connector=connector,
                headers=self._headers,
                auto_decompress=False,  # the bytes are passed on as they are
                skip_auto_headers=("User-Agent",),
            )
        return self._session

    async def call(
        self,
        method: str,
        path: str,
        *,
        params: Sequence[tuple[str, str]] | None = None,
        data: bytes | AsyncIterable[bytes] | None = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> Answer:
        """The whole answer (status, type, body) of one request."""
        response = await self.stream(
            method, path, params=params, data=data, headers=headers, timeout=timeout
        )
        return await whole(response)

    async def stream(
        self,
        method: str,
        path: str,
        *,
        params: Sequence[tuple[str, str]] | None = None,
        data: bytes | AsyncIterable[bytes] | None = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> aiohttp.ClientResponse:
        """The answer with its headers read and its body not yet (pieces(), then
        release())."""
        limits = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT, sock_read=timeout)
        try:
            return await self._open().request(
                method, self.url + path, params=params, data=data, headers=headers, timeout=limits
            )
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            raise Unreached(_why(exc)) from None
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise BrokeOff(_why(exc)) from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


async def whole(response: aiohttp.ClientResponse) -> Answer:
    """A streamed answer read to its end and released; BrokeOff if the node stops."""
    try:
        body = await response.read()
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise BrokeOff(_why(exc)) from None
    finally:
        response.release()
    return Answer(response.status, response.headers.get("Content-Type"), body)


async def pieces(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """A streamed answer's body as it comes; BrokeOff if the node stops mid-way."""
    try:
        async for piece in response.content.iter_any():
            yield piece
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise BrokeOff(_why(exc)) from None


def _why(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__
