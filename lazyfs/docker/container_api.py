"""The container endpoints: create, start, restart, inspect, list, logs, attach, wait,
changes, stop, kill, pause, unpause, rename, remove and prune, over the agent's sandboxes
(containers.py says how a container maps to one).

What a sandbox cannot grant is said, not faked: Privileged, CapAdd, Devices and an
unconfined SecurityOpt are dropped with a warning in the create's answer (the CLI
prints them), and so are the other HostConfig settings it does not apply (NOT_APPLIED:
Sysctls, Dns, ...); host bind mounts are refused; Tmpfs, Mounts of type tmpfs and ShmSize
are the sandbox's own tmpfs mounts (given to a generic sandbox at its claim); CapDrop,
ReadonlyRootfs and Ulimits are the agent's cap_drop, read_only and ulimits
(lazyfs/sandbox/confinement.py), Hostname and ExtraHosts its hostname and extra_hosts
(lazyfs/sandbox/names.py).
A User other than the image's is taken by the exec server when the sandbox's user is
root (root may become anyone), and refused otherwise. A container with Tty runs its
command on a pseudo-terminal in the sandbox (exec protocol v3), and with OpenStdin an
attached client's stdin streams to it. Published ports (PortBindings) are forwarded by
the agent from a loopback host port into the sandbox (ports.py). Inspect shows dockerd's
HostConfig keys at dockerd's defaults where lazyfs applies nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from functools import partial
from pathlib import Path

import anyio
from anyio.abc import ByteStream, TaskGroup

from chunker.errors import LazyfsError
from lazyfs.agent import files
from lazyfs.agent.boxes import AgentBox, BoxState
from lazyfs.agent.changes import Change
from lazyfs.agent.errors import UnknownSandbox
from lazyfs.agent.execute import ExecRequest
from lazyfs.agent.files import make_dirs, opened_root
from lazyfs.agent.images import ImageInfo
from lazyfs.agent.node import Agent
from lazyfs.agent.records import limits_of
from lazyfs.agent.sandbox_io import SandboxIO
from lazyfs.agent.top import PsFailed, top
from lazyfs.docker import detach, ports, refs
from lazyfs.docker.container_log import SEGMENT_BYTES, SEGMENTS, Cursor, Log
from lazyfs.docker.containers import (
    DEFAULT_HOST_CONFIG,
    STDERR,
    STREAMS,
    Container,
    Names,
    Piece,
    frame,
    new_name,
    terminal_size,
    timestamp,
)
from lazyfs.docker.errors import docker_errors
from lazyfs.docker.http import (
    Answer,
    Hijacked,
    HttpError,
    Reply,
    Request,
    Streamed,
    json_line,
    json_reply,
)
from lazyfs.docker.images import Images
from lazyfs.sandbox.confinement import parse_confinement
from lazyfs.sandbox.limits import parse_limits
from lazyfs.sandbox.names import SandboxNames, parse_extra_hosts, parse_hostname
from lazyfs.sandbox.oci_spec import Limits
from lazyfs.sandbox.process import db_entry, is_number, resolve_user
from lazyfs.sandbox.runtime import Sandbox
from lazyfs.sandbox.tmpfs import Tmpfs, parse_tmpfs
from lazyfs.sandbox.usage import disk_used

log = logging.getLogger("lazyfs.docker")
MULTIPLEXED = "application/vnd.docker.multiplexed-stream"
RAW = "application/vnd.docker.raw-stream"  # a terminal's output: no frames
NAME = re.compile(r"^/?[a-zA-Z0-9][a-zA-Z0-9_.-]+$")
STOPPED_CODE = 137  # 128 + SIGKILL: stop and kill end the command with SIGKILL
LOG_DRIVERS = ("json-file", "local", "none")
DIFF_KINDS = {"changed": 0, "added": 1, "deleted": 2}  # dockerd's ChangeType
# HostConfig settings a sandbox does not apply (create warns of them); Binds, Mounts and
# the privileges are refused or warned of apart, ports are published (ports.py).
NOT_APPLIED = (
    "CpusetMems",
    "CpuRealtimePeriod",
    "CpuRealtimeRuntime",
    "CpuCount",
    "CpuPercent",
    "BlkioWeight",
    "BlkioWeightDevice",
    "BlkioDeviceReadBps",
    "BlkioDeviceWriteBps",
    "BlkioDeviceReadIOps",
    "BlkioDeviceWriteIOps",
    "IOMaximumIOps",
    "IOMaximumBandwidth",
    "MemoryReservation",
    "MemorySwap",
    "MemorySwappiness",
    "OomKillDisable",
    "OomScoreAdj",
    "StorageOpt",
    "Sysctls",
    "Mounts",  # of type volume (bind mounts are refused, tmpfs ones applied)
    "MaskedPaths",
    "ReadonlyPaths",
    "Links",
    "VolumesFrom",
    "VolumeDriver",
    "DeviceCgroupRules",
    "DeviceRequests",
    "Dns",
    "DnsOptions",
    "DnsSearch",
    "PidMode",
    "IpcMode",
    "UTSMode",
    "UsernsMode",
    "CgroupnsMode",
    "CgroupParent",
    "RestartPolicy",
)
UNAPPLIED_DEFAULTS: dict[str, tuple] = {  # values that ask nothing (the CLI sends some)
    "MemorySwappiness": (-1,),
    "MemorySwap": (-1,),
    "IpcMode": ("private", "shareable"),
    "PidMode": ("private",),
    "UTSMode": ("private",),
    "UsernsMode": ("private",),
    "CgroupnsMode": ("host",),
}
NO_RESTART = (None, "", "no")
NETWORK_SETTINGS = {  # a sandbox has loopback only (or the node's network, NetworkMode host)
    "Bridge": "",
    "SandboxID": "",
    "SandboxKey": "",
    "HairpinMode": False,
    "LinkLocalIPv6Address": "",
    "LinkLocalIPv6PrefixLen": 0,
    "Ports": {},
    "SecondaryIPAddresses": None,
    "SecondaryIPv6Addresses": None,
    "EndpointID": "",
    "Gateway": "",
    "GlobalIPv6Address": "",
    "GlobalIPv6PrefixLen": 0,
    "IPAddress": "",
    "IPPrefixLen": 0,
    "IPv6Gateway": "",
    "MacAddress": "",
    "Networks": {},
}
START_WAIT = 30.0  # seconds a start waits for the main process to have started
FILE_THREADS = 2  # work on sandboxes' files at once: anonymous volumes, top, diff answers
LOG_THREADS = 2  # containers' log writes and reads at once (container_log.py)
FILE_TIMEOUT = 60.0  # seconds one may take
REFUSED_PRIVILEGE = {
    "Privileged": "Privileged",
    "CapAdd": "added capabilities",
    "Devices": "host devices",
}


class Containers:
    def __init__(self, agent: Agent, tasks: TaskGroup, images: Images) -> None:
        self.agent = agent
        self.tasks = tasks
        self.images = images
        self.all: dict[str, Container] = {}  # box id -> container
        self.names = Names()
        self.io = SandboxIO(FILE_THREADS, FILE_TIMEOUT)  # work on a sandbox's files
        self.log_io = anyio.CapacityLimiter(LOG_THREADS)  # containers' logs' disk work

    def sync(self) -> None:
        """Take in sandboxes made through the agent's own API; drop containers whose
        sandbox is gone (deleted through that API, or by its TTL)."""
        boxes = self.agent.boxes
        for box_id in [b for b in self.all if b not in boxes]:
            self._forget(self.all[box_id])
        for box in list(boxes.values()):
            box.poll()
            if box.id in self.all:
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
                self._new_log(DEFAULT_HOST_CONFIG["LogConfig"]),
                created=box.record.created,
                adopted=True,
                status="running" if box.state is BoxState.RUNNING else "exited",
                started_at=box.record.created,
            )
            self.all[box.id] = container
            self.names.claim(container.name, container.id)

    def _new_log(self, log_config: dict) -> Log:
        """A container's log, sized as its LogConfig asks: its files on the disk the node
        keeps for sandboxes."""
        segment_bytes, segments = _log_sizes(log_config.get("Config") or {})
        return Log(
            self.agent.settings.sandbox_dir, self.log_io, self.tasks, segment_bytes, segments
        )

    def find(self, ref: str) -> Container:
        """A container by full id, name, sandbox id or unique id prefix."""
        self.sync()
        ref = ref.removeprefix("/")
        by_id = {c.id: c for c in self.all.values()}
        found = by_id.get(ref) or self.all.get(ref)
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

    async def user_of(self, container: Container, user: str) -> tuple[int, int, list[int]] | None:
        """(uid, gid, groups) that `user` names in the container's sandbox (its own
        /etc/passwd and /etc/group, read through the agent's file API), or None for the
        sandbox's own user (and for "" when the container names none). Another user
        needs a sandbox whose exec server is root: root may become anyone, and nobody
        else may become root."""
        if not user:
            return container.user
        box = self.agent.boxes.get(container.box_id)
        if box is None:
            raise HttpError(404, f"No such container: {container.id}")
        # In the pool for a sandbox's files, with its timeout, as top.
        read = partial(resolve_user, box.sandbox.rootfs, user, read=files.sandbox_db)
        uid, gid, groups = await self.io.run(read)
        if (uid, gid) == (box.record.uid, box.record.gid) and not groups:
            return None
        if box.record.uid != 0:
            raise HttpError(
                400,
                f"User {user!r}: this container runs as uid {box.record.uid}; another user"
                " needs an image whose user is root",
            )
        return uid, gid, groups

    async def _group_add(self, container: Container, extra: object) -> tuple[int, int, list[int]]:
        """The container's user with GroupAdd's groups too (ids, or names from the
        sandbox's /etc/group); a sandbox whose user is not root refuses them (400)."""
        if not isinstance(extra, list) or not all(isinstance(g, str | int) for g in extra):
            raise HttpError(400, "GroupAdd must be a list of group names or ids")
        box = self.agent.boxes[container.box_id]
        if box.record.uid != 0:
            raise HttpError(400, "GroupAdd needs an image whose user is root")
        uid, gid, groups = container.user or (box.record.uid, box.record.gid, [])
        names = [str(g) for g in extra if not is_number(str(g))]
        known = await self.io.run(_group_ids, box.sandbox.rootfs, names) if names else {}
        added = []
        for group in map(str, extra):
            number = group if is_number(group) else known.get(group, "")
            if not is_number(number):
                raise HttpError(400, f"Unable to find group {group}: no matching entries")
            added.append(int(number))
        return uid, gid, sorted({*groups, *added})

    def _box(self, container: Container) -> AgentBox | None:
        return self.agent.boxes.get(container.box_id)

    def _paused(self, container: Container) -> bool:
        box = self._box(container)
        return box is not None and box.record.paused

    def refuse_if_paused(self, container: Container) -> None:
        """An exec into a paused container is dockerd's 409 (it would wait until the
        unpause)."""
        if self._paused(container):
            raise HttpError(
                409, f"Container {container.id} is paused, unpause the container before exec"
            )

    @docker_errors
    async def pause(self, request: Request) -> Answer:
        """POST /containers/{id}/pause (`docker pause`): its sandbox's processes frozen
        (Agent.set_paused); inspect and ps say paused, execs are refused."""
        container = self.find(request.params["id"])
        if container.status != "running":
            raise HttpError(409, f"Container {container.id} is not running")
        if self._paused(container):
            raise HttpError(409, f"Container {container.id} is already paused")
        await self.agent.set_paused(container.box_id, True)
        return Reply(204)

    @docker_errors
    async def unpause(self, request: Request) -> Answer:
        container = self.find(request.params["id"])
        if not self._paused(container):
            raise HttpError(409, f"Container {container.id} is not paused")
        await self.agent.set_paused(container.box_id, False)
        return Reply(204)

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
        warnings = [*_not_granted(host), *_not_applied(host), *_domain_not_applied(body)]
        _refuse_binds(host)
        info = await self.images.find(ref)
        user = body.get("User") or ""
        if not isinstance(user, str):
            raise HttpError(400, "User must be a string")
        entrypoint, cmd = _command(body, info)
        given_env = strings(body.get("Env"), "Env")
        env = _env(given_env, info)
        log_config = _log_config(host.get("LogConfig"))
        runtime = self._runtime(host.get("Runtime"))
        isolation = _isolation(host.get("Isolation"))
        volumes = _volumes(body.get("Volumes"), info)
        workdir = body.get("WorkingDir") or info.config.get("WorkingDir") or None
        if workdir is not None and not workdir.startswith("/"):
            raise HttpError(400, f"WorkingDir {workdir!r} must be an absolute path")
        network = _network(host)
        exposed = ports.exposed_ports(info.config.get("ExposedPorts"), body.get("ExposedPorts"))
        bindings = ports.bindings(host, exposed)  # refused before any sandbox is made
        if network and bindings:
            warnings.append("Published ports are discarded when using host network mode")
            bindings = []
        limits = _limits(host, self.agent.config.defaults)
        tmpfs = _tmpfs(host)
        confinement = parse_confinement(
            host.get("CapDrop"),
            host.get("ReadonlyRootfs"),
            _ulimits(host.get("Ulimits")),
            ("HostConfig.CapDrop", "HostConfig.ReadonlyRootfs", "HostConfig.Ulimits"),
        )
        box_names = SandboxNames(
            parse_hostname(body.get("Hostname"), "Hostname"),
            parse_extra_hosts(host.get("ExtraHosts"), "HostConfig.ExtraHosts", network),
        )
        placeholder = "creating-" + secrets.token_hex(8)
        self.names.claim(name, placeholder)  # a clash is a 409 before any sandbox is made
        try:
            box = await self.agent.create(
                info.name, env, limits, None, network, tmpfs, confinement, box_names
            )
            try:
                await self._make_volumes(box, volumes)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self.agent.delete(box.id)
                raise
        except BaseException:
            self.names.drop(name)
            raise
        config = {
            "Hostname": box_names.hostname,  # lazyfs/sandbox/names.py
            "User": body.get("User") or info.config.get("User") or "",
            "Env": [*(info.config.get("Env") or []), *given_env],
            "Cmd": cmd,
            "Entrypoint": entrypoint,
            "Image": ref,
            "WorkingDir": workdir or "",
            "Labels": body.get("Labels") or {},
            "Tty": bool(body.get("Tty")),
            "OpenStdin": bool(body.get("OpenStdin")),
            "StdinOnce": bool(body.get("StdinOnce")),
            "AttachStdin": bool(body.get("AttachStdin")),
            "AttachStdout": bool(body.get("AttachStdout")),
            "AttachStderr": bool(body.get("AttachStderr")),
            "ExposedPorts": {**exposed, **{b.key: {} for b in bindings}},
            "Volumes": {v: {} for v in volumes} or None,
        }
        for key in ("StopSignal", "StopTimeout"):  # a stop is a SIGKILL at once (within both)
            if body.get(key) is not None:
                config[key] = body[key]
        host_config = {
            **DEFAULT_HOST_CONFIG,
            "NetworkMode": host.get("NetworkMode") or "default",
            "AutoRemove": bool(host.get("AutoRemove")),
            **_shown_limits(limits),
            "ShmSize": host.get("ShmSize") or DEFAULT_HOST_CONFIG["ShmSize"],
            "CapDrop": host.get("CapDrop") or None,  # as asked, as dockerd echoes it
            "ReadonlyRootfs": confinement.read_only,
            "Ulimits": host.get("Ulimits") or None,
            "ExtraHosts": host.get("ExtraHosts") or None,
            "PortBindings": ports.echoed(bindings),
            "PublishAllPorts": bool(host.get("PublishAllPorts")),
            "LogConfig": log_config,
            "Runtime": runtime,
            "Isolation": isolation,
        }
        for key in ("Tmpfs", "Mounts"):  # as asked, and only if asked (dockerd omits them)
            if host.get(key):
                host_config[key] = host[key]
        if host.get("Init") is not None:  # the main process always runs under an init
            host_config["Init"] = bool(host["Init"])
        log_ = self._new_log(log_config)
        container = Container(box.id, name, ref, info.image_id, config, host_config, log_)
        container.ports = bindings
        try:
            container.user = await self.user_of(container, user)
            if host.get("GroupAdd"):
                container.user = await self._group_add(container, host["GroupAdd"])
            await self._publish(container)
        except BaseException:  # an unknown user, a port in use: the create leaves nothing
            self.names.drop(name)
            with anyio.CancelScope(shield=True), contextlib.suppress(LazyfsError):
                await self.agent.delete(box.id)
            raise
        self.all[box.id] = container
        self.names.by_name[name] = container.id  # the placeholder's
        log.info("docker: container %s (%s) is sandbox %s", name, ref, box.id)
        return json_reply({"Id": container.id, "Warnings": warnings}, 201)

    async def _publish(self, container: Container) -> None:
        """Listen on the container's published ports unless they do (HttpError 500 for
        one in use: then none listens)."""
        if not container.ports or container.published is not None:
            return
        box = self.agent.running(container.box_id)
        if box.sandbox.pid is None:
            raise HttpError(409, f"Container {container.id} is not running")
        endpoint = f"{container.name} ({container.id})"
        published = ports.listen(container.ports, box.sandbox.pid, endpoint)
        container.published = published  # before the await: a concurrent start sees them
        try:
            await published.start(self.tasks)
        except BaseException:
            if container.published is published:
                container.published = None
            raise

    async def _unpublish(self, container: Container) -> None:
        """Stop the container's published ports; they are free when this returns."""
        published, container.published = container.published, None
        if published is not None:
            await published.close()

    @docker_errors
    async def start(self, request: Request) -> Answer:
        container = self.find(request.params["id"])
        if container.status == "running":
            return Reply(304)
        await self._start(container)
        return Reply(204)

    async def _start(self, container: Container) -> None:
        if container.adopted:
            raise HttpError(409, f"container {container.name} was not made through Docker's API")
        self.agent.running(container.box_id)  # its sandbox still runs (else a 409)
        await self._publish(container)  # again after an exit
        if container.status == "running":  # another start came first, while this one waited
            return
        if container.status == "removing":  # or a remove
            raise HttpError(404, f"No such container: {container.id}")
        container.begin()
        ready = anyio.Event()
        self.tasks.start_soon(self._run_main, container, ready)
        with anyio.move_on_after(START_WAIT):
            await ready.wait()

    @docker_errors
    async def restart(self, request: Request) -> Answer:
        """Stop (a SIGKILL at once, as stop is) and start again: a new run of the main
        process in the same sandbox, whose files stay."""
        container = self.find(request.params["id"])
        if container.status == "running":
            container.restarting = True
            try:
                await self._end(container)
            finally:
                container.restarting = False
        await self._start(container)
        return Reply(204)

    async def _run_main(self, container: Container, ready: anyio.Event) -> None:
        """The main process, run through the exec server; `ready` is set once it has
        started (as dockerd's start answers once the process runs), or ended."""

        async def emit(kind: str, data: bytes) -> None:
            await container.log.add(STREAMS[kind], data)

        tty = bool(container.config.get("Tty"))
        fed = container.open_stdin() if tty or container.config.get("OpenStdin") else None
        cwd = container.config.get("WorkingDir") or None
        req = ExecRequest(container.argv, cwd=cwd, feed=fed, terminal=tty, user=container.user)
        code, error = 0, ""
        with anyio.CancelScope() as scope:
            container.main = scope
            try:
                result = await self.agent.exec(container.box_id, req, emit, lambda pid: ready.set())
                code = result.exit_code
            except LazyfsError as exc:
                code, error = 126, str(exc).splitlines()[0]
                await container.log.add(STDERR, f"lazyfs: {error}\n".encode())
            finally:
                ready.set()
        if scope.cancelled_caught or container.stopped:
            code = STOPPED_CODE
        container.close_stdin()
        await self._unpublish(container)  # before the end is told: stop returns with them free
        container.finish(code, error)
        log.info("docker: container %s exited with %d", container.name, code)
        if container.host_config.get("AutoRemove") and not container.restarting:
            await self._remove(container)

    @docker_errors
    async def wait(self, request: Request) -> Answer:
        container = self.find(request.params["id"])
        condition = request.arg("condition") or "not-running"
        if condition not in ("not-running", "next-exit", "removed"):
            raise HttpError(400, f"invalid condition: {condition!r}")
        mark = container.finished_at

        async def outcome() -> AsyncGenerator[bytes, None]:
            yield b""  # the headers go now: the CLI waits for them before it starts
            while True:
                changed = container.log.changed
                if _waited(container, condition, mark):
                    break
                await changed.wait()
            error = {"Message": container.error} if container.error else None
            yield json_line({"StatusCode": container.exit_code, "Error": error})

        return Streamed(outcome())

    @docker_errors
    async def logs(self, request: Request) -> Answer:
        """The log, a frame a line: with `tail` its last lines, `since`/`until` (unix
        seconds) the pieces that came in that time, `timestamps` each line after its
        time."""
        container = self.find(request.params["id"])
        wanted = _wanted(request)
        if not wanted:
            raise HttpError(400, "You must choose at least one stream")
        if container.host_config.get("LogConfig", {}).get("Type") == "none":
            raise HttpError(501, "configured logging driver does not support reading")
        tail = _tail(request.arg("tail"))
        since, until = _moment(request, "since"), _moment(request, "until")
        stamps = request.flag("timestamps")
        follow = request.flag("follow") and container.status in ("running", "created")

        tty = bool(container.config.get("Tty"))

        def within(at: float) -> bool:
            return (since is None or at >= since) and (until is None or at <= until)

        def framed(stream: int, data: bytes, at: float) -> bytes:
            """A frame a line, as dockerd reads them from its log file (a client that
            streams the log gets a line at a time); a terminal's output is raw."""
            stamp = timestamp(at).encode() + b" " if stamps else b""
            if tty:
                return b"".join(stamp + line for line in _lines(data)) if stamps else data
            return b"".join(frame(stream, stamp + line) for line in _lines(data))

        def kept(piece: Piece) -> bool:
            return piece[0] in wanted and within(piece[2])

        async def pieces() -> AsyncGenerator[bytes, None]:
            yield b""
            end = container.log.end
            start, skip = 0, 0
            if tail is not None:
                start, skip = await _tail_start(container.log, end, tail, kept)
            cursor = Cursor()  # from the beginning: cut where the first line kept begins
            async for offset, piece in container.log.records(cursor, end):
                if offset < start or not kept(piece):
                    continue
                stream, data, at = piece
                if offset == start and skip:
                    data = b"".join(_lines(data)[skip:])
                yield framed(stream, data, at)
            if not follow:
                return
            async for stream, data, at in container.follow(cursor, True):
                if until is not None and at > until:
                    return
                if stream in wanted:
                    yield framed(stream, data, at)

        return Streamed(pieces(), RAW if tty else MULTIPLEXED)

    @docker_errors
    async def attach(self, request: Request) -> Answer:
        container = self.find(request.params["id"])
        wanted = _wanted(request)
        cursor = Cursor(0 if request.flag("logs") else container.log.end)
        follow = request.flag("stream")
        tty = bool(container.config.get("Tty"))
        stdin = request.flag("stdin") and bool(container.config.get("OpenStdin"))
        keys = detach.parse(request.arg("detachKeys")) if tty else b""

        async def run(stream: ByteStream) -> None:
            async with stream, anyio.create_task_group() as attached:
                if stdin:
                    ends = attached.cancel_scope
                    attached.start_soon(self._pass_stdin, container, stream, keys, ends)
                async for kind, data, _ in container.follow(cursor, follow):
                    if kind in wanted:
                        await stream.send(data if tty else frame(kind, data))
                attached.cancel_scope.cancel()

        return Hijacked(run, RAW if tty else MULTIPLEXED)

    async def _pass_stdin(
        self, container: Container, stream: ByteStream, keys: bytes, attach: anyio.CancelScope
    ) -> None:
        """An attached client's bytes to the main process's stdin (the run started
        before or after the attach: `docker run -i` attaches first). The client's
        half-close ends that stdin when the container asked StdinOnce, as dockerd does;
        the detach keys (on a terminal) end the attach, and the process runs on."""
        detacher = detach.Detacher(keys) if keys else None
        while True:
            try:
                data = await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError):
                break
            if detacher is not None:
                data, detached = detacher.scan(data)
                if data:
                    await container.send_stdin(data)
                if detached:
                    attach.cancel()
                    return
                continue
            await container.send_stdin(data)
        if container.config.get("StdinOnce"):
            await container.send_stdin(b"")

    @docker_errors
    async def resize(self, request: Request) -> Answer:
        container = self.find(request.params["id"])
        size = terminal_size(request)
        if size is not None:
            container.resize(*size)
        return Reply(200)

    @docker_errors
    async def stop(self, request: Request) -> Answer:
        container = self.find(request.params["id"])
        if container.status != "running":
            return Reply(304)
        await self._end(container)
        return Reply(204)

    @docker_errors
    async def kill(self, request: Request) -> Answer:
        container = self.find(request.params["id"])
        signal = (request.arg("signal") or "KILL").upper().removeprefix("SIG")
        if signal not in ("KILL", "9"):  # not a SIGKILL done instead of what was asked
            raise HttpError(
                400,
                f"signal {request.arg('signal')}: only KILL can be sent to a lazyfs"
                " container's process (the exec server has no other signal to send yet)",
            )
        if container.status != "running":
            raise HttpError(409, f"Container {container.id} is not running")
        await self._end(container)
        return Reply(204)

    async def _end(self, container: Container) -> None:
        """End the main process (SIGKILL to its process group, from the exec server)."""
        if container.adopted:
            raise HttpError(409, f"container {container.name} was not made through Docker's API")
        container.stopped = True
        if self._paused(container):  # the exec server, frozen too, could kill nothing
            await self.agent.set_paused(container.box_id, False)
        if container.main is not None:
            container.main.cancel()
        await container.ended.wait()

    @docker_errors
    async def update(self, request: Request) -> Answer:
        """POST /containers/{id}/update (`docker update`): new limits for its sandbox
        while it runs (Memory, NanoCpus or CpuQuota/CpuPeriod, PidsLimit, CpuShares,
        CpusetCpus; Agent.update_limits); the other settings dockerd updates
        (RestartPolicy, the Blkio ones) are named in the answer's warning, not applied."""
        container = self.find(request.params["id"])
        body = request.json() or {}
        box = self._box(container)
        if box is None:
            raise HttpError(404, f"No such container: {container.id}")
        limits = _limits(body, limits_of(box.record))
        await self.agent.update_limits(box.id, limits)
        container.host_config.update(_shown_limits(limits))
        return json_reply({"Warnings": _not_applied(body)})

    @docker_errors
    async def changes(self, request: Request) -> Answer:
        """GET /containers/{id}/changes (`docker diff`): its sandbox's changes to the
        image's files (Agent.changes), Kind 0 changed, 1 added, 2 deleted; null if none,
        as dockerd answers."""
        container = self.find(request.params["id"])
        box = self._box(container)
        if box is None:
            raise HttpError(404, f"No such container: {container.id}")
        found = await self.agent.changes(box.id)
        return Reply(200, await self.io.run(_diff_json, found))  # big: made off the loop

    @docker_errors
    async def top(self, request: Request) -> Answer:
        """GET /containers/{id}/top (`docker top`): its command's processes
        (lazyfs/agent/top.py); dockerd's 409 if it is not running, its 500 if `ps`
        fails."""
        container = self.find(request.params["id"])
        box = self._box(container)
        if box is None or container.status != "running":
            raise HttpError(409, f"Container {container.id} is not running")
        exec_server = self.agent.settings.exec_server
        ps_args = request.arg("ps_args") or ""
        try:
            # In the pool for a sandbox's files, with its timeout: it reads the
            # sandbox's /etc/passwd (a file its code may have made slow to read) and
            # its processes' command lines; the answer is encoded there too (off the
            # loop: hundreds of rows of 4 KiB).
            shown = await self.io.run(_top_json, box.sandbox, exec_server, ps_args)
        except PsFailed as exc:
            raise HttpError(500, str(exc)) from None
        return Reply(200, shown)

    @docker_errors
    async def rename(self, request: Request) -> Answer:
        container = self.find(request.params["id"])
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
        container = self.find(request.params["id"])
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
        await self._unpublish(container)
        with contextlib.suppress(UnknownSandbox):  # deleted meanwhile (TTL, the agent's API)
            await self.agent.delete(container.box_id)
        self._forget(container)

    def _forget(self, container: Container) -> None:
        self.all.pop(container.box_id, None)
        if container.published is not None:  # its sandbox is gone: they stop by themselves
            container.published.stop()  # too (ports.Published._watch); this is sooner
            container.published = None
        if self.names.by_name.get(container.name) == container.id:
            self.names.drop(container.name)
        container.status = "removing"
        container.removed.set()
        container.log.close()

    @docker_errors
    async def prune(self, request: Request) -> Answer:
        """Remove the containers made here that are not running (created or exited);
        filters `until` (created before) and `label`. SpaceReclaimed: what their
        writable layers held."""
        self.sync()
        filters = _filters(request)
        until = _until(filters.pop("until", []))
        deleted, space = [], 0
        for c in sorted(self.all.values(), key=lambda c: c.created):
            if c.adopted or c.status not in ("created", "exited"):
                continue
            if (until is not None and c.created >= until) or not _matches(c, filters):
                continue
            box = self._box(c)
            if box is not None:
                space += disk_used(box.sandbox.dir)
            await self._remove(c)
            deleted.append(c.id)
        return json_reply({"ContainersDeleted": deleted or None, "SpaceReclaimed": space})

    def _runtime(self, asked: object) -> str:
        """The agent's runtime: the only one a container gets."""
        runtime = os.path.basename(self.agent.config.runtime)
        if asked not in (None, "", runtime):
            raise HttpError(400, f"unknown or invalid runtime name: {asked}")
        return runtime

    async def _make_volumes(self, box: AgentBox, paths: list[str]) -> None:
        """Anonymous volumes (Config.Volumes, the image's VOLUMEs) as directories of the
        sandbox's writable layer, made if missing: they live as long as the container,
        as its files do."""
        if paths:
            await self.io.run(_make_dirs, box.sandbox.rootfs, paths)

    @docker_errors
    async def inspect(self, request: Request) -> Answer:
        container = self.find(request.params["id"])
        box = self._box(container)
        pid = box.sandbox.pid if box is not None and box.sandbox.pid else 0
        argv = container.argv
        return json_reply(
            {
                "Id": container.id,
                "Created": timestamp(container.created),
                "Path": argv[0] if argv else "",
                "Args": argv[1:],
                "State": container.state(pid, self._paused(container)),
                "Image": "sha256:" + container.image_id,
                "Name": "/" + container.name,
                "RestartCount": 0,
                "Driver": "lazyfs",
                "Platform": "linux",
                "MountLabel": "",
                "ProcessLabel": "",
                "AppArmorProfile": "",
                "ExecIDs": container.exec_ids or None,
                "HostConfig": container.host_config,
                "Config": container.config,
                "NetworkSettings": {
                    **NETWORK_SETTINGS,
                    "Ports": ports.port_map(_shown_exposed(container), container.published),
                },
                "Mounts": [],
            }
        )

    @docker_errors
    async def list_containers(self, request: Request) -> Answer:
        self.sync()
        filters = _filters(request)
        show_all = request.flag("all")
        found = []
        for c in sorted(self.all.values(), key=lambda c: -c.created):
            if c.status == "removing" or (not show_all and c.status != "running"):
                continue
            paused = self._paused(c)
            state = "paused" if paused else c.status
            if not _matches(c, filters, state):
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
                    "State": state,
                    "Status": c.status_line(paused),
                    "Ports": ports.port_list(_shown_exposed(c), c.published),
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


