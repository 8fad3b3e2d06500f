"""The Docker Engine API's endpoints, over the agent's sandboxes (containers.py says how
a container maps to one).

Served by `lazyfs serve --docker-socket PATH` (http.py). Errors have Docker's shape,
`{"message": ...}`, with the wording clients key on: docker-py raises ImageNotFound for
a 404 that says "No such image", and `containers.run` pulls on it.

What a sandbox cannot grant is said, not faked: Privileged, CapAdd, Devices and an
unconfined SecurityOpt are dropped with a warning in the create's answer (the CLI
prints them); host bind mounts are refused; a user other than the image's, a terminal
(Tty) and stdin that streams while the command runs are refused as not supported yet.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import re
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import wraps

import anyio
from anyio.abc import ByteStream, TaskGroup

from chunker.errors import BadInputError, LazyfsError, NotFoundError, StoreError
from chunker.images import ImageRef, list_images
from chunker.store.backends import open_store
from lazyfs.agent.boxes import AgentBox, BoxState
from lazyfs.agent.errors import AtCapacity, SandboxExited, SandboxLost, UnknownSandbox
from lazyfs.agent.execute import ExecRequest
from lazyfs.agent.images import ImageInfo
from lazyfs.agent.node import Agent
from lazyfs.docker import refs
from lazyfs.docker.containers import (
    STDERR,
    STREAMS,
    Container,
    Names,
    frame,
    new_name,
    timestamp,
)
from lazyfs.docker.http import (
    Answer,
    Hijacked,
    HttpError,
    Reply,
    Request,
    Router,
    Streamed,
    json_reply,
)
from lazyfs.sandbox.limits import parse_limits
from lazyfs.sandbox.oci_spec import Limits

log = logging.getLogger("lazyfs.docker")
API_VERSION = "1.44"  # what docker-py 7 asks for; the CLI of Debian 12 (20.10) asks 1.41
MIN_API_VERSION = "1.24"
MULTIPLEXED = "application/vnd.docker.multiplexed-stream"
MAX_STDIN = 48 * 2**20  # an exec's stdin, read whole before the command starts
NAME = re.compile(r"^/?[a-zA-Z0-9][a-zA-Z0-9_.-]+$")
NAMES_FRESH = 2.0  # seconds a listing of the store's image names is used as it is
STOPPED_CODE = 137  # 128 + SIGKILL: stop and kill end the command with SIGKILL
REFUSED_PRIVILEGE = {
    "Privileged": "Privileged",
    "CapAdd": "added capabilities",
    "Devices": "host devices",
}

# lazyfs's errors as Docker answers them; the first that matches.
ERRORS: list[tuple[type[BaseException], int]] = [
    (SandboxLost, 404),
    (UnknownSandbox, 404),
    (NotFoundError, 404),
    (SandboxExited, 409),
    (AtCapacity, 429),
    (BadInputError, 400),
    (StoreError, 503),
    (LazyfsError, 500),
]


def docker_errors(
    fn: Callable[[DockerAPI, Request], Awaitable[Answer]],
) -> Callable[[DockerAPI, Request], Awaitable[Answer]]:
    """lazyfs's errors as Docker's: status and one line."""

    @wraps(fn)
    async def handler(self: DockerAPI, request: Request) -> Answer:
        try:
            return await fn(self, request)
        except LazyfsError as exc:
            status = next(s for cls, s in ERRORS if isinstance(exc, cls))
            raise HttpError(status, str(exc).splitlines()[0] if str(exc) else repr(exc)) from None

    return handler


@dataclass
class ExecInstance:
    id: str
    container: Container
    argv: list[str]
    env: list[str]
    cwd: str | None
    stdin: bool
    stdout: bool
    stderr: bool
    running: bool = False
    started: bool = False
    exit_code: int | None = None


class DockerAPI:
    def __init__(self, agent: Agent, tasks: TaskGroup) -> None:
        self.agent = agent
        self.tasks = tasks
        self.containers: dict[str, Container] = {}  # box id -> container
        self.names = Names()
        self.execs: dict[str, ExecInstance] = {}
        self.refs: dict[str, str] = {}  # a Docker reference -> the converted name it found
        self._listing: tuple[float, list[ImageRef]] = (-NAMES_FRESH, [])

    def headers(self) -> list[tuple[str, str]]:
        """Sent with every answer: the CLI negotiates its API version from Api-Version."""
        return [
            ("Api-Version", API_VERSION),
            ("Docker-Experimental", "false"),
            ("Ostype", "linux"),
            ("Server", f"lazyfs/{_lazyfs_version()}"),
        ]

    def router(self) -> Router:
        r = Router()
        for method, path, handler in [
            ("GET", "/_ping", self.ping),
            ("GET", "/version", self.version),
            ("GET", "/info", self.info),
            ("GET", "/images/json", self.list_images),
            ("POST", "/images/create", self.pull),
            ("POST", "/build", self.build),
            ("GET", "/images/{name:path}/json", self.inspect_image),
            ("POST", "/containers/create", self.create),
            ("GET", "/containers/json", self.list_containers),
            ("GET", "/containers/{id}/json", self.inspect),
            ("POST", "/containers/{id}/start", self.start),
            ("POST", "/containers/{id}/wait", self.wait),
            ("GET", "/containers/{id}/logs", self.logs),
            ("POST", "/containers/{id}/attach", self.attach),
            ("POST", "/containers/{id}/stop", self.stop),
            ("POST", "/containers/{id}/kill", self.kill),
            ("POST", "/containers/{id}/rename", self.rename),
            ("DELETE", "/containers/{id}", self.remove),
            ("POST", "/containers/{id}/exec", self.exec_create),
            ("POST", "/exec/{id}/start", self.exec_start),
            ("GET", "/exec/{id}/json", self.exec_inspect),
        ]:
            r.add(method, path, handler)
        return r

    # ------------------------------------------------------------------ system

    async def ping(self, request: Request) -> Answer:
        return Reply(body=b"OK", content_type="text/plain; charset=utf-8")

    async def version(self, request: Request) -> Answer:
        return json_reply(
            {
                "Platform": {"Name": "lazyfs"},
                "Version": _lazyfs_version(),
                "ApiVersion": API_VERSION,
                "MinAPIVersion": MIN_API_VERSION,
                "Os": "linux",
                "Arch": _arch(),
                "KernelVersion": platform.release(),
                "GitCommit": "",
                "GoVersion": "",
                "BuildTime": "",
                "Components": [{"Name": "lazyfs", "Version": _lazyfs_version()}],
            }
        )

    async def info(self, request: Request) -> Answer:
        self._sync()
        states = [c.status for c in self.containers.values()]
        return json_reply(
            {
                "ID": socket.gethostname(),
                "Name": socket.gethostname(),
                "Containers": len(states),
                "ContainersRunning": states.count("running"),
                "ContainersPaused": 0,
                "ContainersStopped": len(states) - states.count("running"),
                "Images": 0,
                "Driver": "lazyfs",
                "DriverStatus": [],
                "OperatingSystem": "lazyfs node agent",
                "OSType": "linux",
                "Architecture": platform.machine(),
                "KernelVersion": platform.release(),
                "NCPU": os.cpu_count() or 1,
                "MemTotal": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                "ServerVersion": _lazyfs_version(),
                "DockerRootDir": str(self.agent.settings.run_dir),
                "Runtimes": {"runc": {"path": "runc"}},
                "DefaultRuntime": "runc",
                "Swarm": {"LocalNodeState": "inactive"},
                "SecurityOptions": ["name=seccomp,profile=default"],
                "CgroupVersion": "1",
                "Plugins": {"Volume": [], "Network": [], "Log": []},
                "Labels": [],
                "Warnings": [],
            }
        )

    # ------------------------------------------------------------------ images

    async def _image(self, ref: str) -> ImageInfo:
        """The converted image a Docker reference names (refs.py), or Docker's 404."""
        known = self.refs.get(ref)
        names = [known] if known else refs.candidates(ref)
        for name in names:
            try:
                info = await self.agent.image(name)
            except NotFoundError:
                continue
            except BadInputError:  # a spelling that is no name at all
                continue
            self.refs[ref] = name
            return info
        self.refs.pop(ref, None)
        raise HttpError(404, f"No such image: {ref}")

    async def _names(self) -> list[ImageRef]:
        """Every name converted in the store (a listing of its refs: kept NAMES_FRESH s)."""
        when, names = self._listing
        if time.monotonic() - when < NAMES_FRESH:
            return names

        def listing() -> list[ImageRef]:
            store = open_store(
                self.agent.config.store_url, timeout=self.agent.settings.cache.fetch_timeout
            )
            try:
                return list_images(store)
            finally:
                store.close()

        names = await anyio.to_thread.run_sync(listing)
        self._listing = (time.monotonic(), names)
        return names

    async def _tags(self, image_id: str) -> list[str]:
        return sorted({refs.repo_tag(r.name) for r in await self._names() if r.image == image_id})

    @docker_errors
    async def list_images(self, request: Request) -> Answer:
        by_id: dict[str, list[ImageRef]] = {}
        for ref in await self._names():
            by_id.setdefault(ref.image, []).append(ref)
        images = []
        for image_id, names in by_id.items():
            info = await self.agent.image(image_id)
            images.append(
                {
                    "Id": "sha256:" + image_id,
                    "ParentId": "",
                    "RepoTags": sorted({refs.repo_tag(r.name) for r in names}),
                    "RepoDigests": sorted({r.source_digest for r in names if r.source_digest}),
                    "Created": int(max(r.created for r in names)),
                    "Size": info.size,
                    "VirtualSize": info.size,
                    "SharedSize": -1,
                    "Labels": info.config.get("Labels") or {},
                    "Containers": -1,
                }
            )
        return json_reply(images)

    @docker_errors
    async def inspect_image(self, request: Request) -> Answer:
        ref = request.params["name"]
        info = await self._image(ref)
        return json_reply(
            {
                "Id": "sha256:" + info.image_id,
                "RepoTags": await self._tags(info.image_id),
                "RepoDigests": [],
                "Parent": "",
                "Comment": "",
                "Created": info.created or timestamp(None),
                "Config": info.config,
                "DockerVersion": "",
                "Author": "",
                "Architecture": "amd64" if _arch() == "amd64" else _arch(),
                "Os": "linux",
                "Size": info.size,
                "VirtualSize": info.size,
                "GraphDriver": {"Name": "lazyfs", "Data": {}},
                "RootFS": {"Type": "layers", "Layers": []},
                "Metadata": {"LastTagTime": timestamp(None)},
            }
        )

    @docker_errors
    async def pull(self, request: Request) -> Answer:
        """An image converted already answers at once. Converting one on pull is not
        built yet: the answer says how to convert it."""
        image = request.arg("fromImage") or ""
        tag = request.arg("tag") or ""
        if not image:
            raise HttpError(400, "fromImage is required (importing a tarball is not supported)")
        ref = f"{image}@{tag}" if tag.startswith("sha256:") else f"{image}:{tag}" if tag else image
        try:
            info = await self._image(ref)
        except HttpError:
            raise HttpError(
                404,
                f"No such image: {ref}: it is not converted in this node's store, and"
                f" converting on pull is not supported yet; run `lazyfs convert {ref}`",
            ) from None
        repo, tag_part = refs.split_tag(ref)
        lines = [
            {"status": f"Pulling from {refs.short(repo)}", "id": tag_part or "latest"},
            {"status": f"Digest: sha256:{info.image_id}"},
            {"status": f"Status: Image is up to date for {ref}"},
        ]
        return Reply(body=b"".join(_json_line(line) for line in lines))

    async def build(self, request: Request) -> Answer:
        raise HttpError(
            501,
            "lazyfs does not build images: build with docker or buildah, push to a"
            " registry, and convert it with `lazyfs convert`",
        )

    # ------------------------------------------------------------------ containers

    def _sync(self) -> None:
        """Take in sandboxes made through the agent's own API; drop containers whose
        sandbox is gone (deleted through that API, or by its TTL)."""
        boxes = self.agent.boxes
        for box_id in [b for b in self.containers if b not in boxes]:
            self._forget(self.containers[box_id])
        for box in list(boxes.values()):
            box.poll()
            if box.id in self.containers:
                continue
            if box.state not in (BoxState.RUNNING, BoxState.EXITED):
                continue  # a pool's, not handed out; or being deleted
            container = Container(
                box.id,
                box.id,
                box.record.image,
                box.record.image_id,
                {"Image": box.record.image, "Env": box.record.env, "Labels": {}},
                {},
                created=box.record.created,
                adopted=True,
                status="running" if box.state is BoxState.RUNNING else "exited",
                started_at=box.record.created,
            )
            self.containers[box.id] = container
            self.names.claim(container.name, container.id)

    def _find(self, ref: str) -> Container:
        """A container by full id, name, sandbox id or unique id prefix."""
        self._sync()
        ref = ref.removeprefix("/")
        by_id = {c.id: c for c in self.containers.values()}
        found = by_id.get(ref) or self.containers.get(ref)
        if found is None and ref in self.names.by_name:
            found = by_id.get(self.names.by_name[ref])
        if found is None and ref:
            matches = [c for cid, c in by_id.items() if cid.startswith(ref)]
            if len(matches) > 1:
                raise HttpError(400, f"multiple IDs found with provided prefix: {ref}")
            found = matches[0] if matches else None
        if found is None or found.status == "removing":
            raise HttpError(404, f"No such container: {ref}")
        return found

    def _box(self, container: Container) -> AgentBox | None:
        return self.agent.boxes.get(container.box_id)

    @docker_errors
    async def create(self, request: Request) -> Answer:
        body = request.json()
        name = request.arg("name") or new_name()
        if not NAME.match(name):
            raise HttpError(
                400,
                f"Invalid container name ({name}), only [a-zA-Z0-9][a-zA-Z0-9_.-] are allowed",
            )
        name = name.removeprefix("/")
        ref = body.get("Image")
        if not isinstance(ref, str) or not ref:
            raise HttpError(400, "Config.Image is required")
        host = body.get("HostConfig") or {}
        warnings = _not_granted(host)
        _refuse_binds(host)
        if body.get("Tty"):
            raise HttpError(400, "Tty: a terminal for the container is not supported yet")
        info = await self._image(ref)
        _check_user(body.get("User"), info)
        entrypoint, cmd = _command(body, info)
        env = _strings(body.get("Env"), "Env")
        workdir = body.get("WorkingDir") or info.config.get("WorkingDir") or None
        if workdir is not None and not workdir.startswith("/"):
            raise HttpError(400, f"WorkingDir {workdir!r} must be an absolute path")
        network = _network(host)
        limits = _limits(host, self.agent)
        placeholder = "creating-" + secrets.token_hex(8)
        self.names.claim(name, placeholder)  # a clash is a 409 before any sandbox is made
        try:
            box = await self.agent.create(info.name, env, limits, None, network)
        except BaseException:
            self.names.drop(name)
            raise
        config = {
            "Hostname": box.id,
            "User": body.get("User") or info.config.get("User") or "",
            "Env": [*(info.config.get("Env") or []), *env],
            "Cmd": cmd,
            "Entrypoint": entrypoint,
            "Image": ref,
            "WorkingDir": workdir or "",
            "Labels": body.get("Labels") or {},
            "Tty": False,
            "OpenStdin": bool(body.get("OpenStdin")),
            "AttachStdin": bool(body.get("AttachStdin")),
            "AttachStdout": bool(body.get("AttachStdout")),
            "AttachStderr": bool(body.get("AttachStderr")),
            "ExposedPorts": body.get("ExposedPorts") or {},
        }
        host_config = {
            "NetworkMode": host.get("NetworkMode") or "default",
            "AutoRemove": bool(host.get("AutoRemove")),
            "Memory": limits.memory or 0,
            "NanoCpus": int((limits.cpus or 0) * 1e9),
            "PidsLimit": limits.pids or 0,
            "Privileged": False,
            "CapAdd": None,
            "Binds": None,
            "PortBindings": {},
            "RestartPolicy": {"Name": "no", "MaximumRetryCount": 0},
            "LogConfig": {"Type": "json-file", "Config": {}},
        }
        container = Container(box.id, name, ref, info.image_id, config, host_config)
        self.containers[box.id] = container
        self.names.by_name[name] = container.id  # the placeholder's
        log.info("docker: container %s (%s) is sandbox %s", name, ref, box.id)
        return json_reply({"Id": container.id, "Warnings": warnings}, 201)

    @docker_errors
    async def start(self, request: Request) -> Answer:
        container = self._find(request.params["id"])
        if container.status == "running":
            return Reply(304)
        if container.adopted:
            raise HttpError(409, f"container {container.name} was not made through Docker's API")
        self.agent.running(container.box_id)  # its sandbox still runs (else a 409)
        container.begin()
        ready = anyio.Event()
        self.tasks.start_soon(self._run_main, container, ready)
        await ready.wait()
        return Reply(204)

    async def _run_main(self, container: Container, ready: anyio.Event) -> None:
        async def emit(kind: str, data: bytes) -> None:
            container.log.add(STREAMS[kind], data)

        req = ExecRequest(container.argv, cwd=container.config.get("WorkingDir") or None)
        code, error = 0, ""
        with anyio.CancelScope() as scope:
            container.main = scope
            ready.set()
            try:
                result = await self.agent.exec(container.box_id, req, emit)
                code = result.exit_code
            except LazyfsError as exc:
                code, error = 126, str(exc).splitlines()[0]
                container.log.add(STDERR, f"lazyfs: {error}\n".encode())
        if scope.cancelled_caught or container.stopped:
            code = STOPPED_CODE
        container.finish(code, error)
        log.info("docker: container %s exited with %d", container.name, code)
        if container.host_config.get("AutoRemove"):
            await self._remove(container)

    @docker_errors
    async def wait(self, request: Request) -> Answer:
        container = self._find(request.params["id"])
        condition = request.arg("condition") or "not-running"
        if condition not in ("not-running", "next-exit", "removed"):
            raise HttpError(400, f"invalid condition: {condition!r}")
        mark = container.finished_at

        async def outcome() -> AsyncIterator[bytes]:
            yield b""  # the headers go now: the CLI waits for them before it starts
            while True:
                changed = container.log.changed
                if _waited(container, condition, mark):
                    break
                await changed.wait()
            error = {"Message": container.error} if container.error else None
            yield _json_line({"StatusCode": container.exit_code, "Error": error})

        return Streamed(outcome())

    @docker_errors
    async def logs(self, request: Request) -> Answer:
        container = self._find(request.params["id"])
        wanted = _wanted(request)
        if not wanted:
            raise HttpError(400, "You must choose at least one stream")
        follow = request.flag("follow") and container.status in ("running", "created")

        async def pieces() -> AsyncIterator[bytes]:
            yield b""
            async for stream, data in container.follow(0, follow):
                if stream in wanted:
                    yield frame(stream, data)

        return Streamed(pieces(), MULTIPLEXED)

    @docker_errors
    async def attach(self, request: Request) -> Answer:
        container = self._find(request.params["id"])
        wanted = _wanted(request)
        start = 0 if request.flag("logs") else container.log.end
        follow = request.flag("stream")

        async def run(stream: ByteStream) -> None:
            async with stream:
                async for kind, data in container.follow(start, follow):
                    if kind in wanted:
                        await stream.send(frame(kind, data))

        return Hijacked(run, MULTIPLEXED)

    @docker_errors
    async def stop(self, request: Request) -> Answer:
        container = self._find(request.params["id"])
        if container.status != "running":
            return Reply(304)
        await self._end(container)
        return Reply(204)

    @docker_errors
    async def kill(self, request: Request) -> Answer:
        container = self._find(request.params["id"])
        if container.status != "running":
            raise HttpError(409, f"Container {container.id} is not running")
        await self._end(container)
        return Reply(204)

    async def _end(self, container: Container) -> None:
        """End the main process (SIGKILL to its process group, from the exec server)."""
        if container.adopted:
            raise HttpError(409, f"container {container.name} was not made through Docker's API")
        container.stopped = True
        if container.main is not None:
            container.main.cancel()
        await container.ended.wait()

    @docker_errors
    async def rename(self, request: Request) -> Answer:
        container = self._find(request.params["id"])
        name = request.arg("name") or ""
        if not NAME.match(name):
            raise HttpError(400, f"Invalid container name ({name})")
        name = name.removeprefix("/")
        self.names.claim(name, container.id)
        self.names.drop(container.name)
        container.name = name
        return Reply(204)

    @docker_errors
    async def remove(self, request: Request) -> Answer:
        container = self._find(request.params["id"])
        if container.status == "running" and not request.flag("force"):
            raise HttpError(
                409,
                f"You cannot remove a running container {container.id}. Stop the container"
                " before attempting removal or force remove",
            )
        await self._remove(container)
        return Reply(204)

    async def _remove(self, container: Container) -> None:
        if container.status == "removing":
            return
        if container.main is not None:
            container.stopped = True
            container.main.cancel()
        container.status = "removing"
        with contextlib.suppress(UnknownSandbox):  # deleted meanwhile (TTL, the agent's API)
            await self.agent.delete(container.box_id)
        self._forget(container)

    def _forget(self, container: Container) -> None:
        self.containers.pop(container.box_id, None)
        if self.names.by_name.get(container.name) == container.id:
            self.names.drop(container.name)
        for exec_id in [e.id for e in self.execs.values() if e.container is container]:
            del self.execs[exec_id]
        container.status = "removing"
        container.removed.set()
        container.log.poke()

    @docker_errors
    async def inspect(self, request: Request) -> Answer:
        container = self._find(request.params["id"])
        box = self._box(container)
        pid = box.sandbox.pid if box is not None and box.sandbox.pid else 0
        argv = container.argv
        return json_reply(
            {
                "Id": container.id,
                "Created": timestamp(container.created),
                "Path": argv[0] if argv else "",
                "Args": argv[1:],
                "State": container.state(pid),
                "Image": "sha256:" + container.image_id,
                "Name": "/" + container.name,
                "RestartCount": 0,
                "Driver": "lazyfs",
                "Platform": "linux",
                "MountLabel": "",
                "ProcessLabel": "",
                "AppArmorProfile": "",
                "ExecIDs": [e.id for e in self.execs.values() if e.container is container] or None,
                "HostConfig": container.host_config,
                "Config": container.config,
                "NetworkSettings": {"Ports": {}, "Networks": {}, "IPAddress": ""},
                "Mounts": [],
            }
        )

    @docker_errors
    async def list_containers(self, request: Request) -> Answer:
        self._sync()
        filters = _filters(request)
        show_all = request.flag("all")
        found = []
        for c in sorted(self.containers.values(), key=lambda c: -c.created):
            if c.status == "removing" or (not show_all and c.status != "running"):
                continue
            if not _matches(c, filters):
                continue
            argv = c.argv
            found.append(
                {
                    "Id": c.id,
                    "Names": ["/" + c.name],
                    "Image": c.image,
                    "ImageID": "sha256:" + c.image_id,
                    "Command": " ".join(argv),
                    "Created": int(c.created),
                    "State": c.status,
                    "Status": c.status_line(),
                    "Ports": [],
                    "Labels": c.config.get("Labels") or {},
                    "HostConfig": {"NetworkMode": c.host_config.get("NetworkMode", "default")},
                    "NetworkSettings": {"Networks": {}},
                    "Mounts": [],
                }
            )
        limit = request.number("limit", -1)
        if limit is not None and limit > 0:
            found = found[:limit]
        return json_reply(found)

    # ------------------------------------------------------------------ exec

    @docker_errors
    async def exec_create(self, request: Request) -> Answer:
        container = self._find(request.params["id"])
        if container.status != "running":
            raise HttpError(409, f"Container {container.id} is not running")
        body = request.json()
        if body.get("Tty"):
            raise HttpError(400, "Tty: a terminal for exec is not supported yet")
        if body.get("Privileged"):
            raise HttpError(400, "Privileged exec is not granted in a lazyfs sandbox")
        argv = body.get("Cmd")
        argv = [argv] if isinstance(argv, str) else argv
        if not argv or not all(isinstance(a, str) for a in argv):
            raise HttpError(400, "No exec command specified")
        info = await self._image(container.image) if not container.adopted else None
        if info is not None:
            _check_user(body.get("User"), info)
        instance = ExecInstance(
            secrets.token_hex(32),
            container,
            argv,
            _strings(body.get("Env"), "Env"),
            body.get("WorkingDir") or container.config.get("WorkingDir") or None,
            bool(body.get("AttachStdin")),
            bool(body.get("AttachStdout", True)),
            bool(body.get("AttachStderr", True)),
        )
        self.execs[instance.id] = instance
        return json_reply({"Id": instance.id}, 201)

    def _exec(self, exec_id: str) -> ExecInstance:
        instance = self.execs.get(exec_id)
        if instance is None:
            raise HttpError(404, f"No such exec instance: {exec_id}")
        return instance

    @docker_errors
    async def exec_start(self, request: Request) -> Answer:
        instance = self._exec(request.params["id"])
        body = request.json()
        if body.get("Tty"):
            raise HttpError(400, "Tty: a terminal for exec is not supported yet")
        if instance.started:
            raise HttpError(409, f"Exec command {instance.id} has already run")
        self.agent.running(instance.container.box_id)
        instance.started = instance.running = True
        if body.get("Detach"):
            self.tasks.start_soon(self._run_exec, instance, None)
            return Reply(200)

        async def run(stream: ByteStream) -> None:
            async with stream:
                await self._run_exec(instance, stream)

        return Hijacked(run, MULTIPLEXED)

    async def _run_exec(self, instance: ExecInstance, stream: ByteStream | None) -> None:
        """Run the command; its output framed on `stream` (None: detached). The exit
        code is set before the stream ends."""
        stdin = None
        try:
            if stream is not None and instance.stdin:
                stdin = await _read_all(stream, MAX_STDIN)

            async def emit(kind: str, data: bytes) -> None:
                wanted = instance.stdout if kind == "stdout" else instance.stderr
                if stream is not None and wanted:
                    await stream.send(frame(STREAMS[kind], data))

            req = ExecRequest(instance.argv, instance.cwd, instance.env, stdin)
            try:
                result = await self.agent.exec(instance.container.box_id, req, emit)
                instance.exit_code = result.exit_code
            except LazyfsError as exc:
                instance.exit_code = 126
                if stream is not None:
                    await stream.send(frame(STDERR, f"lazyfs: {exc}\n".encode()))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, ConnectionError):
            instance.exit_code = instance.exit_code if instance.exit_code is not None else -1
        finally:
            instance.running = False

    @docker_errors
    async def exec_inspect(self, request: Request) -> Answer:
        instance = self._exec(request.params["id"])
        return json_reply(
            {
                "ID": instance.id,
                "Running": instance.running,
                "ExitCode": instance.exit_code,
                "ProcessConfig": {
                    "entrypoint": instance.argv[0],
                    "arguments": instance.argv[1:],
                    "tty": False,
                    "privileged": False,
                    "user": instance.container.config.get("User", ""),
                },
                "OpenStdin": instance.stdin,
                "OpenStdout": instance.stdout,
                "OpenStderr": instance.stderr,
                "CanRemove": False,
                "ContainerID": instance.container.id,
                "DetachKeys": "",
                "Pid": 0,
            }
        )


