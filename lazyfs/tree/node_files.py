"""What the node's tree processes and their manager share, below all of them: the node
cache's files (manifests, the cache opened with the node's settings), each mount's state
files (log and stats under CACHE/mounts/), the hold file's name, and the mount-point checks.

The data daemon (data_daemon.py), the per-image FUSE daemon (fuse_mount.py) and the
image-mount manager (image_mounts.py) import this module; it imports none of them.

State of a mount, under CACHE/mounts/ (<mp> = the absolute mount point, %-quoted):
    <mp>.log    the daemon's log
    <mp>.json   its stats (lazyfs.tree.fuse_ops.Operations.stats plus "mounted"),
                rewritten atomically once a second while they change, and a last time
                at exit ("mounted": false). Read it with `read_stats(mountpoint, cache_dir)`.
                An EROFS tree's device file (the node data daemon's) also holds the
                node-wide cache figures, which every device shares: in one device's file
                they are at most a second old, in every other's at most NODE_STATS_EVERY
                seconds. `mount_stats` gives every device the newest (lazyfs.agent.metrics
                takes each figure's largest).
Both go once no daemon serves the mount and its image's files were swept
(sweep_image_files), so a node keeps state files only for the images it keeps.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

from chunker.errors import BadInputError, NotFoundError
from lazyfs import lazy_logging
from lazyfs.mount_table import entries, mounts, tree_kind
from lazyfs.settings import default_cache_dir
from lazyfs.tree.image_files import Swept, stamp_used, sweep
from node_cache.stats import FIELDS as CACHE_FIELDS

if TYPE_CHECKING:
    from chunker.store.interface import ObjectStore
    from node_cache.policy import CachePolicy

# chunker.images and blake3 are imported where a manifest is fetched: most importers of
# this module (the mount daemons, the CLI's lighter commands) need neither; logging is
# imported where it warns (~6 ms of every `lazyfs run`, which imports this and never does).

HOLD_NAME = ".hold"  # in the data mount's root: open = keep the daemon up (image_mounts.py)
STATS_INTERVAL = 1.0  # seconds between rewrites of a mount's stats file
NODE_STATS_EVERY = 10.0  # ... of a device's, when only its node-wide cache figures changed
_FULL_ID = re.compile(r"[0-9a-f]{64}")


def lazyfs_mounts() -> dict[str, str]:
    """Mount point -> fstype of every FUSE mount."""
    return {m.point: m.fstype for m in entries() if m.fstype.startswith("fuse")}


def check_mountpoint(path: Path) -> Path:
    """An existing, empty directory that is not a mount point already.

    No read of the mount table: a live mount there is a mount point to stat, and a dead
    FUSE mount's stat fails (ENOTCONN), which is_dir() raises. On a busy node the table
    has lines for every sandbox's mounts, and a tree's mount read it several times."""
    path = Path(os.path.abspath(path))
    try:
        if not path.is_dir():
            if path.exists() or path.is_symlink():
                raise BadInputError(f"mount point {path} is not a directory")
            raise BadInputError(f"mount point {path} does not exist")
        if os.path.ismount(path):
            raise BadInputError(f"mount point {path} is already a mount point")
        with os.scandir(path) as it:
            if next(it, None) is not None:
                raise BadInputError(f"mount point {path} is not empty")
    except OSError as exc:  # e.g. ENOTCONN: a dead FUSE mount is sitting there
        raise BadInputError(f"cannot use mount point {path}: {exc.strerror}") from None
    return path


def manifest_path(cache_dir: Path, image_id: str) -> Path:
    """Where the node cache keeps an image's manifest: CACHE/manifests/<id>.db (docs/FORMATS.md)."""
    return cache_dir / "manifests" / f"{image_id}.db"


def cached_manifest(store: ObjectStore, image_id: str, cache_dir: Path) -> Path:
    """The image's manifest in CACHE/manifests/, fetched unless a verified copy is there.

    The file is only ever replaced by rename (never rewritten in place), because running
    mounts keep it open as an immutable SQLite file. Its use is stamped: the node data
    daemon's sweep leaves it for a while (lazyfs/tree/image_files.py, whose rules the
    caller keeps: open it now, and fetch it again through here if it is gone later).
    """
    import blake3

    dest = manifest_path(cache_dir, image_id)
    if _verified_here(dest):
        stamp_used(dest)
        return dest
    try:
        if blake3.blake3(dest.read_bytes()).hexdigest() == image_id:
            _VERIFIED[dest] = _identity(dest)
            stamp_used(dest)
            return dest
    except FileNotFoundError:  # never fetched, or swept
        pass
    from chunker.images import fetch_manifest  # zstandard, tempfile: only to fetch

    fetch_manifest(store, image_id, dest)
    _VERIFIED[dest] = _identity(dest)
    return dest


# Manifests this process verified (or fetched, verified), by path, with the identity of
# the file it verified: an agent's lookup of an image and the mount of its tree, moments
# later, hashed the same 2 MB twice (~1-2 ms of a fresh generic claim's ~30). The files
# are only ever replaced by rename, which gives another inode.
_VERIFIED: dict[Path, tuple[int, int, int, int]] = {}


def _identity(path: Path) -> tuple[int, int, int, int]:
    st = path.stat()
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _verified_here(path: Path) -> bool:
    known = _VERIFIED.get(path)
    try:
        return known is not None and known == _identity(path)
    except FileNotFoundError:
        return False


def cached_image_id(image: str, cache_dir: Path) -> str | None:
    """A full image id whose manifest this node already holds needs no store round trip
    (`lazyfs run` resolves the name itself and hands the daemon the id)."""
    if _FULL_ID.fullmatch(image) and manifest_path(cache_dir, image).exists():
        return image
    return None


