"""The agent's HTTP/JSON API (starlette, served by uvicorn on asyncio: server.py).

The routes and their bodies are documented in docs/api.md. Every error is one JSON
object, {"error": CODE, "message": ONE LINE}, with the status from ERRORS below: the one
place where domain errors become HTTP statuses. A request's failure never stops the agent.
"""

from __future__ import annotations

import base64
import errno
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import TypeVar

import anyio
from anyio.abc import TaskGroup
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from chunker.errors import BadInputError, LazyfsError, NotFoundError, StoreError
from lazyfs.agent import files
from lazyfs.agent.errors import AtCapacity, SandboxExited, SandboxLost, UnknownSandbox
from lazyfs.agent.execute import ExecRequest, ServerBroke
from lazyfs.agent.metrics import AgentMetrics
from lazyfs.agent.node import Agent
from lazyfs.limits import parse_limits, positive
from lazyfs.sandbox_runtime import RuntimeFailed

log = logging.getLogger("lazyfs.agent")
T = TypeVar("T")
MAX_OUTPUT = 64 * 2**20  # per stream of a buffered exec; past it output is dropped, flagged

# Most specific first.
ERRORS: list[tuple[type[BaseException], int, str]] = [
    (UnknownSandbox, 404, "unknown_sandbox"),
    (files.FileNotInSandbox, 404, "no_such_file"),
    (NotFoundError, 404, "not_found"),  # an unknown image
    (SandboxLost, 410, "sandbox_lost"),  # cleaned up when the agent restarted
    (SandboxExited, 409, "sandbox_exited"),  # its PID 1 ended: only delete is left
    (AtCapacity, 429, "at_capacity"),  # --max-sandboxes
    (BadInputError, 400, "bad_request"),  # limits, env, paths, argv that do not parse
    (StoreError, 503, "store_unavailable"),
    (ServerBroke, 502, "exec_server_failed"),  # the sandbox's exec server broke off
    (RuntimeFailed, 500, "runtime_failed"),
    (LazyfsError, 500, "error"),
]


def error_response(exc: BaseException) -> JSONResponse:
    status, code = 500, "internal"
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
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


async def _body(request: Request) -> dict:
    try:
        body = json.loads(await request.body() or b"{}")
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


