"""A store by its URL: the backends (file://, s3://) and the wrapper around every one of
them (retries of temporary errors), wired in one place above the interface
(chunker/store/interface.py), as restic's wrapBackend does. Nothing below imports this module."""

from __future__ import annotations

import os

from chunker.errors import BadInputError
from chunker.store.interface import ObjectStore

__all__ = ["open_store"]


def open_store(
    url: str, *, retry: bool = True, timeout: float | None = None, must_exist: bool = False
) -> ObjectStore:
    """Open a store by URL: file:///path or s3://BUCKET/PREFIX. (Which store a user
    means when they name none is a setting: lazyfs.settings.store_url.)

    timeout: the most seconds a request waits for an answer from a network store, and
    the retries' deadline; None keeps the backends' own (30 s). A caller that answers a
    user within LAZYFS_FETCH_TIMEOUT passes it, so that its request, even abandoned,
    ends by itself then rather than 30 s later.

    must_exist: for a caller that only reads, a file store whose directory is missing is
    a mistyped URL, not an empty store (a writer creates it). An S3 store's missing bucket
    already fails its first request."""
    if url.startswith("file://"):
        from chunker.store.file import FileStore

        store: ObjectStore = FileStore(url)
        if must_exist and not os.path.isdir(store.root):
            raise BadInputError(f"no store at {url}: {store.root} is not a directory")
    elif url.startswith("s3://"):
        from chunker.store.s3 import S3Store

        store = S3Store(url, timeout=timeout)
    else:
        raise BadInputError(
            f"unsupported store URL {url!r}: use file:///PATH or s3://BUCKET/PREFIX"
        )
    if retry:
        from chunker.store.retry import RetryingStore

        store = RetryingStore(store) if timeout is None else RetryingStore(store, deadline=timeout)
    return store
