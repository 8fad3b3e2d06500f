"""The agent's sandboxes: making them (cold or from a warm pool), running commands in
them, TTLs, deleting them, and finding them again after a restart.

A sandbox here is lazyfs.sandbox.runtime's `Sandbox` whose PID 1 is the exec server, a
static binary from the host (exec_server.c), so that it can run many commands, each with
one fork+exec (execute.py; `runtime exec` when the server does not answer). Its listening
socket is made here, on the host, and handed to it as fd 3: the sandbox cannot reach it.
The blocking parts (mounting, the runtime's create/start/delete) run in
threads under one CapacityLimiter; the event loop only keeps the books.

Image trees: one `TreeHold` per image for as long as the agent has a sandbox of it, plus
LAZYFS_AGENT_LINGER seconds, so that create/delete cycles do not remount.

Pools: per image a target number of sandboxes prepared up to just before their first
command ("ready"): overlay mounted, container created and started (its exec server's
socket listens from before the start: a first command waits in its backlog until the
server accepts, so nothing is waited for at the claim). A claim without
--network takes one, so it is bookkeeping (and cgroup writes if it sets limits; env is
given to each exec), and its first command is one exec-server round trip. Otherwise, or
when the pool is empty, a sandbox is made cold. One background task refills pools one
sandbox at a time, so cold claims still get threads; a pooled sandbox whose PID 1 (and
its exec server) ended is dropped, never handed out. A pool's warm-up command runs
once per image before its first sandbox is ready (see _warm_up).

Restart: records.py keeps each sandbox's record on disk. On start, running sandboxes
whose owner died (their lock is free), whose container still runs and whose image tree
is this agent's (the same cache and store: image_mounts.py, the key) are adopted; the
rest are cleaned up and reported in /health. Pooled ones are cleaned up too, though
their containers run: the new agent's pools may differ, and their PID 1 is no longer
its child, so it could not tell a dead exec server before handing one out; a refill
costs a fraction of a second. So is a sandbox on another key's tree: that tree is
served from a cache this agent was not given (maybe deleted since), and the agent would
hold a tree of its own key that the sandbox does not use.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.lowlevel
from anyio.abc import TaskGroup

from chunker.backends import open_store
from chunker.errors import BadInputError, LazyfsError, StoreError
from chunker.manifest import Manifest
from lazyfs.agent.errors import (
    AgentBusy,
    AtCapacity,
    SandboxExited,
    SandboxLost,
    UnknownSandbox,
)
from lazyfs.agent.execute import (
    SOCKET_NAME,
    Emit,
    ExecRequest,
    ExecResult,
    ExecTarget,
    ServerBroke,
    execute,
    listen,
)
from lazyfs.agent.records import BoxRecord, Records
from lazyfs.host_dirs import secure_node_dirs
from lazyfs.oom import refused_message, set_oom_score_adj
from lazyfs.sandbox.limits import cap_sandboxes
from lazyfs.sandbox.oci_spec import DEFAULT_PIDS, Limits
from lazyfs.sandbox.process import merge_env
from lazyfs.sandbox.runtime import (
    RuntimeFailed,
    Sandbox,
    SandboxHost,
    SandboxRequest,
    cleanup_stale,
    find_runtime,
)
from lazyfs.settings import Settings
from lazyfs.tree.image_mounts import (
    KEY_CHARS,
    DataDaemonHold,
    ImageMounts,
    TreeHold,
    tree_kind,
    unmount,
)
from lazyfs.tree.node_files import cached_manifest

log = logging.getLogger("lazyfs.agent")
SERVER_PATH = "/dev/lazyfs-exec"  # in the sandbox: the exec server, bound read-only
SERVER_COMMAND = [SERVER_PATH]  # PID 1; its socket is fd 3 (execute.listen)
THREADS = 4  # blocking sandbox work at once (2 cores here: more only queues in the kernel)
TICK = 0.25  # seconds between TTL / linger checks
DAEMON_CHECK = 2.0  # seconds between checks that the held node data daemon is still up
IMAGE_FRESH = 10.0  # seconds an image name's lookup is used as it is
IMAGE_STALE = 60.0  # ... and then while it is looked up again in the background
REFILL_BACKOFF = 2.0  # seconds before retrying a pool whose sandbox failed to make
# Seconds a sandbox lives when its client sets no ttl (`lazyfs serve --default-ttl`): a
# sandbox whose client crashed or went away holds a --max-sandboxes slot, its memory and
# its disk until then. An hour is 6x the longest command a pool's warm-up may run and
# far above a task's rollout (seconds to minutes), so a client that forgets ttl loses
# nothing it was still using; one that needs longer sets ttl.
DEFAULT_TTL = 3600.0
WARMUP_TIMEOUT = 600.0  # seconds a pool's warm-up command may run
# Pool fills and warm-ups run at this niceness (the runtime and the sandbox's processes;
# a claim sets its sandbox back to 0), so that on a small node a refill, which starts
# right after a claim, does not slow the claimed sandbox's first commands: here a
# `runc create` + start and the exec server's start are ~100 ms of CPU beside a 3 ms exec.
BACKGROUND_NICE = 10
# ... and a refill does not start while a sandbox just handed out runs its first command,
# for up to Settings.refill_defer (LAZYFS_REFILL_DEFER, 0.1 s) after the claim. Niceness
# does not keep a refill's `runc create` from slowing that command: measured on 2 cores,
# claim + `python3 -c print` took 31-47 ms with the refill right after the claim and
# 21-27 ms with the refill's `runc create` 0.1 s later, while nice 10, a low cgroup CPU
# weight for the pooled sandbox, or the runtime's process in a low-weight cgroup changed
# nothing (docs/design-changes.md, 2026-12-01). A claim's first command is often short
# (a python3 or shell start-up); a longer one overlaps the refill after that, where its
# few ms matter less.


@dataclass
class AgentConfig:
    store_url: str
    cache_dir: Path
    runtime: str = "runc"
    max_sandboxes: int = 100
    pools: dict[str, int] = field(default_factory=dict)  # image -> target size
    warmups: dict[str, list[str]] = field(default_factory=dict)  # image -> warm-up argv
    # What a create does not ask for (serve's --memory, --pids, --disk, --cpus); pooled
    # sandboxes are made with them, and a claim's own limits are written at the claim.
    defaults: Limits = field(default_factory=Limits)
    default_ttl: float | None = DEFAULT_TTL  # seconds; None: a sandbox lives until deleted


@dataclass
class ImageInfo:
    name: str
    image_id: str
    config: dict  # the OCI image config's "config"


@dataclass
class AgentBox:
    sandbox: Sandbox
    record: BoxRecord
    target: ExecTarget
    # "ready" (pooled, started, not handed out) | "warmup" (running a pool's warm-up) |
    # "running" | "exited" (its PID 1 ended) | "deleting"
    state: str
    execs: int = 0

    def view(self) -> dict:
        r = self.record
        return {
            "id": r.id,
            "image": r.image,
            "image_id": r.image_id,
            "state": self.state,
            "created": r.created,
            "expires": r.expires,
            "from_pool": r.from_pool,
            "limits": {"cpus": r.cpus, "memory": r.memory, "pids": r.pids, "disk": r.disk},
            "network": r.network,
            "execs": self.execs,
        }


@dataclass
class Pool:
    image: ImageInfo
    target: int
    ready: deque[AgentBox] = field(default_factory=deque)
    creating: int = 0
    failures: int = 0
    last_error: str | None = None
    warmup: list[str] = field(default_factory=list)  # argv; [] for none
    warmed: dict | None = None  # the warm-up's {"exit_code", "seconds"} once it ran

    def view(self) -> dict:
        return {
            "image": self.image.name,
            "image_id": self.image.image_id,
            "target": self.target,
            "ready": len(self.ready),
            "creating": self.creating,
            "failures": self.failures,
            "last_error": self.last_error,
            "warmup": self.warmup,
            "warmed": self.warmed,
        }


@dataclass
class _Tree:
    hold: TreeHold
    users: int = 0
    idle_since: float | None = None


class Agent:
    def __init__(self, config: AgentConfig, settings: Settings) -> None:
        self.config = config
        self.settings = settings
        self.host = SandboxHost.of(settings)  # where its sandboxes live
        self.runtime = find_runtime(config.runtime)
        if not os.access(self.settings.exec_server, os.X_OK):
            raise BadInputError(
                f"the exec server {self.settings.exec_server} is missing: installing lazyfs"
                " (scripts/setup.sh, or pip) builds it; or set LAZYFS_EXEC_SERVER to where it is"
            )
        self.mounts = ImageMounts(config.store_url, config.cache_dir, self.settings)
        self.records = Records(self.settings.run_dir)
        self.boxes: dict[str, AgentBox] = {}
        self.pools: dict[str, Pool] = {}  # by image id
        self.trees: dict[str, _Tree] = {}
        self.tree_locks: dict[str, anyio.Lock] = {}
        self.images: dict[str, tuple[float, ImageInfo]] = {}
        self.limiter = anyio.CapacityLimiter(THREADS)
        self.creating = 0
        self.lost: dict[str, str] = {}  # id -> why, for sandboxes a restart could not keep
        self.adopted: list[str] = []
        self.started = time.time()
        self._refill_wake = anyio.Event()
        # Sandboxes handed out whose first command has not ended: id -> until when (the
        # event loop's clock) refills wait for it; _first_done is set when one ends or goes.
        self._first_commands: dict[str, float] = {}
        self._first_done = anyio.Event()
        self._tasks: TaskGroup | None = None
        self._refreshing: set[str] = set()  # image names being looked up again
        self._lock_file = None
        self._daemon_hold: DataDaemonHold | None = None
        self._daemon_check_at = 0.0
        self.on_claim: Callable[[str, float], None] = lambda source, seconds: None
        self.on_exec: Callable[[ExecResult], None] = lambda result: None

    # ------------------------------------------------------------------ life

    async def prepare(self) -> None:
        """Take the run directory, recover from a previous agent, set the pools (an
        unknown image fails here, before anything serves). The node's private directories
        and its cap on all sandboxes are set first (lazyfs/host_dirs.py, lazyfs/sandbox/limits.py),
        and the agent's OOM bias (lazyfs/oom.py), which the data daemon it starts inherits."""
        secure_node_dirs(self.settings)
        self._take_run_dir()
        cap_sandboxes(self.settings)
        if not set_oom_score_adj():
            log.warning("%s", refused_message("the agent"))
        await anyio.to_thread.run_sync(self._recover)
        await anyio.to_thread.run_sync(self._hold_data_daemon)
        for image, size in self.config.pools.items():
            await self.set_pool(image, size, self.config.warmups.get(image))

    def start(self, tasks: TaskGroup) -> None:
        """The background tasks: pool refills, TTLs, idle trees."""
        self._tasks = tasks
        tasks.start_soon(self._refill_loop)
        tasks.start_soon(self._tick_loop)

    def _hold_data_daemon(self) -> None:
        """Start the node data daemon now and keep it up while the agent runs, so that
        no cold create waits for its start (issue 12; image_mounts.py, "Keeping the data
        daemon up"). If it cannot start now, the first EROFS mount tries again."""
        self._daemon_hold = self.mounts.keep_data_daemon()

    def _take_run_dir(self) -> None:
        path = self.settings.run_dir / "agent" / "lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(path, "a+b")  # noqa: SIM115 - held for the agent's life
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise AgentBusy(f"another agent already serves {self.settings.run_dir}") from None

    async def shutdown(self) -> None:
        """Delete every sandbox and release every tree (SIGTERM: a clean stop)."""
        with anyio.CancelScope(shield=True):
            for pool in self.pools.values():
                pool.target = 0
            for box_id in list(self.boxes):
                with contextlib.suppress(LazyfsError):
                    await self.delete(box_id)
            for image_id in list(self.trees):
                tree = self.trees.pop(image_id)
                await anyio.to_thread.run_sync(tree.hold.release, 0.0)
            if self._daemon_hold is not None:  # the data daemon's idle exit applies again
                self._daemon_hold.release()
                self._daemon_hold = None

    # ------------------------------------------------------------------ restart

    def _recover(self) -> None:
        """Adopt the running sandboxes of a dead agent; clean up everything else."""
        for record in self.records.load_all():
            reason = self._adopt(record)
            if reason is None:
                self.adopted.append(record.id)
                log.info("adopted sandbox %s (%s)", record.id, record.image)
            else:
                self.lost[record.id] = reason
                self.records.remove(record.id)
        for box_id in cleanup_stale(self.host):
            self.lost.setdefault(box_id, "its agent died; cleaned up")
        self._unmount_unused_trees()
        if self.lost:
            log.info("cleaned up %d sandboxes of a previous agent", len(self.lost))

    def _adopt(self, record: BoxRecord) -> str | None:
        """None if the sandbox is ours again, else why not (it is then left to
        cleanup_stale)."""
        if record.state != "running":
            return "a pooled sandbox of a previous agent; cleaned up"
        lock_path = self.host.sandbox_dir / f"{record.id}.lock"
        try:
            fd = os.open(lock_path, os.O_RDWR)
        except FileNotFoundError:
            return "gone before the agent restarted"
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return "owned by another process"
        box = Sandbox(record.id, record.runtime, self.host, fd)
        if record.tree != str(self.mounts.tree_path(record.image_id)):
            box.delete()
            return "its image tree is another cache's or store's; cleaned up"
        status = _runtime_status(box)
        if status != "running":
            box.delete()
            return f"its container was {status or 'gone'} after the restart; cleaned up"
        try:
            hold = self.mounts.hold(record.image_id)
        except (LazyfsError, OSError) as exc:
            box.delete()
            return f"its image could not be mounted again ({exc}); cleaned up"
        tree = self.trees.get(record.image_id)
        if tree is None:
            self.trees[record.image_id] = _Tree(hold, users=1)
        else:
            hold.release()  # the agent holds each tree once
            tree.users += 1
        self.boxes[record.id] = AgentBox(box, record, self._target(box, record), "running")
        return None

    def _unmount_unused_trees(self) -> None:
        """Unmount the image trees nobody holds (a dead agent's holds died with it): the
        last-user step of image_mounts' protocol, done for the users that are gone.

        Every key's (RUN_DIR/images/<key>/), not only ours: the trees of a previous agent
        with another cache or store would otherwise stay mounted for good, and keep their
        data daemon up, once its sandboxes are cleaned up (_adopt); a tree in use is
        held, so it is left alone. Also trees from before trees were keyed
        (RUN_DIR/images/<image id>)."""
        images = self.settings.run_dir / "images"
        if not images.is_dir():
            return
        keys = [d for d in images.iterdir() if len(d.name) == KEY_CHARS]  # not a tree
        for lock_path in [*images.glob("*.lock"), *(p for d in keys for p in d.glob("*.lock"))]:
            if lock_path.name.endswith(".mount.lock"):
                continue
            point = lock_path.with_name(lock_path.name.removesuffix(".lock"))
            with open(lock_path, "a+b") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # in use
                if tree_kind(point) is not None:
                    unmount(point)

    # ------------------------------------------------------------------ images

    async def image(self, name: str) -> ImageInfo:
        """The image's id and config, cached IMAGE_FRESH seconds (a name can be converted
        again). Past that, a claim is answered from the cache while a background task
        looks the name up again (a lookup is a thread hop and store reads: milliseconds
        that a warm claim must not pay), up to IMAGE_STALE seconds."""
        cached = self.images.get(name)
        if cached:
            age = time.monotonic() - cached[0]
            if age < IMAGE_FRESH:
                return cached[1]
            if age < IMAGE_STALE and self._tasks is not None:
                if name not in self._refreshing:
                    self._refreshing.add(name)
                    self._tasks.start_soon(self._refresh_image, name)
                return cached[1]
        try:
            info = await self._load_image_in_time(name)
        except StoreError as exc:
            if cached is None:
                raise
            # The store is down, but the name was known: its sandboxes still run from the
            # node (tree mounted, chunks cached), so an outage does not stop them.
            log.warning("image %s: %s; using what it named before", name, exc)
            return cached[1]
        self.images[name] = (time.monotonic(), info)
        return info

    async def _refresh_image(self, name: str) -> None:
        try:
            info = await self._load_image_in_time(name)
            self.images[name] = (time.monotonic(), info)
        except StoreError as exc:  # kept: image() uses it while the store is down
            log.warning("image %s: looking it up again failed: %s", name, exc)
        except (LazyfsError, OSError) as exc:  # e.g. the name is gone: the next claim says so
            log.warning("image %s: looking it up again failed: %s", name, exc)
            self.images.pop(name, None)
        finally:
            self._refreshing.discard(name)

    async def _load_image_in_time(self, name: str) -> ImageInfo:
        """_load_image, or StoreError once LAZYFS_FETCH_TIMEOUT passes: a store that
        accepts connections and never answers would otherwise hold the create for the
        client's read timeout (30 s) and more. The abandoned thread ends by itself; it
        runs outside self.limiter so that it does not hold a slot of sandbox work."""
        timeout = self.settings.cache.fetch_timeout
        with anyio.move_on_after(timeout):
            return await anyio.to_thread.run_sync(self._load_image, name, abandon_on_cancel=True)
        raise StoreError(
            f"the store did not answer within {timeout:g} s (LAZYFS_FETCH_TIMEOUT)"
            f" while looking up image {name!r}"
        )

    def _load_image(self, name: str) -> ImageInfo:
        image_id = self.mounts.resolve(name)
        store = open_store(self.config.store_url)
        try:
            manifest = Manifest(cached_manifest(store, image_id, self.config.cache_dir))
            try:
                config = manifest.config.get("config") or {}
            finally:
                manifest.close()
        finally:
            store.close()
        return ImageInfo(name, image_id, config)

    async def _hold(self, image_id: str) -> Path:
        lock = self.tree_locks.setdefault(image_id, anyio.Lock())
        async with lock:
            tree = self.trees.get(image_id)
            if tree is None:
                hold = await anyio.to_thread.run_sync(self.mounts.hold, image_id)
                tree = self.trees[image_id] = _Tree(hold)
            else:
                await anyio.to_thread.run_sync(tree.hold.ensure)
            tree.users += 1
            tree.idle_since = None
            return tree.hold.path

    def _unhold(self, image_id: str) -> None:
        tree = self.trees.get(image_id)
        if tree is not None:
            tree.users -= 1
            if tree.users <= 0:
                tree.idle_since = time.monotonic()

    # ------------------------------------------------------------------ making

    def total(self) -> int:
        return len(self.boxes) + self.creating

    async def create(
        self,
        image: str,
        env: list[str] | None = None,
        limits: Limits | None = None,
        ttl: float | None = None,
        network: bool = False,
    ) -> AgentBox:
        """A running sandbox: from the image's pool if it has a ready one and the
        request fits it, else made now. `ttl` None: the agent's default_ttl.

        Cancelled (the agent stops), it leaves nothing: what was made or claimed is
        deleted (a create whose client hung up is undone by the API once it is done:
        lazyfs/agent/api.py). A cancel that comes while a thread does the runtime's work waits for
        that thread (anyio's to_thread shields it) and is delivered at the checkpoint
        below, so the sandbox the thread made is deleted too."""
        t0 = time.perf_counter()
        env = env or []
        merge_env([], env, None)  # KEY=VALUE, before any work
        limits = limits or self.config.defaults
        if ttl is not None and not ttl > 0:
            raise BadInputError(f"ttl {ttl!r} must be a positive number of seconds")
        info = await self.image(image)
        t_image = time.perf_counter() - t0
        box = await self._take_from_pool(info, network)
        source = "pool" if box is not None else "cold"
        try:
            if box is None:
                await self._make_room()
                box = await self._make(info, limits, network, env)
                # Where a cold claim's time goes (bench/agent_bench.py reads this line).
                times = {"image": t_image, **box.sandbox.timings}
                log.info(
                    "sandbox %s: made cold in %.3f s (%s)",
                    box.record.id,
                    time.perf_counter() - t0,
                    ", ".join(f"{k} {v:.3f}" for k, v in times.items()),
                )
            else:  # started, its exec server PID 1: only what the request adds
                box.record.env = env
                box.target.box_env = env
                await self._claim_limits(box, limits)
            await anyio.lowlevel.checkpoint_if_cancelled()
        except BaseException as exc:
            if box is not None:
                if isinstance(exc, anyio.get_cancelled_exc_class()):
                    log.info("sandbox %s: create cancelled; deleting it", box.record.id)
                await self._remove(box)
            raise
        box.state = box.record.state = "running"
        box.record.from_pool = source == "pool"
        if self.settings.refill_defer > 0:
            self._first_commands[box.record.id] = anyio.current_time() + self.settings.refill_defer
        ttl = ttl if ttl is not None else self.config.default_ttl
        if ttl is not None:
            box.record.expires = time.time() + ttl
        self.records.save(box.record)
        self.on_claim(source, time.perf_counter() - t0)
        return box

    async def _claim_limits(self, box: AgentBox, limits: Limits) -> None:
        """Give a pooled sandbox (made with the defaults) a claim's other limits."""
        pooled = self.config.defaults
        if (limits.cpus, limits.memory, limits.pids) != (pooled.cpus, pooled.memory, pooled.pids):
            # cgroup file writes (no runtime binary): 0.2 ms, but a memory
            # limit below what is used makes the kernel reclaim first.
            await anyio.to_thread.run_sync(box.sandbox.update_limits, limits, limiter=self.limiter)
            box.record.cpus, box.record.memory = limits.cpus, limits.memory
            box.record.pids = limits.pids if limits.pids != DEFAULT_PIDS else None
        if limits.disk != pooled.disk:  # a remount of its tmpfs: ~0.1 ms
            await anyio.to_thread.run_sync(box.sandbox.resize_disk, limits, limiter=self.limiter)
            box.record.disk = limits.disk

    async def _take_from_pool(self, info: ImageInfo, network: bool) -> AgentBox | None:
        """A ready sandbox of the image whose PID 1 still runs. Any env and limits fit
        (env is given to each command; limits are written to its cgroups); network does
        not (a pooled sandbox has its own namespace already)."""
        pool = self.pools.get(info.image_id)
        if pool is None or network:
            return None
        while pool.ready:
            box = pool.ready.popleft()
            self._poke()  # refill
            _check_init(box)
            if box.state == "ready":  # PID 1, the server, runs: its socket listens
                return box
            await self._drop_pooled(pool, box)
        return None

    async def _drop_pooled(self, pool: Pool, box: AgentBox) -> None:
        """A pooled sandbox that can no longer serve (its PID 1, the exec server, ended)."""
        why = f"its PID 1 exited (status {box.sandbox.exit_status})"
        log.warning("pool %s: sandbox %s %s; replaced", pool.image.name, box.record.id, why)
        pool.failures += 1
        pool.last_error = f"sandbox {box.record.id}: {why}"
        with contextlib.suppress(LazyfsError):
            await self._remove(box)

    async def _make_room(self) -> None:
        """At --max-sandboxes: give up a ready pooled sandbox for this claim, or refuse."""
        if self.total() < self.config.max_sandboxes:
            return
        if any(p.creating for p in self.pools.values()):
            return  # a refill is taking the last slot: it gives way when it is made
        for pool in sorted(self.pools.values(), key=lambda p: -len(p.ready)):
            if pool.ready:
                await self._remove(pool.ready.pop())
                return
        raise AtCapacity(
            f"the node holds {self.total()} sandboxes, its limit (--max-sandboxes"
            f" {self.config.max_sandboxes}); delete some or retry later"
        )

    async def _make(
        self,
        info: ImageInfo,
        limits: Limits,
        network: bool,
        env: list[str],
        pooled: bool = False,
        background: bool = False,
    ) -> AgentBox:
        """Prepared and started (`runtime run --detach`), in one thread job: with the
        create and the start as separate jobs, a burst's starts queued behind all its
        creates, and every created container waited in `runc init` (10 MB each) meanwhile.
        `background` (pool fills and warm-ups): the runtime and the container's
        processes at BACKGROUND_NICE. The exec server's socket listens before the
        runtime starts (execute.listen), so the sandbox takes commands once made."""
        self.creating += 1
        t0 = time.perf_counter()
        try:
            lower = await self._hold(info.image_id)
            t_tree = time.perf_counter() - t0
            try:

                def build() -> Sandbox:
                    request = SandboxRequest(
                        info.config,
                        SERVER_COMMAND,
                        [],
                        None,
                        limits,
                        network,
                        self.runtime,
                        helper=(str(self.settings.exec_server), SERVER_PATH),
                        init=False,  # the server is PID 1 itself (exec_server.c)
                    )
                    sandbox = Sandbox.prepare(lower, request, self.host)
                    try:
                        # Only the server keeps the socket: once it is gone, a connect
                        # is refused at once rather than queued for ever.
                        with listen(sandbox.dir) as server:
                            nice = BACKGROUND_NICE if background else 0
                            sandbox.run_detached(nice, fd3=server.fileno())
                    except BaseException:
                        sandbox.delete()
                        raise
                    return sandbox

                sandbox = await anyio.to_thread.run_sync(build, limiter=self.limiter)
            except BaseException:
                self._unhold(info.image_id)
                raise
            sandbox.timings = {"tree": t_tree, **sandbox.timings}
        finally:
            self.creating -= 1
        process = json.loads((sandbox.dir / "config.json").read_text())["process"]
        record = BoxRecord(
            id=sandbox.id,
            image=info.name,
            image_id=info.image_id,
            state="ready",
            runtime=self.runtime,
            created=time.time(),
            env=env,
            process_env=process.get("env", []),
            cwd=process.get("cwd", "/"),
            uid=process.get("user", {}).get("uid", 0),
            gid=process.get("user", {}).get("gid", 0),
            cpus=limits.cpus,
            memory=limits.memory,
            pids=limits.pids if limits.pids != DEFAULT_PIDS else None,
            disk=limits.disk,
            network=network,
            from_pool=pooled,
            tree=str(lower),
        )
        box = AgentBox(sandbox, record, self._target(sandbox, record), "ready")
        self.boxes[sandbox.id] = box
        self.records.save(record)
        return box

    def _target(self, sandbox: Sandbox, record: BoxRecord) -> ExecTarget:
        return ExecTarget(
            sandbox.id,
            record.runtime,
            sandbox.state,
            sandbox.rootfs,
            record.process_env,
            record.cwd,
            sandbox.dir / SOCKET_NAME,
            box_env=record.env,
        )

    # ------------------------------------------------------------------ using

    def get(self, box_id: str) -> AgentBox:
        box = self.boxes.get(box_id)
        if box is None or box.state == "deleting":
            if box_id in self.lost:
                raise SandboxLost(f"sandbox {box_id}: {self.lost[box_id]}")
            raise UnknownSandbox(f"no sandbox {box_id!r} on this agent")
        return box

    def running(self, box_id: str) -> AgentBox:
        box = self.get(box_id)
        _check_init(box)
        if box.state == "exited":
            raise SandboxExited(
                f"sandbox {box_id}: its PID 1 exited (status {box.sandbox.exit_status});"
                " it runs nothing more, delete it"
            )
        if box.state != "running":
            raise UnknownSandbox(f"no sandbox {box_id!r} on this agent")
        return box

    async def exec(self, box_id: str, req: ExecRequest, emit: Emit) -> ExecResult:
        if not req.argv or not all(isinstance(a, str) and a for a in req.argv[:1]):
            raise BadInputError("exec needs a command (argv: a non-empty list of strings)")
        if req.cwd is not None and not req.cwd.startswith("/"):
            raise BadInputError(f"cwd {req.cwd!r} must be an absolute path")
        if req.timeout is not None and not req.timeout > 0:
            raise BadInputError(f"timeout {req.timeout!r} must be a positive number of seconds")
        merge_env([], req.env, None)
        box = self.running(box_id)
        box.execs += 1
        try:
            result = await execute(box.target, req, emit)
        except ServerBroke:
            # The process serving the command was killed (by the sandbox's own code: a
            # 502), or with the whole sandbox (its PID 1 killed from the host: a 409)?
            with anyio.move_on_after(1.0):
                while box.state == "running":
                    _check_init(box)
                    await anyio.sleep(0.01)
            self.running(box_id)  # raises SandboxExited if so
            raise
        finally:
            self._first_command_ended(box_id)
        if result.channel == "runtime":
            # A refused connect is also what a PID 1 killed from the host leaves for a
            # moment: then runc's own error is no result of the command (409 instead).
            self.running(box_id)
        self.on_exec(result)
        return result

    def _first_command_ended(self, box_id: str) -> None:
        if self._first_commands.pop(box_id, None) is not None:
            self._first_done.set()

    async def _let_first_commands_run(self) -> None:
        """Wait until no sandbox just handed out runs its first command, each for at most
        refill_defer after its claim, and in all at most refill_defer (so that a stream
        of claims does not stop refills); see BACKGROUND_NICE."""
        until = anyio.current_time() + self.settings.refill_defer
        while (now := anyio.current_time()) < until:
            self._first_commands = {i: t for i, t in self._first_commands.items() if t > now}
            if not self._first_commands:
                return
            self._first_done = anyio.Event()
            with anyio.CancelScope(deadline=min(until, max(self._first_commands.values()))):
                await self._first_done.wait()

    def list(self) -> list[dict]:
        for box in self.boxes.values():
            _check_init(box)
        return [b.view() for b in self.boxes.values() if b.state != "deleting"]

    # ------------------------------------------------------------------ deleting

    async def delete(self, box_id: str) -> None:
        box = self.get(box_id)
        for pool in self.pools.values():
            if box in pool.ready:
                pool.ready.remove(box)
        await self._remove(box)

    async def _remove(self, box: AgentBox) -> None:
        box.state = "deleting"
        self._first_command_ended(box.record.id)
        try:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(box.sandbox.delete, limiter=self.limiter)
        finally:
            self.boxes.pop(box.record.id, None)
            self.records.remove(box.record.id)
            self._unhold(box.record.image_id)
            self._poke()

    # ------------------------------------------------------------------ pools

    async def set_pool(self, image: str, size: int, warmup: list[str] | None = None) -> Pool:
        """The pool's target size; `warmup` (an argv; [] for none, None: unchanged) is
        run once, before the pool's first sandbox is ready, and again if it changes."""
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise BadInputError(f"pool size {size!r} must be a whole number, 0 or more")
        if warmup is not None and not (
            isinstance(warmup, list) and all(isinstance(a, str) for a in warmup)
        ):
            raise BadInputError("a pool's warmup must be a list of strings (an argv)")
        if warmup and not warmup[0]:
            raise BadInputError("a pool's warmup must start with a command")
        info = await self.image(image)
        pool = self.pools.get(info.image_id)
        if pool is None:
            pool = self.pools[info.image_id] = Pool(info, size)
        pool.target = size
        if warmup is not None and warmup != pool.warmup:
            pool.warmup, pool.warmed = list(warmup), None
        while len(pool.ready) > size:
            await self._remove(pool.ready.pop())
        self._poke()
        return pool

    def _poke(self) -> None:
        self._refill_wake.set()

    def _next_refill(self) -> Pool | None:
        if self.total() >= self.config.max_sandboxes:
            return None
        for pool in self.pools.values():
            if pool.creating:
                continue
            if pool.target and pool.warmup and pool.warmed is None:
                return pool  # a new warm-up, even for a full pool
            if len(pool.ready) < pool.target:
                return pool
        return None

    async def _refill_loop(self) -> None:
        while True:
            pool = self._next_refill()
            if pool is None:
                await self._refill_wake.wait()
                self._refill_wake = anyio.Event()
                continue
            if self._first_commands:
                await self._let_first_commands_run()
                pool = self._next_refill()  # claims or pool changes meanwhile
                if pool is None:
                    continue
            pool.creating += 1
            box = None
            try:
                if pool.warmup and pool.warmed is None:
                    await self._warm_up(pool)
                    continue  # the pool may be full already: look again
                box = await self._make(
                    pool.image, self.config.defaults, False, [], True, background=True
                )
                _check_started(box)
                # Made in the background, handed out for commands that are not: its idle
                # init and server go back to the normal niceness now rather than at the
                # claim (0.2 ms of a warm claim's 0.8).
                await anyio.to_thread.run_sync(box.sandbox.renice, 0)
            except (LazyfsError, OSError, subprocess.SubprocessError) as exc:
                if box is not None:
                    with contextlib.suppress(LazyfsError):
                        await self._remove(box)
                pool.failures += 1
                pool.last_error = str(exc)
                log.warning("pool %s: %s", pool.image.name, exc)
                await anyio.sleep(REFILL_BACKOFF)
                continue
            except BaseException:
                # Cancelled (the agent stops) while the sandbox was starting: made after
                # shutdown() listed the sandboxes to delete, it must not outlive the agent.
                if box is not None and box.record.id in self.boxes:
                    with anyio.CancelScope(shield=True):
                        await self._remove(box)
                raise
            finally:
                pool.creating -= 1
            if len(pool.ready) < pool.target and self.total() <= self.config.max_sandboxes:
                pool.ready.append(box)
            else:  # the pool shrank meanwhile, or a claim took the slot
                await self._remove(box)

    async def _warm_up(self, pool: Pool) -> None:
        """Run the pool's warm-up command once, in a throw-away sandbox of the image.

        What it reads lands in the node cache and in the page cache of the image's tree,
        which every sandbox of the image shares (one lower tree, read-only), so one run
        warms the whole pool, at the cost of one extra sandbox per image. Running it in
        each pooled sandbox instead would pay it N times and leave its writes (.pyc
        files, caches, temporary files) in the sandboxes handed out, which would then not
        all start from the image's state. A warm-up that fails (non-zero exit, timeout)
        is reported in the pool's `warmed` and `last_error`; the pool fills anyway."""
        t0 = time.perf_counter()
        box = await self._make(pool.image, self.config.defaults, False, [], background=True)
        box.state = "warmup"
        try:
            _check_started(box)

            async def discard(kind: str, data: bytes) -> None:
                pass

            request = ExecRequest(pool.warmup, timeout=WARMUP_TIMEOUT)
            result = await execute(box.target, request, discard)
        finally:
            await self._remove(box)
        pool.warmed = {"exit_code": result.exit_code, "seconds": time.perf_counter() - t0}
        if result.exit_code != 0:
            pool.last_error = f"warm-up {pool.warmup[0]!r} exited {result.exit_code}"
            log.warning("pool %s: %s", pool.image.name, pool.last_error)
        else:
            log.info("pool %s: warm-up done in %.2f s", pool.image.name, pool.warmed["seconds"])

    # ------------------------------------------------------------------ time

    async def _tick_loop(self) -> None:
        while True:
            await anyio.sleep(TICK)
            now = time.time()
            for box in list(self.boxes.values()):
                expires = box.record.expires
                if box.state in ("running", "exited") and expires is not None and expires <= now:
                    log.info("sandbox %s: TTL passed, deleting it", box.record.id)
                    with contextlib.suppress(LazyfsError):
                        await self._remove(box)
            await self._prune_pools()
            await self._release_idle_trees()
            await self._keep_data_daemon()
            self._reap_orphans()

    async def _prune_pools(self) -> None:
        """Drop ready sandboxes whose PID 1 (the exec server) ended, so that the refill
        replaces them before a claim comes."""
        for pool in list(self.pools.values()):
            for box in list(pool.ready):
                _check_init(box)
                if box.state != "ready" and box in pool.ready:
                    pool.ready.remove(box)
                    await self._drop_pooled(pool, box)

    def _reap_orphans(self) -> None:
        """Reap zombies re-parented to the agent. It is a child subreaper (so that each
        sandbox's init becomes its child when `runtime create` exits), so every process
        that daemonized from it (the node data daemon, its helpers) is re-parented here
        when it ends. Only children in another session than the agent's are reaped:
        the runtime calls that subprocess and anyio wait for share the agent's session,
        and the sandboxes' inits are left to Sandbox.delete."""
        own_session = os.getsid(0)
        inits = {b.sandbox.pid for b in self.boxes.values()}
        for pid in _children():
            if pid in inits:
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] == "Z" and int(fields[3]) != own_session:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)

    async def _keep_data_daemon(self) -> None:
        """Start the held data daemon again if it is gone (its supervisor died: the hold
        went with its mount), so that the next cold create does not wait for it."""
        hold, now = self._daemon_hold, time.monotonic()
        if hold is None or now < self._daemon_check_at:
            return
        self._daemon_check_at = now + DAEMON_CHECK
        if await anyio.to_thread.run_sync(hold.held):
            return
        log.warning("the node data daemon is gone: starting it again")
        try:
            await anyio.to_thread.run_sync(hold.ensure, limiter=self.limiter)
        except (LazyfsError, OSError) as exc:
            log.warning("the node data daemon did not start: %s", exc)

    async def _release_idle_trees(self) -> None:
        linger = self.settings.agent_linger
        for image_id, tree in list(self.trees.items()):
            idle = tree.idle_since
            if tree.users <= 0 and idle is not None and time.monotonic() - idle >= linger:
                async with self.tree_locks.setdefault(image_id, anyio.Lock()):
                    if tree.users <= 0 and self.trees.get(image_id) is tree:
                        del self.trees[image_id]
                        await anyio.to_thread.run_sync(tree.hold.release, 0.0)


