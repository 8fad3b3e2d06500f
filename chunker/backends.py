"""A store by its URL: the backends (file://, s3://) and the wrapper around every one of
them (retries of temporary errors), wired in one place above the interface
(chunker/store.py), as restic's wrapBackend does. Nothing below imports this module."""

from __future__ import annotations

import os

from chunker.errors import BadInputError
from chunker.store import ObjectStore

__all__ = ["default_store_url", "open_store"]


def default_store_url() -> str:
    """$LAZYFS_STORE, else a directory under the user's data directory."""
    if url := os.environ.get("LAZYFS_STORE"):
        return url
    data = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
    return "file://" + os.path.join(data, "lazyfs", "store")


def open_store(url: str | None = None, *, retry: bool = True) -> ObjectStore:
    """Open a store by URL: file:///path or s3://BUCKET/PREFIX."""
    url = url or default_store_url()
    if url.startswith("file://"):
        from chunker.store_file import FileStore

        store: ObjectStore = FileStore(url)
    elif url.startswith("s3://"):
        from chunker.store_s3 import S3Store

        store = S3Store(url)
    else:
        raise BadInputError(
            f"unsupported store URL {url!r}: use file:///PATH or s3://BUCKET/PREFIX"
        )
    if retry:
        from chunker.retry import RetryingStore

        store = RetryingStore(store)
    return store