def cached_config(store: ObjectStore, image_id: str, cache_dir: Path) -> dict:
    """The image config's "config" object (Env, WorkingDir, User, ...): from
    CACHE/manifests/<id>.config.json, written from the verified manifest the first time.

    An image id is the hash of one manifest, so the file never goes stale, and a node
    cache that lost it (or holds a damaged one) writes it again. Why a file: a run whose
    tree is mounted already needs nothing else from the manifest, and opening it (reading
    and hashing 2 MB, importing sqlite3) was ~9 ms of every warm `lazyfs run`
    (docs/design-changes.md, session 29). `image_id` as resolve_image gives it: an id."""
    path = cache_dir / "manifests" / f"{image_id}.config.json"
    try:
        config = json.loads(path.read_bytes())
        if isinstance(config, dict):
            return config
    except (OSError, ValueError):
        pass
    from chunker.manifest import Manifest

    manifest = Manifest(cached_manifest(store, image_id, cache_dir))
    try:
        config = manifest.config.get("config") or {}
    finally:
        manifest.close()
    write_json(path, config)
    return config


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.write_text(json.dumps(data, sort_keys=True) + "\n")
        tmp.replace(path)
    except OSError as exc:
        lazy_logging.warning("lazyfs.tree", "cannot write %s: %s", path, exc)


def mount_stats(cache_dir: Path) -> list[dict]:
    """The published stats of every mount that used this cache directory, each EROFS
    device's with its data daemon's newest node-wide figures (see the top)."""
    found = [stats for _, stats in _stats_files(cache_dir)]
    newest: dict[object, dict] = {}  # data daemon pid -> its device stats with the newest
    for stats in found:
        if stats.get("tree") == "erofs":
            best = newest.setdefault(stats.get("pid"), stats)
            if _node_progress(stats) > _node_progress(best):
                newest[stats.get("pid")] = stats
    for stats in found:
        if stats.get("tree") == "erofs":
            best = newest[stats.get("pid")]
            stats.update({k: best[k] for k in NODE_WIDE if k in best})
    return found


def sweep_image_files(
    cache_dir: Path, policy: CachePolicy, grace: float, serving: Collection[str]
) -> Swept:
    """One sweep of the images' files by a process that serves trees from this cache
    (lazyfs/tree/image_files.py): it leaves the images it is `serving` (ids of images
    and metadata images) and those any other running daemon published stats for; then
    the state files of the mounts of the images whose files it removed go too. The
    removal is logged here, for every process that sweeps."""
    budget = policy.image_files_bytes()
    own = os.getpid()
    swept = sweep(
        cache_dir,
        budget,
        int(budget * policy.evict_to),
        grace,
        lambda: {*serving, *published_by_running(cache_dir, but=own)},
    )
    forget_mounts_of(cache_dir, swept.ids, own=own)
    if swept.removed:
        lazy_logging.info(
            "lazyfs.tree",
            "removed %d image files (%d bytes) of images not in use; %d bytes left",
            *swept[:3],
        )
    return swept


def published_by_running(cache_dir: Path, but: int | None = None) -> set[str]:
    """The images whose mount stats a running daemon published (their stats files'
    pid is a live process other than `but`): every image a FUSE daemon serves, and every
    one the node data daemon has served since its start. A sweep of another process
    leaves their files (lazyfs/tree/image_files.py)."""
    return {
        stats["image"]
        for _, stats in _stats_files(cache_dir)
        if isinstance(stats.get("image"), str) and _runs(stats.get("pid"), but)
    }


def forget_mounts_of(cache_dir: Path, image_ids: Collection[str], own: int | None = None) -> None:
    """Remove the state files (stats, log, the log's .1) of every mount of `image_ids`
    whose daemon is gone or is `own` (the caller, which no longer serves them). Called
    with the images whose files a sweep removed, so that a node keeps no state files but
    those of the images it keeps."""
    ids = set(image_ids)
    for path, stats in _stats_files(cache_dir) if ids else ():
        if stats.get("image") in ids and (stats.get("pid") == own or not _runs(stats.get("pid"))):
            stem = str(path)[: -len(".json")]
            for state in (path, Path(stem + ".log"), Path(stem + ".log.1")):
                state.unlink(missing_ok=True)


def _stats_files(cache_dir: Path) -> list[tuple[Path, dict]]:
    found = []
    for path in sorted((cache_dir / "mounts").glob("*.json")):
        try:
            found.append((path, json.loads(path.read_text())))
        except (OSError, ValueError):
            continue  # being replaced right now, or removed
    return found


def _runs(pid: object, but: int | None = None) -> bool:
    """Whether `pid` is a running process: not gone, not a zombie (a daemon its starter
    has not waited for yet has exited all the same). A reused pid counts as running,
    which only keeps files a while longer."""
    if not isinstance(pid, int) or pid <= 0 or pid == but:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[:1]
    except OSError:
        return False
    return state not in ([b"Z"], [b"X"])


# The node-wide figures in an EROFS device's stats (the data daemon's node_stats): its
# node cache's counters (node_cache/stats.py; "errors" is "cache_errors" there), the
# hot-chunk hits and the image files its sweeps removed (image_files.py). Every one only
# grows while the daemon runs.
NODE_WIDE = (
    "hot_hits",
    "image_files_removed",
    *("cache_errors" if f == "errors" else f for f in CACHE_FIELDS),
)


def _node_progress(stats: dict) -> int:
    return sum(v for k in NODE_WIDE if isinstance(v := stats.get(k), int))


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


def state_path(cache_dir: Path, mountpoint: Path, suffix: str) -> Path:
    """CACHE/mounts/<quoted mount point><suffix>: a mount's log and stats files."""
    return cache_dir / "mounts" / (quote(str(mountpoint), safe="") + suffix)