def build_app(agent: Agent, metrics: AgentMetrics, tasks: TaskGroup) -> Starlette:
    def handler(
        fn: Callable[[Request], Awaitable[Response]],
    ) -> Callable[[Request], Awaitable[Response]]:
        async def wrapped(request: Request) -> Response:
            try:
                return await fn(request)
            except Exception as exc:  # every failure is an answer, never the agent's end
                response = error_response(exc)
                metrics.errors.labels(str(response.status_code)).inc()
                return response

        return wrapped

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

    async def metrics_page(request: Request) -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    async def list_boxes(request: Request) -> Response:
        return JSONResponse({"sandboxes": agent.list()})

    async def create(request: Request) -> Response:
        body = await _body(request)
        image = body.get("image")
        if not isinstance(image, str) or not image:
            raise BadInputError("image must be a non-empty string")
        limits = parse_limits(body.get("cpus"), body.get("memory"), body.get("pids"), prefix="")
        ttl = positive(body.get("ttl"), float, "ttl", "a positive number of seconds")
        network = body.get("network", False)
        if not isinstance(network, bool):
            raise BadInputError("network must be true or false")
        work = agent.create(image, _env(body.get("env"), "create"), limits, ttl, network)
        box = await _unless_client_leaves(request, work, undo=lambda b: agent.delete(b.record.id))
        if box is None:
            return Response(status_code=499)  # deleted: nobody would know its id
        return JSONResponse(box.view(), status_code=201)

    async def get_box(request: Request) -> Response:
        return JSONResponse(agent.get(request.path_params["id"]).view())

    async def delete_box(request: Request) -> Response:
        box_id = request.path_params["id"]
        await agent.delete(box_id)
        return JSONResponse({"deleted": box_id})

    async def exec_buffered(request: Request) -> Response:
        req = _exec_request(await _body(request))
        out = {"stdout": bytearray(), "stderr": bytearray()}
        truncated = {"stdout": False, "stderr": False}

        async def emit(kind: str, data: bytes) -> None:
            if len(out[kind]) + len(data) > MAX_OUTPUT:
                truncated[kind] = True
                data = data[: MAX_OUTPUT - len(out[kind])]
            out[kind] += data

        result = await _unless_client_leaves(
            request, agent.exec(request.path_params["id"], req, emit)
        )
        if result is None:
            return Response(status_code=499)  # nobody is there to read it
        return JSONResponse(
            {
                "exit_code": result.exit_code,
                "timed_out": result.timed_out,
                "seconds": result.seconds,
                "stdout": base64.b64encode(out["stdout"]).decode(),
                "stderr": base64.b64encode(out["stderr"]).decode(),
                "stdout_truncated": truncated["stdout"],
                "stderr_truncated": truncated["stderr"],
            }
        )

    async def exec_stream(request: Request) -> Response:
        box_id = request.path_params["id"]
        req = _exec_request(await _body(request))
        agent.running(box_id)  # an unknown id is a 404 now, not a line in the stream
        send, receive = anyio.create_memory_object_stream[bytes](64)
        scope = anyio.CancelScope()

        async def job() -> None:
            with scope, send:

                async def emit(kind: str, data: bytes) -> None:
                    await send.send(_line({kind: base64.b64encode(data).decode()}))

                try:
                    result = await agent.exec(box_id, req, emit)
                    await send.send(
                        _line(
                            {
                                "exit_code": result.exit_code,
                                "timed_out": result.timed_out,
                                "seconds": result.seconds,
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
        box = agent.get(request.path_params["id"])
        data = await anyio.to_thread.run_sync(files.read_file, box.sandbox.rootfs, _path(request))
        return Response(data, media_type="application/octet-stream")

    async def write_file(request: Request) -> Response:
        box = agent.get(request.path_params["id"])
        path = _path(request)
        data = await request.body()
        owner = (box.record.uid, box.record.gid)
        await anyio.to_thread.run_sync(
            partial(files.write_file, box.sandbox.rootfs, path, data, owner=owner)
        )
        return JSONResponse({"path": path, "size": len(data)})

    async def list_dir(request: Request) -> Response:
        box = agent.get(request.path_params["id"])
        entries = await anyio.to_thread.run_sync(files.list_dir, box.sandbox.rootfs, _path(request))
        return JSONResponse({"entries": entries})

    async def get_pools(request: Request) -> Response:
        return JSONResponse({"pools": [p.view() for p in agent.pools.values()]})

    async def set_pool(request: Request) -> Response:
        body = await _body(request)
        pool = await agent.set_pool(
            request.path_params["image"], body.get("size"), body.get("warmup")
        )
        return JSONResponse(pool.view())

    routes = [
        Route("/health", handler(health)),
        Route("/metrics", handler(metrics_page)),
        Route("/sandboxes", handler(list_boxes), methods=["GET"]),
        Route("/sandboxes", handler(create), methods=["POST"]),
        Route("/sandboxes/{id}", handler(get_box), methods=["GET"]),
        Route("/sandboxes/{id}", handler(delete_box), methods=["DELETE"]),
        Route("/sandboxes/{id}/exec", handler(exec_buffered), methods=["POST"]),
        Route("/sandboxes/{id}/exec/stream", handler(exec_stream), methods=["POST"]),
        Route("/sandboxes/{id}/files", handler(read_file), methods=["GET"]),
        Route("/sandboxes/{id}/files", handler(write_file), methods=["PUT"]),
        Route("/sandboxes/{id}/dir", handler(list_dir), methods=["GET"]),
        Route("/pools", handler(get_pools), methods=["GET"]),
        Route("/pools/{image:path}", handler(set_pool), methods=["PUT"]),
    ]
    return Starlette(routes=routes)


async def _unless_client_leaves(
    request: Request, work: Awaitable[T], undo: Callable[[T], Awaitable[object]] | None = None
) -> T | None:
    """work's result, or None if the client hung up first: the work is then cancelled
    (for an exec, that kills the command, as when a streaming client goes away; a create
    deletes what it made). `undo` is for work that ended after the hang-up but before the
    cancel reached it. The request's body has been read, so the next ASGI message is the
    disconnect."""
    result: list[T] = []
    failed: list[Exception] = []
    left: list[bool] = []
    async with anyio.create_task_group() as tasks:

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            left.append(True)
            tasks.cancel_scope.cancel()

        tasks.start_soon(watch)
        try:
            result.append(await work)
        except Exception as exc:  # raised below, not wrapped in the task group's
            failed.append(exc)
        tasks.cancel_scope.cancel()
    if failed:
        raise failed[0]
    if left and result and undo is not None:
        await undo(result[0])
        return None
    return result[0] if result else None


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


class BearerAuth:
    """ASGI middleware for the TCP listener: every request needs the bearer token."""

    def __init__(self, app: Starlette, token: str) -> None:
        self.app = app
        self.token = token.encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, b"Bearer " + self.token):
                response = JSONResponse(
                    {"error": "unauthorized", "message": "a valid bearer token is required"},
                    status_code=401,
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