# ---------------------------------------------------------------------- helpers


def _json_line(doc: object) -> bytes:
    return json.dumps(doc).encode() + b"\n"


def _lazyfs_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lazyfs")
    except PackageNotFoundError:
        return "0"


def _arch() -> str:
    machine = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def _strings(value: object, what: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise HttpError(400, f"{what} must be a list of strings")
    return value


def _command(body: dict, info: ImageInfo) -> tuple[list[str] | None, list[str] | None]:
    """(Entrypoint, Cmd) as dockerd chooses them: an Entrypoint given at create
    drops the image's Cmd; a Cmd given replaces the image's."""
    entrypoint = body.get("Entrypoint")
    cmd = body.get("Cmd")
    entrypoint = [entrypoint] if isinstance(entrypoint, str) else entrypoint
    cmd = [cmd] if isinstance(cmd, str) else cmd
    if entrypoint is not None:
        entrypoint = [] if entrypoint == [""] else _strings(entrypoint, "Entrypoint")
        cmd = _strings(cmd, "Cmd") if cmd is not None else None
    else:
        entrypoint = info.config.get("Entrypoint")
        cmd = _strings(cmd, "Cmd") if cmd else info.config.get("Cmd")
    if not [*(entrypoint or []), *(cmd or [])]:
        raise HttpError(400, "No command specified")
    return entrypoint, cmd


def _check_user(user: object, info: ImageInfo) -> None:
    """Commands run as the image's user (the exec server's); another is refused."""
    if user in (None, ""):
        return
    image_user = info.config.get("User") or ""
    if not isinstance(user, str):
        raise HttpError(400, "User must be a string")
    as_root = image_user in ("", "root", "0", "0:0", "root:root")
    if user == image_user or (as_root and user in ("root", "0", "0:0", "root:root")):
        return
    raise HttpError(
        400,
        f"User {user!r}: commands run as the image's user ({image_user or 'root'});"
        " another user is not supported yet",
    )


def _not_granted(host: dict) -> list[str]:
    warnings = []
    for key, what in REFUSED_PRIVILEGE.items():
        if host.get(key):
            warnings.append(f"{key}: {what} are not granted in a lazyfs sandbox; dropped")
    unconfined = [o for o in host.get("SecurityOpt") or [] if "unconfined" in str(o)]
    if unconfined:
        warnings.append(
            f"SecurityOpt {', '.join(unconfined)}: a sandbox is always confined; dropped"
        )
    return warnings


def _refuse_binds(host: dict) -> None:
    binds = host.get("Binds") or []
    mounts = [m for m in host.get("Mounts") or [] if (m or {}).get("Type", "bind") == "bind"]
    if binds or mounts:
        shown = ", ".join(binds) or ", ".join(str(m.get("Source")) for m in mounts)
        raise HttpError(400, f"host bind mounts are refused in a lazyfs sandbox: {shown}")


def _network(host: dict) -> bool:
    """NetworkMode host gives the sandbox the node's network (the agent's `network`);
    anything else has only loopback, as every lazyfs sandbox does."""
    mode = host.get("NetworkMode") or "default"
    return mode == "host"


def _limits(host: dict, agent: Agent) -> Limits:
    memory = host.get("Memory") or None
    cpus = None
    if host.get("NanoCpus"):
        cpus = host["NanoCpus"] / 1e9
    elif host.get("CpuQuota") and host["CpuQuota"] > 0:
        cpus = host["CpuQuota"] / (host.get("CpuPeriod") or 100_000)
    pids = host.get("PidsLimit")
    pids = pids if isinstance(pids, int) and pids > 0 else None
    defaults = agent.config.defaults
    return parse_limits(cpus, memory, pids, None, prefix="HostConfig.", defaults=defaults)


def _waited(c: Container, condition: str, mark: float | None) -> bool:
    """Whether a wait's condition holds: `mark` is the end time of the run before the
    wait was asked (next-exit waits for another)."""
    if c.removed.is_set():
        return True
    if condition == "removed":
        return False
    if condition == "next-exit":
        return c.status == "exited" and c.finished_at != mark
    return c.status != "running"  # not-running: a container never started is not running


def _wanted(request: Request) -> set[int]:
    return {n for name, n in STREAMS.items() if request.flag(name)}


def _filters(request: Request) -> dict[str, list[str]]:
    raw = request.arg("filters")
    if not raw:
        return {}
    try:
        doc = json.loads(raw)
    except ValueError:
        raise HttpError(400, f"filters: {raw!r} is not JSON") from None
    if not isinstance(doc, dict):
        raise HttpError(400, "filters must be a JSON object")
    # {"name": ["x"]} or the older {"name": {"x": true}}
    return {k: list(v) if isinstance(v, list | dict) else [str(v)] for k, v in doc.items()}


def _matches(c: Container, filters: dict[str, list[str]]) -> bool:
    for key, values in filters.items():
        if key == "name":
            ok = any(re.search(v.removeprefix("/"), c.name) for v in values)
        elif key == "id":
            ok = any(c.id.startswith(v) for v in values)
        elif key == "status":
            ok = c.status in values
        elif key == "label":
            labels = c.config.get("Labels") or {}
            ok = all(
                labels.get(k) == v if sep else k in labels
                for k, sep, v in (value.partition("=") for value in values)
            )
        elif key == "ancestor":
            ok = any(refs.same_image(c.image, v) or c.image == v for v in values)
        else:
            raise HttpError(400, f"invalid filter '{key}'")
        if not ok:
            return False
    return True


async def _read_all(stream: ByteStream, limit: int) -> bytes:
    """What the client sends until it half-closes (the CLI does at stdin's end)."""
    data = bytearray()
    while True:
        try:
            data += await stream.receive()
        except anyio.EndOfStream:
            return bytes(data)
        if len(data) > limit:
            raise HttpError(413, f"stdin over {limit} bytes")