def strings(value: object, what: str) -> list[str]:
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
        entrypoint = [] if entrypoint == [""] else strings(entrypoint, "Entrypoint")
        cmd = strings(cmd, "Cmd") if cmd is not None else None
    else:
        entrypoint = info.config.get("Entrypoint")
        cmd = strings(cmd, "Cmd") if cmd else info.config.get("Cmd")
    if not [*(entrypoint or []), *(cmd or [])]:
        raise HttpError(400, "No command specified")
    return entrypoint, cmd


def _env(env: list[str], info: ImageInfo) -> list[str]:
    """The variables to set. A bare NAME (no `=`) in Docker unsets NAME: nothing to do
    unless the image sets it, which a sandbox cannot undo (400)."""
    image = {e.partition("=")[0] for e in info.config.get("Env") or []}
    for name in (e for e in env if "=" not in e):
        if name in image:
            raise HttpError(400, f"Env {name}: unsetting a variable of the image is not supported")
    return [e for e in env if "=" in e]


def _log_config(asked: object) -> dict:
    """The log driver: json-file (or local: the same files), or none; another is not
    there. Its options are kept as given; max-size and max-file size the log."""
    asked = asked if isinstance(asked, dict) else {}
    kind = asked.get("Type") or "json-file"
    if kind not in LOG_DRIVERS:
        raise HttpError(400, f"logger: no log driver named '{kind}' is registered")
    options = asked.get("Config") or {}
    if not isinstance(options, dict):
        raise HttpError(400, "LogConfig.Config must be an object")
    _log_sizes(options)
    return {"Type": kind, "Config": options}


