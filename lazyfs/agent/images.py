"""Image names as the agent's clients give them, looked up to an image id and config.

A lookup is a thread hop and store reads (milliseconds), so each name's answer is kept
IMAGE_FRESH seconds as it is, and up to IMAGE_STALE seconds while a background task
looks the name up again (a name can be converted again): a warm claim never pays one.
While the store is down, a name known before is answered with what it named then.

The creates that ask for a name while its lookup runs wait for that lookup rather than
make their own: a burst sends one node several sandboxes of an image at once (cache
placement sends them all to the same node), and each fetched the image's manifest, 0.7
MB from the store and ~12 ms of this process's time, once for every create.

At most NAMES_KEPT names are kept, the least recently used going first: a node runs
thousands of task images a day, one name each, and each name kept is ~2.7 kB (its
config) that the placement report, read by every gateway each second, also walks. A
name gone is looked up again at its next create, as a new one.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import anyio
from anyio.abc import TaskGroup

from chunker.errors import LazyfsError, StoreError
from chunker.manifest import Manifest
from chunker.refs import lookup_ref, resolve_id
from chunker.store.backends import open_store
from lazyfs.sandbox.overlay import lower_trees_that_fit
from lazyfs.tree.image_mounts import ImageMounts
from lazyfs.tree.node_files import cached_image_id, cached_manifest

log = logging.getLogger("lazyfs.agent")
IMAGE_FRESH = 10.0  # seconds an image name's lookup is used as it is
IMAGE_STALE = 60.0  # ... and then while it is looked up again in the background
NAMES_KEPT = 10_000  # names whose lookup is kept, the least recently used going first


@dataclass
class _Lookup:
    """A lookup in progress, which other creates of the same name wait for."""

    done: anyio.Event
    info: ImageInfo | None = None
    error: Exception | None = None


@dataclass
class ImageInfo:
    name: str
    image_id: str
    config: dict  # the OCI image config's "config"
    size: int = 0  # bytes of its files' contents (Docker's image Size)
    created: str = ""  # the OCI image config's "created" (RFC 3339), if it says
    layers: tuple[str, ...] = ()  # its layer trees' ids, bottom first (docs/FORMATS.md)

    @property
    def trees(self) -> tuple[str, ...]:
        """The trees a sandbox of it stands on, top first: its layer trees, stacked by
        the sandbox's overlay, or else its merged tree."""
        return self.layers[::-1] or (self.image_id,)


