"""One sandbox on an OCI runtime (runc by default), from bundle to nothing left.

    box = Sandbox.prepare(lower, SandboxRequest(config, command, ...))  # overlay + config.json
    box.create()          # `runtime create`: namespaces, cgroups, mounts; PID 1 waits
    box.start()           # `runtime start`: the command runs (~ms)
    status = box.wait()   # its exit status, 128+N for signal N
    box.delete()          # container, cgroups, overlay, directories: all gone

`run_foreground()` does create/start/wait, killing the sandbox on SIGTERM, SIGINT or
SIGHUP; `start_foreground()` stops before the wait, for `lazyfs run`, which then waits
as a small C program (lazyfs/sandbox/run_wait.c) and deletes the sandbox from a finisher
(lazyfs/sandbox/run_finish.py) through lazyfs/sandbox/teardown.py, as delete() does.
The node agent can keep created sandboxes (warm pools) and start them later.

Why not a foreground `runtime run`: it deletes the container's cgroup as soon as the
command exits, before anyone can read whether the memory cgroup OOM-killed it. With
create/start, or `runtime run --detach` (both in one runtime process: `run_detached()`,
how the node agent starts sandboxes), this process is the sandbox's PID 1's parent: it
marks itself a child subreaper, so when the runtime exits the container's init is
re-parented to it, and it waits for it directly (no runtime process stays around while
the command runs); the cgroup stays until delete().

On disk, per sandbox: SANDBOX_DIR/<id>.lock, flocked by the owning process for the
sandbox's whole life (made under a temporary name and renamed into place, so that no
cleaner can take an unlocked one), and SANDBOX_DIR/<id>/, the sandbox's writable layer
(below), with upper/, work/, rootfs/ (the overlay mount), config.json, the runtime's log,
`runtime` (the binary that created it) and, for the agent's sandboxes, the exec server's
listening socket (lazyfs/agent/execute.py: mounted nowhere in the sandbox). SANDBOX_DIR is 0711
(lazyfs/host_dirs.py); the overlay is mounted nosuid,nodev, so neither a setuid file nor
a device node a sandbox makes means anything on the host.

The writable layer: SANDBOX_DIR/<id>/ is a tmpfs mounted mode=0700,nosuid,nodev with
size=Limits.disk and nr_inodes=Limits.inodes, so the kernel stops a sandbox's writes
(ENOSPC) at its --disk, in files and in inodes. Everything the sandbox can fill lives in
it: the overlay's upper and work dirs (its /tmp, /root, ...) and the runtime's log (its
PID 1's stdout and stderr); /dev/shm, /dev and /run in the sandbox are tmpfs of 64 MiB
each (oci_spec.MOUNTS). Measured here (30 rounds interleaved, docs/design-changes.md,
2026-12-02): tmpfs mount + umount 0.30 ms median (0.16-8.0); a 10G sparse file +
mkfs.ext4 + loop mount + umount 182 ms (41-425), without a journal 224 ms (54-609); a
project quota needs a filesystem mounted with prjquota, which / here (ext4, noquota) is
not and cannot become without a reformat. A tmpfs's pages are charged to the memory
cgroup of the process that writes them: the sandbox's own writes count against its
--memory (it is OOM-killed, not ENOSPC'd, if that comes first) and against the node's
cap on all sandboxes (lazyfs/sandbox/limits.py); what the agent writes on its behalf (the file
API) is charged to the agent, bounded by size= alike. Deleting the sandbox unmounts it:
the memory is freed at once, and nothing is left on the host's disk.

The runtime's state lives under RUN_DIR/oci/<runtime name>, cgroups at /lazyfs/<id>
under every controller (or under $LAZYFS_CGROUP_PARENT). `cleanup_stale()` deletes every
sandbox whose owner died (kill -9).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import re
import select
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from chunker.errors import BadInputError, LazyfsError
from lazyfs.host_dirs import SEARCH_ONLY, private_dir
from lazyfs.libc import libc
from lazyfs.sandbox.confinement import DEFAULT_CONFINEMENT, Confinement
from lazyfs.sandbox.freezer import thaw
from lazyfs.sandbox.names import DEFAULT_NAMES, SandboxNames
from lazyfs.sandbox.oci_spec import Init, Limits, build_spec, limit_resources
from lazyfs.sandbox.overlay import mount_overlay
from lazyfs.sandbox.process import root_of
from lazyfs.sandbox.teardown import CGROUP_FS, cgroup_dirs, oom_kills, remove_sandbox
from lazyfs.sandbox.userns import (
    IdRange,
    UserNamespace,
    allocate,
    check_reachable,
    idmapped,
    make_userns,
    pin,
    set_limits,
    shift,
)
from lazyfs.spawn import spawn

if TYPE_CHECKING:
    from lazyfs.sandbox.process import Root
    from lazyfs.sandbox.tmpfs import Tmpfs
    from lazyfs.settings import Settings

CGROUP_ROOT = Path(CGROUP_FS)
ID_PREFIX = "lazyfs-"  # only these are ever cleaned: other tools' directories are left alone
DEFAULT_RUNTIME = "runc"
# tini (Debian's static build) as PID 1: it reaps zombies and passes signals on, and it
# makes "killed by signal N" exit 128+N even for signals the command sends itself (the
# kernel ignores those for a namespace's PID 1 without a handler). -g: to the command's
# whole process group, as a shell's job control would.
TINI = "/usr/bin/tini-static"
TINI_ARGS = ["-g"]
RESOLV_CONF = "/etc/resolv.conf"
PR_SET_CHILD_SUBREAPER = 36
NICE = shutil.which("nice") or "/usr/bin/nice"
# A runtime command (create, start, delete) that takes longer than this is stuck, not
# slow (they take milliseconds): give up rather than hang `lazyfs run` for ever.
RUNTIME_TIMEOUT = 60.0
MS_NOSUID, MS_NODEV, MS_REMOUNT = 2, 4, 32
# A generic sandbox's start-up root (prepare_generic), in its layer: the mount points
# the runtime needs and /newroot, where take_root() attaches the image's root.
STARTUP_ROOT = "startup"
STARTUP_DIRS = ("proc", "dev", "sys", "run", "newroot")
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # they kill a sandbox


class RuntimeFailed(LazyfsError):
    """The OCI runtime failed (its own message is on stderr already)."""


# NamedTuples, not dataclasses: `lazyfs run` imports this module on every run, and
# dataclasses with inspect is ~5 ms of its imports (docs/design-changes.md, session 29).


class SandboxHost(NamedTuple):
    """Where a node keeps its sandboxes, from its settings: their directories (SANDBOX_DIR
    above), the runtime's state, and the cgroup that holds theirs, in every hierarchy
    (/sys/fs/cgroup/<controller>/<cgroup_parent>/<id>)."""

    sandbox_dir: Path
    state_dir: Path
    cgroup_parent: str

    @classmethod
    def of(cls, settings: Settings) -> SandboxHost:
        return cls(settings.sandbox_dir, settings.run_dir / "oci", settings.cgroup_parent)


class SandboxRequest(NamedTuple):
    """Everything a sandbox is made from, besides the image's tree."""

    image_config: dict  # the OCI image config's "config": Env, WorkingDir, User
    command: list[str]
    env: list[str] | None = None  # --env K=V, over the image's Env
    cwd: str | None = None  # --cwd, over WorkingDir
    limits: Limits = Limits()
    network: bool = False  # True: the host's network namespace
    runtime: str = DEFAULT_RUNTIME
    # (host path, destination): the command is this static binary from the host,
    # bind-mounted read-only at destination (the agent's exec server, exec_server.c).
    helper: tuple[str, str] | None = None
    # False: the command is PID 1 itself, with no tini in front. For the agent's exec
    # server, which reaps as PID 1 does and must be the namespace's init so that the
    # sandbox's code cannot kill it (exec_server.c says why).
    init: bool = True
    tmpfs: tuple[Tmpfs, ...] = ()  # its own tmpfs mounts (lazyfs/sandbox/tmpfs.py)
    confinement: Confinement = DEFAULT_CONFINEMENT  # capabilities dropped, a read-only root
    names: SandboxNames = DEFAULT_NAMES  # its hostname and extra hosts (lazyfs/sandbox/names.py)
    # True: a user namespace of its own, root in it a range of unprivileged host ids
    # (lazyfs/sandbox/userns.py).
    userns: bool = False


