"""The mount process: one read-only FUSE mount of one image (pyfuse3 allows one per process).

    lazyfs mount IMAGE MOUNTPOINT [--store URL] [--cache DIR] [--foreground]
    lazyfs umount MOUNTPOINT

`serve` does the work in the calling process (--foreground): resolve the image, fetch its
manifest into CACHE/manifests/, open the manifest and the node cache, start the image's
start-up trace (node_cache/prefetch.py: replay it in the background, or record one),
mount, run the trio loop until SIGTERM/SIGINT or an unmount, then unmount (writing a
trace still being recorded before the final stats). `start_daemon` runs `serve` in a
detached child (`python -m lazyfs.mount ... --ready-fd N`) and returns once the child
reports through a pipe that the mount answers, or raises with the child's one-line error.

The mount uses `auto_unmount`: libfuse leaves a `fusermount3` helper watching the FUSE fd,
so a daemon killed with SIGKILL leaves no dead (ENOTCONN) mount behind.

State of a mount, under CACHE/mounts/ (<mp> = the absolute mount point, %-quoted):
    <mp>.log    the daemon's log
    <mp>.json   its stats (lazyfs.fuse_ops.Operations.stats plus "mounted"), rewritten
                atomically once a second while they change, and a last time at exit
                ("mounted": false). Read it with `read_stats(mountpoint, cache_dir)`.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

import blake3

from chunker.backends import open_store
from chunker.errors import BadInputError, LazyfsError, NotFoundError
from chunker.images import fetch_manifest, resolve_image
from chunker.manifest import Manifest
from chunker.store import ObjectStore
from lazyfs.errors import MountError
from lazyfs.mount_table import FUSE_TREE_FSTYPE, entries, mount_device, mounts, tree_kind
from lazyfs.mount_watch import (
    Ready,
    raise_read_ahead,
    read_report,
    ready_reporter,
    start_watchdog,
)
from lazyfs.oom import set_oom_score_adj
from lazyfs.settings import Settings, default_cache_dir, parse_size  # noqa: F401 - re-exported

if TYPE_CHECKING:
    from lazyfs.fuse_ops import Operations
    from node_cache.prefetch import StartupTrace

log = logging.getLogger("lazyfs.mount")

FSTYPE = FUSE_TREE_FSTYPE
_FULL_ID = re.compile(r"[0-9a-f]{64}")
STATS_INTERVAL = 1.0  # seconds between rewrites of the stats file
START_TIMEOUT = 600.0  # seconds for the daemon to fetch the manifest and mount


@dataclass(frozen=True)
class MountRequest:
    image: str
    mountpoint: Path
    store_url: str | None = None
    cache_dir: Path | None = None

    @property
    def cache(self) -> Path:
        return self.cache_dir or default_cache_dir()


# ---------------------------------------------------------------- checks


def lazyfs_mounts() -> dict[str, str]:
    """Mount point -> fstype of every FUSE mount."""
    return {m.point: m.fstype for m in entries() if m.fstype.startswith("fuse")}


def check_mountpoint(path: Path) -> Path:
    """An existing, empty directory that is not a mount point already."""
    path = Path(os.path.abspath(path))
    try:
        if not path.is_dir():
            if path.exists() or path.is_symlink():
                raise BadInputError(f"mount point {path} is not a directory")
            raise BadInputError(f"mount point {path} does not exist")
        if os.path.ismount(path) or str(path) in lazyfs_mounts():
            raise BadInputError(f"mount point {path} is already a mount point")
        with os.scandir(path) as it:
            if next(it, None) is not None:
                raise BadInputError(f"mount point {path} is not empty")
    except OSError as exc:  # e.g. ENOTCONN: a dead FUSE mount is sitting there
        raise BadInputError(f"cannot use mount point {path}: {exc.strerror}") from None
    return path


def cached_manifest(store: ObjectStore, image_id: str, cache_dir: Path) -> Path:
    """The image's manifest in CACHE/manifests/, fetched unless a verified copy is there.

    The file is only ever replaced by rename (never rewritten in place), because running
    mounts keep it open as an immutable SQLite file.
    """
    dest = cache_dir / "manifests" / f"{image_id}.db"
    if dest.exists() and blake3.blake3(dest.read_bytes()).hexdigest() == image_id:
        return dest
    return fetch_manifest(store, image_id, dest)


def _cached_image_id(image: str, cache_dir: Path) -> str | None:
    """A full image id whose manifest this node already holds needs no store round trip
    (`lazyfs run` resolves the name itself and hands the daemon the id)."""
    if _FULL_ID.fullmatch(image) and (cache_dir / "manifests" / f"{image}.db").exists():
        return image
    return None


def open_node_cache(cache_dir: Path, store: ObjectStore):  # noqa: ANN201 - NodeCache
    """The node cache, sized and timed by the settings (lazyfs/settings.py).

    Every process on the node evicts down to its own limit, so give them all the same
    $LAZYFS_CACHE_SIZE; $LAZYFS_FETCH_TIMEOUT bounds a read's wait for the store, after
    which the read fails with EIO instead of hanging.
    """
    from node_cache.cache import NodeCache

    settings = Settings.from_env()
    return NodeCache(
        cache_dir, store, max_bytes=settings.cache_size, fetch_timeout=settings.fetch_timeout
    )


# ---------------------------------------------------------------- the daemon


def serve(req: MountRequest, ready: Ready | None = None) -> int:
    """Mount and serve until unmounted or signalled; returns the exit code.

    ready(None, 0) is called once the mount answers requests; ready(message, code) if
    starting failed (the exception is raised too, as a LazyfsError).
    """
    return reporting_failure(functools.partial(_serve, req, ready), ready)


def reporting_failure(start: Callable[[], int], ready: Ready | None) -> int:
    """start(), whose failure is told to ready (the starter waiting for its report) as
    one line with an exit code, then raised as a LazyfsError."""
    try:
        return start()
    except OSError as exc:  # the local machine said no: permissions, a full disk
        where = f": {exc.filename}" if exc.filename else ""
        err: LazyfsError = MountError(f"{exc.strerror or exc}{where}")
    except LazyfsError as exc:
        err = exc
    if ready:
        ready(str(err), err.exit_code)
    raise err


def prefetch_enabled() -> bool:
    """$LAZYFS_PREFETCH=0 turns start-up traces off (no replay, no recording)."""
    return Settings.from_env().prefetch


def _serve(req: MountRequest, ready: Ready | None) -> int:
    mountpoint = check_mountpoint(req.mountpoint)
    cache_dir = req.cache
    stats_file = state_path(cache_dir, mountpoint, ".json")
    stats_file.parent.mkdir(parents=True, exist_ok=True)
    store = open_store(req.store_url)
    manifest = cache = trace = None
    try:
        image_id = _cached_image_id(req.image, cache_dir) or resolve_image(store, req.image)
        manifest = Manifest(cached_manifest(store, image_id, cache_dir))
        cache = open_node_cache(cache_dir, store)
        if prefetch_enabled():
            from node_cache.prefetch import StartupTrace

            # Before the FUSE imports and set-up: the trace's GETs run meanwhile.
            trace = StartupTrace(cache, store, image_id)
            trace.start()
        import pyfuse3
        import trio

        from lazyfs.fuse_ops import Operations

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
        stop_signals_only_in_loop()
        try:
            trio.run(_main_loop, str(mountpoint), ready, stats, stats_file)
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
    mountpoint: str, ready: Ready | None, stats: Callable[[], dict], stats_file: Path
) -> None:
    import pyfuse3
    import trio

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stop_on_signal)
        nursery.start_soon(_when_answering, mountpoint, ready)
        nursery.start_soon(_publish_stats, stats, stats_file)
        await pyfuse3.main()  # returns on terminate() or when the kernel unmounts us
        nursery.cancel_scope.cancel()


async def _publish_stats(get_stats: Callable[[], dict], path: Path) -> None:
    import trio

    last = None
    while True:
        stats = get_stats()
        counters = {k: v for k, v in stats.items() if k != "uptime_s"}
        if counters != last:
            # Small file, local disk: writing it on the loop thread costs microseconds.
            write_json(path, {**stats, "mounted": True})
            last = counters
        await trio.sleep(STATS_INTERVAL)


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.write_text(json.dumps(data, sort_keys=True) + "\n")
        tmp.replace(path)
    except OSError as exc:
        log.warning("cannot write stats to %s: %s", path, exc)


def mount_stats(cache_dir: Path) -> list[dict]:
    """The published stats of every mount that used this cache directory."""
    found = []
    for path in sorted((cache_dir / "mounts").glob("*.json")):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # being replaced right now, or removed
    return found


def read_stats(mountpoint: Path, cache_dir: Path | None = None) -> dict:
    """The stats a mount's daemon last published (see the module docstring); for an
    EROFS tree, the node data daemon's stats of the image's device."""
    point = Path(os.path.abspath(mountpoint))
    if tree_kind(point) == "erofs":
        point = Path(mounts()[str(point)][1])
    path = state_path(cache_dir or default_cache_dir(), point, ".json")
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise NotFoundError(f"no lazyfs mount stats for {mountpoint} in {path.parent}") from None


def stop_signals_only_in_loop() -> None:
    """Ignore SIGTERM and SIGINT outside the trio loop (call it just before trio.run):
    inside, stop_on_signal turns them into an orderly stop, and once the loop has
    returned (unmounted) the daemon is already stopping, so a signal then must not cut
    its last writes short (the start-up trace, the final stats). A stop signal sent just
    after an unmount, while the daemon finished, once killed it before those writes."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


