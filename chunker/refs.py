"""The refs of a store: names and source digests that point at images, and finding an
image by any of them (or by its id or a prefix of it).

Apart from chunker/images.py (publishing and fetching an image's objects) because every
`lazyfs run` resolves an image, and that needs none of zstandard, tempfile, the manifest
or dataclasses: ~17 ms of imports on each run's clock (docs/design-changes.md,
session 29). A ref is written last in a convert (chunker/images.py's publish_tree, then
publish_refs here): a name never points at a half-published image.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from typing import NamedTuple
from urllib.parse import quote, unquote

from chunker.errors import BadInputError, CorruptObjectError, NotFoundError, ObjectNotFound
from chunker.keys import DIGESTS_PREFIX, IMAGE_ID, IMAGES_PREFIX, NAMES_PREFIX
from chunker.store.interface import ObjectStore


class ImageRef(NamedTuple):
    name: str
    image: str
    source_digest: str
    created: float


def publish_refs(
    store: ObjectStore,
    image_id: str,
    name: str,
    source_digest: str,
    start: dict | None = None,
) -> None:
    """Point a name and the source manifest digest at an image: the last step of a convert.

    `start` (an image with layer trees): what a node needs to start it, copied from its
    manifest, so that a lookup by name fetches no manifest (`lookup_ref`)."""
    body = {"image": image_id, "name": name, "source_digest": source_digest, "created": time.time()}
    if start:
        body["start"] = start
    if source_digest:
        store.put(digest_ref_key(source_digest), json.dumps(body).encode())
    store.put(NAMES_PREFIX + quote(name, safe=""), json.dumps(body).encode())


def copy_refs(src: ObjectStore, dst: ObjectStore, image_id: str) -> None:
    """Every name and digest that points at the image in src, as they are, into dst."""
    for ref in list_images(src):
        if ref.image != image_id:
            continue
        keys = [NAMES_PREFIX + quote(ref.name, safe="")]
        if ref.source_digest:
            keys.insert(0, digest_ref_key(ref.source_digest))
        for key in keys:
            with contextlib.suppress(ObjectNotFound):
                dst.put(key, src.get(key))


class StartInfo(NamedTuple):
    """What a ref says a node needs to start its image (docs/FORMATS.md, "Store layout")."""

    image: str
    layers: list[str]  # layer tree ids, bottom first
    config: dict  # the OCI image config's "config"
    created: str
    size: int  # bytes of its files' contents


def lookup_ref(store: ObjectStore, name: str) -> tuple[str, StartInfo | None] | None:
    """What the ref of a name (or source digest) says: the image id, and the start
    information when it carries one (an image converted with layer trees); None if no
    ref has that name. A ref naming no image id, or carrying malformed start
    information, is refused (CorruptObjectError)."""
    for key in _ref_keys(name):
        body = _ref(store, key)
        if body is None:
            continue
        image = body["image"]
        start = body.get("start")
        if start is None:
            return image, None
        try:
            info = StartInfo(
                image, start["layers"], start["config"], start["created"], start["size"]
            )
        except (KeyError, TypeError):
            info = None
        if not (
            info is not None
            and isinstance(info.layers, list)
            and info.layers
            and all(isinstance(i, str) and IMAGE_ID.fullmatch(i) for i in info.layers)
            and isinstance(info.config, dict)
            and isinstance(info.created, str)
            and isinstance(info.size, int)
        ):
            raise CorruptObjectError(f"ref {key} in {store.url}: malformed start information")
        return image, info
    return None


def _ref_keys(image: str) -> list[str]:
    """Where a ref of this name is: its name, and if it is one, the source digest."""
    keys = [NAMES_PREFIX + quote(image, safe="")]
    if image.startswith("sha256:"):
        keys.append(digest_ref_key(image))
    return keys


def remove_name(store: ObjectStore, name: str) -> None:
    """Take a name off its image (NotFoundError if no image has it). The image's objects
    stay until `lazyfs gc` finds nothing naming it."""
    key = NAMES_PREFIX + quote(name, safe="")
    if not store.exists(key):
        raise NotFoundError(f"no image named {name!r} in {store.url}")
    store.delete(key)


def digest_ref_key(digest: str) -> str:
    algo, _, hexdigest = digest.partition(":")
    if not re.fullmatch(r"[a-z0-9]+", algo) or not re.fullmatch(r"[0-9a-f]+", hexdigest):
        raise BadInputError(f"malformed digest {digest!r}")
    return f"{DIGESTS_PREFIX}{algo}/{hexdigest}"


def list_images(store: ObjectStore) -> list[ImageRef]:
    refs = []
    for info in store.list(NAMES_PREFIX):
        try:
            body = json.loads(store.get(info.key))
        except ObjectNotFound:
            continue
        refs.append(
            ImageRef(
                unquote(info.key[len(NAMES_PREFIX) :]),
                body["image"],
                body.get("source_digest", ""),
                body.get("created", info.mtime),
            )
        )
    return sorted(refs, key=lambda r: r.name)


def _ref(store: ObjectStore, key: str) -> dict | None:
    """The ref at `key` (its JSON); None if there is no such ref. Its "image" names
    files on every node (CACHE/manifests/<id>.db, ...): a ref that does not hold an
    image id there is refused here (CorruptObjectError), before any path is made of it."""
    try:
        body = json.loads(store.get(key))
    except ObjectNotFound:
        return None
    except ValueError:
        body = None
    image = body.get("image") if isinstance(body, dict) else None
    if not (isinstance(image, str) and IMAGE_ID.fullmatch(image)):
        raise CorruptObjectError(f"ref {key} in {store.url} names no image id")
    return body


def image_of_digest(store: ObjectStore, digest: str) -> str | None:
    """The image converted from the source image of this manifest digest, if any."""
    body = _ref(store, digest_ref_key(digest))
    return None if body is None else body["image"]


def resolve_image(store: ObjectStore, image: str) -> str:
    """A name, a source digest (sha256:...), an image id or a unique id prefix -> image id."""
    found = lookup_ref(store, image)
    return found[0] if found is not None else resolve_id(store, image)


def resolve_id(store: ObjectStore, image: str) -> str:
    """An image id or a unique id prefix -> image id, for a caller whose lookup_ref found
    no ref of that name (resolve_image without reading the refs again)."""
    if IMAGE_ID.fullmatch(image) and store.exists(IMAGES_PREFIX + image):
        return image
    if re.fullmatch(r"[0-9a-f]{6,63}", image):
        found = [i.key[len(IMAGES_PREFIX) :] for i in store.list(IMAGES_PREFIX + image)]
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise BadInputError(f"image id prefix {image!r} is ambiguous")
    raise NotFoundError(f"no image {image!r} in {store.url}")
