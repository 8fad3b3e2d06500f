"""The snapshotter's logic, independent of gRPC: an overlay snapshotter whose layers may be
lazy placeholders for a converted image.

Ordinary snapshots behave as containerd's overlayfs snapshotter: an active snapshot is a
bind mount of its own fs/ (no parent) or an overlay with the parents' fs/ directories as
lowerdirs; containerd applies a layer's diff into it and commits it.

A layer of a converted image (remote.py) is never unpacked: Prepare commits an empty
placeholder under the chain id containerd asked for and answers ALREADY_EXISTS, so
containerd downloads nothing. Any snapshot stacked on a placeholder stands on the
image's layer trees from that layer down (docs/FORMATS.md, "Layer trees"): a chain id
names the same content whichever image committed it, so an unconverted image that shares
a converted image's lower layers stands on their trees too. An image converted without
layer trees (or with more than one overlay's options can list) has its merged tree as
the lowest lowerdir of a snapshot on its last layer; stacking on an inner placeholder of
such an image hydrates the placeholders from their layer records first (hydrate.py), so
every image still runs.

The trees are the node's shared ones (lazyfs/tree/image_mounts.py), the same mounts that
`lazyfs run` and the node agent use with the same cache and store:
RUN_DIR/images/<key>/<tree id>, the key naming that cache and store, so a snapshotter
never takes up a tree another cache or store serves. The snapshotter holds one use (a
TreeHold) of each tree that some active or view snapshot stands on, from the first such
snapshot to the last one's Remove, and then releases it with `linger`: the tree stays
`linger` seconds for the next container. A tree's daemon (the node data daemon for EROFS
trees, the tree's own FUSE daemon otherwise) runs detached, so a snapshotter that stops
or crashes leaves the trees running containers use mounted; on start it takes up a hold
again for every tree its snapshots need (`reattach`), remounting dead ones.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

from chunker.store.interface import ObjectStore
from lazyfs.sandbox.overlay import lower_trees_in_options
from lazyfs.settings import Settings
from lazyfs.snapshotter import filters
from lazyfs.snapshotter.hydrate import hydrate_layer
from lazyfs.snapshotter.remote import LABEL_LAZY_IMAGE, LABEL_REF, RemoteImages
from lazyfs.snapshotter.state import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    Kind,
    LazyLayer,
    Snapshot,
    State,
)
from lazyfs.tree.image_mounts import DataDaemonHold, ImageMounts, TreeHold
from node_cache.cache import NodeCache

log = logging.getLogger("lazyfs.snapshotter")


@dataclass(frozen=True)
class Mount:
    type: str
    source: str
    options: tuple[str, ...]


def disk_usage(path: Path) -> tuple[int, int]:
    """(bytes, inodes) used under path, as containerd counts them: allocated blocks of
    each inode once, hard links included once."""
    seen: set[tuple[int, int]] = set()
    size = 0
    for top, dirs, files in os.walk(path):
        for name in [*dirs, *files, "."] if top == str(path) else [*dirs, *files]:
            st = os.lstat(os.path.join(top, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                size += st.st_blocks * 512
    return size, len(seen)


class Snapshotter:
    def __init__(
        self,
        root: Path,
        store: ObjectStore,
        store_url: str,
        cache: Path,
        settings: Settings,
        linger: float = 0.0,
    ) -> None:
        self.root = root
        self.state = State(root)
        self.store = store
        self.cache_dir = cache
        self.remote = RemoteImages(store, cache)
        self.images = ImageMounts(store_url, cache, settings)
        self.linger = linger
        self._holds: dict[str, TreeHold] = {}  # tree id -> our use of it
        # Layer trees one container's overlay can list: containerd mounts it from its
        # options, one page (lazyfs/sandbox/overlay.py). An image with more stands on its
        # merged tree.
        self.max_layer_trees = lower_trees_in_options(self.images.trees_dir)
        self._node_cache: NodeCache | None = None  # opened for the first hydration
        self._daemon_hold: DataDaemonHold | None = None

    def keep_data_daemon(self) -> None:
        """Start the node data daemon and keep it up while we serve, as the node agent
        does: a node's first container then does not wait for the daemon's start (its
        CreateContainer took 0.33-0.51 s against 0.07-0.10 s with overlayfs or stargz,
        bench/cri_sympy.py, before this)."""
        self._daemon_hold = self.images.keep_data_daemon()

    def close(self) -> None:
        """Stop, leaving every tree we hold mounted: running containers use them, and
        the next snapshotter process takes them up again (reattach)."""
        for hold in self._holds.values():
            hold.close()
        self._holds.clear()
        if self._daemon_hold is not None:  # its idle exit applies again
            self._daemon_hold.release()
        if self._node_cache is not None:
            self._node_cache.close()
        self.state.close()

    def reattach(self) -> None:
        """After a restart: hold every image an existing snapshot stands on again (a
        running container's tree is still there; a dead one is mounted again)."""
        for tree_id in self._trees_in_use():
            try:
                self._tree(tree_id)
            except Exception as exc:  # noqa: BLE001 - retried at the next Mounts
                log.warning("cannot mount tree %s again: %s", tree_id, exc)

    def prestart(self, lazy: LazyLayer) -> None:
        """Mount the trees a container of the image's top layer stands on in the
        background and let them linger: its containers come next, and the mounts
        overlap the rest of the pull. A failure is retried when a container needs them."""
        if self.linger <= 0:
            return  # they would be released again before anyone used them
        image_id = lazy.image

        def run() -> None:
            try:
                for tree_id in self._lazy_trees(lazy):
                    self.images.hold(tree_id).release(self.linger)
            except Exception as exc:  # noqa: BLE001 - only a head start
                log.warning("cannot mount image %s ahead of its containers: %s", image_id, exc)

        threading.Thread(target=run, name=f"prestart-{image_id[:12]}", daemon=True).start()

    # ------------------------------------------------------------------ the API

    def prepare(self, key: str, parent: str, labels: dict[str, str]) -> list[Mount]:
        lazy = self.remote.layer(labels)
        if lazy is not None:
            name = labels[LABEL_REF]
            if self.state.find(name) is None:
                if self.state.find(key) is not None:
                    raise AlreadyExists(f"snapshot {key} already exists")
                placeholder = dict(labels, **{LABEL_LAZY_IMAGE: lazy.image})
                self.state.create(Kind.COMMITTED, name, parent, placeholder, lazy)
                log.info("layer %s of image %s is lazy (%s)", lazy.layer, lazy.image, name)
                if lazy.top:  # its containers come next: have the trees ready by then
                    self.prestart(lazy)
            # containerd then finds the committed placeholder by its label and parent.
            raise AlreadyExists(f"snapshot {name} already exists (lazy)")
        return self._create_with_mounts(Kind.ACTIVE, key, parent, labels)

    def view(self, key: str, parent: str, labels: dict[str, str]) -> list[Mount]:
        return self._create_with_mounts(Kind.VIEW, key, parent, labels)

    def _create_with_mounts(
        self, kind: Kind, key: str, parent: str, labels: dict[str, str]
    ) -> list[Mount]:
        """A new snapshot and its mounts; if the mounts cannot be made (a lazy image that
        will not mount), the snapshot is taken back: containerd saw an error, so it keeps
        no record of the key and would never remove it."""
        snap = self.state.create(kind, key, parent, labels)
        try:
            return self._mounts(snap)
        except BaseException:
            self.state.remove(snap.key)
            shutil.rmtree(self.state.dir(snap), ignore_errors=True)
            raise

    def mounts(self, key: str) -> list[Mount]:
        snap = self.state.get(key)
        if snap.kind == Kind.COMMITTED:
            raise FailedPrecondition(f"snapshot {key} is committed: it has no mounts")
        return self._mounts(snap)

    def commit(self, name: str, key: str, labels: dict[str, str]) -> Snapshot:
        snap = self.state.get(key)
        if snap.kind != Kind.ACTIVE:
            raise FailedPrecondition(f"snapshot {key} is not active")
        usage = disk_usage(self.state.dir(snap) / "fs")
        committed = self.state.commit(name, key, labels, usage)
        shutil.rmtree(self.state.dir(committed) / "work", ignore_errors=True)
        return committed

    def remove(self, key: str) -> None:
        snap = self.state.remove(key)
        shutil.rmtree(self.state.dir(snap), ignore_errors=True)
        self._release_unused()  # its image's linger starts now if it was the last

    def stat(self, key: str) -> Snapshot:
        return self.state.get(key)

    def update(self, key: str, labels: dict[str, str], paths: list[str]) -> Snapshot:
        snap = self.state.get(key)
        if not paths:
            new = dict(labels)
        else:
            new = dict(snap.labels)
            for path in paths:
                if path == "labels":
                    new = dict(labels)
                elif path.startswith("labels."):
                    label = path[len("labels.") :]
                    if label in labels:
                        new[label] = labels[label]
                    else:
                        new.pop(label, None)
                else:
                    raise InvalidArgument(f"cannot update field {path!r} of a snapshot")
        return self.state.set_labels(key, new)

    def list(self, wanted: list[str]) -> list[Snapshot]:
        match = filters.matcher(wanted)
        return [s for s in self.state.all() if match(s)]

    def usage(self, key: str) -> tuple[int, int]:
        snap = self.state.get(key)
        if snap.kind == Kind.COMMITTED:
            return snap.size, snap.inodes
        return disk_usage(self.state.dir(snap) / "fs")

    def cleanup(self) -> None:
        """Delete directories no snapshot names (left by a crash); release unused trees."""
        known = {str(s.id) for s in self.state.all()}
        for entry in os.scandir(self.state.snapshots_dir):
            if entry.name not in known:
                log.info("cleanup: removing %s", entry.path)
                shutil.rmtree(entry.path, ignore_errors=True)
        self._release_unused()

    # ------------------------------------------------------------------ mounts

    def _mounts(self, snap: Snapshot) -> list[Mount]:
        lowers = self._lowers(snap)
        own = self.state.dir(snap)
        if snap.kind == Kind.ACTIVE:
            if not lowers:
                return [Mount("bind", str(own / "fs"), ("rbind", "rw"))]
            options = (
                "index=off",
                f"workdir={own / 'work'}",
                f"upperdir={own / 'fs'}",
                f"lowerdir={':'.join(lowers)}",
            )
            return [Mount("overlay", "overlay", options)]
        if not lowers:
            return [Mount("bind", str(own / "fs"), ("rbind", "ro"))]
        if len(lowers) == 1:
            return [Mount("bind", lowers[0], ("rbind", "ro"))]
        return [Mount("overlay", "overlay", ("index=off", f"lowerdir={':'.join(lowers)}"))]

    def _lowers(self, snap: Snapshot) -> list[str]:
        """The lowerdirs for a snapshot, nearest first: the fs/ of each snapshot below it
        down to the first lazy placeholder, then the trees that placeholder and every
        layer below it stand for (_stack). An inner placeholder whose image has no layer
        trees is hydrated into its fs/ first."""
        lowers = []
        for below in self._stack(snap):
            if isinstance(below, str):
                lowers.append(str(self._tree(below)))
                continue
            if below.lazy:
                self._hydrate(below)
            lowers.append(str(self.state.dir(below) / "fs"))
        return lowers

    def _stack(self, snap: Snapshot) -> list[Snapshot | str]:
        """What a snapshot stands on, nearest first, without mounting or hydrating: a
        parent snapshot (its fs/), or a tree id. Below the first lazy placeholder are only
        trees: its image's layer trees from its layer down (they stand for those layers
        whichever snapshots containerd committed for them: a chain id names the same
        content), or, for an image without layer trees, its merged tree if the
        placeholder is its top layer. Otherwise the placeholder is hydrated, and the walk
        goes on below it."""
        out: list[Snapshot | str] = []
        for parent in self.state.chain(snap):
            if parent.lazy:
                trees = self._lazy_trees(LazyLayer(parent.image, parent.layer, parent.top))
                if trees:
                    return out + trees
            out.append(parent)
        return out

    def _lazy_trees(self, lazy: LazyLayer) -> list[str]:
        """The trees that a lazy layer and every layer below it stand for, top first: its
        image's layer trees up to it if the image has them and they fit one overlay's
        options, else the merged tree for its top layer; [] for an inner layer of an
        image without layer trees (hydrated instead)."""
        per_layer = self.remote.layer_trees(lazy.image)
        if per_layer:
            trees = [t for t in per_layer[: lazy.layer + 1] if t is not None][::-1]
            if len(trees) <= self.max_layer_trees:
                return trees
        return [lazy.image] if lazy.top else []

    def _hydrate(self, placeholder: Snapshot) -> None:
        """Write an inner placeholder's layer, and its lazy ancestors', into their fs/."""
        for snap in reversed([placeholder, *self.state.chain(placeholder)]):
            snap = self.state.get(snap.key)  # an earlier call may have done it already
            if not snap.lazy:
                continue
            fs = self.state.dir(snap) / "fs"
            lower_dirs = [self.state.dir(s) / "fs" for s in self.state.chain(snap)]
            log.info("hydrating layer %d of image %s into %s", snap.layer, snap.image, fs)
            if self._node_cache is None:
                policy = self.images.settings.cache
                self._node_cache = NodeCache(self.cache_dir, self.store, policy)
            hydrate_layer(
                self.store, self.cache_dir, snap.image, snap.layer, fs, lower_dirs,
                self._node_cache.read,
            )  # fmt: skip
            self.state.mark_hydrated(snap, disk_usage(fs))

    def _tree(self, tree_id: str) -> str:
        """The shared tree (an image's merged tree or a layer tree), held from now until
        no snapshot stands on it; one whose daemon died is mounted again (for new
        containers; running ones keep theirs)."""
        hold = self._holds.get(tree_id)
        if hold is None:
            hold = self._holds[tree_id] = self.images.hold(tree_id)
            log.info("holding tree %s at %s", tree_id, hold.path)
            return str(hold.path)
        if not hold.alive():
            log.warning("tree %s is dead; mounting it again", tree_id)
        return str(hold.ensure())

    def _trees_in_use(self) -> set[str]:
        """Trees that some active or view snapshot has as a lowerdir. What a snapshot
        stands on depends on its parent alone, and the containers of an image share one:
        one walk per parent, not per container (with 500 containers of a 10-layer image
        each Remove took 41 ms, and deleting them all ~10 s)."""
        used: set[str] = set()
        walked: set[str] = set()
        for snap in self.state.all():
            if snap.kind == Kind.COMMITTED or snap.parent in walked:
                continue
            walked.add(snap.parent)
            used.update(below for below in self._stack(snap) if isinstance(below, str))
        return used

    def _release_unused(self) -> None:
        """Release our hold on each tree no snapshot stands on any more: it lingers, then
        goes unless another user (another container, `lazyfs run`) came meanwhile."""
        try:
            in_use = self._trees_in_use()
        except Exception as exc:  # noqa: BLE001 - e.g. an image's manifest unreadable now
            log.warning("cannot tell which trees are in use (%s); releasing none", exc)
            return
        for tree_id in self._holds.keys() - in_use:
            try:
                self._holds.pop(tree_id).release(self.linger)
            except Exception as exc:  # noqa: BLE001 - still busy: its user is leaving
                log.warning("cannot unmount tree %s: %s", tree_id, exc)
