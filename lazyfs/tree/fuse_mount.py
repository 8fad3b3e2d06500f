"""The mount process: one read-only FUSE mount of one image (pyfuse3 allows one per process).

    lazyfs mount IMAGE MOUNTPOINT [--store URL] [--cache DIR] [--foreground]
    lazyfs umount MOUNTPOINT

`serve` does the work in the calling process (--foreground): resolve the image, fetch its
manifest into CACHE/manifests/, open the manifest and the node cache, start the image's
start-up trace (node_cache/prefetch.py: replay it in the background, or record one),
mount, run the loop until SIGTERM/SIGINT or an unmount, then unmount (writing a
trace still being recorded before the final stats). While it serves, it keeps the node's
files bounded as the node data daemon does (_keep_node_files): on a node whose kernel
cannot mount EROFS from a file, these daemons are the only tree processes it has.
`start_daemon` runs `serve` in a detached child (`python -m lazyfs.tree.fuse_mount ...
--ready-fd N`) and returns once the child reports through a pipe that the mount answers,
or raises with the child's one-line error.

The mount uses `auto_unmount`: libfuse leaves a `fusermount3` helper watching the FUSE fd,
so a daemon killed with SIGKILL leaves no dead (ENOTCONN) mount behind.

Its log and stats files: node_files.py.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chunker.errors import BadInputError, LazyfsError
from chunker.manifest import Manifest
from chunker.refs import resolve_image
from chunker.store.backends import open_store
from lazyfs.arguments import Parser
from lazyfs.errors import MountError
from lazyfs.mount_table import FUSE_TREE_FSTYPE
from lazyfs.oom import set_oom_score_adj
from lazyfs.settings import Settings
from lazyfs.tree.daemon_log import LOG_KEEP, keep_log_bounded
from lazyfs.tree.daemon_start import spawn_daemon
from lazyfs.tree.fuse_daemon import (
    raise_mount_read_ahead,
    reporting_failure,
    start_mount_watchdog,
)
from lazyfs.tree.image_files import sweep_period
from lazyfs.tree.mount_watch import (
    Ready,
    ready_reporter,
)
from lazyfs.tree.node_files import (
    STATS_INTERVAL,
    cached_image_id,
    cached_manifest,
    check_mountpoint,
    lazyfs_mounts,
    state_path,
    sweep_image_files,
    write_json,
)

if TYPE_CHECKING:
    from lazyfs.tree.fuse_ops import Operations
    from node_cache.prefetch import StartupTrace

log = logging.getLogger("lazyfs.tree.fuse_mount")

FSTYPE = FUSE_TREE_FSTYPE
FIRST_UPKEEP = 1.0  # seconds after the mount of its first sweep of the node's files
SWEEP_LOCK = "image-files-sweep"  # in CACHE/locks/: one FUSE daemon's sweep at a time


@dataclass(frozen=True)
class MountRequest:
    """What to mount: also what a started daemon gets on its command line (start_daemon);
    the cache's policy it reads from its own settings."""

    image: str
    mountpoint: Path
    store_url: str
    cache_dir: Path


# ---------------------------------------------------------------- the daemon


def serve(req: MountRequest, settings: Settings, ready: Ready | None = None) -> int:
    """Mount and serve until unmounted or signalled; returns the exit code.

    ready(None, 0) is called once the mount answers requests; ready(message, code) if
    starting failed (the exception is raised too, as a LazyfsError).
    """
    return reporting_failure(functools.partial(_serve, req, settings, ready), ready)


