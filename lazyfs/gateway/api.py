"""The gateway's routes: the node agent's API (docs/api.md), answered by the fleet.

A create is placed (placement.py) and sent to the first node that takes it: a 429 or a
node that cannot be connected to moves it to the next. Every call about a sandbox goes
to the node its id names (ids.py), with the agent's id in the path; the agent's answer
comes back as it is, its ids made gateway ids. Lists and pools are asked of every node.

Errors are the agent's shape, `{"error": CODE, "message": ONE LINE}`; the gateway's own:
404 `unknown_sandbox` (an id that is not `ID@HOST:PORT`), 503 `node_unavailable` (the
node an id names is not in the fleet, or did not answer: the message names it), 503
`no_nodes` (no node answers), 400 `bad_request`, 413 `too_large`.

A client that hangs up is passed on: the gateway closes its call to the node, which the
agent takes as its own client hanging up (an exec is killed, a create undone).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from chunker.errors import BadInputError, LazyfsError
from lazyfs.gateway.fleet import Fleet, Node
from lazyfs.gateway.ids import UnknownGatewayId, gateway_id, split_id
from lazyfs.gateway.metrics import GatewayMetrics
from lazyfs.gateway.placement import EPSILON, choose
from lazyfs.gateway.pools import FleetPools, merged_pools
from lazyfs.gateway.upstream import Answer, BrokeOff, NodeResponse, Unreached, whole
from lazyfs.serving import ApiApp, PiecewiseResponse, unless_client_leaves

log = logging.getLogger("lazyfs.gateway")
MAX_JSON = 64 * 2**20  # a JSON body, as the agent takes it (an exec's stdin is in it)
CREATE_TIMEOUT = 300.0  # seconds a node may take to make a sandbox (a cold image: seconds)
CALL_TIMEOUT = 150.0  # other calls about one sandbox (the agent's file work ends at 120 s)
ASK_ALL_TIMEOUT = 10.0  # a list or pools answer from each node
EXEC_SLACK = 30.0  # beyond an exec's own timeout


class NodeUnavailable(LazyfsError):
    """The node a call needs is not in the fleet, or did not answer."""


class NoNodes(LazyfsError):
    """No node of the fleet answers."""


class TooLarge(BadInputError):
    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body is over {limit // 2**20} MiB")


ERRORS: list[tuple[type[BaseException], int, str]] = [  # the first that matches
    (TooLarge, 413, "too_large"),
    (UnknownGatewayId, 404, "unknown_sandbox"),
    (NodeUnavailable, 503, "node_unavailable"),
    (NoNodes, 503, "no_nodes"),
    (BadInputError, 400, "bad_request"),
]


def error_response(exc: BaseException) -> JSONResponse:
    for kind, status, code in ERRORS:
        if isinstance(exc, kind):
            return JSONResponse({"error": code, "message": str(exc)}, status_code=status)
    log.exception("internal error")
    return JSONResponse(
        {"error": "internal", "message": f"{type(exc).__name__}: {exc}"}, status_code=500
    )


def build_app(
    fleet: Fleet,
    metrics: GatewayMetrics,
    policy: str = "cache",
    epsilon: float = EPSILON,
    pools: FleetPools | None = None,
) -> ApiApp:
    pools = pools or FleetPools(fleet)
    started = time.time()

    # ------------------------------------------------------------------ the fleet

    async def health(request: Request) -> Response:
        healthy = fleet.healthy()
        reports = [n.report or {} for n in healthy]
        return JSONResponse(
            {
                "status": "ok" if healthy else "no_nodes",
                "gateway": True,
                "placement": policy,
                "nodes": [n.status() for n in fleet.nodes.values()],
                "healthy_nodes": len(healthy),
                "sandboxes": sum(r.get("sandboxes", 0) for r in reports),
                "max_sandboxes": sum(r.get("max_sandboxes", 0) for r in reports),
                "uptime": time.time() - started,
            }
        )

    async def metrics_page(request: Request) -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    async def list_boxes(request: Request) -> Response:
        answers, unreachable = await _ask_all(fleet, "GET", "/sandboxes")
        boxes = [
            _as_gateway(view, name)
            for name, answer in answers.items()
            for view in answer.get("sandboxes", [])
        ]
        return JSONResponse({"sandboxes": boxes, "unreachable": unreachable})

    async def create(request: Request) -> Response:
        raw = await _read(request, MAX_JSON)
        try:
            body = json.loads(raw)
        except ValueError:
            raise BadInputError("the request body is not JSON") from None
        if not isinstance(body, dict):
            raise BadInputError("the request body must be a JSON object")
        image = body.get("image")
        if not isinstance(image, str) or not image:
            raise BadInputError("image must be a non-empty string")
        answer = await unless_client_leaves(request, _place(raw, image))
        if answer is None:
            return Response(status_code=499)  # the node undid it: its call was closed
        return answer

    async def _place(raw: bytes, image: str) -> Response:
        t0 = time.perf_counter()
        healthy = fleet.healthy()
        if not healthy:
            raise NoNodes("no node of the fleet answers (GET /health shows each one's error)")
        image_id = fleet.image_id(image)
        choices = choose(image, [n.view(image, image_id) for n in healthy], policy, epsilon)
        busy: Answer | None = None
        for choice in choices:
            node = fleet.nodes.get(choice.node)
            if node is None:
                continue
            node.placed_here(image)
            made = False
            try:
                answer = await node.http.call(
                    "POST",
                    "/sandboxes",
                    data=raw,
                    headers={"Content-Type": "application/json"},
                    timeout=CREATE_TIMEOUT,
                )
                made = answer.status == 201
            except Unreached as exc:
                fleet.mark_down(node, str(exc))
                metrics.node_errors.labels(node.name).inc()
                continue  # nothing reached it: the next node
            except BrokeOff as exc:
                metrics.node_errors.labels(node.name).inc()
                # Out of placement until its next report answers: the trainer's retry of
                # this create must not go back to a node that just died (its pooled
                # connections then break off too: a retry failed so in the fleet bench).
                fleet.mark_down(node, str(exc))
                # It may have made the sandbox: not tried elsewhere (its TTL deletes it).
                raise NodeUnavailable(f"node {node.name} broke off the create: {exc}") from None
            finally:
                node.create_ended(image, made)
            if made:
                view = answer.json()
                if view.get("image_id"):
                    fleet.learn(image, view["image_id"])
                metrics.creates.labels(node.name, choice.reason).inc()
                metrics.create_seconds.observe(time.perf_counter() - t0)
                return JSONResponse(_as_gateway(view, node.name), status_code=201)
            if answer.status == 429:  # at capacity: the next node
                busy = answer
                continue
            return _passed_on(answer)
        if busy is not None:
            return _passed_on(busy)
        raise NoNodes("no node of the fleet could be reached for the create")

    # ------------------------------------------------------------------ one sandbox

    async def get_box(request: Request) -> Response:
        return await _one(request, "", timeout=CALL_TIMEOUT, rewrite=True)

    async def update_box(request: Request) -> Response:
        raw = await _read(request, MAX_JSON)
        return await _one(request, "", raw, CALL_TIMEOUT, rewrite=True)

    async def box_stats(request: Request) -> Response:
        return await _one(request, "/stats", timeout=CALL_TIMEOUT)

    async def box_changes(request: Request) -> Response:
        return await _one(request, "/changes", timeout=CALL_TIMEOUT)

    async def pause_box(request: Request) -> Response:
        return await _one(request, "/pause", timeout=CALL_TIMEOUT, rewrite=True)

    async def unpause_box(request: Request) -> Response:
        return await _one(request, "/unpause", timeout=CALL_TIMEOUT, rewrite=True)

    async def delete_box(request: Request) -> Response:
        answer = await _one(request, "", timeout=CALL_TIMEOUT)
        if answer.status_code == 200:
            return JSONResponse({"deleted": request.path_params["id"]})
        return answer

    async def exec_buffered(request: Request) -> Response:
        raw = await _read(request, MAX_JSON)
        timeout = _exec_timeout(raw)
        answer = await unless_client_leaves(request, _one(request, "/exec", raw, timeout))
        return answer if answer is not None else Response(status_code=499)

    async def exec_stream(request: Request) -> Response:
        raw = await _read(request, MAX_JSON)
        return await _one(request, "/exec/stream", raw, _exec_timeout(raw), stream=True)

    async def read_file(request: Request) -> Response:
        return await _one(request, "/files", timeout=CALL_TIMEOUT, stream=True)

    async def write_file(request: Request) -> Response:
        length = request.headers.get("content-length")
        return await _one(request, "/files", request.stream(), CALL_TIMEOUT, length=length)

    async def list_dir(request: Request) -> Response:
        return await _one(request, "/dir", timeout=CALL_TIMEOUT)

    async def _one(
        request: Request,
        suffix: str,
        content: bytes | AsyncIterator[bytes] | None = None,
        timeout: float | None = None,
        *,
        rewrite: bool = False,
        stream: bool = False,
        length: str | None = None,
    ) -> Response:
        """The call for the sandbox in the path, made to its node."""
        sandbox_id = request.path_params["id"]
        agent_id, name = split_id(sandbox_id)
        node = fleet.get(name)
        if node is None:
            raise NodeUnavailable(f"node {name} of {sandbox_id} is not in the fleet (gone?)")
        headers = {"Content-Type": request.headers.get("content-type", "application/json")}
        if length is not None:
            headers["Content-Length"] = length
        path = f"/sandboxes/{agent_id}{suffix}"
        params = request.query_params.multi_items()
        try:
            answer = await node.http.stream(
                request.method, path, params=params, data=content, headers=headers, timeout=timeout
            )
        except (Unreached, BrokeOff) as exc:
            metrics.node_errors.labels(node.name).inc()
            if isinstance(exc, Unreached):
                fleet.mark_down(node, str(exc))
            raise NodeUnavailable(f"node {node.name} did not answer: {exc}") from None
        if stream and answer.status == 200:
            return StreamingResponse(
                _relay(answer, node), status_code=200, media_type=answer.content_type
            )
        try:
            read = await whole(answer)
        except BrokeOff as exc:
            raise NodeUnavailable(f"node {node.name} broke off its answer: {exc}") from None
        if rewrite and read.status == 200:
            return JSONResponse(_as_gateway(read.json(), node.name))
        return _passed_on(read)

    async def _relay(answer: NodeResponse, node: Node) -> AsyncIterator[bytes]:
        """The node's streamed answer, as it comes; if the node breaks off, one last
        error line that names it (the client raises it: lazyfs.client)."""
        try:
            async for piece in answer.pieces():
                yield piece
        except BrokeOff as exc:
            metrics.node_errors.labels(node.name).inc()
            if "ndjson" in (answer.content_type or ""):
                message = f"node {node.name} broke off the stream: {exc}"
                yield b"\n" + _line({"error": "node_unavailable", "message": message})
        finally:
            answer.release()

    # ------------------------------------------------------------------ pools

    async def get_pools(request: Request) -> Response:
        answers, unreachable = await _ask_all(fleet, "GET", "/pools")
        lists = {name: answer.get("pools", []) for name, answer in answers.items()}
        return JSONResponse({"pools": merged_pools(lists), "unreachable": unreachable})

    async def set_pool(request: Request) -> Response:
        body = _object(await _read(request, MAX_JSON))
        size, warmup = body.get("size"), body.get("warmup")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise BadInputError(f"pool size {size!r} must be a whole number, 0 or more")
        if not fleet.healthy():
            raise NoNodes("no node of the fleet answers")
        answers = await pools.set(request.path_params["image"], size, warmup)
        failed = [a for a in answers.values() if a.status != 200]
        if failed:
            return _passed_on(failed[0])
        merged = merged_pools({name: [a.json()] for name, a in answers.items()})
        view = merged[0] if merged else {"image": request.path_params["image"], "target": 0}
        return JSONResponse({**view, "target": size})

    async def set_warm(request: Request) -> Response:
        raw = await _read(request, MAX_JSON)
        answers, unreachable = await _ask_all(fleet, "PUT", "/warm", raw)
        merged = merged_pools({name: [answer] for name, answer in answers.items()})
        if not merged:
            raise NoNodes("no node of the fleet took the generic pool's size")
        return JSONResponse({**merged[0], "unreachable": unreachable})

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
    return ApiApp(handlers, error_response)


async def _ask_all(
    fleet: Fleet, method: str, path: str, body: bytes | None = None
) -> tuple[dict[str, dict], list[dict]]:
    """Every healthy node's JSON answer, by node name; and the nodes that gave none
    (each with why), so that a list says what it is missing rather than hang or fail."""
    answers: dict[str, dict] = {}
    missing: list[dict] = [
        {"node": n.name, "error": n.error} for n in fleet.nodes.values() if not n.healthy
    ]

    async def ask(node: Node) -> None:
        try:
            with anyio.fail_after(ASK_ALL_TIMEOUT):
                answer = await node.http.call(
                    method,
                    path,
                    data=body,
                    headers={"Content-Type": "application/json"} if body is not None else None,
                    timeout=ASK_ALL_TIMEOUT,
                )
            if answer.status != 200:
                raise RuntimeError(f"HTTP {answer.status}: {answer.body[:200]!r}")
            answers[node.name] = answer.json()
        except (Unreached, BrokeOff, TimeoutError, RuntimeError, ValueError) as exc:
            missing.append({"node": node.name, "error": _why(exc)})

    async with anyio.create_task_group() as tasks:
        for node in fleet.healthy():
            tasks.start_soon(ask, node)
    return answers, missing


def _as_gateway(view: dict, node: str) -> dict:
    """An agent's sandbox view with the gateway's id and its node."""
    return {**view, "id": gateway_id(view["id"], node), "node": node}


def _passed_on(answer: Answer) -> Response:
    """The node's answer as it is (its status, its error body); a buffered exec's may be
    ~170 MB, written a piece at a time (lazyfs/serving.py)."""
    return PiecewiseResponse(answer.body, status_code=answer.status, media_type=answer.content_type)


async def _read(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise TooLarge(limit)
    data = bytearray()
    async for piece in request.stream():
        data += piece
        if len(data) > limit:
            raise TooLarge(limit)
    return bytes(data)


def _object(raw: bytes) -> dict:
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        raise BadInputError("the request body is not JSON") from None
    if not isinstance(body, dict):
        raise BadInputError("the request body must be a JSON object")
    return body


def _exec_timeout(raw: bytes) -> float | None:
    """How long the node may take to answer an exec: its own timeout and some slack, or
    no limit (the client's own timeout ends it, and its hang-up kills the command)."""
    try:
        timeout = json.loads(raw).get("timeout")
    except (ValueError, AttributeError):
        return None  # the node answers 400
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0:
        return float(timeout) + EXEC_SLACK
    return None


def _why(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _line(obj: dict) -> bytes:
    return json.dumps(obj).encode() + b"\n"