def _log_sizes(options: dict) -> tuple[int, int]:
    """(bytes a log file holds, files kept) from json-file's max-size and max-file; the
    log keeps the newest of its output within them. Unset: 8 MiB and 2 (dockerd keeps
    json-file logs unbounded)."""
    size, files = SEGMENT_BYTES, SEGMENTS
    if "max-size" in options:
        match = re.fullmatch(r"(\d+(?:\.\d+)?) ?([kmgtp]?)i?b?", str(options["max-size"]).lower())
        size = int(float(match[1]) * 1000 ** " kmgtp".index(match[2] or " ")) if match else 0
        if size <= 0:
            raise HttpError(400, f"max-size: {options['max-size']!r} is not a positive size")
    if "max-file" in options:
        value = str(options["max-file"])
        if not is_number(value) or int(value) < 1:
            raise HttpError(400, f"max-file: {value!r}: it cannot be less than 1")
        files = int(value)
    return size, files


def _isolation(asked: object) -> str:
    if asked not in (None, "", "default"):
        raise HttpError(400, f"Invalid isolation: {asked!r} - Linux only supports 'default'")
    return str(asked or "")


def _volumes(asked: object, info: ImageInfo) -> list[str]:
    """The anonymous volumes' paths: the create's Volumes and the image's."""
    paths: list[str] = []
    for given in (asked, info.config.get("Volumes")):
        if given is None:
            continue
        if not isinstance(given, dict):
            raise HttpError(400, "Volumes must be an object")
        for path in given:
            if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
                raise HttpError(
                    400,
                    f'invalid mount config for type "volume": invalid mount path: {path!r}'
                    " mount path must be absolute",
                )
            if path not in paths:
                paths.append(path)
    return paths


