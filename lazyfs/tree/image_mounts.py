"""The node's one image-mount manager: which images are mounted, how, and for how long.

Two ways to serve an image's read-only tree (chosen per mount, automatically):

- **erofs** (Linux 6.12+ with file-backed EROFS, and an image converted with an EROFS
  metadata image): the kernel mounts the tree with `mount -t erofs DEVICE DIR`, where
  DEVICE is the image's file on the node data daemon's FUSE mount (lazyfs/tree/data_daemon.py,
  one process per node, started here on first use). Mounting one more image starts no
  process; lookups, opens and cached reads never leave the kernel.
- **fuse**: the per-image FUSE daemon (lazyfs/tree/fuse_mount.py), for kernels without file-backed
  EROFS or images converted before EROFS images existed. $LAZYFS_TREE=fuse forces it.

The key: a hash of the cache directory and store URL a manager was made for
(ImageMounts.key). A mount is only ever served by the cache and store it was asked for:
the data daemon is RUN_DIR/data/<key> and the trees it serves are under
RUN_DIR/images/<key>/, so a user with another cache or store (another snapshotter root
on the same run dir, a `lazyfs run --cache` of its own) never finds, adopts or unmounts
them. Measured before the key named the trees: containerd + CRI with the lazyfs
snapshotter, four runs in a row on one run dir, each with its own store, cache and root;
a lingering tree of the run before, served by a daemon whose cache had been deleted, was
adopted, and two of four containers failed with `exec /usr/bin/env: input/output error`.
A daemon whose cache directory is deleted or replaced under it stops serving from it
(lazyfs/tree/data_daemon.py, reopen_cache).

Shared trees (`hold`, `use`): every user of an image on the node with the same key
(`lazyfs run`, the containerd snapshotter, the node agent) shares one mount at
RUN_DIR/images/<key>/<image id> (ImageMounts.tree_path; the directories 0700:
lazyfs/host_dirs.py). Two lock files per image, beside it:

- <image id>.lock: every user holds it shared for as long as it uses the tree, and
  stamps its mtime on arrival (which voids a pending reaper, below).
- <image id>.mount.lock: held exclusively, by a user that already holds the first lock
  shared, while it checks the tree and mounts it (or replaces a dead one: its daemon
  died). Mounting under the shared lock means nobody waits for other users to leave.

The last user out is the one that gets <image id>.lock exclusively (without waiting):
nobody else can be using or mounting the tree then. It unmounts the tree or, with
`linger`, stamps the lock file's mtime and starts a detached reaper that, `linger`
seconds later, unmounts only if it gets the lock exclusively and nobody stamped it since.
Whoever unmounts as the last user then removes the tree's files, the lock files too
(tree_release.forget_tree): a user takes <image id>.lock only once it has checked that
the file it locked is still the one at the path. A user that goes away without
releasing (a crash, or `TreeHold.close` in a process that will take the tree up again
when it restarts) leaves the tree mounted.

A tree is dead when it is not mounted, its FUSE daemon died (ENOTCONN), or, for EROFS,
the node data daemon it reads from is not the one that answers now (<image id>.device
records that daemon's mount when the tree is mounted) or not its key's.

The data daemon: RUN_DIR/data/<key> (normally one per node: one cache, one store).
Starters hold RUN_DIR/data/<key>.lock shared while they start it and mount a tree from
it; the daemon exits only when it can take that lock exclusively and no device is open
($LAZYFS_DAEMON_IDLE seconds after the last closed, or at once when its cache directory
is gone). A starter takes the lock exclusively only to start the daemon, when it does
not answer under the shared lock.

Keeping the data daemon up (`hold_data_daemon`, for a resident user: the node agent):
the holder opens RUN_DIR/data/<key>/.hold (HOLD_NAME) under the starter's
shared lock, starting the daemon first if it is not running, and keeps the file open;
the daemon counts that handle like an open device, so it does not exit idle. Only the
lock's usual short shared hold is taken, so other starters never wait for the holder.
A crashed worker's successor adopts the handle (fuse_supervisor.py); if the whole
supervisor died, the mount and the handle are gone, and the manager's next
`_data_daemon` (its next EROFS mount, or `DataDaemonHold.ensure`: the node agent calls
it when `held()` says the daemon is gone) starts a new daemon, as for anyone, and opens
the hold again there. `DataDaemonHold.release` closes it: the idle exit applies again.
"""

