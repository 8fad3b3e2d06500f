"""The agent's HTTP/JSON API (starlette, served by uvicorn on asyncio: server.py).

The routes and their bodies are documented in docs/api.md. Every error is one JSON
object, {"error": CODE, "message": ONE LINE}, with the status from ERRORS below: the one
place where domain errors become HTTP statuses. A request's failure never stops the agent.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from pathlib import Path

import anyio
from anyio.abc import TaskGroup
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from chunker.errors import BadInputError, LazyfsError, NotFoundError, StoreError
from lazyfs.agent import files
from lazyfs.agent.changes import Change
from lazyfs.agent.errors import (
    AtCapacity,
    ReadOnlyRoot,
    SandboxExited,
    SandboxLost,
    SandboxPaused,
    UnknownSandbox,
)
from lazyfs.agent.execute import ExecRequest, ExecResult, ServerBroke
from lazyfs.agent.metrics import AgentMetrics
from lazyfs.agent.node import Agent
from lazyfs.agent.records import limits_of
from lazyfs.agent.report import placement_report
from lazyfs.agent.sandbox_io import TooSlow
from lazyfs.sandbox.confinement import parse_confinement
from lazyfs.sandbox.limits import parse_limits, positive
from lazyfs.sandbox.names import SandboxNames, parse_extra_hosts, parse_hostname
from lazyfs.sandbox.oci_spec import Limits
from lazyfs.sandbox.runtime import RuntimeFailed
from lazyfs.sandbox.tmpfs import parse_tmpfs
from lazyfs.serving import (
    ENDPOINTS,
    ApiApp,
    BreakableResponse,
    PiecewiseResponse,
    unless_client_leaves,
)

log = logging.getLogger("lazyfs.agent")
MAX_OUTPUT = 64 * 2**20  # per stream of a buffered exec; past it output is dropped, flagged
# Output that buffered execs hold at once, node-wide; past it output is dropped, flagged.
# An answer costs ~2.4x its output at its peak (the output and its base64 answer). Six
# execs of 60 MB each at once raised the agent's peak RSS by 702 MiB before this budget
# (1.8 GB in the run), by 316-330 MiB with it (tests/security/test_file_api.py).
OUTPUT_BUDGET = 256 * 2**20
MAX_JSON = 64 * 2**20  # a JSON request body (an exec's base64 stdin: 48 MiB)
STREAM_PIECE = 64 * 2**10  # bytes of output per line of a streaming exec
# Bytes encoded at a time (a multiple of 3: no padding inside). binascii holds the GIL
# while it encodes: 3 MiB took 7.7 ms here, 192 KiB 0.5 ms, which the event loop may
# then wait for the GIL at most (with one encoder: ENCODERS).
BASE64_STEP = 192 * 2**10
# Answers encoded at once. Six at once (60 MB each) queued the event loop behind six
# threads for the GIL: /health took up to 142 ms; with one (264 MB in ~0.8 s), 14 ms.
ENCODERS = 1


class BodyTooLarge(LazyfsError):
    """A request body over its limit (413)."""


# Most specific first.
ERRORS: list[tuple[type[BaseException], int, str]] = [
    (UnknownSandbox, 404, "unknown_sandbox"),
    (files.FileNotInSandbox, 404, "no_such_file"),
    (NotFoundError, 404, "not_found"),  # an unknown image
    (SandboxLost, 410, "sandbox_lost"),  # cleaned up when the agent restarted
    (SandboxExited, 409, "sandbox_exited"),  # its PID 1 ended: only delete is left
    (SandboxPaused, 409, "sandbox_paused"),  # an exec into a paused sandbox
    (AtCapacity, 429, "at_capacity"),  # --max-sandboxes
    (ReadOnlyRoot, 403, "read_only"),  # a file written into a read-only root
    (BodyTooLarge, 413, "too_large"),
    (BadInputError, 400, "bad_request"),  # limits, env, paths, argv that do not parse
    (TooSlow, 504, "timeout"),  # a sandbox's file did not answer
    (StoreError, 503, "store_unavailable"),
    (ServerBroke, 502, "exec_server_failed"),  # the sandbox's exec server broke off
    (RuntimeFailed, 500, "runtime_failed"),
    (LazyfsError, 500, "error"),
]


def error_response(exc: BaseException) -> JSONResponse:
    status, code = 500, "internal"
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        status, code = 507, "disk_full"
    for cls, cls_status, cls_code in ERRORS:
        if isinstance(exc, cls):
            status, code = cls_status, cls_code
            break
    if status == 500:
        log.error("request failed: %s", exc, exc_info=exc)
    message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return JSONResponse({"error": code, "message": message}, status_code=status)


def _env(value: object, what: str) -> list[str]:
    """env as {"K": "V"} or ["K=V"]."""
    if value is None:
        return []
    if isinstance(value, dict):
        return [f"{k}={v}" for k, v in value.items()]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise BadInputError(f"{what}: env must be an object or a list of K=V strings")


async def _read_body(request: Request, limit: int) -> bytearray:
    """The request's body, a BodyTooLarge past `limit` bytes: from its Content-Length
    before any of it is read, else once that much has come (it is not read further)."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise BodyTooLarge(f"the request body ({length} bytes) is more than {limit}")
    body = bytearray()
    async for chunk in request.stream():
        if len(body) + len(chunk) > limit:
            raise BodyTooLarge(f"the request body is more than {limit} bytes")
        body += chunk
    return body


