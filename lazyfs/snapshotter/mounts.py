"""The snapshotter's lazy mounts: one per image at ROOT/mounts/<image id>, shared by every
container of that image on the node.

Each is an ordinary `lazyfs mount` daemon started detached (lazyfs/mount.py), so it
outlives a snapshotter restart: running containers keep their lower layer, and the
restarted snapshotter finds the mount still there. A mount whose daemon died (ENOTCONN)
is detached lazily and started again.

A mount is started as soon as containerd pulls the image's last layer (`prestart`, in the
background), so that the daemon's start overlaps the rest of the pull and container
creation; and it lingers for `linger` seconds after its last user is gone, so that the
next container of the image (sandboxes come and go by the minute) finds it ready.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import subprocess
import threading
import time
from pathlib import Path

from lazyfs.mount import MountRequest, lazyfs_mounts, start_daemon, umount

log = logging.getLogger("lazyfs.snapshotter")


class ImageMounts:
    def __init__(
        self, root: Path, store_url: str | None, cache_dir: Path, linger: float = 0.0
    ) -> None:
        self.dir = root / "mounts"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.store_url = store_url
        self.cache_dir = cache_dir
        self.linger = linger
        self._lock = threading.Lock()
        self._last_used: dict[str, float] = {}  # image -> monotonic time it was last needed

    def touch(self, image_id: str) -> None:
        """The image was needed now: it lingers `linger` seconds from here."""
        self._last_used[image_id] = time.monotonic()

    def idle(self, image_id: str) -> bool:
        return time.monotonic() - self._last_used.get(image_id, 0.0) >= self.linger

    def prestart(self, image_id: str) -> None:
        """Mount the image in the background (a failure is retried when it is needed)."""
        if self.linger <= 0:
            return  # it would be released again before anyone used it
        self.touch(image_id)

        def run() -> None:
            try:
                self.ensure(image_id)
            except Exception as exc:  # noqa: BLE001 - only a head start
                log.warning("cannot mount image %s ahead of its containers: %s", image_id, exc)

        threading.Thread(target=run, name=f"prestart-{image_id[:12]}", daemon=True).start()

    def path(self, image_id: str) -> Path:
        return self.dir / image_id

    def ensure(self, image_id: str) -> Path:
        """The image's mount point, mounting it first unless a live mount is there."""
        mountpoint = self.path(image_id)
        self.touch(image_id)
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