class Images:
    def __init__(
        self, mounts: ImageMounts, store_url: str, cache_dir: Path, fetch_timeout: float
    ) -> None:
        self.mounts = mounts
        self.store_url = store_url
        self.cache_dir = cache_dir
        self.fetch_timeout = fetch_timeout
        # An image with more layer trees than a sandbox's overlay can stack is
        # served from its merged tree (ImageInfo.layers left empty).
        self.max_layers = lower_trees_that_fit(mounts.trees_dir)
        self.tasks: TaskGroup | None = None  # for background lookups, once the agent runs
        # name -> (when looked up, what), least recently used first
        self._known: OrderedDict[str, tuple[float, ImageInfo]] = OrderedDict()
        self._refreshing: set[str] = set()  # names being looked up again
        self._lookups: dict[str, _Lookup] = {}  # name -> its lookup in progress

    async def get(self, name: str) -> ImageInfo:
        """The image's id and config (see the top for how long an answer is kept)."""
        cached = self._known.get(name)
        if cached:
            self._known.move_to_end(name)
            age = time.monotonic() - cached[0]
            if age < IMAGE_FRESH:
                return cached[1]
            if age < IMAGE_STALE and self.tasks is not None:
                if name not in self._refreshing:
                    self._refreshing.add(name)
                    self.tasks.start_soon(self._refresh, name)
                return cached[1]
        try:
            info = await self._load_once(name)
        except StoreError as exc:
            if cached is None:
                raise
            # The store is down, but the name was known: its sandboxes still run from the
            # node (tree mounted, chunks cached), so an outage does not stop them.
            log.warning("image %s: %s; using what it named before", name, exc)
            return cached[1]
        self._keep(name, info)
        return info

    def _keep(self, name: str, info: ImageInfo) -> None:
        self._known[name] = (time.monotonic(), info)
        self._known.move_to_end(name)
        while len(self._known) > NAMES_KEPT:
            self._known.popitem(last=False)

    def peek(self, name: str) -> ImageInfo | None:
        """What the name was last looked up to, however long ago; no lookup."""
        cached = self._known.get(name)
        return cached[1] if cached else None

    def infos(self) -> list[ImageInfo]:
        """What every name looked up here was last looked up to."""
        return [info for _, info in self._known.values()]

    def known(self) -> dict[str, tuple[float, str]]:
        """Name -> (time.monotonic() of its last lookup, image id), for every name looked
        up here (GET /placement). A name in use is looked up again every IMAGE_FRESH to
        IMAGE_STALE seconds, so its time is its last use to within IMAGE_STALE."""
        return {name: (when, info.image_id) for name, (when, info) in self._known.items()}

    def forget(self, name: str) -> None:
        """Drop what is known of a name (it was taken off its image)."""
        self._known.pop(name, None)

    async def _refresh(self, name: str) -> None:
        try:
            info = await self._load_once(name)
            self._keep(name, info)
        except StoreError as exc:  # kept: get() uses it while the store is down
            log.warning("image %s: looking it up again failed: %s", name, exc)
        except (LazyfsError, OSError) as exc:  # e.g. the name is gone: the next claim says so
            log.warning("image %s: looking it up again failed: %s", name, exc)
            self._known.pop(name, None)
        finally:
            self._refreshing.discard(name)

    async def _load_once(self, name: str) -> ImageInfo:
        """_load_in_time, or the answer of the one already running for this name (its
        error too). If that one's caller was cancelled (its client left), a waiter
        looks the name up itself."""
        while (running := self._lookups.get(name)) is not None:
            await running.done.wait()
            if running.info is not None:
                return running.info
            if running.error is not None:
                raise running.error
        lookup = self._lookups[name] = _Lookup(anyio.Event())
        try:
            lookup.info = await self._load_in_time(name)
            return lookup.info
        except Exception as exc:
            lookup.error = exc
            raise
        finally:
            del self._lookups[name]
            lookup.done.set()

    async def _load_in_time(self, name: str) -> ImageInfo:
        """_load, or StoreError once LAZYFS_FETCH_TIMEOUT passes: a store that accepts
        connections and never answers would otherwise hold the create for the client's
        read timeout (30 s) and more. The abandoned thread ends by itself; it runs on
        anyio's default limiter, not the agent's, so that it holds no slot of sandbox
        work."""
        timeout = self.fetch_timeout
        with anyio.move_on_after(timeout):
            return await anyio.to_thread.run_sync(self._load, name, abandon_on_cancel=True)
        raise StoreError(
            f"the store did not answer within {timeout:g} s (LAZYFS_FETCH_TIMEOUT)"
            f" while looking up image {name!r}"
        )

    def _load(self, name: str) -> ImageInfo:
        """The image's id and config: from its ref when the ref carries them (an image
        with layer trees: no manifest is fetched, a new image on a known base costs its
        top tree alone), else from its manifest."""
        store = open_store(self.store_url, timeout=self.fetch_timeout)
        try:
            cached_id = cached_image_id(name, self.cache_dir)
            found = None if cached_id else lookup_ref(store, name)
            if found is not None and found[1] is not None:
                s = found[1]
                info = ImageInfo(name, s.image, s.config, s.size, s.created, tuple(s.layers))
            else:
                # No ref of that name: an image id or a prefix, without reading the refs
                # again (resolve_image's second half).
                image_id = found[0] if found is not None else cached_id or resolve_id(store, name)
                manifest = Manifest(cached_manifest(store, image_id, self.cache_dir))
                try:
                    whole = manifest.config
                    info = ImageInfo(
                        name,
                        image_id,
                        whole.get("config") or {},
                        manifest.file_bytes(),
                        whole.get("created", ""),
                        tuple(manifest.layer_trees),
                    )
                finally:
                    manifest.close()
        finally:
            store.close()
        if len(info.layers) > self.max_layers:
            info.layers = ()  # served from its merged tree
        return info
