"""The refs of a store: names and source digests that point at images, and finding an
image by any of them (or by its id or a prefix of it).

Apart from chunker/images.py (publishing and fetching an image's objects) because every
`lazyfs run` resolves an image, and that needs none of zstandard, tempfile, the manifest
or dataclasses: ~17 ms of imports on each run's clock (docs/design-changes.md,
session 29). A ref is written last in a convert (chunker/images.py's publish_tree, then
publish_refs here): a name never points at a half-published image.
"""

from __future__ import annotations

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


def publish_refs(store: ObjectStore, image_id: str, name: str, source_digest: str) -> None:
    """Point a name and the source manifest digest at an image: the last step of a convert."""
    body = {"image": image_id, "name": name, "source_digest": source_digest, "created": time.time()}
    if source_digest:
        store.put(digest_ref_key(source_digest), json.dumps(body).encode())
    store.put(NAMES_PREFIX + quote(name, safe=""), json.dumps(body).encode())


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


def _ref(store: ObjectStore, key: str) -> str | None:
    """The image id the ref at `key` names; None if there is no such ref. The id names
    files on every node (CACHE/manifests/<id>.db, ...): a ref that does not hold one is
    refused here (CorruptObjectError), before any path is made of it."""
    try:
        body = store.get(key)
    except ObjectNotFound:
        return None
    try:
        image = json.loads(body)["image"]
    except (ValueError, TypeError, KeyError):
        image = None
    if not (isinstance(image, str) and IMAGE_ID.fullmatch(image)):
        raise CorruptObjectError(f"ref {key} in {store.url} names no image id")
    return image


def image_of_digest(store: ObjectStore, digest: str) -> str | None:
    """The image converted from the source image of this manifest digest, if any."""
    return _ref(store, digest_ref_key(digest))


def resolve_image(store: ObjectStore, image: str) -> str:
    """A name, a source digest (sha256:...), an image id or a unique id prefix -> image id."""
    for key in (NAMES_PREFIX + quote(image, safe=""),) + (
        (digest_ref_key(image),) if image.startswith("sha256:") else ()
    ):
        found = _ref(store, key)
        if found is not None:
            return found
    if IMAGE_ID.fullmatch(image) and store.exists(IMAGES_PREFIX + image):
        return image
    if re.fullmatch(r"[0-9a-f]{6,63}", image):
        found = [i.key[len(IMAGES_PREFIX) :] for i in store.list(IMAGES_PREFIX + image)]
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise BadInputError(f"image id prefix {image!r} is ambiguous")
    raise NotFoundError(f"no image {image!r} in {store.url}")
