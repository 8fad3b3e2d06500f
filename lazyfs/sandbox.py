"""`lazyfs run`: a private, writable, throw-away root filesystem over a shared lazy mount.

Each image is mounted at most once per node, at RUN_DIR/images/<image id>, and shared by
every concurrent sandbox of that image. Users hold a shared flock on the mount's lock
file; the last one out (the one that gets the exclusive lock) unmounts it, or with
`linger` leaves it for the next sandbox of the image: it stamps the lock file's mtime and
starts a detached reaper that, `linger` seconds later, unmounts only if nobody holds the
lock and nobody stamped it since (a later last user started its own reaper). A sandbox's
upper and work directories live under SANDBOX_DIR/<random> and are deleted when its
command exits, whatever the exit status.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from chunker.errors import BadInputError
from chunker.images import resolve_image
from chunker.manifest import Manifest
from chunker.store import open_store
from lazyfs.mount import MountRequest, cached_manifest, start_daemon, umount
from lazyfs.oci_spec import Limits
from lazyfs.sandbox_runtime import (
    DEFAULT_RUNTIME,
    Sandbox,
    SandboxRequest,
    cleanup_stale,
    find_runtime,
)

RUN_DIR = Path(os.environ.get("LAZYFS_RUN_DIR", "/run/lazyfs"))


@contextmanager
def shared_mount(
    image_id: str, store_url: str | None, cache_dir: Path, linger: float = 0.0
) -> Iterator[Path]:
    """The image's node-wide mount, mounted on first use, unmounted after the last user
    (`linger` seconds after, if no other user came meanwhile)."""
    images = RUN_DIR / "images"
    images.mkdir(parents=True, exist_ok=True)
    mountpoint = images / image_id
    lock_path = images / f"{image_id}.lock"
    with open(lock_path, "a+b") as lock:
        while True:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one process sets the mount up
            if not os.path.ismount(mountpoint):
                mountpoint.mkdir(exist_ok=True)
                start_daemon(MountRequest(image_id, mountpoint, store_url, cache_dir))
            fcntl.flock(lock, fcntl.LOCK_SH)  # now just a user of it
            if os.path.ismount(mountpoint):  # not torn down while we switched locks
                break
        try:
            yield mountpoint
        finally:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pass  # another sandbox still uses the mount
            else:
                if linger > 0:
                    _start_reaper(lock_path, mountpoint, linger)
                else:
                    umount(mountpoint)


def _start_reaper(lock_path: Path, mountpoint: Path, linger: float) -> None:
    """Unmount `linger` seconds from now unless the mount was used meanwhile (see top)."""
    os.utime(lock_path)
    stamp = lock_path.stat().st_mtime_ns
    subprocess.Popen(
        ["sh", "-c", 'sleep "$0" && exec "$@"', str(linger), sys.executable]
        + ["-m", "lazyfs.sandbox", "reap", str(lock_path), str(mountpoint), str(stamp)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd="/",
        start_new_session=True,  # outlives this process and its process group
    ).returncode = 0  # never waited for


def reap(lock_path: Path, mountpoint: Path, stamp: int) -> None:
    """The reaper's last step: unmount if the mount is idle and was not used since."""
    with open(lock_path, "a+b") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # in use: its last user will start a reaper
        if os.fstat(lock.fileno()).st_mtime_ns == stamp and os.path.ismount(mountpoint):
            umount(mountpoint)


def run(
    image: str,
    command: list[str],
    store_url: str | None,
    cache_dir: Path,
    linger: float = 0.0,
    *,
    limits: Limits | None = None,
    env: list[str] | None = None,
    cwd: str | None = None,
    network: bool = False,
    runtime: str = DEFAULT_RUNTIME,
) -> int:
    """Run COMMAND in a fresh sandbox of IMAGE on an OCI runtime; returns its exit status.
    The image stays mounted `linger` seconds after its last sandbox, for the next one."""
    if not command:
        raise BadInputError("lazyfs run needs a command after --")
    find_runtime(runtime)  # before mounting anything
    cleanup_stale()  # what a killed `lazyfs run` left: it may still hold an image mount
    store = open_store(store_url)
    image_id = resolve_image(store, image)
    manifest = Manifest(cached_manifest(store, image_id, cache_dir))
    try:
        config = manifest.config.get("config") or {}
    finally:
        manifest.close()
    request = SandboxRequest(config, command, env or [], cwd, limits or Limits(), network, runtime)
    with shared_mount(image_id, store_url, cache_dir, linger) as lower:
        box = Sandbox.prepare(lower, request)
        try:
            status = box.run_foreground()
            if box.oom_kills() and request.limits.memory is not None:
                print(
                    f"lazyfs: the sandbox ran out of memory (--memory"
                    f" {_mib(request.limits.memory)}) and was killed",
                    file=sys.stderr,
                )
                status = 137
            return status
        finally:
            box.delete()


def _mib(size: int) -> str:
    return f"{size / 2**20:g} MiB"


if __name__ == "__main__":  # python -m lazyfs.sandbox reap LOCK MOUNTPOINT STAMP
    if len(sys.argv) != 5 or sys.argv[1] != "reap":
        sys.exit("usage: python -m lazyfs.sandbox reap LOCK MOUNTPOINT STAMP")
    reap(Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]))