def _make_dirs(rootfs: Path, paths: list[str]) -> None:
    with opened_root(rootfs) as root:
        for path in paths:
            os.close(make_dirs(root, path, (0, 0)))


def _top_json(sandbox: Sandbox, exec_server: Path, ps_args: str) -> bytes:
    return json_line(top(sandbox, exec_server, ps_args))


def _group_ids(rootfs: Path, names: list[str]) -> dict[str, str]:
    """GroupAdd's group names -> their gid field in the sandbox's /etc/group (the first
    entry of each name, as docker takes it); names it lacks are left out."""
    text = files.sandbox_db(rootfs, "/etc/group")
    found = {name: db_entry(text, 0, name, least=3) for name in names}
    return {name: fields[2] for name, fields in found.items() if fields is not None}


def _diff_json(found: list[Change]) -> bytes:
    """`docker diff`'s answer: null if nothing changed, as dockerd answers."""
    return json_line([{"Path": c.path, "Kind": DIFF_KINDS[c.kind]} for c in found] or None)


def _until(values: list[str]) -> float | None:
    """A prune's `until`: unix seconds, or a Go duration ago (`10m`, `24h`)."""
    if not values:
        return None
    value = values[-1]
    with contextlib.suppress(ValueError):
        return float(value)
    found = re.fullmatch(r"(\d+(?:\.\d+)?)(s|m|h)", value)
    if not found:
        raise HttpError(400, f"invalid filter 'until={value}'")
    seconds = float(found.group(1)) * {"s": 1, "m": 60, "h": 3600}[found.group(2)]
    return time.time() - seconds