async def stop_on_signal() -> None:
    import pyfuse3
    import trio

    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("signal %d: unmounting", signum)
            pyfuse3.terminate()
            return


async def _when_answering(mountpoint: str, ready: Ready | None) -> None:
    # The loop runs, so the kernel's INIT will be answered: callers may use the mount.
    # (Never stat our own mount from this process to find out: a thread blocked in a
    # request the loop no longer answers, at shutdown, keeps the process and its FUSE
    # fd alive forever.)
    if ready:
        ready(None, 0)


def raise_mount_read_ahead(mountpoint: str) -> None:
    """1 MiB kernel read-ahead; must run after INIT, whose reply resets it."""
    raise_read_ahead(mount_device(mountpoint))


def start_mount_watchdog(mountpoint: str) -> None:
    """Detach the mount if this daemon dies and auto_unmount leaves it (mount_watch)."""
    start_watchdog(
        mountpoint, mount_device(mountpoint), ["fusermount3", "-u", "-z", "--", mountpoint]
    )


# ---------------------------------------------------------------- starting and stopping


def state_path(cache_dir: Path, mountpoint: Path, suffix: str) -> Path:
    """CACHE/mounts/<quoted mount point><suffix>: a mount's log and stats files."""
    return cache_dir / "mounts" / (quote(str(mountpoint), safe="") + suffix)