from __future__ import annotations

import errno
import fcntl
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import BinaryIO

from chunker.errors import BadInputError, LazyfsError
from lazyfs import lazy_logging
from lazyfs.errors import MountError
from lazyfs.host_dirs import private_dir
from lazyfs.mount_table import (
    DATA_FSTYPE,
    Mount,
    is_mount_point,
    mount_device,
    mounts,
    newest,
    tree_kind,
)
from lazyfs.settings import Settings
from lazyfs.tree.node_files import HOLD_NAME
from lazyfs.tree.tree_release import (
    DEVICE_SUFFIX,
    LOCK_SUFFIX,
    MOUNT_LOCK_SUFFIX,
    detach,
    release_tree,
    same_file,
    stamp,
)

# The store, manifest and FUSE-daemon modules (chunker.*, lazyfs.tree.fuse_mount, blake3) are
# imported where a mount needs them: a hold's release needs none of them, and `lazyfs
# run`'s finisher imports this module for that alone (35 of its 67 ms of imports).
# logging too is imported only to warn: ~6 ms of every `lazyfs run` that never does.

MS_RDONLY, MS_NOSUID, MS_NODEV = 1, 2, 4
KEY_CHARS = 16  # hex digits of a key (ImageMounts.key): 64 bits, and never an image id


def kernel_mounts_erofs_files() -> bool:
    """Whether this kernel can mount EROFS from a regular file (6.12+, built with
    CONFIG_EROFS_FS_BACKED_BY_FILE). The release is checked here; a kernel built
    without the option answers the first mount with ENOTBLK, and that image falls
    back to the FUSE tree."""
    release = os.uname().release.split("-")[0].split(".")
    try:
        major, minor = int(release[0]), int(release[1])
    except (IndexError, ValueError):
        return False
    if (major, minor) < (6, 12):
        return False
    with open("/proc/filesystems") as f:
        if any(line.split()[-1:] == ["erofs"] for line in f):
            return True
    import subprocess  # here: a run whose tree is mounted already never needs it

    subprocess.run(["modprobe", "-q", "erofs"], capture_output=True, check=False)
    with open("/proc/filesystems") as f:
        return any(line.split()[-1:] == ["erofs"] for line in f)


def planned_tree(has_erofs: bool, settings: Settings) -> str:
    """How a mount of an image on this node is served: "erofs" or "fuse"."""
    if settings.tree != "fuse" and has_erofs and kernel_mounts_erofs_files():
        return "erofs"
    return "fuse"


LOGGER = "lazyfs.tree.image_mounts"