def _tail(value: str | None) -> int | None:
    """`tail`: a number of lines, or all (None)."""
    if value in (None, "", "all"):
        return None
    try:
        n = int(value)
    except ValueError:
        raise HttpError(400, f"tail: {value!r} is not a number") from None
    return None if n < 0 else n


def _moment(request: Request, name: str) -> float | None:
    """`since` or `until`: unix seconds, with a fraction (docker-py, the CLI send that);
    0 or none: no bound."""
    value = request.arg(name)
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        raise HttpError(400, f"{name}: {value!r} is not a unix time") from None
    return seconds or None


def _lines(data: bytes) -> list[bytes]:
    return re.findall(rb"[^\n]*\n|[^\n]+", data)


async def _tail_start(
    log_: Log, end: int, n: int, kept: Callable[[Piece], bool]
) -> tuple[int, int]:
    """Where the last n lines of the kept pieces up to end begin: a record's offset and
    the lines of it to skip. A line may span pieces; the log's unended last line counts
    as one. The log is read through once, holding the last n lines' starts only."""
    if n == 0:
        return end, 0
    starts: deque[tuple[int, int]] = deque(maxlen=n)
    line_ended = True
    async for offset, piece in log_.records(Cursor(), end):
        if not kept(piece):
            continue
        for i, part in enumerate(_lines(piece[1])):
            if line_ended:
                starts.append((offset, i))
            line_ended = part.endswith(b"\n")
    return starts[0] if starts else (end, 0)