def find_runtime(runtime: str) -> str:
    """The runtime's absolute path; BadInputError if there is no such executable."""
    path = shutil.which(runtime)
    if path is None:
        raise BadInputError(f"--runtime {runtime}: no such executable")
    return os.path.abspath(path)


class OutputTooBig(OSError):
    """A helper wrote more than run_helper's `limit` (it has been killed)."""


def run_helper(
    argv: list[str], timeout: float = RUNTIME_TIMEOUT, limit: int | None = None
) -> tuple[int, str]:
    """A short-lived host helper's exit status and what it wrote (stdout and stderr),
    its stdin /dev/null; OSError if it cannot start, or if it is still running after
    `timeout` seconds (it is killed then). With a `limit`, a helper that writes more
    bytes than that is killed and OutputTooBig raised: for one whose output a sandbox
    can make huge (`ps`, of its processes' command lines).

    posix_spawn (lazyfs/spawn.py, with the GIL released) rather than subprocess.run: a
    generic sandbox's claim runs one (the attach helper), and in a process of the agent's
    size and threads subprocess.run took 1.33 ms and 0.28 ms of CPU per call here,
    posix_spawn 0.86-0.94 ms and 0.12-0.15 ms (docs/design-changes.md, session 27). Only
    descriptors without O_CLOEXEC reach the helper, where subprocess would close them:
    Python opens every descriptor so, and the helpers are lazyfs's own, which exit
    without running anything else."""
    r, w = os.pipe()
    try:
        with _stdio(w, quiet=False) as (stdin, out):  # /dev/null, and w as 1 and 2
            pid = _spawn(argv, stdin, out, None)
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)
    said = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while (left := deadline - time.monotonic()) > 0 and select.select([r], [], [], left)[0]:
            piece = os.read(r, 65536)
            if not piece:  # it exited, or closed its stdout and stderr
                break
            said += piece
            if limit is not None and len(said) > limit:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise OutputTooBig(errno.EMSGSIZE, f"{argv[0]} wrote more than {limit} bytes")
    finally:
        os.close(r)
    try:  # within what the reads left of the timeout; killed past it
        code = _wait_for(pid, argv, max(deadline - time.monotonic(), 0))
    except TimeoutError:  # an OSError, ETIMEDOUT: said with the whole timeout
        raise TimeoutError(errno.ETIMEDOUT, f"{argv[0]} still ran after {timeout:g} s") from None
    return code, said.decode(errors="replace")


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _layer_options(limits: Limits) -> bytes:
    return f"size={limits.disk},nr_inodes={limits.inodes},mode=0700".encode()


