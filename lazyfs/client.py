"""The node agent's Python client (a contract: see DESIGN.md §5 and docs/api.md).

    from lazyfs.client import Client
    c = Client(socket="/run/lazyfs/agent.sock")
    with c.create("tasks/1234", memory="2G", ttl=3600) as sb:   # deleted on exit
        r = sb.exec(["python3", "-m", "pytest", "-x"], timeout=600)
        r.exit_code, r.stdout, r.stderr                          # int, bytes, bytes
        sb.write_file("/repo/fix.patch", b"...")
        data = sb.read_file("/repo/setup.py")

Errors are `AgentError` (a LazyfsError: one line, with the HTTP status and the agent's
error code); an agent that does not answer is `AgentNotRunning`.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import httpx

from chunker.errors import LazyfsError
from lazyfs.settings import Settings

SLACK = 30.0  # seconds an exec's HTTP request may take beyond the command's own timeout
_EXIT_CODES = {400: 2, 404: 3, 410: 3, 429: 6, 503: 4}


class AgentError(LazyfsError):
    def __init__(self, message: str, status: int = 0, code: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.exit_code = _EXIT_CODES.get(status, 1)


class AgentNotRunning(AgentError):
    """Nothing answers on the socket (or at the URL)."""


@dataclass
class ExecResult:
    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool = False
    seconds: float = 0.0


class Client:
    def __init__(
        self,
        socket: str | Path | None = None,
        url: str | None = None,
        token: str | None = None,
        timeout: float = 300.0,
    ) -> None:
        """socket: the agent's unix socket (default $LAZYFS_AGENT_SOCKET or
        /run/lazyfs/agent.sock); or url (http://HOST:PORT) with its bearer token."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if url is not None:
            self.where = url
            self._http = httpx.Client(base_url=url, headers=headers, timeout=timeout)
        else:
            path = str(socket or Settings.from_env().agent_socket)
            self.where = path
            transport = httpx.HTTPTransport(uds=path)
            self._http = httpx.Client(
                transport=transport, base_url="http://agent", headers=headers, timeout=timeout
            )

    # -------------------------------------------------------------- plumbing

    def request(self, method: str, path: str, **kw: object) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kw)  # type: ignore[arg-type]
        except (httpx.ConnectError, FileNotFoundError, ConnectionRefusedError) as exc:
            raise not_running(self.where) from exc
        except httpx.TimeoutException as exc:
            raise AgentError(f"the agent on {self.where} did not answer in time") from exc
        except (httpx.NetworkError, httpx.RemoteProtocolError) as exc:
            raise broke_off(self.where) from exc
        if response.status_code >= 400:
            raise _error(response)
        return response

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------- sandboxes

    def create(
        self,
        image: str,
        *,
        env: dict[str, str] | list[str] | None = None,
        cpus: float | str | None = None,
        memory: int | str | None = None,
        pids: int | str | None = None,
        ttl: float | None = None,
        network: bool = False,
    ) -> Sandbox:
        body = create_body(image, env, cpus, memory, pids, ttl, network)
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
        return self.request("GET", "/metrics").text

    def pools(self) -> list[dict]:
        return self.request("GET", "/pools").json()["pools"]

    def set_pool(self, image: str, size: int, warmup: list[str] | None = None) -> dict:
        """Keep `size` ready sandboxes of image; `warmup` (an argv, run once before the
        first is ready; [] for none) is left as it was when None."""
        body: dict = {"size": size}
        if warmup is not None:
            body["warmup"] = warmup
        return self.request("PUT", f"/pools/{image}", json=body).json()


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
        try:
            with self.client._http.stream(
                "POST", f"/sandboxes/{self.id}/exec/stream", json=body, timeout=http_timeout
            ) as response:
                if response.status_code >= 400:
                    response.read()
                    raise _error(response)
                for line in response.iter_lines():
                    if not line:
                        continue
                    event = json.loads(line)
                    if "error" in event:
                        raise AgentError(event.get("message", event["error"]), 500, event["error"])
                    for kind in ("stdout", "stderr"):
                        if kind in event:
                            yield kind, base64.b64decode(event[kind])
                    if "exit_code" in event:
                        yield (
                            "exit",
                            ExecResult(
                                event["exit_code"], b"", b"", event["timed_out"], event["seconds"]
                            ),
                        )
                        return
        except (httpx.ConnectError, FileNotFoundError, ConnectionRefusedError) as exc:
            raise AgentNotRunning(f"no lazyfs agent answers on {self.client.where}") from exc
        raise AgentError("the agent ended the exec stream without an exit status")

    def write_file(self, path: str, data: bytes) -> None:
        self.client.request(
            "PUT", f"/sandboxes/{self.id}/files", params={"path": path}, content=data
        )

    def read_file(self, path: str) -> bytes:
        return self.client.request(
            "GET", f"/sandboxes/{self.id}/files", params={"path": path}
        ).content

    def list_dir(self, path: str = "/") -> list[dict]:
        return self.client.request(
            "GET", f"/sandboxes/{self.id}/dir", params={"path": path}
        ).json()["entries"]

    def delete(self, missing_ok: bool = False) -> None:
        try:
            self.client.request("DELETE", f"/sandboxes/{self.id}")
        except AgentError as exc:
            if not (missing_ok and exc.status == 404):
                raise


# ---------------------------------------------------------------- shared with async_client


def create_body(
    image: str,
    env: dict[str, str] | list[str] | None,
    cpus: float | str | None,
    memory: int | str | None,
    pids: int | str | None,
    ttl: float | None,
    network: bool,
) -> dict:
    body = {
        "image": image,
        "env": env,
        "cpus": cpus,
        "memory": memory,
        "pids": pids,
        "ttl": ttl,
        "network": network,
    }
    return {k: v for k, v in body.items() if v is not None}


def exec_body(
    argv: list[str],
    timeout: float | None,
    cwd: str | None,
    env: dict[str, str] | list[str] | None,
    stdin: bytes | None,
) -> dict:
    body: dict = {"argv": list(argv)}
    if timeout is not None:
        body["timeout"] = timeout
    if cwd is not None:
        body["cwd"] = cwd
    if env:
        body["env"] = env
    if stdin is not None:
        body["stdin"] = base64.b64encode(stdin).decode()
    return body


def exec_result(r: dict) -> ExecResult:
    return ExecResult(
        r["exit_code"],
        base64.b64decode(r["stdout"]),
        base64.b64decode(r["stderr"]),
        r["timed_out"],
        r["seconds"],
    )


def not_running(where: str) -> AgentNotRunning:
    return AgentNotRunning(f"no lazyfs agent answers on {where} (is `lazyfs serve` running?)")


def broke_off(where: str) -> AgentError:
    """The connection ended mid-request: the agent stopped or was killed (a sandbox it
    kept running is adopted by the next agent: ask again once it answers)."""
    return AgentError(f"the agent on {where} broke off the request (did it stop or restart?)")


def error_of(response: httpx.Response) -> AgentError:
    return _error(response)


def _error(response: httpx.Response) -> AgentError:
    try:
        body = response.json()
        message, code = body["message"], body["error"]
    except (ValueError, KeyError, TypeError):
        message, code = f"the agent answered HTTP {response.status_code}", ""
    return AgentError(message, response.status_code, code)
