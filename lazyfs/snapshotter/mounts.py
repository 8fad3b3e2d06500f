"""The snapshotter's lazy mounts: one per image at ROOT/mounts/<image id>, shared by every
container of that image on the node.

Each is an ordinary `lazyfs mount` daemon started detached (lazyfs/mount.py), so it
outlives a snapshotter restart: running containers keep their lower layer, and the
restarted snapshotter finds the mount still there. A mount whose daemon died (ENOTCONN)
is detached lazily and started again.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import subprocess
import threading
from pathlib import Path

from lazyfs.mount import MountRequest, lazyfs_mounts, start_daemon, umount

log = logging.getLogger("lazyfs.snapshotter")


class ImageMounts:
    def __init__(self, root: Path, store_url: str | None, cache_dir: Path) -> None:
        self.dir = root / "mounts"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.store_url = store_url
        self.cache_dir = cache_dir
        self._lock = threading.Lock()

    def path(self, image_id: str) -> Path:
        return self.dir / image_id

    def ensure(self, image_id: str) -> Path:
        """The image's mount point, mounting it first unless a live mount is there."""
        mountpoint = self.path(image_id)
        with self._lock:
            if str(mountpoint) in lazyfs_mounts():
                try:
                    os.stat(mountpoint)
                    return mountpoint
                except OSError as exc:
                    if exc.errno != errno.ENOTCONN:
                        raise
                    log.warning("mount of %s is dead; mounting it again", image_id)
                    subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False)
            mountpoint.mkdir(exist_ok=True)
            pid = start_daemon(MountRequest(image_id, mountpoint, self.store_url, self.cache_dir))
            log.info("mounted image %s at %s (pid %d)", image_id, mountpoint, pid)
            return mountpoint

    def mounted(self) -> set[str]:
        prefix = str(self.dir) + "/"
        return {p[len(prefix) :] for p in lazyfs_mounts() if p.startswith(prefix)}

    def release(self, image_id: str) -> bool:
        """Unmount an image nobody uses; False if the kernel says it is still busy."""
        mountpoint = self.path(image_id)
        with self._lock:
            if str(mountpoint) in lazyfs_mounts():
                try:
                    umount(mountpoint)
                except Exception as exc:  # noqa: BLE001 - busy: a later Cleanup retries
                    log.warning("cannot unmount %s yet: %s", mountpoint, exc)
                    return False
            with contextlib.suppress(OSError):
                mountpoint.rmdir()
            return True
