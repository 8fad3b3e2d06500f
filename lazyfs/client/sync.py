"""The node agent's client for threads (a contract: see DESIGN.md §5 and docs/api.md).

    from lazyfs.client import Client
    c = Client(socket="/run/lazyfs/agent.sock")
    with c.create("tasks/1234", memory="2G", ttl=3600) as sb:   # deleted on exit
        r = sb.exec(["python3", "-m", "pytest", "-x"], timeout=600)
        r.exit_code, r.stdout, r.stderr                          # int, bytes, bytes
        sb.write_file("/repo/fix.patch", b"...")
        data = sb.read_file("/repo/setup.py")

Errors are `AgentError` (a LazyfsError: one line, with the HTTP status and the agent's
error code); an agent that does not answer is `AgentNotRunning`.

HTTP is urllib3's (a thread-safe pool of keep-alive connections; only the connect to the
unix socket is ours). It was httpx, as the async client still is: on a warm claim +
exec, httpx's request and response layers took 0.53 ms of client CPU per request against
urllib3's 0.30 (docs/design-changes.md).
"""

from __future__ import annotations

import base64
import json
import socket as socketlib
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, Unpack
from urllib.parse import urlencode

import urllib3
from urllib3.connection import HTTPConnection
from urllib3.exceptions import NewConnectionError, ProtocolError, SSLError
from urllib3.exceptions import TimeoutError as HTTPTimeout

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

_DEFAULT = object()  # request(): the client's timeout (None means none)


class Client:
    def __init__(
        self,
        socket: str | Path | None = None,
        url: str | None = None,
        token: str | None = None,
        timeout: float = 300.0,
        verify: bool | str | Path = True,
    ) -> None:
        """socket: the agent's unix socket (default $LAZYFS_AGENT_SOCKET or
        /run/lazyfs/agent.sock); or url (https://HOST:PORT, or http://127.0.0.1:PORT on
        the agent's own host) with its bearer token. verify (https): True checks the
        agent's certificate against the system's CAs, a path against that CA bundle (PEM;
        for a self-signed certificate, the certificate itself)."""
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        pool_timeout = urllib3.Timeout(connect=timeout, read=timeout)
        if url is not None:
            self.where = url
            tls = tls_of(verify) if url.lower().startswith("https:") else {}
            self._pool = urllib3.connection_from_url(
                url, maxsize=POOL_SIZE, timeout=pool_timeout, retries=False, **tls
            )
        else:
            path = str(socket or agent_socket())
            self.where = path
            self._pool = _UnixPool(path, maxsize=POOL_SIZE, timeout=pool_timeout, retries=False)

    # -------------------------------------------------------------- plumbing

    def request(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, str] | None = None,
        json: object = None,
        content: bytes | None = None,
        timeout: float | None | object = _DEFAULT,
        stream: bool = False,
    ) -> urllib3.BaseHTTPResponse:
        """The agent's answer; AgentError for an HTTP error status (with the agent's
        message), AgentNotRunning if nothing answers. `stream`: the body is not read yet
        (iterate the response, then release_conn())."""
        headers = dict(self._headers)
        body = content
        if json is not None:
            body = _dumps(json)
            headers["Content-Type"] = "application/json"
        if params:
            path = f"{path}?{urlencode(params)}"
        kw: dict[str, Any] = {}
        if timeout is not _DEFAULT:
            kw["timeout"] = timeout if timeout is None else urllib3.Timeout(timeout, timeout)
        try:
            response = self._pool.urlopen(
                method, path, body=body, headers=headers, preload_content=not stream, **kw
            )
        except NewConnectionError as exc:
            raise not_running(self.where) from exc
        except SSLError as exc:
            raise tls_failed(self.where, exc) from exc
        except HTTPTimeout as exc:
            raise AgentError(f"the agent on {self.where} did not answer in time") from exc
        except (ProtocolError, OSError) as exc:
            raise broke_off(self.where) from exc
        if response.status >= 400:
            data = response.read() if stream else response.data
            response.release_conn()
            raise error_of(response.status, data)
        return response

    def close(self) -> None:
        self._pool.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------- sandboxes

    def create(
        self,
        image: str,
        **options: Unpack[CreateOptions],
    ) -> Sandbox:
        """A new sandbox of `image` (CreateOptions: what else a create may ask)."""
        body = create_body(image, options)
        view = self.request("POST", "/sandboxes", json=body).json()
        return Sandbox(self, view["id"], view)

    def sandbox(self, box_id: str) -> Sandbox:
        """A handle on an existing sandbox (404 AgentError if there is none)."""
        return Sandbox(self, box_id, self.request("GET", f"/sandboxes/{box_id}").json())

    def list(self) -> list[dict]:
        return self.request("GET", "/sandboxes").json()["sandboxes"]

    def health(self) -> dict:
        return self.request("GET", "/health").json()

    def metrics(self) -> str:
        return self.request("GET", "/metrics").data.decode()

    def pools(self) -> list[dict]:
        return self.request("GET", "/pools").json()["pools"]

    def set_pool(self, image: str, size: int, warmup: list[str] | None = None) -> dict:
        """Keep `size` ready sandboxes of image; `warmup` (an argv, run once before the
        first is ready; [] for none) is left as it was when None."""
        body: dict = {"size": size}
        if warmup is not None:
            body["warmup"] = warmup
        return self.request("PUT", f"/pools/{image}", json=body).json()

    def set_warm(self, size: int) -> dict:
        """Keep `size` generic sandboxes ready, which any image's create can take."""
        return self.request("PUT", "/warm", json={"size": size}).json()