def _serve(req: MountRequest, settings: Settings, ready: Ready | None) -> int:
    policy = settings.cache
    mountpoint = check_mountpoint(req.mountpoint)
    cache_dir = req.cache_dir
    stats_file = state_path(cache_dir, mountpoint, ".json")
    stats_file.parent.mkdir(parents=True, exist_ok=True)
    store = open_store(req.store_url)
    manifest = cache = trace = ops = None
    try:
        image_id = cached_image_id(req.image, cache_dir) or resolve_image(store, req.image)
        manifest = Manifest(cached_manifest(store, image_id, cache_dir))
        from node_cache.cache import NodeCache

        cache = NodeCache(cache_dir, store, policy)
        if policy.prefetch:
            from node_cache.prefetch import StartupTrace

            # Before the FUSE imports and set-up: the trace's GETs run meanwhile.
            trace = StartupTrace(cache, store, image_id)
            trace.start()
        from lazyfs.tree.daemon_loop import run_loop
        from lazyfs.tree.fuse_ops import Operations
        from lazyfs.tree.pyfuse3_asyncio import pyfuse3

        ops = Operations(
            manifest,
            cache,
            image_id=image_id,
            mountpoint=str(mountpoint),
            after_init=functools.partial(raise_mount_read_ahead, str(mountpoint)),
        )
        options = {"fsname=lazyfs", "subtype=lazyfs", "ro", "default_permissions"}
        options |= {"nosuid", "nodev"}  # an image's setuid files and devices: inert here
        options.add("auto_unmount")  # a killed daemon must not leave an ENOTCONN mount
        if os.geteuid() == 0 or _user_allow_other():
            options.add("allow_other")  # sandboxes run as other users
        try:
            pyfuse3.init(ops, str(mountpoint), options)
        except RuntimeError as exc:
            raise MountError(f"cannot mount {mountpoint}: {exc}") from None
        log.info("mounted image %s at %s (pid %d)", image_id, mountpoint, os.getpid())
        start_mount_watchdog(str(mountpoint))
        stats = functools.partial(_stats, ops, trace)
        try:
            upkeep = functools.partial(_keep_node_files, cache_dir, image_id, settings)
            run_loop(_main_loop, ready, stats, stats_file, upkeep)
        finally:
            pyfuse3.close(unmount=True)
            if trace is not None:
                trace.finish()  # writes a recorded trace before the final stats say so
            final = {**stats(), "mounted": False}
            write_json(stats_file, final)
            log.info("unmounted %s; stats %s", mountpoint, json.dumps(final))
    finally:
        if trace is not None:
            trace.finish()  # idempotent; here for a failure before the loop ran
        if ops is not None:
            ops.reader.close()  # its fetches first: they use the cache
        if cache is not None:
            cache.close()
        if manifest is not None:
            manifest.close()
        store.close()
    return 0


def _user_allow_other() -> bool:
    try:
        with open("/etc/fuse.conf") as f:
            return any(line.strip() == "user_allow_other" for line in f)
    except OSError:
        return False


def _stats(ops: Operations, trace: StartupTrace | None) -> dict:
    """The mount's published stats: the FUSE layer's and cache's, and the trace's state."""
    return {**ops.stats(), **(trace.status() if trace is not None else {"trace": "off"})}


async def _main_loop(
    ready: Ready | None,
    stats: Callable[[], dict],
    stats_file: Path,
    upkeep: Callable[[], Coroutine[Any, Any, None]],
) -> None:
    from lazyfs.tree.daemon_loop import serve_requests

    await serve_requests(ready, _publish_stats(stats, stats_file), upkeep())


async def _keep_node_files(cache_dir: Path, image_id: str, settings: Settings) -> None:
    """What the node data daemon does for the node (data_daemon.py: _sweep_image_files,
    _bound_log), here where no data daemon runs: the images' files kept under their
    share of the cache, with the state files of the mounts of images whose files went,
    and this daemon's log file bounded. Each FUSE daemon of the node does it, one at a
    time (a lock in the cache); the first time soon after the mount, since most serve a
    single `lazyfs run` and exit before a longer wait would be over."""
    import asyncio

    from lazyfs.tree.daemon_loop import in_thread

    idle = settings.daemon_idle
    wait = min(FIRST_UPKEEP, idle)
    while True:
        await asyncio.sleep(wait)
        wait = sweep_period(idle)
        try:
            if await in_thread(keep_log_bounded):
                log.info("log file over %d bytes: the lines before are in its .1", LOG_KEEP)
            await in_thread(_sweep_once, cache_dir, image_id, settings)
        except OSError as exc:
            log.warning("cannot keep the node's files under %s bounded: %s", cache_dir, exc)
        except Exception:  # a bug here must not end the mount: its sandboxes stand on it
            log.exception("keeping the node's files under %s bounded failed", cache_dir)


