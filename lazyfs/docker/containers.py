"""Docker containers as the agent's sandboxes.

A container is one agent sandbox (claimed at create, so a ready pool's sandbox serves
`docker create` at the pool's speed) plus what Docker adds: a name, its create config,
and a main process. The main process is the container's command (Entrypoint + Cmd), run
through the sandbox's exec server when the container starts; its output is the
container's log, and its end is the container's exit. The sandbox outlives it until the
container is removed, so that `docker cp` from an exited container works, as it does
with dockerd.

The container's id is the sha256 of its sandbox's id: a sandbox made through the
agent's own API is the same container here (shown running, named by its sandbox id),
and nothing needs to be kept to map one to the other. What Docker adds is held in
memory, and the log in unlinked files (container_log.py): after the agent restarts, its
sandboxes are seen here as such adopted containers.
"""

from __future__ import annotations

import contextlib
import hashlib
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from lazyfs.docker.container_log import STDERR, STDOUT, Cursor, Log, Piece
from lazyfs.docker.http import HttpError, Request
from lazyfs.docker.ports import Binding, Published

STREAMS = {"stdout": STDOUT, "stderr": STDERR}
STDIN_DEPTH = 16  # pieces of stdin queued for the main process before the client waits


# A container's HostConfig as dockerd shows it when nothing was asked (API 1.44): every
# key is there, so that clients that index it find it. What a create asks and lazyfs
# applies replaces these; what lazyfs does not apply stays as it is here.
DEFAULT_HOST_CONFIG: dict = {
    "Binds": None,
    "ContainerIDFile": "",
    "LogConfig": {"Type": "json-file", "Config": {}},
    "NetworkMode": "default",
    "PortBindings": {},
    "RestartPolicy": {"Name": "no", "MaximumRetryCount": 0},
    "AutoRemove": False,
    "VolumeDriver": "",
    "VolumesFrom": None,
    "ConsoleSize": [0, 0],
    "CapAdd": None,
    "CapDrop": None,
    "CgroupnsMode": "host",  # a sandbox has no cgroup namespace of its own
    "Dns": [],
    "DnsOptions": [],
    "DnsSearch": [],
    "ExtraHosts": None,
    "GroupAdd": None,
    "IpcMode": "private",
    "Cgroup": "",
    "Links": None,
    "OomScoreAdj": 0,
    "PidMode": "",
    "Privileged": False,
    "PublishAllPorts": False,
    "ReadonlyRootfs": False,
    "SecurityOpt": None,
    "UTSMode": "",
    "UsernsMode": "",
    "ShmSize": 67108864,
    "Runtime": "runc",
    "Isolation": "",
    "CpuShares": 0,
    "Memory": 0,
    "NanoCpus": 0,
    "CgroupParent": "",
    "BlkioWeight": 0,
    "BlkioWeightDevice": [],
    "BlkioDeviceReadBps": [],
    "BlkioDeviceWriteBps": [],
    "BlkioDeviceReadIOps": [],
    "BlkioDeviceWriteIOps": [],
    "CpuPeriod": 0,
    "CpuQuota": 0,
    "CpuRealtimePeriod": 0,
    "CpuRealtimeRuntime": 0,
    "CpusetCpus": "",
    "CpusetMems": "",
    "Devices": [],
    "DeviceCgroupRules": None,
    "DeviceRequests": None,
    "MemoryReservation": 0,
    "MemorySwap": 0,
    "MemorySwappiness": None,
    "OomKillDisable": False,
    "PidsLimit": None,
    "Ulimits": None,
    "CpuCount": 0,
    "CpuPercent": 0,
    "IOMaximumIOps": 0,
    "IOMaximumBandwidth": 0,
}


def container_id(box_id: str) -> str:
    return hashlib.sha256(box_id.encode()).hexdigest()


def frame(stream: int, data: bytes) -> bytes:
    """Docker's multiplexed-stream frame: stream, three zero bytes, big-endian size."""
    return bytes([stream, 0, 0, 0]) + len(data).to_bytes(4, "big") + data


def terminal_size(request: Request) -> tuple[int, int] | None:
    """(rows, columns) from a resize's h and w (containers' and execs'); None if either
    is missing, 0 or past a terminal's 16 bits."""
    rows, columns = request.number("h", 0) or 0, request.number("w", 0) or 0
    if not 0 < rows < 65536 or not 0 < columns < 65536:
        return None
    return rows, columns


def timestamp(seconds: float | None) -> str:
    """RFC 3339 with nanoseconds, as dockerd writes it; Docker's zero time for None."""
    if not seconds:
        return "0001-01-01T00:00:00Z"
    moment = datetime.fromtimestamp(seconds, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond:06d}000Z"