def start_daemon(req: MountRequest) -> int:
    """Start a detached mount daemon; return its pid once the mount answers."""
    mountpoint = check_mountpoint(req.mountpoint)  # fail fast, before any fork
    cache_dir = req.cache.absolute()
    argv = [sys.executable, "-m", "lazyfs.mount", req.image, str(mountpoint)]
    argv += ["--cache", str(cache_dir)]
    if req.store_url:
        argv += ["--store", req.store_url]
    return spawn_daemon(argv, state_path(cache_dir, mountpoint, ".log"), "mount daemon")


def spawn_daemon(argv: list[str], logfile: Path, what: str) -> int:
    """Start `argv --ready-fd N` detached, logging to logfile; return its pid once it
    reports ready on fd N, or raise MountError with the one-line error it reported."""
    try:
        logfile.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BadInputError(f"cannot use directory {logfile.parent}: {exc.strerror}") from None
    r, w = os.pipe()
    try:
        with open(logfile, "ab") as out:
            proc = subprocess.Popen(
                [*argv, "--ready-fd", str(w)],
                pass_fds=(w,),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                cwd="/",  # never keep the caller's directory busy
                start_new_session=True,  # the terminal's ^C must not reach the daemon
            )
    finally:
        os.close(w)
    try:
        report = read_report(r, START_TIMEOUT)
    except TimeoutError:
        proc.kill()
        proc.wait()
        timeout = f"{what} did not start within {START_TIMEOUT:.0f} s; see {logfile}"
        raise MountError(timeout) from None
    finally:
        os.close(r)
    if report is None:
        report = {"error": f"{what} exited with status {proc.wait()} before it was ready"}
    if report.get("error") is not None:
        proc.wait()
        raise MountError(report["error"], int(report.get("exit_code", 1)))
    proc.returncode = 0  # detached on purpose: no "still running" warning from Popen
    return proc.pid


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


# ---------------------------------------------------------------- python -m lazyfs.mount


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lazyfs.mount", description="lazyfs mount daemon")
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
    req = MountRequest(args.image, args.mountpoint, args.store, args.cache)
    try:
        return serve(req, ready)
    except LazyfsError as exc:
        log.error("%s", exc)
        return exc.exit_code
    except BaseException as exc:  # a bug: tell the starter before the traceback
        if ready:
            ready(f"mount daemon failed: {exc!r}", 1)
        raise


if __name__ == "__main__":
    sys.exit(main())