class Sandbox:
    def __init__(self, client: Client, box_id: str, view: dict | None = None) -> None:
        self.client = client
        self.id = box_id
        self.info = view or {}

    def __repr__(self) -> str:
        return f"Sandbox({self.id!r})"

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.delete(missing_ok=True)

    def exec(
        self,
        argv: list[str],
        timeout: float | None = None,
        *,
        cwd: str | None = None,
        env: dict[str, str] | list[str] | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        """Run argv in the sandbox to its end (or timeout seconds: then it is killed,
        exit_code 137 and timed_out True; the sandbox stays usable)."""
        body = exec_body(argv, timeout, cwd, env, stdin)
        http_timeout = None if timeout is None else timeout + SLACK
        r = self.client.request(
            "POST", f"/sandboxes/{self.id}/exec", json=body, timeout=http_timeout
        ).json()
        return exec_result(r)

    def exec_stream(
        self,
        argv: list[str],
        timeout: float | None = None,
        *,
        cwd: str | None = None,
        env: dict[str, str] | list[str] | None = None,
        stdin: bytes | None = None,
    ) -> Iterator[tuple[str, bytes | ExecResult]]:
        """("stdout" | "stderr", bytes) as the command writes them, then ("exit", ExecResult)
        with empty stdout/stderr."""
        body = exec_body(argv, timeout, cwd, env, stdin)
        http_timeout = None if timeout is None else timeout + SLACK
        where = f"/sandboxes/{self.id}/exec/stream"
        response = self.client.request("POST", where, json=body, timeout=http_timeout, stream=True)
        ended = False
        try:
            for line in response:
                if not line.strip():
                    continue
                event = json.loads(line)
                if "error" in event:
                    raise AgentError(event.get("message", event["error"]), 500, event["error"])
                for kind in ("stdout", "stderr"):
                    if kind in event:
                        yield kind, base64.b64decode(event[kind])
                if "exit_code" in event:
                    ended = True
                    yield (
                        "exit",
                        ExecResult(
                            event["exit_code"],
                            b"",
                            b"",
                            event["timed_out"],
                            event["seconds"],
                            event.get("channel"),
                        ),
                    )
                    return
        except (ProtocolError, OSError) as exc:
            raise broke_off(self.client.where) from exc
        finally:
            if ended:  # only the stream's end is left: the connection can serve again
                response.drain_conn()
            else:  # given up on (or broken): hanging up kills the command, as documented
                response.close()
            response.release_conn()
        raise AgentError("the agent ended the exec stream without an exit status")

    def write_file(self, path: str, data: bytes) -> None:
        self.client.request(
            "PUT", f"/sandboxes/{self.id}/files", params={"path": path}, content=data
        )

    def read_file(self, path: str) -> bytes:
        try:
            answer = self.client.request(
                "GET", f"/sandboxes/{self.id}/files", params={"path": path}
            )
        except BrokeOff as exc:
            raise cut_read(path, exc) from exc
        return answer.data

    def list_dir(self, path: str = "/") -> list[dict]:
        return self.client.request(
            "GET", f"/sandboxes/{self.id}/dir", params={"path": path}
        ).json()["entries"]

    def update(
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
        self.info = self.client.request("PATCH", f"/sandboxes/{self.id}", json=body).json()
        return self.info

    def pause(self) -> dict:
        """Freeze every process in it (a command cannot run until unpause()); its view,
        kept in .info too."""
        self.info = self.client.request("POST", f"/sandboxes/{self.id}/pause").json()
        return self.info

    def unpause(self) -> dict:
        self.info = self.client.request("POST", f"/sandboxes/{self.id}/unpause").json()
        return self.info

    def changes(self) -> list[dict]:
        """What it changed in its image's files: [{"path", "kind"}], kind "added",
        "changed" or "deleted", sorted by path."""
        return self.client.request("GET", f"/sandboxes/{self.id}/changes").json()["changes"]

    def stats(self) -> dict:
        """What it uses now: cpu_seconds, memory (bytes), memory_limit, pids, pids_limit."""
        return self.client.request("GET", f"/sandboxes/{self.id}/stats").json()

    def delete(self, missing_ok: bool = False) -> None:
        try:
            self.client.request("DELETE", f"/sandboxes/{self.id}")
        except AgentError as exc:
            if not (missing_ok and exc.status == 404):
                raise


def _dumps(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


class _UnixConnection(HTTPConnection):
    """urllib3's HTTP connection, to a unix socket instead of a TCP port."""

    def __init__(self, path: str, **kw: Any) -> None:
        super().__init__("localhost", **kw)
        self.socket_path = path

    def _new_conn(self) -> socketlib.socket:
        sock = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
        try:
            if isinstance(self.timeout, (int, float)):
                sock.settimeout(self.timeout)
            sock.connect(self.socket_path)
        except OSError as exc:
            sock.close()
            raise NewConnectionError(self, f"{self.socket_path}: {exc}") from exc
        return sock


class _UnixPool(urllib3.HTTPConnectionPool):
    def __init__(self, path: str, **kw: Any) -> None:
        super().__init__("localhost", **kw)
        self.socket_path = path

    def _new_conn(self) -> _UnixConnection:
        return _UnixConnection(self.socket_path, timeout=self.timeout.connect_timeout)
