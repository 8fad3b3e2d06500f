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
memory: after the agent restarts, its sandboxes are seen here as such adopted
containers.
"""

from __future__ import annotations

import contextlib
import hashlib
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import islice

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from lazyfs.docker.http import HttpError, Request
from lazyfs.docker.ports import Binding, Published

STDIN, STDOUT, STDERR = 0, 1, 2
STREAMS = {"stdout": STDOUT, "stderr": STDERR}
STDIN_DEPTH = 16  # pieces of stdin queued for the main process before the client waits
LOG_BYTES = 16 * 2**20  # a container's log kept in memory; the oldest goes first past it
# What a piece costs in memory besides its bytes (its tuple, bytes object, float and
# slot, ~130 B in CPython), counted toward LOG_BYTES: a sandbox that writes a byte at a
# time, each its own piece, had its 1 MB of log cost the agent 110 MB.
PIECE_COST = 128


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


Piece = tuple[int, bytes, float]  # (stream, bytes, when it came: unix seconds)


class Log:
    """A container's output as (stream, bytes, time) pieces, with a way to follow it.
    The sandbox decides how its output is cut into pieces (a byte each, if it likes), so
    every step here is O(1) a piece or O(pieces read): a list's pop(0) of the oldest
    piece was O(pieces), and with a million one-byte pieces one 17 MiB write held the
    agent's event loop 57 s."""

    def __init__(self) -> None:
        self.pieces: deque[Piece] = deque()
        self.first = 0  # index of pieces[0] in the whole log (older pieces were dropped)
        self.size = 0  # bytes the pieces cost, PIECE_COST each included
        self.changed = anyio.Event()

    def add(self, stream: int, data: bytes) -> None:
        self.pieces.append((stream, data, time.time()))
        self.size += PIECE_COST + len(data)
        while self.size > LOG_BYTES and len(self.pieces) > 1:
            _, old, _ = self.pieces.popleft()
            self.size -= PIECE_COST + len(old)
            self.first += 1
        self.poke()

    def poke(self) -> None:
        """Wake whoever follows the log."""
        self.changed.set()
        self.changed = anyio.Event()

    @property
    def end(self) -> int:
        return self.first + len(self.pieces)

    def since(self, index: int) -> tuple[list[Piece], int]:
        """The pieces from `index` on (those still kept), and the index after them;
        taken from the newest end, so a follower pays for what is new only."""
        new = self.end - max(index, self.first)
        return list(islice(reversed(self.pieces), max(new, 0)))[::-1], self.end


@dataclass
class Container:
    box_id: str
    name: str  # without Docker's leading "/"
    image: str  # the reference it was created from
    image_id: str
    config: dict  # Docker's Config, with the image's defaults filled in
    host_config: dict
    created: float = field(default_factory=time.time)
    adopted: bool = False  # made through the agent's API: no main process of ours
    status: str = "created"  # created | running | exited | removing
    exit_code: int = 0
    started_at: float | None = None
    finished_at: float | None = None
    error: str = ""
    log: Log = field(default_factory=Log)
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

    async def follow(self, index: int, until_end: bool) -> AsyncIterator[Piece]:
        """The log from piece `index` on; with until_end, also what comes until this
        run ends (waiting for the run to begin if it has not)."""
        ended = self.ended
        while True:
            changed = self.log.changed
            # Before the read: what came before the end is read. A container removed
            # without ever running has no end of its own.
            done = ended.is_set() or self.removed.is_set()
            pieces, index = self.log.since(index)
            for piece in pieces:
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