def mount_layer(target: Path, limits: Limits, ids: IdRange | None = None) -> None:
    """The sandbox's writable layer: a tmpfs of --disk bytes (see the top), owned by the
    base of the sandbox's id range if it has its own user namespace (userns.py)."""
    options = _layer_options(limits)
    if ids is not None:
        options += f",uid={ids.base},gid={ids.base}".encode()
    ret = libc.mount(b"lazyfs-layer", bytes(target), b"tmpfs", MS_NOSUID | MS_NODEV, options)
    _check(ret, f"mount the writable layer on {target}")


class Sandbox:
    """One sandbox; see the module docstring for its lifecycle and what it leaves."""

    def __init__(
        self, box_id: str, runtime: str, host: SandboxHost, lock_fd: int | None = None
    ) -> None:
        self.id = box_id
        self.host = host
        self.dir = host.sandbox_dir / box_id
        self.lock_path = host.sandbox_dir / f"{box_id}.lock"
        self.runtime = runtime
        self.state = host.state_dir / Path(runtime).name
        self.rootfs = self.dir / "rootfs"
        self.pid: int | None = None  # the container's init, while not yet reaped
        self.exit_status: int | None = None
        self._lock_fd = lock_fd
        self.timings: dict[str, float] = {}  # phase -> seconds, for benchmarks
        # With a user namespace of its own (userns.py): its id range, and the resource
        # limits that create() gives it.
        self.ids: IdRange | None = None
        self.rlimits: list[dict] = []

    @property
    def lock_fd(self) -> int | None:
        """The descriptor holding the sandbox's lock file (see the top), while it is held."""
        return self._lock_fd

    # -------------------------------------------------------------- making one

    @classmethod
    def prepare(cls, lower: Root, request: SandboxRequest, host: SandboxHost) -> Sandbox:
        """A bundle ready for create(): a private overlay over `lower` (the image's
        read-only tree) and its config.json. Raises BadInputError for a command that is
        not in the image (exit 127) or a user the image does not know."""
        from lazyfs.sandbox.process import build_process

        with cls._bundle(request, host) as box:
            pinned = box._mount_root(lower, request.names, request.network)
            userns = None if pinned is None else UserNamespace(pinned, box.ids)
            process = build_process(
                box.rootfs,
                request.image_config,
                request.command,
                request.env,
                request.cwd,
                from_host=request.helper is not None,
                hostname=request.names.hostname,
            )
            spec = build_spec(
                box.rootfs,
                process,
                request.limits,
                cgroups_path=f"/{host.cgroup_parent}/{box.id}",
                network=request.network,
                init=Init(TINI, TINI_ARGS) if request.init and os.path.exists(TINI) else None,
                resolv_conf=RESOLV_CONF if os.path.exists(RESOLV_CONF) else None,
                helper=request.helper,
                tmpfs=request.tmpfs,
                confinement=request.confinement,
                hostname=request.names.hostname,
                userns=userns,
            )
            if userns is not None:  # set after the create (userns.py)
                box.rlimits = spec["process"].pop("rlimits")
            (box.dir / "config.json").write_text(json.dumps(spec))
        return box

    @classmethod
    def prepare_generic(cls, request: SandboxRequest, host: SandboxHost) -> Sandbox:
        """A bundle for a warm sandbox that no image is chosen for yet (issue 23), which
        take_root() later gives an image's root. Its own root until then is the start-up
        root: a read-only directory of empty mount points (STARTUP_DIRS) in its writable
        layer; the command is a static binary bound in from the host (request.helper),
        run as root with the default PATH. Everything else is a normal sandbox's: the
        namespaces, cgroup, capabilities, seccomp filter, masked and read-only paths."""
        from lazyfs.sandbox.oci_spec import Process
        from lazyfs.sandbox.process import DEFAULT_PATH

        assert request.helper is not None and not request.network and not request.init
        with cls._bundle(request, host) as box:
            startup = box.dir / STARTUP_ROOT
            for sub in STARTUP_DIRS:
                (startup / sub).mkdir(parents=True)
            process = Process(
                args=list(request.command), env=[f"PATH={DEFAULT_PATH}"], cwd="/", uid=0, gid=0
            )
            spec = build_spec(
                startup,
                process,
                request.limits,
                cgroups_path=f"/{host.cgroup_parent}/{box.id}",
                helper=request.helper,
                confinement=Confinement(read_only=True),
            )
            (box.dir / "config.json").write_text(json.dumps(spec))
        return box

    @classmethod
    @contextlib.contextmanager
    def _bundle(cls, request: SandboxRequest, host: SandboxHost) -> Iterator[Sandbox]:
        """A new sandbox's id, lock and writable layer (of request.limits), for the with
        to fill in its bundle; deleted if the with fails; its "prepare" timing set."""
        t0 = time.perf_counter()
        runtime = find_runtime(request.runtime)
        box = cls._allocate(runtime, host)
        try:
            if request.userns:
                check_reachable(host.sandbox_dir, "LAZYFS_SANDBOX_DIR")
                box.ids = allocate(
                    host.sandbox_dir, lambda ids: mount_layer(box.dir, request.limits, ids)
                )
            else:
                mount_layer(box.dir, request.limits)
            (box.dir / "runtime").write_text(runtime)
            yield box
        except BaseException:
            box.delete()
            raise
        box.timings["prepare"] = time.perf_counter() - t0

    def take_root(
        self,
        lower: Root,
        attach: Path,
        tmpfs: tuple[Tmpfs, ...] = (),
        read_only: bool = False,
        names: SandboxNames = DEFAULT_NAMES,
    ) -> None:
        """Give this started generic sandbox a private overlay over `lower` (an image's
        tree, under the sandbox's /etc/hosts and /etc/hostname with `names`: names.py) as
        the root of all its processes, its hostname if not the default, and then its
        `tmpfs` mounts, the root made read-only last if asked, through the static helper `attach`
        (lazyfs/sandbox/attach_root.c, which says how). The overlay stays mounted at
        rootfs/ on the host as well, as a normal sandbox's: the agent's file API and
        command lookup read it there. RuntimeFailed if the helper
        fails; the caller then deletes the sandbox."""
        assert self.pid is not None, "a started sandbox"
        t0 = time.perf_counter()
        try:
            self._mount_root(lower, names)
            mounts = [arg for t in tmpfs for arg in t.helper_args()]
            flags = ["--read-only"] if read_only else []
            if names.hostname != DEFAULT_NAMES.hostname:
                flags += ["--hostname", names.hostname]
            argv = [str(attach), *flags, str(self.pid), str(self.rootfs), *mounts]
            code, said = run_helper(argv)
        except OSError as exc:
            raise RuntimeFailed(f"sandbox {self.id}: taking the image's root: {exc}") from None
        if code != 0:
            why = said.strip().splitlines()[-1:] or [f"exit {code}"]
            raise RuntimeFailed(f"sandbox {self.id}: taking the image's root: {why[0]}")
        self.timings["take_root"] = time.perf_counter() - t0

    def _mount_root(self, lower: Root, names: SandboxNames, network: bool = False) -> str | None:
        """The sandbox's private overlay at rootfs/: its upper and work directories and
        its /etc/hosts layer (lazyfs/sandbox/names.py) in its writable layer, over `lower`.
        With an id range (userns.py): over id-mapped clones of `lower`'s trees, everything
        of its own owned by the range, and its user namespace pinned at userns in its
        layer, whose path this returns (else None)."""
        from lazyfs.sandbox.names import stacked, write_names_layer

        for sub in ("upper", "work", "rootfs"):
            (self.dir / sub).mkdir()
        layer = write_names_layer(self.dir, lower, names, network)
        if self.ids is None:
            mount_overlay(stacked(layer, lower), self.dir / "upper", self.dir / "work", self.rootfs)
            return None
        for own in (self.dir / "upper", self.dir / "work", layer):
            if own is not None:
                shift(own, self.ids)
        userns = make_userns(self.ids)
        clones: list[int] = []
        try:
            pinned = pin(userns, self.dir / "userns")
            trees = [lower] if isinstance(lower, Path) else list(lower)
            for tree in trees:
                clones.append(idmapped(tree, userns))
            mapped = root_of([Path(f"/proc/self/fd/{fd}") for fd in clones])
            upper, work = self.dir / "upper", self.dir / "work"
            mount_overlay(stacked(layer, mapped), upper, work, self.rootfs)
        finally:
            for fd in [userns, *clones]:  # the overlay holds its layers
                os.close(fd)
        return pinned

    @classmethod
    def _allocate(cls, runtime: str, host: SandboxHost) -> Sandbox:
        """A new id whose lock file is ours before its name exists. A `.new-*.lock` that
        nobody holds locked is an allocator's that died (cleanup_stale removes it at
        once); one made a moment ago is not locked yet either, so once ours is locked we
        check that no cleaner removed it meanwhile, and make another if one did."""
        private_dir(host.sandbox_dir, private=SEARCH_ONLY)
        # os.urandom (what secrets.token_hex reads), not secrets: its import loads OpenSSL,
        # ~10 ms of each `lazyfs run` here (session 26); O_EXCL as tempfile.mkstemp, whose
        # import was another ~1 ms of each (session 29).
        while True:
            tmp = host.sandbox_dir / f".new-{os.urandom(8).hex()}.lock"
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_nlink:
                break
            os.close(fd)  # a cleaner took it between the open and the lock
        try:
            os.write(fd, f"{os.getpid()}\n".encode())
            box_id = ID_PREFIX + os.urandom(6).hex()
            os.rename(tmp, host.sandbox_dir / f"{box_id}.lock")
            box = cls(box_id, runtime, host, fd)
            box.dir.mkdir(mode=0o700)
            return box
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    # -------------------------------------------------------------- running it

    def _runtime(
        self,
        *args: str,
        check: bool = True,
        quiet: bool = False,
        log: int | None = None,
        nice: int = 0,
        fd3: int | None = None,
    ) -> int:
        """Run the runtime with `args` and wait for it (its exit status). Its stdin is
        /dev/null, its stdout and stderr `log`, unless log is None: then its stdio is this
        process's (`quiet`: /dev/null instead). `fd3`: the descriptor it gets as its 3."""
        argv = [self.runtime, "--root", str(self.state), *args]
        if nice:  # what the runtime starts in the container inherits it (see renice)
            argv = [NICE, "-n", str(nice), *argv]
        try:
            with _stdio(log, quiet) as (stdin, out):
                pid = _spawn(argv, stdin, out, fd3)
            code = _wait_for(pid, argv, RUNTIME_TIMEOUT)
        except TimeoutError:
            name = Path(self.runtime).name
            raise RuntimeFailed(
                f"{name} {args[0]} did not finish in {RUNTIME_TIMEOUT:g} s"
            ) from None
        if check and code != 0:
            name = Path(self.runtime).name
            why = self._runtime_error() if log is not None else ""
            raise RuntimeFailed(f"{name} {args[0]} failed (exit {code}){why}")
        return code

    def _runtime_error(self) -> str:
        """The runtime's own reason, from the end of the bundle's log (where a detached
        runtime writes): runc logs `level=error msg="..."`."""
        try:
            with open(self.dir / "log", "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
                lines = f.read().decode(errors="replace").strip().splitlines()
        except OSError:
            return ""
        if not lines:
            return ""
        found = re.search(r'msg="((?:[^"\\]|\\.)*)"', lines[-1])
        return f": {found.group(1) if found else lines[-1]}"

    def create(self, detached: bool = False, nice: int = 0) -> int:
        """`runtime create`; returns the container init's pid. The container's stdin,
        stdout and stderr are this process's (the runtime passes its own through), or
        with `detached`, /dev/null and the bundle's `log` file: a resident agent must not
        hand its own stdio to sandboxes that outlive the request. `nice`: the runtime and
        the container's processes run at that niceness (background work: warm pools)."""
        t0 = time.perf_counter()
        pid = self._launch(("create",), detached, nice)
        self.timings["create"] = time.perf_counter() - t0
        return pid

    def run_detached(self, nice: int = 0, fd3: int | None = None, stdio: bool = False) -> int:
        """create(detached=True) and start(detached=True) in one `runtime run --detach`:
        one start-up of the runtime's binary fewer (65 against 74 ms median here, 15
        rounds interleaved). `fd3`: a descriptor that the container's PID 1 gets as its
        fd 3 (`--preserve-fds 1`; the agent's exec server's listening socket). `stdio`:
        the container's stdio is this process's, as with create(). Returns the container
        init's pid. A sandbox with a user namespace of its own is created and started in
        two, its resource limits set in between (_launch)."""
        t0 = time.perf_counter()
        if self.ids is None:
            pid = self._launch(("run", "--detach"), not stdio, nice, fd3)
        else:
            pid = self._launch(("create",), not stdio, nice, fd3)
            self.start(not stdio, nice)
        self.timings["runtime"] = time.perf_counter() - t0
        return pid

    def _launch(
        self, verb: tuple[str, ...], detached: bool, nice: int, fd3: int | None = None
    ) -> int:
        # The container's init is re-parented to us when the runtime exits: we reap it.
        _check(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)")
        self.state.mkdir(parents=True, exist_ok=True)
        pid_file = self.dir / "init.pid"
        if fd3 is not None:
            verb = (*verb, "--preserve-fds", "1")
        args = (*verb, "--bundle", str(self.dir), "--pid-file", str(pid_file), self.id)
        if detached:
            with open(self.dir / "log", "ab") as log:
                self._runtime(*args, log=log.fileno(), nice=nice, fd3=fd3)
        else:
            self._runtime(*args, nice=nice)
        self.pid = int(pid_file.read_text())
        if self.ids is not None and self.rlimits:  # created, not started (userns.py)
            set_limits(self.pid, self.ids, self.rlimits)
        return self.pid

    def start(self, detached: bool = False, nice: int = 0) -> None:
        """`runtime start`: the command starts (exec of PID 1)."""
        t0 = time.perf_counter()
        if detached:
            with open(self.dir / "log", "ab") as log:
                self._runtime("start", self.id, log=log.fileno(), nice=nice)
        else:
            self._runtime("start", self.id, nice=nice)
        self.timings["start"] = time.perf_counter() - t0

    def renice(self, nice: int = 0) -> None:
        """Set the niceness of every process in the sandbox (per thread, as Linux keeps
        it): how a pooled sandbox, started in the background at a low priority, runs its
        claimant's commands at the normal one. A few syscalls: a pooled sandbox holds
        its init and the process it runs."""
        # Each hierarchy lists every thread: one will do.
        for path in map(Path, cgroup_dirs(self.host.cgroup_parent, self.id)):
            try:
                tasks = (path / "tasks").read_text()  # v1
            except FileNotFoundError:
                tasks = (path / "cgroup.threads").read_text()  # v2
            for tid in tasks.split():
                with contextlib.suppress(ProcessLookupError):
                    os.setpriority(os.PRIO_PROCESS, int(tid), nice)
            return

    def update_limits(self, limits: Limits) -> None:
        """Set the cgroup limits of a created (or running) container: how a pooled
        sandbox, made without limits, takes a claim's. Only limits the claim sets change
        (a pooled sandbox has none to undo).

        The cgroup files are written here rather than through `runtime update`: that is a
        Go binary's start (12 ms p50 here, the bulk of a claim with limits), while the
        writes take 0.2 ms. The values are those the runtime would write for the
        same linux.resources (oci_spec.limit_resources), on cgroup v1 or v2, at the path
        config.json names (cgroupfs driver: /lazyfs/<id> in every hierarchy)."""
        resources = limit_resources(limits)
        try:
            if (CGROUP_ROOT / "cgroup.controllers").exists():  # v2: one unified hierarchy
                _write_v2(CGROUP_ROOT / self.host.cgroup_parent / self.id, resources)
            else:
                _write_v1(self.host.cgroup_parent, self.id, resources)
        except OSError as exc:
            raise RuntimeFailed(
                f"sandbox {self.id}: setting its limits failed ({exc.strerror or exc})"
            ) from None

    def resize_disk(self, limits: Limits) -> None:
        """Set the writable layer's size and inode count to `limits`' (a remount: how a
        pooled sandbox, made with the agent's default, takes a claim's --disk)."""
        flags = MS_REMOUNT | MS_NOSUID | MS_NODEV
        if libc.mount(b"lazyfs-layer", bytes(self.dir), b"tmpfs", flags, _layer_options(limits)):
            err = ctypes.get_errno()
            if err == errno.EINVAL:  # the sandbox holds more than that already
                raise BadInputError(f"disk {limits.disk} is less than sandbox {self.id} uses")
            raise RuntimeFailed(f"sandbox {self.id}: resizing its disk failed ({os.strerror(err)})")

    def wait(self) -> int:
        """The command's exit status (128+N if signal N killed it); reaps PID 1."""
        assert self.pid is not None, "create() first"
        t0 = time.perf_counter()
        _, status = os.waitpid(self.pid, 0)
        self.timings["run"] = time.perf_counter() - t0
        self.pid = None
        code = os.waitstatus_to_exitcode(status)
        self.exit_status = 128 - code if code < 0 else code
        return self.exit_status

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the sandbox's PID 1; SIGKILL ends every process in it (the kernel kills
        a PID namespace with its init)."""
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)  # not yet reaped by us, so the pid is still its

    @contextlib.contextmanager
    def _killed_by_signals(self) -> Iterator[list[int]]:
        """For the with: SIGTERM, SIGINT and SIGHUP to this process kill the sandbox's PID
        1 (SIGKILL) and are listed in the list it yields."""
        got: list[int] = []

        def on_signal(signum: int, _frame: object) -> None:
            got.append(signum)
            self.kill(signal.SIGKILL)

        previous = {s: signal.signal(s, on_signal) for s in FORWARDED_SIGNALS}
        try:
            yield got
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def run_foreground(self) -> int:
        """create, start, wait; SIGTERM/SIGINT/SIGHUP to this process kill the sandbox
        and the result is then 128+that signal. The caller still calls delete()."""
        with self._killed_by_signals() as got:
            self.create()
            if not got:
                self.start()
            status = self.wait() if not got else 128 + got[0]
            return 128 + got[0] if got else status

    def start_foreground(self) -> int | None:
        """create and start as run_foreground does, in one `runtime run --detach` (one
        start-up of the runtime's binary fewer: run_detached()) with this process's stdio,
        without the wait: None once the command runs, with SIGTERM, SIGINT and SIGHUP then
        blocked (one that comes stays pending) for whoever waits next to take over
        (`lazyfs run`'s waiter, run_wait.c, which does what run_foreground does with
        them). If one came meanwhile, the sandbox is killed and that signal's number
        returned (the result is 128+it), with the signals not blocked. The caller still
        calls delete()."""
        with self._killed_by_signals() as got:
            self.run_detached(stdio=True)
            if got:
                self.kill()  # it may have started before the signal's handler could
            else:
                # pthread_sigmask runs the handler of a signal that came just before
                signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED_SIGNALS)
                if got:
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED_SIGNALS)
            return got[0] if got else None

    def oom_kills(self) -> int:
        """How many processes the memory cgroup's OOM killer killed (read before delete)."""
        return oom_kills(self.host.cgroup_parent, self.id)

    # -------------------------------------------------------------- removing it

    def delete(self) -> None:
        """Remove everything of this sandbox, whatever state it is in; idempotent. A
        paused one is thawed first: a frozen PID 1 would not die of the kill."""
        thaw(self.host.cgroup_parent, self.id)
        # Once PID 1 is reaped the kernel has killed the PID namespace, so there is nothing
        # left for `runtime delete` to do that the lines below do not (cgroups, state),
        # and not starting the runtime binary saves 15-30 ms per sandbox; the agent's
        # sandboxes' inits are its children too, and its deletes went from 115-127 ms
        # (`runtime delete --force` first) to 6-8 ms.
        if self.pid is not None:  # our child: kill it, and reap it rather than leave a zombie
            self.kill(signal.SIGKILL)
            try:
                _, status = os.waitpid(self.pid, 0)
                if self.exit_status is None:
                    code = os.waitstatus_to_exitcode(status)
                    self.exit_status = 128 - code if code < 0 else code
            except ChildProcessError:
                pass  # not ours after all (reaped elsewhere): the runtime deletes it
            self.pid = None
        if self.exit_status is None and (self.state / self.id).exists():
            self._runtime("delete", "--force", self.id, check=False, quiet=True)
        remove_sandbox(
            str(self.dir),
            str(self.state / self.id),
            str(self.lock_path),
            self.host.cgroup_parent,
            self.id,
        )
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


@contextlib.contextmanager
def _stdio(log: int | None, quiet: bool) -> Iterator[tuple[int | None, int | None]]:
    """(stdin, stdout and stderr) for a runtime call, as _runtime says; None: this
    process's own."""
    if log is None and not quiet:
        yield None, None
        return
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        yield null, null if log is None else log
    finally:
        os.close(null)


def _spawn(argv: list[str], stdin: int | None, out: int | None, fd3: int | None) -> int:
    """Start argv (argv[0] an absolute path: find_runtime, NICE) with `stdin` as its
    descriptor 0, `out` as 1 and 2, `fd3` as 3 (None: leave that one as this process's;
    `runc --preserve-fds 1` passes the container fd 3 exactly); returns its pid.

    posix_spawn (lazyfs/spawn.py, which lets the caller's other threads run meanwhile),
    not subprocess: every `lazyfs run` starts the runtime, and subprocess's
    import was ~2 ms of each (session 29); it cannot give a child a descriptor at a chosen
    number either (pass_fds keeps the parent's). The sources are first copied above 3,
    close-on-exec, so that no dup2 overwrites another's source and no other child inherits
    them. Only descriptors without O_CLOEXEC reach the child, as with run_helper. The
    child keeps this process's working directory (posix_spawn here cannot chdir): `runc
    init` leaves it for the container's own at once, and runc itself exits."""
    wanted = [(n, fd) for n, fd in ((0, stdin), (1, out), (2, out), (3, fd3)) if fd is not None]
    sources: list[int] = []
    try:
        sources = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 4) for _, fd in wanted]
        targets = [n for n, _ in wanted]
        return spawn(argv, os.environ, dup2=list(zip(sources, targets, strict=True)))
    finally:
        for fd in sources:
            os.close(fd)


