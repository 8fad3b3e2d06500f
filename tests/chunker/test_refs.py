"""Finding an image in a store by a name, a source digest, its id or a prefix of it; and
refusing a ref whose image is not an id (it becomes file names on every node)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chunker.errors import BadInputError, CorruptObjectError, NotFoundError
from chunker.keys import IMAGES_PREFIX, NAMES_PREFIX
from chunker.refs import (
    digest_ref_key,
    image_of_digest,
    list_images,
    publish_refs,
    remove_name,
    resolve_image,
)
from chunker.store.backends import open_store

IMAGE = "ab" * 32
OTHER = "ababab" + "cd" * 29  # shares 6 hex digits with IMAGE
DIGEST = "sha256:" + "01" * 32


@pytest.fixture
def store(tmp_path: Path):
    store = open_store(f"file://{tmp_path}")
    for image in (IMAGE, OTHER):
        store.put(IMAGES_PREFIX + image, b"a manifest")
    publish_refs(store, IMAGE, "python:3.11", DIGEST)
    yield store
    store.close()


def test_a_name_a_digest_an_id_or_a_unique_prefix_finds_the_image(store) -> None:
    assert resolve_image(store, "python:3.11") == IMAGE
    assert resolve_image(store, DIGEST) == IMAGE
    assert image_of_digest(store, DIGEST) == IMAGE  # the snapshotter's question
    assert image_of_digest(store, "sha256:" + "03" * 32) is None
    assert resolve_image(store, IMAGE) == IMAGE
    assert resolve_image(store, OTHER[:8]) == OTHER
    with pytest.raises(BadInputError, match="ambiguous"):
        resolve_image(store, "ababab")
    with pytest.raises(NotFoundError):
        resolve_image(store, "python:3.12")
    assert [(r.name, r.image, r.source_digest) for r in list_images(store)] == [
        ("python:3.11", IMAGE, DIGEST)
    ]
    remove_name(store, "python:3.11")
    assert list_images(store) == []


@pytest.mark.parametrize(
    "body",
    [
        {"image": "../../../../tmp/escape", "name": "bad"},
        {"image": IMAGE.upper(), "name": "bad"},
        {"image": 7, "name": "bad"},
        {"name": "bad"},
        ["not", "a", "ref"],
        "cut short",
    ],
)
def test_a_ref_that_names_no_image_id_is_refused(store, body: object) -> None:
    raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    store.put(NAMES_PREFIX + "bad", raw)
    store.put(digest_ref_key("sha256:" + "02" * 32), raw)
    with pytest.raises(CorruptObjectError, match="names no image id"):
        resolve_image(store, "bad")
    with pytest.raises(CorruptObjectError, match="names no image id"):
        resolve_image(store, "sha256:" + "02" * 32)
    with pytest.raises(CorruptObjectError, match="names no image id"):
        image_of_digest(store, "sha256:" + "02" * 32)
