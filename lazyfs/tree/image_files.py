"""An image's files in the node cache, and how they are kept under their share of it.

Besides chunks (node_cache/), the node cache holds each image it mounted: its manifest
CACHE/manifests/<image id>.db, its config CACHE/manifests/<image id>.config.json
(node_files.py), and its EROFS metadata image CACHE/erofs/<object id>. They are 1-8 MB
an image (docs/design-changes.md, session 46), and a node that cycles through thousands
of task images would otherwise grow them by gigabytes, outside any budget. They get
`CachePolicy.image_files_bytes()` of $LAZYFS_CACHE_SIZE (the chunks the rest), and the
processes that serve trees remove those of images nobody serves, least recently used
first, when they hold more (sweep, through node_files.sweep_image_files): the node data
daemon every SWEEP_EVERY seconds (data_daemon.py), and where the kernel cannot mount
EROFS from a file, each per-image FUSE daemon, one at a time (fuse_mount.py). An image
is being served when the sweeping process serves it or another running daemon published
stats for it (node_files.published_by_running); the state files of the mounts of images
whose files went (CACHE/mounts/) go with them.

No lock between the processes that use these files: what makes a removal safe is the
rules every user keeps.
- A file is only ever written whole under a temporary name (a leading dot) and renamed
  into place, so the sweep never sees one half written.
- A user opens a file and then reads the open file (the data daemon keeps its devices'
  open; SQLite keeps the manifest's), which outlives an unlink. A user that finds a file
  missing fetches it again from the store (node_files.cached_manifest and cached_config,
  the image-mount manager's _prepare_erofs), and a mount whose device the data daemon
  could not open because its files went between their fetch and the mount prepares
  them again, once (ImageMounts.mount).
- A use stamps the file's access time (stamp_used: cached_manifest and the manager's
  fetch before each mount, the data daemon's close of a device after its last one; an
  open device is in use, below), and the sweep leaves every file used or written in the
  last `grace` seconds ($LAZYFS_DAEMON_IDLE): far longer than a fetch takes to reach the
  mount that follows it.
- The sweep never removes the files of an image whose device the data daemon holds open
  (removing them would free nothing while it holds them, and a restarted worker reopens
  devices from them: data_daemon.py, known), nor the metadata images those devices read.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import NamedTuple

SWEEP_EVERY = 30.0  # seconds between sweeps (a shorter idle time, down to 1 s, sweeps sooner)
STALE_TEMPORARY = 3600.0  # seconds: a temporary this old is a killed fetch's, removed
SUBDIRS = ("manifests", "erofs")  # CACHE/<subdir>/<id>[.<suffix>]


class Swept(NamedTuple):
    removed: int  # files removed
    freed: int  # bytes of disk they held
    kept: int  # bytes of disk the image files hold after the sweep
    ids: tuple[str, ...] = ()  # the ids whose files were removed


def sweep_period(idle: float) -> float:
    """Seconds between a daemon's sweeps (and its log's checks), given its idle time."""
    return min(SWEEP_EVERY, max(idle, 1.0))


def stamp_used(path: Path) -> None:
    """Say that `path` was just used: its access time becomes now, and its modification
    time stays (node_files' verified-copy check keys on it). A file that is not there
    has nothing to say."""
    try:
        mtime = os.stat(path).st_mtime_ns
        os.utime(path, ns=(time.time_ns(), mtime))
    except OSError:
        pass


def sweep(
    cache_dir: Path,
    budget: int,
    target: int,
    grace: float,
    in_use: Callable[[], Collection[str]],
) -> Swept:
    """If the image files take more than `budget` bytes of disk, remove those of the
    least recently used ids until they take at most `target`: never an id in `in_use()`
    (image ids and metadata image ids; asked only when there is something to remove),
    nor one whose files were used or written in the last `grace` seconds. An image's
    manifest and config go together (one id). A temporary (being written) is left
    alone, unless its writer was killed long ago."""
    groups: dict[str, list[tuple[Path, int]]] = {}  # id -> its files and their bytes
    last: dict[str, float] = {}  # id -> its files' latest use or write
    total = removed = freed = 0
    now = time.time()
    for sub in SUBDIRS:
        try:
            entries = list(os.scandir(cache_dir / sub))
        except FileNotFoundError:
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            size = st.st_blocks * 512
            if entry.name.startswith("."):  # a temporary, being written
                if now - st.st_mtime > STALE_TEMPORARY:
                    Path(entry.path).unlink(missing_ok=True)
                    removed, freed = removed + 1, freed + size
                continue
            total += size
            key = entry.name.split(".", 1)[0]
            groups.setdefault(key, []).append((Path(entry.path), size))
            last[key] = max(last.get(key, 0.0), st.st_atime, st.st_mtime)
    if total <= budget:
        return Swept(removed, freed, total)
    ids = []
    keep = set(in_use())
    for key in sorted(last, key=last.__getitem__):
        if total <= target or now - last[key] < grace:
            break  # the rest were used later still
        if key in keep:
            continue
        for path, size in groups[key]:
            path.unlink(missing_ok=True)  # (gone meanwhile: the cache directory went?)
            removed += 1
            freed += size
            total -= size
        ids.append(key)
    return Swept(removed, freed, total, tuple(ids))