def _wait_for(pid: int, argv: list[str], timeout: float) -> int:
    """The exit status of our child `pid` (-N: signal N), as subprocess gives it; after
    `timeout` seconds it is killed and TimeoutError (an OSError, ETIMEDOUT) raised.
    Through a pidfd: subprocess's wait with a timeout polls with sleeps that double up to
    50 ms, and saw a runtime that took ~70 ms end ~40 ms late (lazyfs run,
    docs/design-changes.md)."""
    pidfd = os.pidfd_open(pid)
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        ended = poller.poll(timeout * 1000)
    finally:
        os.close(pidfd)
    if not ended:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise TimeoutError(errno.ETIMEDOUT, f"{argv[0]} still ran after {timeout:g} s")
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _write(path: Path, value: object) -> None:
    with open(path, "w") as f:  # one write(2): cgroup files take a value per write
        f.write(str(value))


def _write_v1(parent: str, box_id: str, resources: dict) -> None:
    """The resources into the sandbox's cgroup of each v1 controller."""
    where = f"{parent}/{box_id}"
    memory = resources.get("memory")
    if memory is not None:
        mem = CGROUP_ROOT / "memory" / where
        limit, memsw = mem / "memory.limit_in_bytes", mem / "memory.memsw.limit_in_bytes"
        try:  # memory <= memory+swap at every step: which goes first depends on the old
            _write(limit, memory["limit"])
            if memsw.exists():  # swap accounting is on
                _write(memsw, memory["swap"])
        except OSError:
            _write(memsw, memory["swap"])
            _write(limit, memory["limit"])
    cpu = resources.get("cpu", {})
    if "quota" in cpu:
        _write(CGROUP_ROOT / "cpu" / where / "cpu.cfs_period_us", cpu["period"])
        _write(CGROUP_ROOT / "cpu" / where / "cpu.cfs_quota_us", cpu["quota"])
    if "shares" in cpu:
        _write(CGROUP_ROOT / "cpu" / where / "cpu.shares", cpu["shares"])
    if "cpus" in cpu:
        _write(CGROUP_ROOT / "cpuset" / where / "cpuset.cpus", cpu["cpus"])
    _write(CGROUP_ROOT / "pids" / where / "pids.max", resources["pids"]["limit"])


