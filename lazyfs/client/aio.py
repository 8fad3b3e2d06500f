"""The node agent's client for asyncio (and trio) frameworks: lazyfs.client's calls,
awaited.

    from lazyfs.client.aio import AsyncClient
    async with AsyncClient(socket="/run/lazyfs/agent.sock") as c:
        async with await c.create("tasks/1234", memory="2G", ttl=3600) as sb:
            r = await sb.exec(["python3", "-m", "pytest", "-x"], timeout=600)
            await sb.write_file("/repo/fix.patch", b"...")
            data = await sb.read_file("/repo/setup.py")
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Unpack

import httpx

from lazyfs.client.model import (
    POOL_SIZE,
    SLACK,
    AgentError,
    BrokeOff,
    CreateOptions,
    ExecResult,
    broke_off,
    create_body,
    cut_read,
    error_of,
    exec_body,
    exec_result,
    limits_body,
    not_running,
    tls_failed,
    tls_of,
)
from lazyfs.settings import agent_socket


class AsyncClient:
    def __init__(
        self,
        socket: str | Path | None = None,
        url: str | None = None,
        token: str | None = None,
        timeout: float = 300.0,
        verify: bool | str | Path = True,
    ) -> None:
        """As lazyfs.client.Client's (verify: True or a CA bundle's path, for https)."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        # No cap on connections, as the thread client has none (POOL_SIZE kept alive):
        # httpx's default of 100 made the 101st call wait for one of the first 100, so a
        # trainer's 101st exec waited for another sandbox's command to end (and failed as
        # "did not answer in time" past the timeout), and a burst of 200 creates took two
        # rounds. The agent bounds its own work (max sandboxes, 429). The unix socket's
        # transport is given them itself: httpx applies a client's limits only to a
        # transport it makes.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=POOL_SIZE)
        if url is not None:
            self.where = url
            self._http = httpx.AsyncClient(
                base_url=url,
                headers=headers,
                timeout=timeout,
                verify=_ssl_context(verify),
                limits=limits,
            )
        else:
            path = str(socket or agent_socket())
            self.where = path
            self._http = httpx.AsyncClient(
                transport=httpx.AsyncHTTPTransport(uds=path, limits=limits),
                base_url="http://agent",
                headers=headers,
                timeout=timeout,
            )

    async def request(self, method: str, path: str, **kw: object) -> httpx.Response:
        try:
            response = await self._http.request(method, path, **kw)  # type: ignore[arg-type]
        except (httpx.ConnectError, FileNotFoundError, ConnectionRefusedError) as exc:
            if (tls := _ssl_error_in(exc)) is not None:
                raise tls_failed(self.where, tls) from exc
            raise not_running(self.where) from exc
        except httpx.TimeoutException as exc:
            raise AgentError(f"the agent on {self.where} did not answer in time") from exc
        except (httpx.NetworkError, httpx.RemoteProtocolError) as exc:
            raise broke_off(self.where) from exc
        if response.status_code >= 400:
            raise error_of(response.status_code, response.content)
        return response

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def create(
        self,
        image: str,
        **options: Unpack[CreateOptions],
    ) -> AsyncSandbox:
        """A new sandbox of `image` (CreateOptions: what else a create may ask)."""
        body = create_body(image, options)
        view = (await self.request("POST", "/sandboxes", json=body)).json()
        return AsyncSandbox(self, view["id"], view)

    async def list(self) -> list[dict]:
        return (await self.request("GET", "/sandboxes")).json()["sandboxes"]

    async def health(self) -> dict:
        return (await self.request("GET", "/health")).json()


class AsyncSandbox:
    def __init__(self, client: AsyncClient, box_id: str, view: dict | None = None) -> None:
        self.client = client
        self.id = box_id
        self.info = view or {}

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.delete(missing_ok=True)

    async def exec(
        self,
        argv: list[str],
        timeout: float | None = None,
        *,
        cwd: str | None = None,
        env: dict[str, str] | list[str] | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        body = exec_body(argv, timeout, cwd, env, stdin)
        http_timeout = None if timeout is None else timeout + SLACK
        r = await self.client.request(
            "POST", f"/sandboxes/{self.id}/exec", json=body, timeout=http_timeout
        )
        return exec_result(r.json())

    async def write_file(self, path: str, data: bytes) -> None:
        await self.client.request(
            "PUT", f"/sandboxes/{self.id}/files", params={"path": path}, content=data
        )

    async def read_file(self, path: str) -> bytes:
        params = {"path": path}
        try:
            r = await self.client.request("GET", f"/sandboxes/{self.id}/files", params=params)
        except BrokeOff as exc:
            raise cut_read(path, exc) from exc
        return r.content

    async def update(
        self,
        *,
        cpus: float | str | None = None,
        memory: int | str | None = None,
        pids: int | str | None = None,
        disk: int | str | None = None,
        cpu_shares: int | str | None = None,
        cpuset_cpus: str | None = None,
    ) -> dict:
        """New limits while it runs (those not given stay as they are); its view, kept
        in .info too."""
        body = limits_body(cpus, memory, pids, disk, cpu_shares, cpuset_cpus)
        answer = await self.client.request("PATCH", f"/sandboxes/{self.id}", json=body)
        self.info = answer.json()
        return self.info

    async def pause(self) -> dict:
        """Freeze every process in it (a command cannot run until unpause()); its view,
        kept in .info too."""
        self.info = (await self.client.request("POST", f"/sandboxes/{self.id}/pause")).json()
        return self.info

    async def unpause(self) -> dict:
        self.info = (await self.client.request("POST", f"/sandboxes/{self.id}/unpause")).json()
        return self.info

    async def changes(self) -> list[dict]:
        """What it changed in its image's files: [{"path", "kind"}], kind "added",
        "changed" or "deleted", sorted by path."""
        return (await self.client.request("GET", f"/sandboxes/{self.id}/changes")).json()["changes"]

    async def stats(self) -> dict:
        """What it uses now: cpu_seconds, memory (bytes), memory_limit, pids, pids_limit."""
        return (await self.client.request("GET", f"/sandboxes/{self.id}/stats")).json()

    async def delete(self, missing_ok: bool = False) -> None:
        try:
            await self.client.request("DELETE", f"/sandboxes/{self.id}")
        except AgentError as exc:
            if not (missing_ok and exc.status == 404):
                raise


def _ssl_context(verify: bool | str | Path) -> ssl.SSLContext:
    """httpx's verify for the same settings as the sync client's (tls_of refuses False)."""
    return ssl.create_default_context(cafile=tls_of(verify).get("ca_certs"))


def _ssl_error_in(exc: BaseException | None) -> ssl.SSLError | None:
    """The ssl error under httpx's and httpcore's wrappers of a failed connect, if any."""
    while exc is not None and not isinstance(exc, ssl.SSLError):
        exc = exc.__cause__ or exc.__context__
    return exc