@dataclass
class Container:
    box_id: str
    name: str  # without Docker's leading "/"
    image: str  # the reference it was created from
    image_id: str
    config: dict  # Docker's Config, with the image's defaults filled in
    host_config: dict
    log: Log  # its main process's output (container_log.py)
    created: float = field(default_factory=time.time)
    adopted: bool = False  # made through the agent's API: no main process of ours
    status: str = "created"  # created | running | exited | removing
    exit_code: int = 0
    started_at: float | None = None
    finished_at: float | None = None
    error: str = ""
    main: anyio.CancelScope | None = None
    stopped: bool = False  # ended by stop or kill: its exit code is the signal's
    restarting: bool = False  # ended by a restart: not auto-removed
    ended: anyio.Event = field(default_factory=anyio.Event)  # this run's end
    removed: anyio.Event = field(default_factory=anyio.Event)
    exec_ids: list[str] = field(default_factory=list)
    # The main process's stdin and terminal size (Tty or OpenStdin), while it runs: what
    # an attach before the start sends waits in `stdin_ready` for the run to begin.
    stdin: MemoryObjectSendStream[bytes | tuple[int, int]] | None = None
    stdin_ready: anyio.Event = field(default_factory=anyio.Event)
    size: tuple[int, int] | None = None  # its terminal's, as last asked
    user: tuple[int, int, list[int]] | None = None  # its User: None, the sandbox's own
    ports: list[Binding] = field(default_factory=list)  # to publish (ports.py)
    published: Published | None = None  # while they listen

    @property
    def id(self) -> str:
        return container_id(self.box_id)

    @property
    def argv(self) -> list[str]:
        return [*(self.config.get("Entrypoint") or []), *(self.config.get("Cmd") or [])]

    def begin(self) -> None:
        self.status = "running"
        self.started_at = time.time()
        self.finished_at = None
        self.exit_code = 0
        self.stopped = False
        if self.ended.is_set():  # started again: a new run (an attach before start waits
            self.ended = anyio.Event()  # on the first one's event)

    def open_stdin(self) -> MemoryObjectReceiveStream[bytes | tuple[int, int]]:
        """A new run's stdin: its receiving end, for the exec request. A size asked
        before the run began (the CLI resizes as it starts the container) goes first."""
        self.stdin, fed = anyio.create_memory_object_stream[bytes | tuple[int, int]](STDIN_DEPTH)
        if self.size is not None:
            self.stdin.send_nowait(self.size)
        self.stdin_ready.set()
        return fed

    def close_stdin(self) -> None:
        if self.stdin is not None:
            self.stdin.close()
        self.stdin = None
        self.stdin_ready = anyio.Event()

    async def send_stdin(self, data: bytes) -> None:
        """To the main process's stdin (b"": its end); dropped once the run is over."""
        await self.stdin_ready.wait()
        if self.stdin is not None:
            with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
                await self.stdin.send(data)

    def resize(self, rows: int, columns: int) -> None:
        self.size = (rows, columns)
        if self.stdin is not None:
            with contextlib.suppress(anyio.WouldBlock, anyio.ClosedResourceError):
                self.stdin.send_nowait((rows, columns))

    def finish(self, code: int, error: str = "") -> None:
        self.status = "exited"
        self.exit_code = code
        self.error = error
        self.finished_at = time.time()
        self.main = None
        self.ended.set()
        self.log.poke()

    def state(self, pid: int, paused: bool = False) -> dict:
        """Inspect's State; `paused`: its sandbox is (a running container only)."""
        running = self.status == "running"
        paused = paused and running
        return {
            "Status": "paused" if paused else self.status,
            "Running": running,
            "Paused": paused,
            "Restarting": False,
            "OOMKilled": False,
            "Dead": False,
            "Pid": pid if running else 0,
            "ExitCode": self.exit_code,
            "Error": self.error,
            "StartedAt": timestamp(self.started_at),
            "FinishedAt": timestamp(self.finished_at),
        }

    def status_line(self, paused: bool = False) -> str:
        """`docker ps`'s STATUS column."""
        if self.status == "running":
            return f"Up {_ago(self.started_at)}" + (" (Paused)" if paused else "")
        if self.status == "exited":
            return f"Exited ({self.exit_code}) {_ago(self.finished_at)} ago"
        return self.status.capitalize()

    async def follow(self, cursor: Cursor, until_end: bool) -> AsyncIterator[Piece]:
        """The log from the cursor on; with until_end, also what comes until this run
        ends (waiting for the run to begin if it has not)."""
        ended = self.ended
        while True:
            changed = self.log.changed
            # Before the read: what came before the end is read. A container removed
            # without ever running has no end of its own.
            done = ended.is_set() or self.removed.is_set()
            async for _, piece in self.log.records(cursor, self.log.end):
                yield piece
            if not until_end or done:
                return
            await changed.wait()


def _ago(since: float | None) -> str:
    seconds = time.time() - (since or time.time())
    for unit, size in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if seconds >= 2 * size:
            return f"{int(seconds // size)} {unit}"
    return "Less than a second" if seconds < 1 else f"{int(seconds)} seconds"


def new_name() -> str:
    return "lazyfs_" + secrets.token_hex(4)


class Names:
    """Container names, unique, as Docker keeps them."""

    def __init__(self) -> None:
        self.by_name: dict[str, str] = {}  # name -> container id

    def claim(self, name: str, cid: str) -> None:
        held = self.by_name.get(name)
        if held is not None and held != cid:
            raise HttpError(
                409,
                f'Conflict. The container name "/{name}" is already in use by container'
                f' "{held}". You have to remove (or rename) that container to be able to'
                " reuse that name.",
            )
        self.by_name[name] = cid

    def drop(self, name: str) -> None:
        self.by_name.pop(name, None)
