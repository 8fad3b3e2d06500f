"""The image endpoints: list, inspect and pull the images converted in the node's
store, named as Docker names them (refs.py). Building is refused with where to do it."""

from __future__ import annotations

import time

import anyio

from chunker.errors import BadInputError, NotFoundError
from chunker.images import ImageRef, list_images
from chunker.store.backends import open_store
from lazyfs.agent.images import ImageInfo
from lazyfs.agent.node import Agent
from lazyfs.docker import refs
from lazyfs.docker.containers import timestamp
from lazyfs.docker.errors import docker_errors
from lazyfs.docker.http import Answer, HttpError, Reply, Request, json_line, json_reply
from lazyfs.docker.system import arch

NAMES_FRESH = 2.0  # seconds a listing of the store's image names is used as it is


class Images:
    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.refs: dict[str, str] = {}  # a Docker reference -> the converted name it found
        self._listing: tuple[float, list[ImageRef]] = (-NAMES_FRESH, [])

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
        """An image converted already answers at once. Converting one on pull is not
        built yet: the answer says how to convert it."""
        image = request.arg("fromImage") or ""
        tag = request.arg("tag") or ""
        if not image:
            raise HttpError(400, "fromImage is required (importing a tarball is not supported)")
        ref = f"{image}@{tag}" if tag.startswith("sha256:") else f"{image}:{tag}" if tag else image
        try:
            info = await self.find(ref)
        except HttpError:
            raise HttpError(
                404,
                f"No such image: {ref}: it is not converted in this node's store, and"
                f" converting on pull is not supported yet; run `lazyfs convert {ref}`",
            ) from None
        repo, tag_part = refs.split_tag(ref)
        lines = [
            {"status": f"Pulling from {refs.short(repo)}", "id": tag_part or "latest"},
            {"status": f"Digest: sha256:{info.image_id}"},
            {"status": f"Status: Image is up to date for {ref}"},
        ]
        return Reply(body=b"".join(json_line(line) for line in lines))

    async def build(self, request: Request) -> Answer:
        raise HttpError(
            501,
            "lazyfs does not build images: build with docker or buildah, push to a"
            " registry, and convert it with `lazyfs convert`",
        )