def _not_applied(host: dict) -> list[str]:
    """A warning naming the HostConfig settings asked that a sandbox does not apply (the
    create goes on without them, as with the privileges of _not_granted)."""
    asked = []
    for key in NOT_APPLIED:
        value = host.get(key)
        if key == "Mounts" and isinstance(value, list):  # binds refused, tmpfs applied
            value = [m for m in value if (m or {}).get("Type", "bind") not in ("bind", "tmpfs")]
        if value in (None, 0, "", [], {}, False) or value in UNAPPLIED_DEFAULTS.get(key, ()):
            continue
        if key == "RestartPolicy" and isinstance(value, dict) and value.get("Name") in NO_RESTART:
            continue
        asked.append(key)
    if not asked:
        return []
    return [f"{', '.join(asked)}: not applied in a lazyfs sandbox; ignored"]


def _domain_not_applied(body: dict) -> list[str]:
    """A warning for a Domainname asked (docker's --domainname): a sandbox has a
    hostname (Hostname, applied), no NIS domain name."""
    if body.get("Domainname") in (None, ""):
        return []
    return ["Domainname: a sandbox has no domain name; not applied"]


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


def _ulimits(asked: object) -> dict | None:
    """HostConfig.Ulimits ([{Name, Soft, Hard}]) as the agent's ulimits ({name: [soft,
    hard]}; lazyfs/sandbox/ulimits.py checks them)."""
    if not asked:
        return None
    if not isinstance(asked, list) or not all(isinstance(u, dict) for u in asked):
        raise HttpError(400, "HostConfig.Ulimits must be a list of {Name, Soft, Hard}")
    return {u.get("Name"): [u.get("Soft"), u.get("Hard")] for u in asked}