class ImageMounts:
    def __init__(self, store_url: str, cache_dir: Path, settings: Settings) -> None:
        import blake3

        # The store by its URL (the caller resolved the default: Settings.store_url): the
        # daemons get it as --store, and the key names it (two users with another
        # $LAZYFS_STORE are two keys).
        self.store_url = store_url
        self.cache_dir = Path(os.path.abspath(cache_dir))
        self.settings = settings
        self.run_dir = Path(os.path.abspath(self.settings.run_dir))
        # What a mount is served from: the node cache and the store (for S3, its endpoint
        # too). A tree and the data daemon serving it are both named by it, so that a
        # caller never uses a mount made for another cache or store (see the top).
        served_from = [str(self.cache_dir), self.store_url]
        if self.store_url.startswith("s3://"):
            # only then: its module brings http.client, email and ssl (~16 ms of imports)
            from chunker.store.s3_http import endpoint_url

            served_from.append(endpoint_url())
        key = blake3.blake3("\0".join(served_from).encode()).hexdigest()
        self.key = key[:KEY_CHARS]
        self.data_dir = self.run_dir / "data" / self.key
        self.trees_dir = self.run_dir / "images" / self.key
        self._daemon_hold: DataDaemonHold | None = None

    def _erofs_trees(self) -> bool:
        """Whether this node mounts EROFS trees (from the data daemon) at all."""
        return self.settings.tree != "fuse" and kernel_mounts_erofs_files()

    def tree_path(self, image_id: str) -> Path:
        """Where the image's shared tree of this cache and store is mounted."""
        return self.trees_dir / image_id

    def tree_alive(self, image_id: str) -> bool:
        """Whether the image's tree is mounted and read from this manager's data daemon
        as it answers now (not one that died: a running sandbox on that tree would get
        EIO for every read not cached yet). Holds nothing."""
        path = self.tree_path(image_id)
        data_dir = self.data_dir if self._erofs_trees() else None
        return _tree_in_table(path, _device_record(path), data_dir)[0]

    # ------------------------------------------------------------------ one tree

    def resolve(self, image: str) -> str:
        """The image id of a name or id (no store round trip for a cached full id)."""
        from chunker.refs import resolve_image
        from chunker.store.backends import open_store
        from lazyfs.tree.node_files import cached_image_id

        found = cached_image_id(image, self.cache_dir)
        if found:
            return found
        store = open_store(self.store_url, timeout=self.settings.cache.fetch_timeout)
        try:
            return resolve_image(store, image)
        finally:
            store.close()

    def mount(self, image_id: str, mountpoint: Path) -> str:
        """Mount the image's tree at mountpoint (an empty directory); returns "erofs" or
        "fuse", the way it is served."""
        from lazyfs.tree.node_files import check_mountpoint

        mountpoint = check_mountpoint(mountpoint)
        if self._erofs_trees():
            device = self._prepare_erofs(image_id)
            if device is not None:
                try:
                    with self._data_daemon() as data_dir:
                        try:
                            _mount_erofs(data_dir / image_id, mountpoint)
                        except _DeviceMissing:
                            # Its files were swept between our fetch and the mount: the
                            # sweep's grace makes it rare, and a fetch again ends it
                            # (lazyfs/tree/image_files.py).
                            self._prepare_erofs(image_id)
                            _mount_erofs(data_dir / image_id, mountpoint)
                    return "erofs"
                except _NoFileBackedErofs:
                    if self.settings.tree == "erofs":
                        raise MountError(
                            "this kernel cannot mount EROFS from a file (LAZYFS_TREE=erofs)"
                        ) from None
            elif self.settings.tree == "erofs":
                raise BadInputError(
                    f"image {image_id} has no EROFS metadata image (LAZYFS_TREE=erofs);"
                    " convert it again"
                )
        # Imported here: subprocess, argparse and logging are ~8 ms that an EROFS tree's
        # mount never needs.
        from lazyfs.tree.fuse_mount import MountRequest, start_daemon

        start_daemon(MountRequest(image_id, mountpoint, self.store_url, self.cache_dir))
        return "fuse"

    def _prepare_erofs(self, image_id: str) -> Path | None:
        """Fetch and verify the manifest and metadata image into the cache; the local
        metadata image, or None if the image has none."""
        from chunker.images import fetch_erofs
        from chunker.manifest import Manifest
        from chunker.store.backends import open_store
        from lazyfs.tree.image_files import stamp_used
        from lazyfs.tree.node_files import cached_manifest

        store = open_store(self.store_url, timeout=self.settings.cache.fetch_timeout)
        try:
            manifest = Manifest(cached_manifest(store, image_id, self.cache_dir))
            try:
                erofs = manifest.erofs
            finally:
                manifest.close()
            if erofs is None:
                return None
            path = self.cache_dir / "erofs" / erofs[0]
            if path.exists():
                stamp_used(path)  # the sweep leaves it until our mount has opened it
            else:
                fetch_erofs(store, erofs[0], path)
            return path
        finally:
            store.close()

    @contextmanager
    def _data_daemon(self) -> Iterator[Path]:
        """The node data daemon's mount, started if it is not running, held (the lock,
        shared) for the duration of the with."""
        private_dir(self.data_dir.parent)
        with open(f"{self.data_dir}.lock", "a+b") as lock:
            # Shared first: a daemon that answers now cannot exit while we hold it. Every
            # mount used to take it exclusively first, which waits until no mount is in
            # progress: 50 trees mounting at once (a burst of new images) queued on it.
            fcntl.flock(lock, fcntl.LOCK_SH)
            hold = self._daemon_hold
            # The daemon this manager holds cannot exit while held: if it is the one at
            # data_dir, it answers, and the mount table need not be read (~1-3 ms each
            # on a busy node).
            while not (hold is not None and hold.held()) and not _answers(self.data_dir):
                fcntl.flock(lock, fcntl.LOCK_EX)  # one starter; not atomic, hence the loop
                if not _answers(self.data_dir):
                    self._start_data_daemon(lock.fileno())
                fcntl.flock(lock, fcntl.LOCK_SH)  # and it did not exit meanwhile?
            if hold is not None:
                try:
                    hold.take()  # again, if this daemon is not the one it held
                except OSError as exc:  # a mount must not fail for it (an older daemon?)
                    lazy_logging.warning(
                        LOGGER, "cannot hold the data daemon at %s: %s", self.data_dir, exc
                    )
            yield self.data_dir

    def hold_data_daemon(self) -> DataDaemonHold:
        """A hold that keeps the node data daemon up until its release(), also across a
        restart of the daemon (see the top); its ensure() starts the daemon now. One per
        manager: a second call returns the same hold."""
        if self._daemon_hold is None:
            self._daemon_hold = DataDaemonHold(self)
        return self._daemon_hold

    def keep_data_daemon(self) -> DataDaemonHold | None:
        """For a resident user (the node agent, the containerd snapshotter): start the
        node data daemon now and keep it up until the hold's release(), so that no first
        mount waits for its start (issue 12). None where this node mounts no EROFS
        trees. If it cannot start now, the first EROFS mount tries again."""
        if not self._erofs_trees():
            return None
        hold = self.hold_data_daemon()
        try:
            hold.ensure()
        except (LazyfsError, OSError) as exc:
            lazy_logging.warning(LOGGER, "the node data daemon did not start: %s", exc)
        return hold

    def start_data_daemon_soon(self) -> threading.Thread | None:
        """Start the node data daemon in a thread, if this node mounts EROFS trees and it
        is not up: its start (two Python processes, ~0.2-0.3 s from a cold page cache)
        then overlaps the caller's own work before its first mount (resolving the image,
        fetching its manifest and metadata image), and that mount finds it up. `lazyfs
        run` joins the thread before it execs. A failure here is only logged: the mount
        starts the daemon itself."""
        if not self._erofs_trees() or _answers(self.data_dir):
            return None

        def start() -> None:
            try:
                with self._data_daemon():
                    pass
            except (LazyfsError, OSError) as exc:
                lazy_logging.warning(LOGGER, "the node data daemon did not start early: %s", exc)

        thread = threading.Thread(target=start, name="data-daemon-start", daemon=True)
        thread.start()
        return thread

    def _start_data_daemon(self, starter_lock: int) -> None:
        """Start the data daemon; starter_lock: our descriptor of the exclusive lock on
        data_dir.lock, which the daemon holds too until it is ready (a caller that exits
        meanwhile must not let a second starter in: fuse_supervisor.py)."""
        from lazyfs.tree.daemon_start import spawn_daemon
        from lazyfs.tree.node_files import state_path

        if str(self.data_dir) in mounts():  # a dead daemon's mount (ENOTCONN)
            import subprocess

            subprocess.run(["fusermount3", "-u", "-z", str(self.data_dir)], capture_output=True)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # The supervisor owns the FUSE connection and runs the data daemon under it, so
        # a crashed daemon is restarted without the trees noticing (fuse_supervisor.py).
        argv = [sys.executable, "-m", "lazyfs.tree.fuse_supervisor", str(self.data_dir)]
        argv += ["--cache", str(self.cache_dir)]
        argv += ["--store", self.store_url, "--starter-lock-fd", str(starter_lock)]
        logfile = state_path(self.cache_dir, self.data_dir, ".log")
        spawn_daemon(argv, logfile, "data daemon", keep=starter_lock)

    # ------------------------------------------------------------------ shared trees

    def hold(self, image_id: str) -> TreeHold:
        """A use of the image's node-wide tree, mounted now unless a live one is there;
        the caller keeps it as long as it needs the tree and then calls release()."""
        return TreeHold(self, image_id)

    @contextmanager
    def use(self, image_id: str, linger: float = 0.0) -> Iterator[Path]:
        """The image's node-wide tree, held for the with; unmounted after the last user
        (`linger` seconds after, if no other user came meanwhile)."""
        held = self.hold(image_id)
        try:
            yield held.path
        finally:
            held.release(linger)