def _write_v2(path: Path, resources: dict) -> None:
    memory = resources.get("memory")
    if memory is not None:
        _write(path / "memory.max", memory["limit"])
        if (path / "memory.swap.max").exists():  # the OCI swap is memory+swap
            _write(path / "memory.swap.max", memory["swap"] - memory["limit"])
    cpu = resources.get("cpu", {})
    if "quota" in cpu:
        _write(path / "cpu.max", f"{cpu['quota']} {cpu['period']}")
    if "shares" in cpu:
        _write(path / "cpu.weight", cpu_weight(cpu["shares"]))
    if "cpus" in cpu:
        _write(path / "cpuset.cpus", cpu["cpus"])
    _write(path / "pids.max", resources["pids"]["limit"])


def cpu_weight(shares: int) -> int:
    """cgroup v2's cpu.weight (1-10000) for v1's cpu.shares (2-262144), mapped linearly
    as runc 1.1 maps linux.resources.cpu.shares, so that a pooled sandbox given shares
    at its claim gets the weight a sandbox created with them has."""
    return 1 + (shares - 2) * 9999 // 262142


def cleanup_stale(host: SandboxHost) -> list[str]:
    """Delete every sandbox whose owner is gone (its lock file is not locked), and return
    their ids. Safe while other sandboxes run: a live owner holds its lock."""
    if not host.sandbox_dir.is_dir():
        return []
    cleaned = []
    for entry in host.sandbox_dir.iterdir():
        name = entry.name
        if name.startswith(".new-") and name.endswith(".lock"):
            _remove_unlocked(entry)  # an owner killed while allocating
            continue
        if not name.startswith(ID_PREFIX):
            continue
        box_id = name.removesuffix(".lock")
        lock_path = host.sandbox_dir / f"{box_id}.lock"
        try:
            fd = os.open(lock_path, os.O_RDWR)
        except FileNotFoundError:
            if entry.is_dir() and not lock_path.exists():  # a cleaner died half-way
                _delete_orphan(host, box_id, None)
                cleaned.append(box_id)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)  # alive
            continue
        if not lock_path.exists():  # deleted by its owner or another cleaner meanwhile
            os.close(fd)
            continue
        _delete_orphan(host, box_id, fd)
        cleaned.append(box_id)
    return cleaned


def _delete_orphan(host: SandboxHost, box_id: str, lock_fd: int | None) -> None:
    runtime_file = host.sandbox_dir / box_id / "runtime"
    try:
        runtime = runtime_file.read_text().strip()
    except OSError:
        runtime = shutil.which(DEFAULT_RUNTIME) or DEFAULT_RUNTIME
    Sandbox(box_id, runtime, host, lock_fd).delete()


def _remove_unlocked(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        path.unlink(missing_ok=True)
    except BlockingIOError:
        pass
    finally:
        os.close(fd)