LIMIT_FIELDS = {"cpus", "memory", "pids", "disk", "cpu_shares", "cpuset_cpus"}


def _limits(body: dict, defaults: Limits) -> Limits:
    """A create's or an update's limit fields (LIMIT_FIELDS); `defaults` for the rest."""
    return parse_limits(
        body.get("cpus"),
        body.get("memory"),
        body.get("pids"),
        body.get("disk"),
        prefix="",
        defaults=defaults,
        cpu_shares=body.get("cpu_shares"),
        cpuset=body.get("cpuset_cpus"),
    )


async def _body(request: Request) -> dict:
    try:
        body = json.loads(await _read_body(request, MAX_JSON) or b"{}")
    except ValueError:
        raise BadInputError("the request body is not JSON") from None
    if not isinstance(body, dict):
        raise BadInputError("the request body must be a JSON object")
    return body


def _exec_request(body: dict) -> ExecRequest:
    argv = body.get("argv")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise BadInputError("argv must be a non-empty list of strings")
    stdin = body.get("stdin")
    if stdin is not None:
        try:
            stdin = base64.b64decode(stdin, validate=True)
        except (ValueError, TypeError):
            raise BadInputError("stdin must be base64") from None
    cwd = body.get("cwd")
    if cwd is not None and not isinstance(cwd, str):
        raise BadInputError("cwd must be a string")
    timeout = positive(body.get("timeout"), float, "timeout", "a positive number of seconds")
    return ExecRequest(argv, cwd, _env(body.get("env"), "exec"), stdin, timeout)


class OutputBudget:
    """Bytes of output that buffered execs may still hold (OUTPUT_BUDGET, node-wide).
    Used from the event loop only."""

    def __init__(self, total: int = OUTPUT_BUDGET) -> None:
        self.left = total

    def take(self, want: int) -> int:
        got = min(want, self.left)
        self.left -= got
        return got

    def give(self, n: int) -> None:
        self.left += n


class _Output:
    """A buffered exec's output: each stream up to MAX_OUTPUT, all of it within the
    node's budget; what does not fit is dropped and flagged."""

    def __init__(self, budget: OutputBudget) -> None:
        self.budget = budget
        self.held = 0
        self.data = {"stdout": bytearray(), "stderr": bytearray()}
        self.truncated = {"stdout": False, "stderr": False}

    async def emit(self, kind: str, data: bytes) -> None:
        room = MAX_OUTPUT - len(self.data[kind])
        got = self.budget.take(min(len(data), room))
        self.held += got
        if got < len(data):
            self.truncated[kind] = True
        self.data[kind] += data[:got]

    def release(self) -> None:
        self.budget.give(self.held)
        self.held = 0