class DataDaemonHold:
    """A manager's open handle on its data daemon's HOLD_NAME (the protocol: see the top)."""

    def __init__(self, manager: ImageMounts) -> None:
        self.manager = manager
        self._fd: int | None = None
        self._dev = -1  # st_dev of the data mount the handle is on
        self._lock = threading.Lock()  # the manager mounts from several threads

    def ensure(self) -> None:
        """The data daemon running (started if it is not) and held."""
        if self.manager._daemon_hold is not self:
            raise MountError("the hold on the data daemon was released")
        with self.manager._data_daemon():
            self.take()  # taken there already; here its failure is the caller's

    def take(self) -> None:
        """Open the hold on the data daemon that answers now, unless it is held already.
        The caller holds the starter lock shared, so that daemon cannot exit meanwhile."""
        with self._lock:
            if self.manager._daemon_hold is not self:
                return  # released
            dev = os.stat(self.manager.data_dir).st_dev
            if self._fd is not None and self._dev == dev:
                return
            if self._fd is not None:  # a dead daemon's mount: its supervisor died
                _close(self._fd)
                self._fd = None
            self._fd = os.open(self.manager.data_dir / HOLD_NAME, os.O_RDONLY | os.O_CLOEXEC)
            self._dev = dev

    def held(self) -> bool:
        """Whether the data daemon that answers now is the one held: the mount at the data
        directory has the device of the one the handle was opened on (the handle keeps
        that mount, so its number is not reused), and answers a stat. No read of the
        mount table: a burst of new trees asked this several times each."""
        with self._lock:
            if self._fd is None:
                return False
            try:
                return os.stat(self.manager.data_dir).st_dev == self._dev
            except OSError:  # ENOTCONN: its supervisor died
                return False

    def release(self) -> None:
        """Let go: the daemon exits $LAZYFS_DAEMON_IDLE seconds after its last device
        and hold are closed."""
        with self._lock:
            if self.manager._daemon_hold is self:
                self.manager._daemon_hold = None
            if self._fd is not None:
                _close(self._fd)
                self._fd = None


