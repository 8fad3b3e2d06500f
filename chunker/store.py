"""The object-store interface every backend implements.

Keys are relative POSIX-style paths ("packs/ab12...", "refs/names/..."). Objects are
immutable except refs; writing the same key twice with the same bytes is harmless, which
is what lets many converters share one store without locks.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

from chunker.errors import BadInputError, ObjectNotFound

__all__ = ["ObjectInfo", "ObjectNotFound", "ObjectStore", "default_store_url", "open_store"]


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str
    size: int
    mtime: float  # seconds since the epoch (used by gc's grace period)


class ObjectStore(ABC):
    url: str

    @abstractmethod
    def get(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes [offset, offset+length) of an object (to its end if length is None).

        Raises ObjectNotFound if the key does not exist.
        """

    @abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Store an object atomically: readers see the old object or the whole new one."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove an object; removing a missing key is not an error."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with prefix, in no particular order."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections; the default has nothing to release."""


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