def _runtime_status(box: Sandbox) -> str | None:
    """The runtime's status of the container ("running", "created", "stopped"), or None."""
    proc = subprocess.run(
        [box.runtime, "--root", str(box.state), "state", box.id],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if proc.returncode != 0:
        return None
    try:
        return json.loads(proc.stdout).get("status")
    except ValueError:
        return None


def _check_started(box: AgentBox) -> None:
    """RuntimeFailed if the sandbox's PID 1, its exec server, already ended: a pool must
    not take it (a claim would check again, _take_from_pool)."""
    _check_init(box)
    if box.state == "exited":
        raise RuntimeFailed(
            f"sandbox {box.record.id}: its exec server exited at start"
            f" (status {box.sandbox.exit_status}; the bundle's log says why)"
        )


def _children() -> list[int]:
    found = []
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/children") as f:
            found += [int(p) for p in f.read().split()]
    return found


def _check_init(box: AgentBox) -> None:
    """Mark the sandbox exited if its PID 1 (our child since `runtime create`) ended. The
    sandbox's own code cannot kill it (the namespace's init: exec_server.c); the host can
    (an operator, the OOM killer), and it exits at once if its start went wrong."""
    pid = box.sandbox.pid
    if pid is None or box.state not in ("running", "ready", "warmup"):
        return
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return
    if done:
        box.sandbox.pid = None
        code = os.waitstatus_to_exitcode(status)
        box.sandbox.exit_status = 128 - code if code < 0 else code
        box.state = "exited"