def _close(fd: int) -> None:
    """Close a handle on the data mount; on a dead mount close() says ENOTCONN (the
    flush failed), and the descriptor is closed all the same."""
    with suppress(OSError):
        os.close(fd)


class TreeHold:
    """One user's claim on an image's shared tree (the protocol: see the top)."""

    def __init__(self, manager: ImageMounts, image_id: str) -> None:
        private_dir(manager.trees_dir.parent)  # RUN_DIR/images, then its key's directory
        private_dir(manager.trees_dir)
        self.manager = manager
        self.image_id = image_id
        self.path = path = manager.tree_path(image_id)
        self.lock_path = path.with_name(path.name + LOCK_SUFFIX)
        self._mount_lock = path.with_name(path.name + MOUNT_LOCK_SUFFIX)
        self._device_record = _device_record(path)
        # (tree, data mount) devices the last full check found alive (see alive())
        self._seen_alive: tuple[str, str] | None = None
        self._lock: BinaryIO | None = _lock_shared(self.lock_path)
        try:
            stamp(str(self.lock_path))
            self.ensure()
        except BaseException:
            self.close()
            raise

    @property
    def lock_fd(self) -> int | None:
        """The descriptor holding the tree's lock, while held (`lazyfs run` hands it to its
        finisher, lazyfs/sandbox/run_finish.py)."""
        return self._lock.fileno() if self._lock is not None else None

    def ensure(self) -> Path:
        """The tree, mounted again first if it died while held."""
        if self._lock is None:
            raise MountError(f"the hold on image {self.image_id} was released")
        # What is not even a mount point is not alive, and needs no read of the mount
        # table: a burst of claims of new images read it several times each, and on a
        # busy node each read waits for the mount namespace's lock (design-changes).
        if is_mount_point(self.path) and self.alive():
            return self.path
        with open(self._mount_lock, "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one user mounts; the others wait for it
            if _nothing_mounted(self.path):  # the first use of the image: no table read
                self._mount_new()
            elif not self.alive(table := newest()):  # one read for both questions
                if is_mount_point(self.path) or str(self.path) in table:
                    detach(self.path)  # dead: the users of the old tree keep it
                self._mount_new()
        return self.path

    def _mount_new(self) -> None:
        """Mount the tree at its path, where nothing (alive) is mounted."""
        self._device_record.unlink(missing_ok=True)
        self.path.mkdir(exist_ok=True)
        self._seen_alive = None
        if self.manager.mount(self.image_id, self.path) == "erofs":
            # the tree's source is a file of the data mount, whose device this is
            data_device = _device_of(self.manager.data_dir)
            self._device_record.write_text(data_device)
            # Mounted just now from that data mount: what a full check would find.
            self._seen_alive = (_device_of(self.path), data_device)

    def alive(self, table: dict[str, Mount] | None = None) -> bool:
        """Whether the tree is mounted and its daemon answers (from `table`, the mount
        table as newest() reads it, if the caller has just read it).

        Every agent claim asks (lazyfs/agent/trees.py), and the mount table has lines for
        every sandbox's mounts: 2-3 ms to read on a busy node. So once a full check
        found the tree alive, the next ones only stat the tree and the data mount: the
        same two devices there mean the same two mounts (a detached tree shows its
        directory's device, a new data daemon's mount another device, a dead one
        ENOTCONN), and anything else falls back to the full check."""
        seen = self._seen_alive
        if seen is not None:
            try:
                now = (_device_of(self.path), _device_of(self.manager.data_dir))
            except OSError:
                now = None
            if now == seen:
                return True
        self._seen_alive = None
        alive, devices = self._alive_in_table(table)
        if alive:
            self._seen_alive = devices
        return alive

    def _alive_in_table(
        self, table: dict[str, Mount] | None = None
    ) -> tuple[bool, tuple[str, str] | None]:
        return _tree_in_table(self.path, self._device_record, self.manager.data_dir, table)

    def release(self, linger: float = 0.0) -> None:
        """Stop using the tree; the last user unmounts it (after `linger` seconds)."""
        lock, self._lock = self._lock, None
        if lock is not None:
            try:
                release_tree(lock.fileno(), str(self.lock_path), str(self.path), linger)
            finally:
                lock.close()

    def close(self) -> None:
        """Stop holding without unmounting: the tree stays as it is, with no user."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None


class _NoFileBackedErofs(Exception):
    pass


class _DeviceMissing(MountError):
    """The data daemon has no device for the image: it could not open its files."""


EROFS_READ_AHEAD_KB = 512  # see _mount_erofs


def _mount_erofs(device: Path, mountpoint: Path) -> None:
    # Imported here: ctypes is ~5 ms of a cold `lazyfs run` before it starts the node data
    # daemon (lazyfs/sandbox/run.py), and the mount comes after that start; mount_watch
    # brings logging (~6 ms), which a run whose tree is mounted already never needs.
    import ctypes

    from lazyfs.libc import libc
    from lazyfs.tree.mount_watch import erofs_bdi, raise_read_ahead

    # nosuid,nodev: a setuid file or a device node shipped in an image means nothing on
    # the host (the trees are 0700 as well: lazyfs/host_dirs.py).
    flags = MS_RDONLY | MS_NOSUID | MS_NODEV
    if libc.mount(os.fsencode(device), os.fsencode(mountpoint), b"erofs", flags, None) == 0:
        # The tree's own read-ahead sizes the reads EROFS sends the data daemon (128 KiB by
        # default, one FUSE request each). Warm sequential read of 1 GiB, fresh tree, same
        # minutes: 128 KiB 0.1-0.6 GB/s; 256 KiB 0.56-0.76; 512 KiB 0.72-1.10; 1 MiB
        # 0.43-0.52, its 1 MiB replies costing the supervisor 1.1-1.25 s of kernel copy per
        # GiB into fresh page cache, against 0.26-0.30 s at 512 KiB (docs/design-changes.md).
        bdi = erofs_bdi(str(mountpoint))
        if bdi:
            raise_read_ahead(bdi, EROFS_READ_AHEAD_KB)
        return
    err = ctypes.get_errno()
    if err == errno.ENOTBLK:
        raise _NoFileBackedErofs
    if err == errno.ENOENT:
        raise _DeviceMissing(f"the data daemon cannot serve {device.name}; see its log")
    raise MountError(f"cannot mount the EROFS tree of {device.name}: {os.strerror(err)}")


def _nothing_mounted(path: Path) -> bool:
    """Whether nothing at all is mounted at path: it is missing, or a directory that is
    not a mount point. A dead FUSE mount there fails its lstat (ENOTCONN): not this."""
    try:
        os.lstat(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return not is_mount_point(path)


def _answers(path: Path, table: dict[str, Mount] | None = None) -> bool:
    """A data daemon mount that answers (not a dead ENOTCONN one, not missing). statfs,
    not stat: the kernel answers a stat of a dead mount's root from its attribute cache,
    without asking the daemon."""
    found = (newest() if table is None else table).get(str(path))
    if found is None or found.fstype != DATA_FSTYPE:
        return False
    try:
        os.statvfs(path)
    except OSError:
        return False
    return True


def _tree_in_table(
    path: Path, device_record: Path, data_dir: Path | None, table: dict[str, Mount] | None = None
) -> tuple[bool, tuple[str, str] | None]:
    """Whether the tree at path is alive, from one read of the mount table (`table`, or
    read now); with, for an EROFS tree, the devices of the tree and of its data mount
    that the table showed. data_dir: the data daemon's mount it must read from (None:
    any that answers)."""
    point = str(path)
    table = newest() if table is None else table
    kind = tree_kind(path, table)
    if kind is None:
        return False, None
    if kind == "fuse":
        try:
            os.stat(point)
        except OSError:  # ENOTCONN: the daemon died and left its mount
            return False, None
        return True, None
    data = os.path.dirname(table[point].source)
    if data_dir is not None and data != str(data_dir):
        return False, None  # another cache's or store's daemon (mounted there by hand)
    try:
        recorded = device_record.read_text()
    except FileNotFoundError:
        recorded = ""  # mounted by hand (`lazyfs mount`): trust a daemon that answers
    data_device = mount_device(data, table)
    if not (_answers(Path(data), table) and recorded in ("", data_device)):
        return False, None
    return True, (table[point].device, data_device)


def detach_dead_tree(point: Path) -> bool:
    """Detach what is mounted at an image tree's mount point if it is a tree no data
    daemon serves any more (its EROFS source was on a data mount that is gone): nothing
    can read it, and unmount() no longer knows it for a tree. True if it did."""
    table = newest()  # one read for both questions
    found = table.get(str(point))
    if found is None or found.fstype != "erofs" or tree_kind(point, table) is not None:
        return False
    detach(point)
    return True


def _device_record(tree: Path) -> Path:
    """Beside a tree: the device of the data mount it was mounted from (see the top)."""
    return tree.with_name(tree.name + DEVICE_SUFFIX)


def _lock_shared(lock_path: Path) -> BinaryIO:
    """The tree's lock file, open and locked shared: the one at the path once locked.
    The tree's last user removes it (tree_release.forget_tree), so a file opened before
    that and locked after is not the tree's lock any more: open the path again."""
    while True:
        lock = open(lock_path, "a+b")  # noqa: SIM115 - held by the caller
        try:
            fcntl.flock(lock, fcntl.LOCK_SH)
            if same_file(lock.fileno(), str(lock_path)):
                return lock
        except BaseException:
            lock.close()
            raise
        lock.close()


def _device_of(path: Path) -> str:
    """major:minor of the filesystem at path, as the mount table writes it."""
    dev = os.stat(path).st_dev
    return f"{os.major(dev)}:{os.minor(dev)}"
