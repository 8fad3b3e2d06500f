"""The agent API's request and answer model, shared by the sync client (sync.py) and the
async one (aio.py): the request bodies, the answers as Python values, and the errors.
The API itself: docs/api.md."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from chunker.errors import LazyfsError

SLACK = 30.0  # seconds an exec's HTTP request may take beyond the command's own timeout
POOL_SIZE = 64  # kept-alive connections: one per thread of a client shared by threads
_EXIT_CODES = {400: 2, 404: 3, 410: 3, 413: 2, 429: 6, 503: 4}


class AgentError(LazyfsError):
    def __init__(self, message: str, status: int = 0, code: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.exit_code = _EXIT_CODES.get(status, 1)


class AgentNotRunning(AgentError):
    """Nothing answers on the socket (or at the URL)."""


class BrokeOff(AgentError):
    """The connection ended mid-request or mid-answer."""


@dataclass
class ExecResult:
    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool = False
    seconds: float = 0.0
    # "server": the sandbox's exec server ran it; "runtime": it did not answer and the
    # agent used `runc exec` (docs/api.md); None from an agent that does not say.
    channel: str | None = None


class CreateOptions(TypedDict, total=False):
    """What a create may ask besides the image: both clients' create() take these as
    keywords (docs/api.md, POST /sandboxes, says what each does)."""

    env: dict[str, str] | list[str] | None
    cpus: float | str | None
    memory: int | str | None
    pids: int | str | None
    ttl: float | None
    network: bool
    disk: int | str | None
    cpu_shares: int | str | None
    cpuset_cpus: str | None
    tmpfs: dict[str, str] | None
    cap_drop: list[str] | None
    read_only: bool | None
    ulimits: dict[str, tuple[int, int]] | None
    extra_hosts: list[str] | None
    hostname: str | None


_LIMITS = ("cpus", "memory", "pids", "disk", "cpu_shares", "cpuset_cpus")


def create_body(image: str, options: CreateOptions) -> dict:
    """POST /sandboxes's body: the image and the options given (None: not given)."""
    unknown = sorted(set(options) - set(CreateOptions.__annotations__))
    if unknown:
        raise TypeError(f"create() got an unexpected keyword argument {unknown[0]!r}")
    body: dict = {"image": image, "network": bool(options.get("network", False))}
    for key, value in options.items():
        if value is None or key in _LIMITS or key == "network":
            continue
        if key == "ulimits":
            value = {k: list(v) for k, v in value.items()} or None  # type: ignore[union-attr]
        if value is not None:
            body[key] = value
    limits = {k: options.get(k) for k in _LIMITS}
    return {**body, **limits_body(**limits)}  # type: ignore[arg-type]


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
        r.get("channel"),
    )


def not_running(where: str) -> AgentNotRunning:
    return AgentNotRunning(f"no lazyfs agent answers on {where} (is `lazyfs serve` running?)")


def tls_of(verify: bool | str | Path) -> dict[str, str]:
    """urllib3's TLS settings for `verify`. False is refused: the bearer token would go
    to whoever answers; a self-signed certificate is checked by giving it as the CA."""
    if verify is True:
        return {"cert_reqs": "CERT_REQUIRED"}
    if verify is False or not str(verify):
        raise ValueError("verify must be True (the system's CAs) or a CA bundle's path")
    return {"cert_reqs": "CERT_REQUIRED", "ca_certs": str(verify)}


def tls_failed(where: str, exc: BaseException) -> AgentError:
    """The TLS handshake failed: most often the agent's certificate is not signed by a
    CA the client trusts (verify=), or the agent serves plain HTTP."""
    return AgentError(f"TLS with the agent on {where} failed: {exc}")


def broke_off(where: str) -> AgentError:
    """The connection ended mid-request: the agent stopped or was killed (a sandbox it
    kept running is adopted by the next agent: ask again once it answers)."""
    return BrokeOff(f"the agent on {where} broke off the request (did it stop or restart?)")


def cut_read(path: str, exc: BrokeOff) -> AgentError:
    """A file's answer that broke off: the agent cuts it short when the sandbox grows
    the file past the agent's limit while it is read, so that no part of it is taken
    for the whole."""
    return AgentError(
        f"{path}: the answer was cut short: the file grew past the agent's"
        f" limit while it was read, or the agent stopped ({exc})"
    )


def error_of(status: int, body: bytes) -> AgentError:
    """The agent's error answer as an AgentError (its message and code, if it has them)."""
    try:
        answer = json.loads(body)
        message, code = answer["message"], answer["error"]
    except (ValueError, KeyError, TypeError):
        message, code = f"the agent answered HTTP {status}", ""
    return AgentError(message, status, code)


def limits_body(
    cpus: float | str | None = None,
    memory: int | str | None = None,
    pids: int | str | None = None,
    disk: int | str | None = None,
    cpu_shares: int | str | None = None,
    cpuset_cpus: str | None = None,
) -> dict:
    """The limits given, as a create's and an update's (PATCH /sandboxes/{id}) body has
    them."""
    body = {
        "cpus": cpus,
        "memory": memory,
        "pids": pids,
        "disk": disk,
        "cpu_shares": cpu_shares,
        "cpuset_cpus": cpuset_cpus,
    }
    return {k: v for k, v in body.items() if v is not None}