def _exec_answer(result: ExecResult, output: _Output, in_thread: bool = False) -> bytearray:
    """The buffered exec's JSON answer, output base64-encoded a piece at a time (run in
    a thread when there is more than one piece: 60 MiB take ~170 ms of CPU here; a small
    output is encoded on the event loop, since a thread hop cost a warm claim + `true`
    ~1.2 ms in bench/agent_bench.py); each stream is freed once encoded.

    `in_thread`: give the GIL away after each piece. Otherwise the event loop waits up to
    the 5 ms switch interval at every step it takes while an encoder runs: six 60 MB
    answers at once held /health up to 115-198 ms in 2 of 5 runs of
    tests/security/test_file_api.py, and at most 44 ms in 11 runs with it."""
    head = {
        "exit_code": result.exit_code,
        "timed_out": result.timed_out,
        "seconds": result.seconds,
        "channel": result.channel,
        "stdout_truncated": output.truncated["stdout"],
        "stderr_truncated": output.truncated["stderr"],
    }
    answer = bytearray(json.dumps(head)[:-1].encode())
    for kind in ("stdout", "stderr"):
        answer += f', "{kind}": "'.encode()
        data = output.data[kind]
        with memoryview(data) as view:
            for start in range(0, len(view), BASE64_STEP):
                answer += binascii.b2a_base64(view[start : start + BASE64_STEP], newline=False)
                if in_thread:  # hand the GIL to the event loop now, not after 5 ms
                    time.sleep(0)
        data.clear()
        answer += b'"'
    answer += b"}"
    return answer


class _HeldResponse(PiecewiseResponse):
    """A response that gives its exec's output budget back once it is sent (or its
    client went away): until then its bytes are in memory."""

    def __init__(self, content: bytearray, output: _Output) -> None:
        super().__init__(memoryview(content), media_type="application/json")
        self.output = output

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.output.release()


