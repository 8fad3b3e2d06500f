"""The image endpoints: list, inspect and pull the images converted in the node's
store, named as Docker names them (refs.py). Building is refused with where to do it."""

from __future__ import annotations

import contextlib
import json
import logging
import platform
import subprocess
import sys
import time
from collections.abc import AsyncGenerator, Callable

import anyio
from anyio.abc import ByteReceiveStream

from chunker.errors import BadInputError, NotFoundError
from chunker.refs import ImageRef, list_images, remove_name
from chunker.store.backends import open_store
from lazyfs.agent.images import ImageInfo
from lazyfs.agent.node import Agent
from lazyfs.docker import refs
from lazyfs.docker.containers import timestamp
from lazyfs.docker.errors import docker_errors
from lazyfs.docker.http import Answer, HttpError, Reply, Request, Streamed, json_line, json_reply

log = logging.getLogger("lazyfs.docker")
NAMES_FRESH = 2.0  # seconds a listing of the store's image names is used as it is
LAZYFS = [sys.executable, "-m", "lazyfs.launcher"]  # this install's command
CONVERT_NICE = 10  # a pull's conversion runs below the agent and its sandboxes' refills
PROGRESS_EVERY = 2.0  # seconds between a conversion's progress lines


class Images:
    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.refs: dict[str, str] = {}  # a Docker reference -> the converted name it found
        self._listing: tuple[float, list[ImageRef]] = (-NAMES_FRESH, [])
        self._converting: dict[str, anyio.Lock] = {}  # a reference being pulled
        # The ids of the containers whose image is the given one (container_api's).
        self.containers_of: Callable[[str], list[str]] = lambda image_id: []

    async def find(self, ref: str) -> ImageInfo:
        """The converted image a Docker reference names (refs.py), or Docker's 404."""
        known = self.refs.get(ref)
        names = [known] if known else refs.candidates(ref)
        for name in names:
            try:
                info = await self.agent.image(name)
            except NotFoundError:
                continue
            except BadInputError:  # a spelling that is no name at all
                continue
            self.refs[ref] = name
            return info
        self.refs.pop(ref, None)
        raise HttpError(404, f"No such image: {ref}")

    async def _names(self) -> list[ImageRef]:
        """Every name converted in the store (a listing of its refs: kept NAMES_FRESH s)."""
        when, names = self._listing
        if time.monotonic() - when < NAMES_FRESH:
            return names

        def listing() -> list[ImageRef]:
            store = open_store(
                self.agent.config.store_url, timeout=self.agent.settings.cache.fetch_timeout
            )
            try:
                return list_images(store)
            finally:
                store.close()

        names = await anyio.to_thread.run_sync(listing)
        self._listing = (time.monotonic(), names)
        return names

    async def _tags(self, image_id: str) -> list[str]:
        return sorted({refs.repo_tag(r.name) for r in await self._names() if r.image == image_id})

    @docker_errors
    async def list_images(self, request: Request) -> Answer:
        by_id: dict[str, list[ImageRef]] = {}
        for ref in await self._names():
            by_id.setdefault(ref.image, []).append(ref)
        images = []
        for image_id, names in by_id.items():
            info = await self.agent.image(image_id)
            images.append(
                {
                    "Id": "sha256:" + image_id,
                    "ParentId": "",
                    "RepoTags": sorted({refs.repo_tag(r.name) for r in names}),
                    "RepoDigests": sorted({r.source_digest for r in names if r.source_digest}),
                    "Created": int(max(r.created for r in names)),
                    "Size": info.size,
                    "VirtualSize": info.size,
                    "SharedSize": -1,
                    "Labels": info.config.get("Labels") or {},
                    "Containers": -1,
                }
            )
        return json_reply(images)

    @docker_errors
    async def inspect_image(self, request: Request) -> Answer:
        ref = request.params["name"]
        info = await self.find(ref)
        return json_reply(
            {
                "Id": "sha256:" + info.image_id,
                "RepoTags": await self._tags(info.image_id),
                "RepoDigests": [],
                "Parent": "",
                "Comment": "",
                "Created": info.created or timestamp(None),
                "Config": info.config,
                "DockerVersion": "",
                "Author": "",
                "Architecture": "amd64" if arch() == "amd64" else arch(),
                "Os": "linux",
                "Size": info.size,
                "VirtualSize": info.size,
                "GraphDriver": {"Name": "lazyfs", "Data": {}},
                "RootFS": {"Type": "layers", "Layers": []},
                "Metadata": {"LastTagTime": timestamp(None)},
            }
        )

    @docker_errors
    async def pull(self, request: Request) -> Answer:
        """An image converted already answers at once; any other is converted from its
        registry into the node's store (`lazyfs convert`, a process of its own at low
        priority: chunking and compressing would hold the agent's event loop), with
        Docker's progress lines while it runs. Credentials come from the usual auth
        files (registry_bridge/auth.py); a loopback registry is plain HTTP, as Docker
        allows it."""
        image = request.arg("fromImage") or ""
        tag = request.arg("tag") or ""
        if not image:
            raise HttpError(400, "fromImage is required (importing a tarball is not supported)")
        ref = f"{image}@{tag}" if tag.startswith("sha256:") else f"{image}:{tag}" if tag else image
        repo, tag_part = refs.split_tag(ref)
        head = {"status": f"Pulling from {refs.short(repo)}", "id": tag_part or "latest"}
        with contextlib.suppress(HttpError):
            info = await self.find(ref)
            lines = [head, *_done(info.image_id, f"Image is up to date for {ref}")]
            return Reply(body=b"".join(json_line(line) for line in lines))
        return Streamed(self._convert(ref, head))

    async def _convert(self, ref: str, head: dict) -> AsyncGenerator[bytes, None]:
        yield json_line(head)
        lock = self._converting.setdefault(ref, anyio.Lock())
        async with lock:  # one conversion of a reference at a time; the next finds it
            with contextlib.suppress(HttpError):
                info = await self.find(ref)
                for line in _done(info.image_id, f"Image is up to date for {ref}"):
                    yield json_line(line)
                return
            source = refs.registry_source(ref)
            argv = [*LAZYFS, "convert", source, "--name", ref, "--json"]
            argv += ["--store", self.agent.config.store_url]
            if refs.is_loopback_registry(ref):
                argv.append("--tls-verify=false")
            yield json_line({"status": f"Converting {source} into lazyfs's store", **_id(head)})
            async with await anyio.open_process(
                ["nice", "-n", str(CONVERT_NICE), *argv], stdin=subprocess.DEVNULL
            ) as proc:
                out, err = bytearray(), bytearray()
                async with anyio.create_task_group() as reading:
                    reading.start_soon(_read_into, proc.stdout, out)
                    reading.start_soon(_read_into, proc.stderr, err)
                    while proc.returncode is None:
                        with anyio.move_on_after(PROGRESS_EVERY):
                            await proc.wait()
                        if proc.returncode is None:
                            yield json_line({"status": "Converting", **_id(head)})
                code = await proc.wait()
        self._converting.pop(ref, None)
        if code != 0:
            why = err.decode(errors="replace").strip().splitlines()
            message = (why[-1] if why else f"lazyfs convert exited {code}").removeprefix("lazyfs: ")
            yield json_line({"errorDetail": {"message": message}, "error": message})
            return
        image_id = json.loads(out)["image_id"]
        self._listing = (-NAMES_FRESH, [])  # the new name is in the store's listing now
        log.info("docker: pulled %s (converted %s as image %s)", ref, source, image_id)
        for line in _done(image_id, f"Downloaded newer image for {ref}"):
            yield json_line(line)

    @docker_errors
    async def remove(self, request: Request) -> Answer:
        """`docker rmi`: take the name off its image in the store (its chunks stay for
        `lazyfs gc`). A reference that is an image id untags its one name, or all with
        force. An image a container uses is kept unless forced, as dockerd does."""
        ref = request.params["name"]
        force = request.flag("force")
        info = await self.find(ref)
        self._listing = (-NAMES_FRESH, [])  # a fresh listing: a name pulled a moment ago
        named = [r.name for r in await self._names() if r.image == info.image_id]
        bare = ref.removeprefix("sha256:")
        if info.image_id.startswith(bare) and len(bare) >= 12:  # by id: every name of it
            if len(named) > 1 and not force:
                raise HttpError(
                    409,
                    f"conflict: unable to delete {info.image_id[:12]} (must be forced) -"
                    " image is referenced in multiple repositories",
                )
        else:  # by name: the names this reference spells
            named = [name for name in named if refs.same_image(name, ref)]
        users = self.containers_of(info.image_id)
        if users and not force:
            raise HttpError(
                409,
                f'conflict: unable to remove repository reference "{ref}" (must force) -'
                f" container {users[0][:12]} is using its referenced image"
                f" {info.image_id[:12]}",
            )
        if not named:
            raise HttpError(404, f"No such image: {ref}")

        def untag() -> None:
            store = open_store(self.agent.config.store_url)
            try:
                for name in named:
                    remove_name(store, name)
            finally:
                store.close()

        await anyio.to_thread.run_sync(untag)
        for name in named:
            self.agent.images.forget(name)
        self.refs.clear()
        self._listing = (-NAMES_FRESH, [])
        return json_reply([{"Untagged": refs.repo_tag(name)} for name in named])

    async def build(self, request: Request) -> Answer:
        raise HttpError(
            501,
            "lazyfs does not build images: build with docker or buildah, push to a"
            " registry, and convert it with `lazyfs convert`",
        )


def _id(head: dict) -> dict:
    return {"id": head["id"]}


def _done(image_id: str, status: str) -> list[dict]:
    return [{"status": f"Digest: sha256:{image_id}"}, {"status": f"Status: {status}"}]


async def _read_into(stream: ByteReceiveStream | None, into: bytearray) -> None:
    if stream is None:
        return
    async for data in stream:
        into += data


def lazyfs_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lazyfs")
    except PackageNotFoundError:
        return "0"


def arch() -> str:
    machine = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)
