"""Where a store keeps an image's objects and the refs to it: the key prefixes
(docs/FORMATS.md, "Store layout", has the whole layout and each object's format).

    images/<id>                  zstd of the manifest SQLite file; id = blake3 of that file
    erofs/<id>                   zstd of the image's EROFS metadata image; id = its blake3
    refs/names/<quoted name>     JSON {"image", "name", "source_digest", "created"}: mutable,
                                 written last
    refs/digests/<algo>/<hex>    the same JSON: the source manifest digest -> image

A module of its own so that finding an image (chunker/refs.py, on every `lazyfs run`)
does not import what publishing and fetching one takes (chunker/images.py).
"""

import re

IMAGE_ID = re.compile(r"[0-9a-f]{64}")  # what names an image: file names on every node

IMAGES_PREFIX = "images/"
EROFS_PREFIX = "erofs/"
NAMES_PREFIX = "refs/names/"
DIGESTS_PREFIX = "refs/digests/"
