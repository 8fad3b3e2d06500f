"""The agent: what the API and the server use (create, get, running, exec, list,
delete, set_pool; prepare, start, shutdown), over the parts that do one job each:

- boxes.py: a sandbox as the agent keeps it, and its state machine
- pools.py: the warm pools' policy (what to make next, when, how many)
- trees.py: the image trees the agent holds, and their linger
- images.py: image names looked up to ids and configs
- arrivals.py: images new to the node brought up a few at a time, in arrival order
- recovery.py: a restarted agent finds its sandboxes again
- records.py: what the agent keeps on disk about each sandbox

Here: making a sandbox (cold, or for a pool), running commands in one, deleting one,
and the tick loop (TTLs, pools' prune, idle trees, the data daemon, zombies). A
sandbox's exec server's listening socket is made here, on the host, and handed to it as
fd 3: the sandbox cannot reach it. The blocking parts (mounting, the runtime's
create/start/delete) run in threads under one CapacityLimiter; the event loop only
keeps the books.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.lowlevel
from anyio.abc import TaskGroup

from chunker.errors import BadInputError, LazyfsError
from lazyfs.agent.arrivals import Arrivals
from lazyfs.agent.boxes import AgentBox, BoxState, exec_target
from lazyfs.agent.changes import Change, changes
from lazyfs.agent.errors import (
    AgentBusy,
    SandboxExited,
    SandboxLost,
    SandboxPaused,
    UnknownSandbox,
)
from lazyfs.agent.execute import (
    Emit,
    ExecRequest,
    ExecResult,
    ServerBroke,
    Started,
    execute,
    listen,
)
from lazyfs.agent.images import ImageInfo, Images
from lazyfs.agent.pools import Pool, Pools, check_pool_request
from lazyfs.agent.records import BoxRecord, Records, limits_of, record_limits
from lazyfs.agent.recovery import recover
from lazyfs.agent.sandbox_io import SandboxIO
from lazyfs.agent.trees import Trees
from lazyfs.host_dirs import secure_node_dirs
from lazyfs.oom import refused_message, set_oom_score_adj
from lazyfs.sandbox.confinement import DEFAULT_CONFINEMENT, Confinement, cap_mask
from lazyfs.sandbox.freezer import FreezeFailed, set_frozen
from lazyfs.sandbox.limits import cap_sandboxes
from lazyfs.sandbox.names import DEFAULT_NAMES, SandboxNames
from lazyfs.sandbox.oci_spec import Limits, Process
from lazyfs.sandbox.process import build_process, merge_env, root_of, root_text, with_hostname
from lazyfs.sandbox.runtime import (
    RuntimeFailed,
    Sandbox,
    SandboxHost,
    SandboxRequest,
    find_runtime,
)
from lazyfs.sandbox.shared_counters import raise_shared_counters
from lazyfs.sandbox.tmpfs import Tmpfs
from lazyfs.sandbox.ulimits import as_field, check_node_gives, header, warm_can_give
from lazyfs.sandbox.usage import Usage, usage
from lazyfs.settings import Settings
from lazyfs.tree.image_mounts import DataDaemonHold, ImageMounts

log = logging.getLogger("lazyfs.agent")
GENERIC = ImageInfo("generic", "", {})  # the generic pool's image: none yet (issue 23)
PROCESSES_KEPT = 4096  # images whose generic exec server process is remembered
SERVER_PATH = "/dev/lazyfs-exec"  # in the sandbox: the exec server, bound read-only
SERVER_COMMAND = [SERVER_PATH]  # PID 1; its socket is fd 3 (execute.listen)
THREADS = 4  # blocking sandbox work at once (2 cores here: more only queues in the kernel)
TICK = 0.25  # seconds between TTL / linger checks
LOOP_LATE = 1.0  # seconds a tick may come late before the log says so
DAEMON_CHECK = 2.0  # seconds between checks that the held node data daemon is still up
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
# ... and a refill waits for a claim's first command (pools.py, the deferral).
BACKGROUND_NICE = 10


@dataclass
class AgentConfig:
    store_url: str
    cache_dir: Path
    runtime: str = "runc"
    max_sandboxes: int = 100
    pools: dict[str, int] = field(default_factory=dict)  # image -> target size
    warmups: dict[str, list[str]] = field(default_factory=dict)  # image -> warm-up argv
    warm: int = 0  # generic sandboxes kept ready, for any image (`lazyfs serve --warm`)
    # What a create does not ask for (serve's --memory, --pids, --disk, --cpus); pooled
    # sandboxes are made with them, and a claim's own limits are written at the claim.
    defaults: Limits = field(default_factory=Limits)
    default_ttl: float | None = DEFAULT_TTL  # seconds; None: a sandbox lives until deleted


class Agent:
    """The facade; it is also the pools' Maker (pools.py): total, make_pooled,
    run_warm_up, remove."""

    def __init__(self, config: AgentConfig, settings: Settings) -> None:
        self.config = config
        self.settings = settings
        self.host = SandboxHost.of(settings)  # where its sandboxes live
        self.sandbox_io = SandboxIO()  # work on sandboxes' files: threads apart, timed out
        self.runtime = find_runtime(config.runtime)
        if not os.access(self.settings.exec_server, os.X_OK):
            raise BadInputError(
                f"the exec server {self.settings.exec_server} is missing: installing lazyfs"
                " (scripts/setup.sh, or pip) builds it; or set LAZYFS_EXEC_SERVER to where it is"
            )
        if config.warm and not os.access(self.settings.attach_root, os.X_OK):
            raise BadInputError(
                f"--warm needs {self.settings.attach_root}, which is missing: installing"
                " lazyfs (scripts/setup.sh, or pip) builds it"
            )
        self.mounts = ImageMounts(config.store_url, config.cache_dir, self.settings)
        self.records = Records(self.settings.run_dir)
        self.boxes: dict[str, AgentBox] = {}
        self.pools = Pools(self, config.max_sandboxes, self.settings.refill_defer)
        self.trees = Trees(self.mounts, self.settings.agent_linger)
        self.images = Images(
            self.mounts, config.store_url, config.cache_dir, self.settings.cache.fetch_timeout
        )
        self.limiter = anyio.CapacityLimiter(THREADS)
        self.arrivals = Arrivals()
        self.creating = 0
        self.lost: dict[str, str] = {}  # id -> why, for sandboxes a restart could not keep
        self.adopted: list[str] = []
        self.started = time.time()
        self._tasks: TaskGroup | None = None
        self._lock_file = None
        self._daemon_hold: DataDaemonHold | None = None
        self._daemon_check_at = 0.0
        # image id -> its generic sandboxes' exec server process (user, env, cwd): an
        # image's tree and config never change, and reading its /etc/passwd and /etc/group
        # again in a thread was ~1 ms of a mounted tree's ~8 ms claim.
        self._exec_server_process: dict[str, Process] = {}
        self.on_claim: Callable[[str, float], None] = lambda source, seconds: None
        self.on_exec: Callable[[ExecResult], None] = lambda result: None

    # ------------------------------------------------------------------ life

    async def prepare(self) -> None:
        """Take the run directory, recover from a previous agent, set the pools (an
        unknown image fails here, before anything serves). The node's private directories
        and its cap on all sandboxes are set first (lazyfs/host_dirs.py,
        lazyfs/sandbox/limits.py), the kernel's counters that sandboxes share with the
        host raised (lazyfs/sandbox/shared_counters.py), and the agent's OOM bias
        (lazyfs/oom.py), which the data daemon it starts inherits."""
        secure_node_dirs(self.settings)
        self._take_run_dir()
        cap_sandboxes(self.settings)
        if left := raise_shared_counters():
            log.warning(
                "these kernel counters could not be raised, and one sandbox can take all"
                " of them from the node (docs/security.md): %s",
                ", ".join(left),
            )
        if not set_oom_score_adj():
            log.warning("%s", refused_message("the agent"))
        await anyio.to_thread.run_sync(self._recover)
        await anyio.to_thread.run_sync(self._hold_data_daemon)
        for image, size in self.config.pools.items():
            await self.set_pool(image, size, self.config.warmups.get(image))
        if self.config.warm:
            await self.set_warm(self.config.warm)

    def start(self, tasks: TaskGroup) -> None:
        """The background tasks: pool refills, TTLs, idle trees."""
        self._tasks = tasks
        self.images.tasks = tasks
        tasks.start_soon(self.pools.run)
        tasks.start_soon(self._tick_loop)

    def _recover(self) -> None:
        found = recover(self.records, self.mounts, self.trees, self.host, self.settings.run_dir)
        for box in found.boxes:
            self.boxes[box.id] = box
            self.adopted.append(box.id)
        self.lost.update(found.lost)

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
            self.pools.stop()
            for box_id in list(self.boxes):
                with contextlib.suppress(LazyfsError):
                    await self.delete(box_id)
            await self.trees.release_all()
            if self._daemon_hold is not None:  # the data daemon's idle exit applies again
                self._daemon_hold.release()
                self._daemon_hold = None

    # ------------------------------------------------------------------ making

    async def image(self, name: str) -> ImageInfo:
        return await self.images.get(name)

    def _on_node(self, name: str) -> bool:
        """Whether the image was looked up here and its tree is held (arrivals.py)."""
        info = self.images.peek(name)
        return info is not None and all(t in self.trees for t in info.trees)

    async def _bring(self, name: str) -> None:
        """An image's first create on the node: its lookup and its tree's mount, which
        then lingers for the creates that follow (arrivals.py)."""
        info = await self.image(name)
        await self.trees.hold_all(info.trees)
        self.trees.unhold_all(info.trees)

    def total(self) -> int:
        """Sandboxes held or being made (against --max-sandboxes)."""
        return len(self.boxes) + self.creating

    async def create(
        self,
        image: str,
        env: list[str] | None = None,
        limits: Limits | None = None,
        ttl: float | None = None,
        network: bool = False,
        tmpfs: tuple[Tmpfs, ...] = (),
        confinement: Confinement = DEFAULT_CONFINEMENT,
        names: SandboxNames = DEFAULT_NAMES,
    ) -> AgentBox:
        """A running sandbox: from the image's pool if it has a ready one and the
        request fits it, else made now. `ttl` None: the agent's default_ttl. A ready
        sandbox has its namespaces already: one that asks for the node's network is made
        for it. A sandbox of the image's pool has its root and mounts too: tmpfs mounts
        of its own, a read-only root and names of its own (a hostname, extra hosts in
        its /etc/hosts) are given to a generic one at its claim, or made with a cold
        one. Capabilities dropped are dropped, and ulimits set, by any sandbox's exec
        server on each command
        (lazyfs/sandbox/confinement.py); ulimits that a warm sandbox cannot give make a
        cold one (lazyfs/sandbox/ulimits.py).

        Cancelled (the agent stops), it leaves nothing: what was made or claimed is
        deleted (a create whose client hung up is undone by the API once it is done:
        lazyfs/agent/api.py). A cancel that comes while a thread does the runtime's work waits for
        that thread (anyio's to_thread shields it) and is delivered at the checkpoint
        below, so the sandbox the thread made is deleted too."""
        t0 = time.perf_counter()
        env = env or []
        merge_env([], env, None)  # KEY=VALUE, before any work
        check_node_gives(confinement.ulimits)
        limits = limits or self.config.defaults
        if ttl is not None and not ttl > 0:
            raise BadInputError(f"ttl {ttl!r} must be a positive number of seconds")
        await self.arrivals.bring(image, lambda: self._on_node(image), lambda: self._bring(image))
        info = await self.image(image)
        t_image = time.perf_counter() - t0  # with a new image's tree (arrivals.py)
        # The claim order: a ready sandbox of the image's pool, a generic one, a cold create.
        # A sandbox of the image's pool was made with its mounts and its root's: one with
        # tmpfs, a read-only root or names of its own skips it.
        # Limits a sandbox made with the defaults cannot give (ulimits.py) skip both.
        own_root = bool(tmpfs) or confinement.read_only or names.own
        warm = warm_can_give(confinement.ulimits)
        box = None if own_root or not warm else await self.pools.take(info.image_id, network)
        source = "pool"
        if box is None and not network and warm:
            box = await self._claim_generic(info, t_image, tmpfs, confinement.read_only, names)
            source = "generic"
        if box is None:
            source = "cold"
        try:
            if box is None:
                await self.pools.make_room()
                box = await self._make(
                    info,
                    limits,
                    network,
                    env,
                    tmpfs=tmpfs,
                    confinement=confinement,
                    names=names,
                )
                # Where a cold claim's time goes (bench/agent_bench.py reads this line).
                times = {"image": t_image, **box.sandbox.timings}
                log.info(
                    "sandbox %s: made cold in %.3f s (%s)",
                    box.id,
                    time.perf_counter() - t0,
                    ", ".join(f"{k} {v:.3f}" for k, v in times.items()),
                )
            else:  # started, its exec server PID 1: only what the request adds
                box.record.env = env
                box.target.box_env = env
                box.record.cap_drop = list(confinement.cap_drop)
                box.record.read_only = confinement.read_only  # given by _claim_generic
                box.target.drop_caps = cap_mask(confinement.cap_drop)
                box.record.ulimits = as_field(confinement.ulimits)
                box.target.limits = header(confinement.ulimits)
                await self._set_limits(box, limits)
            await anyio.lowlevel.checkpoint_if_cancelled()
        except BaseException as exc:
            if box is not None:
                if isinstance(exc, anyio.get_cancelled_exc_class()):
                    log.info("sandbox %s: create cancelled; deleting it", box.id)
                await self.remove(box)
            raise
        # Its PID 1 may have ended during the awaits above (seen by a list() meanwhile):
        # then it stays EXITED, and its first command is told so (SandboxExited).
        if box.state is BoxState.READY:
            box.move(BoxState.RUNNING)
        box.record.state = BoxState.RUNNING.value
        box.record.from_pool = source != "cold"
        box.record.tmpfs = {t.destination: ",".join(t.options) for t in tmpfs}
        box.record.extra_hosts = [h.text() for h in names.extra_hosts]
        box.record.hostname = names.hostname
        self.pools.claimed(box.id)
        ttl = ttl if ttl is not None else self.config.default_ttl
        if ttl is not None:
            box.record.expires = time.time() + ttl
        self.records.save(box.record)
        self.on_claim(source, time.perf_counter() - t0)
        return box

    async def update_limits(self, box_id: str, limits: Limits) -> AgentBox:
        """Set a running sandbox's limits to `limits` while its commands run (the API's
        PATCH, Docker's update): the cgroup files for memory, CPU and pids, and a remount
        of its writable layer for disk. A memory or disk below what the sandbox uses
        is refused by the kernel (the first after reclaiming what it can): an error
        that says so, and the limits it had stay in its record."""
        box = self.running(box_id)
        await self._set_limits(box, limits)
        self.records.save(box.record)
        return box

    def usage(self, box_id: str) -> Usage:
        """What the sandbox uses now (its cgroup's counters: lazyfs/sandbox/usage.py)."""
        box = self.get(box_id)
        try:
            return usage(self.host.cgroup_parent, box.id)
        except OSError as exc:  # its cgroup went: it is being deleted, or its PID 1 died
            raise SandboxExited(f"sandbox {box.id}: its cgroup is gone ({exc.strerror})") from None

    async def changes(self, box_id: str) -> list[Change]:
        """What the sandbox changed in its image's files (lazyfs/agent/changes.py):
        its overlay's upper directory against the trees it stands on, walked in the
        sandbox I/O pool (a sandbox's tree can be large, and it may change meanwhile)."""
        box = self.get(box_id)
        if not box.record.tree:
            raise BadInputError(f"sandbox {box.id} was made by an agent that kept no tree")
        lower = root_of([Path(p) for p in box.record.tree.split(":")])
        return await self.sandbox_io.run(changes, box.sandbox.dir / "upper", lower)

    async def _set_limits(self, box: AgentBox, limits: Limits) -> None:
        """Give a started sandbox the limits of `limits` that differ from its record's:
        a pooled or generic one at its claim (made with the defaults), or a running one
        (update_limits). Its record then has them (the caller saves it)."""
        current = limits_of(box.record)
        if limits._replace(disk=current.disk) != current:
            # cgroup file writes (no runtime binary): 0.2 ms, but a memory
            # limit below what is used makes the kernel reclaim first.
            await anyio.to_thread.run_sync(box.sandbox.update_limits, limits, limiter=self.limiter)
        if limits.disk != current.disk:  # a remount of its tmpfs: ~0.1 ms
            await anyio.to_thread.run_sync(box.sandbox.resize_disk, limits, limiter=self.limiter)
        for name, value in record_limits(limits).items():
            setattr(box.record, name, value)

    async def make_pooled(self, pool: Pool) -> AgentBox:
        """A sandbox for the pool (pools.Maker): made in the background with the
        defaults, its exec server checked up; on a failure nothing is left."""
        if pool.image is GENERIC:
            box = await self._make_generic()
        else:
            box = await self._make(
                pool.image, self.config.defaults, False, [], True, background=True
            )
        try:
            box.check_started()
            # Made in the background, handed out for commands that are not: its idle
            # init and server go back to the normal niceness now rather than at the
            # claim (0.2 ms of a warm claim's 0.8).
            await anyio.to_thread.run_sync(box.sandbox.renice, 0)
        except (LazyfsError, OSError, subprocess.SubprocessError):
            with contextlib.suppress(LazyfsError):
                await self.remove(box)
            raise
        except BaseException:
            # Cancelled (the agent stops) while the sandbox was starting: made after
            # shutdown() listed the sandboxes to delete, it must not outlive the agent.
            if box.id in self.boxes:
                with anyio.CancelScope(shield=True):
                    await self.remove(box)
            raise
        return box

    async def run_warm_up(self, pool: Pool) -> int:
        """The pool's warm-up command in a throw-away sandbox of the image (pools.Maker;
        why one sandbox for the whole pool: Pools._warm_up); its exit code."""
        box = await self._make(pool.image, self.config.defaults, False, [], background=True)
        box.move(BoxState.WARMUP)
        try:
            box.check_started()

            async def discard(kind: str, data: bytes) -> None:
                pass

            request = ExecRequest(pool.warmup, timeout=WARMUP_TIMEOUT)
            result = await execute(box.target, request, discard)
        finally:
            await self.remove(box)
        return result.exit_code

    async def _make(
        self,
        info: ImageInfo,
        limits: Limits,
        network: bool,
        env: list[str],
        pooled: bool = False,
        background: bool = False,
        tmpfs: tuple[Tmpfs, ...] = (),
        confinement: Confinement = DEFAULT_CONFINEMENT,
        names: SandboxNames = DEFAULT_NAMES,
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
            lower = await self.trees.hold_all(info.trees)
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
                        tmpfs=tmpfs,
                        # The capabilities are dropped by the exec server, from each
                        # command, as in a warm sandbox (the record's cap_drop): it
                        # changes a Docker exec's User before it drops them, as runc
                        # does, which it could not without CAP_SETUID itself.
                        confinement=confinement._replace(cap_drop=()),
                        names=names,
                    )
                    sandbox = Sandbox.prepare(lower, request, self.host)
                    _start_server(sandbox, BACKGROUND_NICE if background else 0)
                    return sandbox

                sandbox = await anyio.to_thread.run_sync(build, limiter=self.limiter)
            except BaseException:
                self.trees.unhold_all(info.trees)
                raise
            sandbox.timings = {"tree": t_tree, **sandbox.timings}
        finally:
            self.creating -= 1
        process = json.loads((sandbox.dir / "config.json").read_text())["process"]
        record = BoxRecord(
            id=sandbox.id,
            image=info.name,
            image_id=info.image_id,
            state=BoxState.READY.value,
            runtime=self.runtime,
            created=time.time(),
            env=env,
            process_env=process.get("env", []),
            cwd=process.get("cwd", "/"),
            uid=process.get("user", {}).get("uid", 0),
            gid=process.get("user", {}).get("gid", 0),
            **record_limits(limits),
            network=network,
            cap_drop=list(confinement.cap_drop),
            read_only=confinement.read_only,
            ulimits=as_field(confinement.ulimits),
            from_pool=pooled,
            tree=root_text(lower),
            trees=list(info.trees),
        )
        box = AgentBox(sandbox, record, exec_target(sandbox, record), BoxState.READY)
        self.boxes[sandbox.id] = box
        self.records.save(record)
        return box

    # ------------------------------------------------------------------ using

    def get(self, box_id: str) -> AgentBox:
        box = self.boxes.get(box_id)
        if box is None or box.state is BoxState.DELETING:
            if box_id in self.lost:
                raise SandboxLost(f"sandbox {box_id}: {self.lost[box_id]}")
            raise UnknownSandbox(f"no sandbox {box_id!r} on this agent")
        return box

    def running(self, box_id: str) -> AgentBox:
        box = self.get(box_id)
        box.poll()
        if box.state is BoxState.EXITED:
            raise SandboxExited(
                f"sandbox {box_id}: its PID 1 exited (status {box.sandbox.exit_status});"
                " it runs nothing more, delete it"
            )
        if box.state is not BoxState.RUNNING:
            raise UnknownSandbox(f"no sandbox {box_id!r} on this agent")
        return box

    def takes_commands(self, box_id: str) -> AgentBox:
        """The sandbox, running and not paused (an exec into a frozen one would wait
        until it is unpaused: refused instead, as dockerd does)."""
        box = self.running(box_id)
        if box.record.paused:
            raise SandboxPaused(f"sandbox {box_id} is paused; unpause it to run a command")
        return box

    async def set_paused(self, box_id: str, paused: bool) -> AgentBox:
        """Freeze (or thaw) every process of a running sandbox (lazyfs/sandbox/freezer.py);
        its record keeps it, so a restarted agent knows. Asking again is no error."""
        box = self.running(box_id)
        if box.record.paused != paused:
            cgroup_parent = self.host.cgroup_parent
            try:
                await anyio.to_thread.run_sync(set_frozen, cgroup_parent, box.id, paused)
            except FreezeFailed as exc:
                raise RuntimeFailed(str(exc)) from None
            box.record.paused = paused
            self.records.save(box.record)
        return box

    async def exec(
        self, box_id: str, req: ExecRequest, emit: Emit, started: Started | None = None
    ) -> ExecResult:
        if not req.argv or not all(isinstance(a, str) and a for a in req.argv[:1]):
            raise BadInputError("exec needs a command (argv: a non-empty list of strings)")
        if req.cwd is not None and not req.cwd.startswith("/"):
            raise BadInputError(f"cwd {req.cwd!r} must be an absolute path")
        if req.timeout is not None and not req.timeout > 0:
            raise BadInputError(f"timeout {req.timeout!r} must be a positive number of seconds")
        merge_env([], req.env, None)
        box = self.takes_commands(box_id)
        box.execs += 1
        try:
            result = await execute(box.target, req, emit, started)
        except ServerBroke:
            # The process serving the command was killed (by the sandbox's own code: a
            # 502), or with the whole sandbox (its PID 1 killed from the host: a 409)?
            with anyio.move_on_after(1.0):
                while box.state is BoxState.RUNNING:
                    box.poll()
                    await anyio.sleep(0.01)
            self.running(box_id)  # raises SandboxExited if so
            raise
        finally:
            self.pools.first_command_ended(box_id)
        if result.channel == "runtime":
            # A refused connect is also what a PID 1 killed from the host leaves for a
            # moment: then runc's own error is no result of the command (409 instead).
            self.running(box_id)
        self.on_exec(result)
        return result

    def list(self) -> list[dict]:
        for box in self.boxes.values():
            box.poll()
        return [b.view() for b in self.boxes.values() if b.state is not BoxState.DELETING]

    # ------------------------------------------------------------------ deleting

    async def delete(self, box_id: str) -> None:
        box = self.get(box_id)
        self.pools.forget(box)
        await self.remove(box)

    async def remove(self, box: AgentBox) -> None:
        """Delete the sandbox, whatever its state, and free its slot (pools.Maker)."""
        box.move(BoxState.DELETING)
        self.pools.first_command_ended(box.id)
        try:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(box.sandbox.delete, limiter=self.limiter)
        finally:
            self.boxes.pop(box.id, None)
            self.records.remove(box.id)
            if box.record.image_id:  # a generic sandbox not claimed holds no tree
                self.trees.unhold_all(box.record.tree_ids)
            self.pools.poke()

    # ------------------------------------------------------------------ pools

    async def set_pool(
        self, image: str, size: int, warmup: list[str] | None = None, fleet: dict | None = None
    ) -> Pool:
        """The pool's target size; `warmup` (an argv; [] for none, None: unchanged) is
        run once, before the pool's first sandbox is ready, and again if it changes.
        `fleet`: a gateway's whole-fleet target (lazyfs/gateway/pools.py)."""
        check_pool_request(size, warmup, fleet)
        info = await self.image(image)
        return await self.pools.set(info, size, warmup, fleet)

    async def set_warm(self, size: int) -> Pool:
        """The generic pool's target: sandboxes ready for any image (issue 23)."""
        check_pool_request(size, None)
        return await self.pools.set(GENERIC, size, None)

    # ------------------------------------------------------------------ generic sandboxes

    async def _make_generic(self) -> AgentBox:
        """A started sandbox that no image is chosen for yet (READY, in the generic pool):
        its root is the start-up root until a claim gives it an image's
        (Sandbox.prepare_generic, take_root). Made with the defaults, in the
        background."""
        self.creating += 1
        try:

            def build() -> Sandbox:
                request = SandboxRequest(
                    {},
                    SERVER_COMMAND,
                    limits=self.config.defaults,
                    runtime=self.runtime,
                    helper=(str(self.settings.exec_server), SERVER_PATH),
                    init=False,
                )
                sandbox = Sandbox.prepare_generic(request, self.host)
                _start_server(sandbox, BACKGROUND_NICE)
                return sandbox

            sandbox = await anyio.to_thread.run_sync(build, limiter=self.limiter)
        finally:
            self.creating -= 1
        limits = self.config.defaults
        record = BoxRecord(
            id=sandbox.id,
            image="",
            image_id="",
            state=BoxState.READY.value,
            runtime=self.runtime,
            created=time.time(),
            **record_limits(limits),
            from_pool=True,
        )
        box = AgentBox(sandbox, record, exec_target(sandbox, record), BoxState.READY)
        self.boxes[sandbox.id] = box
        self.records.save(record)
        return box

    async def _claim_generic(
        self,
        info: ImageInfo,
        t_image: float,
        tmpfs: tuple[Tmpfs, ...] = (),
        read_only: bool = False,
        names: SandboxNames = DEFAULT_NAMES,
    ) -> AgentBox | None:
        """A ready generic sandbox given the image's root, or None: none is ready, or the
        image's user is not root. A generic sandbox's exec server, whose user every
        command inherits, runs as root, so an image with another User gets a cold create
        (docs/design-changes.md, "how a warm sandbox takes an image's root"). A claim that
        fails half-way deletes that sandbox and raises."""
        pool = self.pools.get(GENERIC.image_id)
        if pool is None or not pool.ready:
            return None
        t0 = time.perf_counter()
        lower = await self.trees.hold_all(info.trees)
        t_tree = time.perf_counter()
        try:
            process = self._exec_server_process.get(info.image_id)
            if process is None:
                process = await anyio.to_thread.run_sync(
                    build_process, lower, info.config, SERVER_COMMAND, None, None, True
                )
                self._remember_exec_server_process(info.image_id, process)
            t_user = time.perf_counter()
            box = None
            if (process.uid, process.gid, tuple(process.additional_gids)) == (0, 0, ()):
                box = await self.pools.take(GENERIC.image_id, False)
        except BaseException:
            self.trees.unhold_all(info.trees)
            raise
        if box is None:
            self.trees.unhold_all(info.trees)
            return None
        record = box.record
        record.image, record.image_id = info.name, info.image_id
        record.tree, record.trees = root_text(lower), list(info.trees)
        try:
            await anyio.to_thread.run_sync(
                box.sandbox.take_root,
                lower,
                self.settings.attach_root,
                tmpfs,
                read_only,
                names,
                limiter=self.limiter,
            )
        except BaseException:
            log.warning("sandbox %s: taking image %s's root failed; deleting it", box.id, info.name)
            await self.remove(box)
            raise
        env = with_hostname(process.env, info.config.get("Env"), names.hostname)
        record.process_env, record.cwd = env, process.cwd
        box.target = exec_target(box.sandbox, record)
        # Where a generic claim's time goes (bench/generic_claims.py reads this line).
        log.info(
            "sandbox %s: given image %s's root in %.3f s"
            " (image %.3f, tree %.3f, user %.3f, root %.3f)",
            box.id,
            info.name,
            t_image + time.perf_counter() - t0,
            t_image,
            t_tree - t0,
            t_user - t_tree,
            box.sandbox.timings.get("take_root", 0.0),
        )
        return box

    def _remember_exec_server_process(self, image_id: str, process: Process) -> None:
        if len(self._exec_server_process) >= PROCESSES_KEPT:  # the oldest goes
            del self._exec_server_process[next(iter(self._exec_server_process))]
        self._exec_server_process[image_id] = process

    # ------------------------------------------------------------------ time

    async def _tick_loop(self) -> None:
        while True:
            slept = time.monotonic()
            await anyio.sleep(TICK)
            late = time.monotonic() - slept - TICK
            if late > LOOP_LATE:  # something ran on the event loop that belongs in a thread
                log.warning("the agent's event loop was held for %.1f s", late)
            now = time.time()
            for box in list(self.boxes.values()):
                expires = box.record.expires
                if (
                    box.state in (BoxState.RUNNING, BoxState.EXITED)
                    and expires is not None
                    and expires <= now
                ):
                    log.info("sandbox %s: TTL passed, deleting it", box.id)
                    with contextlib.suppress(LazyfsError):
                        await self.remove(box)
            await self.pools.prune()
            await self.trees.release_idle()
            await self._keep_data_daemon()
            self._reap_orphans()

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


def _start_server(sandbox: Sandbox, nice: int) -> None:
    """Start a prepared sandbox with its exec server as PID 1, listening on a socket made
    here and handed over as fd 3; on a failure the sandbox is deleted. Only the server
    keeps the socket: once it is gone, a connect is refused at once rather than queued
    for ever."""
    try:
        with listen(sandbox.dir) as server:
            sandbox.run_detached(nice, fd3=server.fileno())
    except BaseException:
        sandbox.delete()
        raise


def _children() -> list[int]:
    found = []
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/children") as f:
            found += [int(p) for p in f.read().split()]
    return found