def _tmpfs(host: dict) -> tuple[Tmpfs, ...]:
    """HostConfig.Tmpfs ({path: options}), Mounts of type tmpfs and ShmSize (a tmpfs at
    /dev/shm of that size, over the runtime's 64 MiB), as the agent's."""
    asked = dict(host.get("Tmpfs") or {})
    shm = host.get("ShmSize")
    if shm:
        if not isinstance(shm, int) or isinstance(shm, bool) or shm < 0:
            raise HttpError(400, f"ShmSize {shm!r} is not a number of bytes")
        asked.setdefault("/dev/shm", f"size={shm}")
    for m in host.get("Mounts") or []:
        if not isinstance(m, dict) or m.get("Type") != "tmpfs":
            continue
        target = m.get("Target")
        if not isinstance(target, str) or target in asked:
            raise HttpError(400, f"Mounts: a tmpfs target {target!r} is missing or given twice")
        given = m.get("TmpfsOptions") or {}
        options = [f"size={given['SizeBytes']}"] if given.get("SizeBytes") else []
        mode = given.get("Mode")
        if mode:
            if not isinstance(mode, int) or isinstance(mode, bool):
                raise HttpError(400, f"Mounts: TmpfsOptions.Mode {mode!r} is not a file mode")
            options.append(f"mode={mode:o}")  # os.FileMode, an integer
        if m.get("ReadOnly"):
            options.append("ro")
        asked[target] = ",".join(options)
    return parse_tmpfs(asked, "HostConfig.Tmpfs") if asked else ()