def _sweep_once(cache_dir: Path, image_id: str, settings: Settings) -> None:
    """One sweep of the node's image files, unless another process sweeps them now."""
    import fcntl

    lock = os.open(cache_dir / "locks" / SWEEP_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return
        sweep_image_files(cache_dir, settings.cache, settings.daemon_idle, {image_id})
    finally:
        os.close(lock)


async def _publish_stats(get_stats: Callable[[], dict], path: Path) -> None:
    import asyncio

    last = None
    while True:
        stats = get_stats()
        counters = {k: v for k, v in stats.items() if k != "uptime_s"}
        if counters != last:
            # Small file, local disk: writing it on the loop thread costs microseconds.
            write_json(path, {**stats, "mounted": True})
            last = counters
        await asyncio.sleep(STATS_INTERVAL)


# ---------------------------------------------------------------- starting and stopping


def start_daemon(req: MountRequest) -> int:
    """Start a detached mount daemon; return its pid once the mount answers."""
    mountpoint = check_mountpoint(req.mountpoint)  # fail fast, before any fork
    cache_dir = req.cache_dir.absolute()
    argv = [sys.executable, "-m", "lazyfs.tree.fuse_mount", req.image, str(mountpoint)]
    argv += ["--cache", str(cache_dir)]
    if req.store_url:
        argv += ["--store", req.store_url]
    return spawn_daemon(argv, state_path(cache_dir, mountpoint, ".log"), "mount daemon")


def umount(mountpoint: Path) -> None:
    """Unmount a lazyfs mount (the daemon exits by itself once unmounted)."""
    point = os.path.abspath(mountpoint)
    fstype = lazyfs_mounts().get(point)
    if fstype is None:
        raise BadInputError(f"{point} is not a lazyfs mount")
    if fstype != FSTYPE:
        raise BadInputError(f"{point} is a {fstype} mount, not a lazyfs mount")
    done = subprocess.run(["fusermount3", "-u", point], capture_output=True, text=True)
    if done.returncode != 0:
        msg = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        raise MountError(f"cannot unmount {point}: {msg[0]}")


# ---------------------------------------------------------------- python -m lazyfs.tree.fuse_mount


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m lazyfs.tree.fuse_mount", description="lazyfs mount daemon")
    p.add_argument("image")
    p.add_argument("mountpoint", type=Path)
    p.add_argument("--store", default=None)
    p.add_argument("--cache", type=Path, default=None)
    p.add_argument("--ready-fd", type=int, default=None, help="write one JSON line when ready")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"
    )
    set_oom_score_adj()  # its sandboxes' image files: the OOM killer takes them first
    ready = None
    if args.ready_fd is not None:
        os.set_inheritable(args.ready_fd, False)  # not into libfuse's fusermount3 helper
        ready = ready_reporter(args.ready_fd)

    def start() -> int:
        settings = Settings.from_env()  # this daemon's entry point: read once, here
        store = args.store or settings.store_url
        req = MountRequest(args.image, args.mountpoint, store, args.cache or settings.cache_dir)
        return _serve(req, settings, ready)

    try:
        return reporting_failure(start, ready)
    except LazyfsError as exc:
        log.error("%s", exc)
        return exc.exit_code
    except BaseException as exc:  # a bug: tell the starter before the traceback
        if ready:
            ready(f"mount daemon failed: {exc!r}", 1)
        raise


if __name__ == "__main__":
    sys.exit(main())