def build_app(agent: Agent, metrics: AgentMetrics, tasks: TaskGroup) -> ApiApp:
    sandbox_io = agent.sandbox_io
    budget = OutputBudget()
    encoders = anyio.CapacityLimiter(ENCODERS)
    max_file = agent.settings.max_file

    def on_error(exc: Exception) -> Response:
        response = error_response(exc)
        metrics.errors.labels(str(response.status_code)).inc()
        return response

    async def health(request: Request) -> Response:
        return JSONResponse(
            {
                "status": "ok",
                "sandboxes": len(agent.boxes),
                "max_sandboxes": agent.config.max_sandboxes,
                "mounted_images": len(agent.trees),
                "pools": [p.view() for p in agent.pools.values()],
                "adopted_on_start": agent.adopted,
                "cleaned_on_start": agent.lost,
                "uptime": time.time() - agent.started,
            }
        )

    async def placement(request: Request) -> Response:
        return JSONResponse(placement_report(agent))

    async def metrics_page(request: Request) -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    async def list_boxes(request: Request) -> Response:
        return JSONResponse({"sandboxes": agent.list()})

    async def create(request: Request) -> Response:
        body = await _body(request)
        image = body.get("image")
        if not isinstance(image, str) or not image:
            raise BadInputError("image must be a non-empty string")
        limits = _limits(body, agent.config.defaults)
        ttl = positive(body.get("ttl"), float, "ttl", "a positive number of seconds")
        network = body.get("network", False)
        if not isinstance(network, bool):
            raise BadInputError("network must be true or false")
        tmpfs = parse_tmpfs(body.get("tmpfs"))
        confinement = parse_confinement(
            body.get("cap_drop"), body.get("read_only"), body.get("ulimits")
        )
        names = SandboxNames(
            parse_hostname(body.get("hostname")),
            parse_extra_hosts(body.get("extra_hosts"), network=network),
        )
        env = _env(body.get("env"), "create")
        box = await agent.create(image, env, limits, ttl, network, tmpfs, confinement, names)
        # A client that hung up meanwhile would never learn the id: undo it. Asked once
        # the create is done rather than watched beside it (as an exec is), since a
        # create, unlike a command, ends by itself within seconds; and only for a create
        # that made its sandbox (tens of ms or more): the question costs ~0.2 ms, a
        # warm claim's whole handling 0.5 ms (bench/agent_ab.py), and a client gone in
        # that millisecond leaves a sandbox that the default TTL deletes.
        if not box.record.from_pool and await request.is_disconnected():
            log.info("sandbox %s: its client hung up during the create; deleting it", box.record.id)
            await agent.delete(box.record.id)
            return Response(status_code=499)
        return JSONResponse(box.view(), status_code=201)

    async def get_box(request: Request) -> Response:
        return JSONResponse(agent.get(request.path_params["id"]).view())

    async def update_box(request: Request) -> Response:
        """New limits for a running sandbox: the fields a create takes (cpus, memory,
        pids, disk, cpu_shares, cpuset_cpus); those not given stay as they are."""
        body = await _body(request)
        box = agent.get(request.path_params["id"])
        unknown = sorted(set(body) - LIMIT_FIELDS)
        if unknown:
            raise BadInputError(f"a sandbox's update takes only its limits, not {unknown}")
        limits = _limits(body, limits_of(box.record))
        return JSONResponse((await agent.update_limits(box.id, limits)).view())

    async def box_stats(request: Request) -> Response:
        used = agent.usage(request.path_params["id"])
        return JSONResponse(
            {
                "cpu_seconds": used.cpu_ns / 1e9,
                "memory": used.memory,
                "memory_limit": used.memory_limit,
                "pids": used.pids,
                "pids_limit": used.pids_limit,
            }
        )

    async def pause_box(request: Request) -> Response:
        return JSONResponse((await agent.set_paused(request.path_params["id"], True)).view())

    async def unpause_box(request: Request) -> Response:
        return JSONResponse((await agent.set_paused(request.path_params["id"], False)).view())

    async def box_changes(request: Request) -> Response:
        found = await agent.changes(request.path_params["id"])
        body = await sandbox_io.run(_changes_json, found)  # up to MAX_PATH_BYTES of paths
        return PiecewiseResponse(body, media_type="application/json")

    async def delete_box(request: Request) -> Response:
        box_id = request.path_params["id"]
        await agent.delete(box_id)
        return JSONResponse({"deleted": box_id})

    async def exec_buffered(request: Request) -> Response:
        req = _exec_request(await _body(request))
        output = _Output(budget)
        try:
            result = await unless_client_leaves(
                request, agent.exec(request.path_params["id"], req, output.emit)
            )
            if result is None:
                output.release()
                return Response(status_code=499)  # nobody is there to read it
            if output.held <= BASE64_STEP:  # one step: cheaper here than a thread hop
                answer = _exec_answer(result, output)
            else:
                encode = partial(_exec_answer, result, output, in_thread=True)
                answer = await anyio.to_thread.run_sync(encode, limiter=encoders)
        except BaseException:
            output.release()
            raise
        return _HeldResponse(answer, output)

    async def exec_stream(request: Request) -> Response:
        box_id = request.path_params["id"]
        req = _exec_request(await _body(request))
        agent.takes_commands(box_id)  # an unknown id is a 404 now, not a line in the stream
        send, receive = anyio.create_memory_object_stream[bytes](64)
        scope = anyio.CancelScope()

        async def job() -> None:
            with scope, send:

                async def emit(kind: str, data: bytes) -> None:
                    # Short lines into a bounded queue: an exec's output waits in its
                    # pipe, not here, while the client reads slower than it comes.
                    for start in range(0, len(data), STREAM_PIECE):
                        piece = data[start : start + STREAM_PIECE]
                        await send.send(_line({kind: base64.b64encode(piece).decode()}))

                try:
                    result = await agent.exec(box_id, req, emit)
                    await send.send(
                        _line(
                            {
                                "exit_code": result.exit_code,
                                "timed_out": result.timed_out,
                                "seconds": result.seconds,
                                "channel": result.channel,
                            }
                        )
                    )
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    pass  # the client went away: execute() killed the command
                except Exception as exc:
                    body = json.loads(error_response(exc).body)
                    with _ignore_gone():
                        await send.send(_line(body))

        async def lines() -> AsyncIterator[bytes]:
            try:
                async with receive:
                    async for line in receive:
                        yield line
            finally:
                # The client went away (or the response ended): a command that prints
                # nothing more would never notice, so it is cancelled, which kills it.
                scope.cancel()

        tasks.start_soon(job)
        return StreamingResponse(lines(), media_type="application/x-ndjson")

    async def read_file(request: Request) -> Response:
        """The file as it is read, a piece at a time (files.stream_file): a missing file
        or one over the limit is an error answer; one that grows past the limit while it
        is read cuts the answer short, so no client takes part of it for the whole."""
        box = agent.get(request.path_params["id"])
        path = _path(request)
        read = partial(files.stream_file, box.sandbox.rootfs, path, max_file)
        pieces = await sandbox_io.stream(read)
        try:
            await anext(pieces)  # open, and within the limit
        except BaseException:
            await pieces.aclose()
            raise

        async def body() -> AsyncIterator[bytes]:
            async with contextlib.aclosing(pieces):
                async for piece in pieces:
                    yield piece

        what = f"sandbox {box.record.id}: the read of {path}"
        return BreakableResponse(body(), what, media_type="application/octet-stream")

    async def write_file(request: Request) -> Response:
        box = agent.get(request.path_params["id"])
        box.check_writable()
        path = _path(request)
        data = await _read_body(request, max_file)
        owner = (box.record.uid, box.record.gid)
        await sandbox_io.run(partial(files.write_file, box.sandbox.rootfs, path, data, owner=owner))
        return JSONResponse({"path": path, "size": len(data)})

    async def list_dir(request: Request) -> Response:
        box = agent.get(request.path_params["id"])
        body = await sandbox_io.run(_listing_json, box.sandbox.rootfs, _path(request))
        return PiecewiseResponse(body, media_type="application/json")

    async def get_pools(request: Request) -> Response:
        return JSONResponse({"pools": [p.view() for p in agent.pools.values()]})

    async def set_pool(request: Request) -> Response:
        body = await _body(request)
        pool = await agent.set_pool(
            request.path_params["image"], body.get("size"), body.get("warmup"), body.get("fleet")
        )
        return JSONResponse(pool.view())

    async def set_warm(request: Request) -> Response:
        body = await _body(request)
        pool = await agent.set_warm(body.get("size"))
        return JSONResponse(pool.view())

    handlers = {
        "health": health,
        "metrics": metrics_page,
        "list_boxes": list_boxes,
        "create": create,
        "get_box": get_box,
        "update_box": update_box,
        "box_stats": box_stats,
        "box_changes": box_changes,
        "pause_box": pause_box,
        "unpause_box": unpause_box,
        "delete_box": delete_box,
        "exec_buffered": exec_buffered,
        "exec_stream": exec_stream,
        "read_file": read_file,
        "write_file": write_file,
        "list_dir": list_dir,
        "get_pools": get_pools,
        "set_pool": set_pool,
        "set_warm": set_warm,
    }
    # The API both the agent and the gateway serve, and what only an agent answers: its
    # placement report, which gateways poll (lazyfs/agent/report.py).
    placement_route = [("/placement", "placement", ["GET"])]
    return ApiApp({**handlers, "placement": placement}, on_error, ENDPOINTS + placement_route)


def _path(request: Request) -> str:
    path = request.query_params.get("path")
    if not path:
        raise BadInputError("the path query parameter is missing")
    return path


def _line(obj: dict) -> bytes:
    return json.dumps(obj).encode() + b"\n"


class _ignore_gone:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: object) -> bool:
        return kind is not None and issubclass(
            kind, (anyio.BrokenResourceError, anyio.ClosedResourceError)
        )


# Answers that may be large, made in the sandbox I/O pool's thread with the work itself:
# a listing of 100,000 names is ~10 MB of JSON, which the event loop would stall on.


def _changes_json(found: list[Change]) -> bytes:
    return json.dumps({"changes": [c._asdict() for c in found]}).encode()


def _listing_json(rootfs: Path, path: str) -> bytes:
    return json.dumps({"entries": files.list_dir(rootfs, path)}).encode()