def _network(host: dict) -> bool:
    """NetworkMode host gives the sandbox the node's network (the agent's `network`);
    anything else has only loopback, as every lazyfs sandbox does."""
    mode = host.get("NetworkMode") or "default"
    return mode == "host"


def _limits(host: dict, defaults: Limits) -> Limits:
    """HostConfig's resources (or an update's), over `defaults` for those not asked."""
    memory = host.get("Memory") or None
    cpus = None
    if host.get("NanoCpus"):
        cpus = host["NanoCpus"] / 1e9
    elif host.get("CpuQuota") and host["CpuQuota"] > 0:
        cpus = host["CpuQuota"] / (host.get("CpuPeriod") or 100_000)
    pids = host.get("PidsLimit")
    pids = pids if isinstance(pids, int) and pids > 0 else None
    return parse_limits(
        cpus,
        memory,
        pids,
        None,
        prefix="HostConfig.",
        defaults=defaults,
        cpu_shares=host.get("CpuShares") or None,  # 0 and "": not asked, as dockerd reads them
        cpuset=host.get("CpusetCpus") or None,
    )


def _shown_limits(limits: Limits) -> dict:
    """The HostConfig keys inspect shows for a sandbox's limits."""
    return {
        "Memory": limits.memory or 0,
        "NanoCpus": int((limits.cpus or 0) * 1e9),
        "PidsLimit": limits.pids or 0,
        "CpuShares": limits.cpu_shares or 0,
        "CpusetCpus": limits.cpuset or "",
    }


def _shown_exposed(c: Container) -> list[str]:
    """The exposed ports inspect and ps list (null: not published): while it runs, as
    Docker shows them."""
    return list(c.config.get("ExposedPorts") or {}) if c.status == "running" else []


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


def _matches(c: Container, filters: dict[str, list[str]], state: str | None = None) -> bool:
    """Whether the container passes `docker ps`'s filters; state: as shown (paused)."""
    for key, values in filters.items():
        if key == "name":
            ok = any(re.search(v.removeprefix("/"), c.name) for v in values)
        elif key == "id":
            ok = any(c.id.startswith(v) for v in values)
        elif key == "status":
            ok = (state or c.status) in values
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
