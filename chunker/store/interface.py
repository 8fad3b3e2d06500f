"""The object-store interface every backend implements.

Keys are relative POSIX-style paths ("packs/ab12...", "refs/names/..."). Objects are
immutable except refs; writing the same key twice with the same bytes is harmless, which
is what lets many converters share one store without locks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import NamedTuple

from chunker.errors import BadInputError, ObjectNotFound

__all__ = ["TEMP_PREFIX", "ObjectInfo", "ObjectNotFound", "ObjectStore", "check_key", "check_range"]

# Reserved for a backend's own temporary objects (the file store's atomic writes): no key
# may start a part with it, so list() never meets a half-written object as a key.
TEMP_PREFIX = ".tmp-"


class ObjectInfo(NamedTuple):  # not a dataclass: see chunker/model.py
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


def check_key(key: str) -> str:
    """Reject keys that are not plain relative paths, so nothing lands outside the root.

    Shared by every backend so that a key valid on one store is valid on all of them.
    """
    if not isinstance(key, str) or not key:
        raise BadInputError(f"invalid store key {key!r}: must be a non-empty string")
    if key.startswith("/") or "\\" in key or "\0" in key:
        raise BadInputError(f"invalid store key {key!r}: must be a relative path of '/' parts")
    for part in key.split("/"):
        if part in ("", ".", ".."):
            raise BadInputError(f"invalid store key {key!r}: empty, '.' or '..' component")
        if part.startswith(TEMP_PREFIX):
            raise BadInputError(f"invalid store key {key!r}: {TEMP_PREFIX!r} names are reserved")
    return key


def check_range(key: str, offset: int, length: int | None) -> None:
    if offset < 0 or (length is not None and length < 0):
        raise BadInputError(f"invalid range for {key!r}: offset={offset} length={length}")
