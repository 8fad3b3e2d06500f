"""Retrying as a wrapper around any ObjectStore (restic's habit: one concern, one place).

Only TemporaryStoreError is retried, with full-jitter exponential backoff (AWS's
recommendation: sleep uniform(0, min(max_delay, base * 2**n))), which spreads out many
clients that failed at the same moment. Every other error passes straight through. When
the attempts or the deadline run out, the caller gets one StoreError naming the operation,
the key and the last failure.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from chunker.errors import StoreError, TemporaryStoreError
from chunker.store.interface import ObjectInfo, ObjectStore

__all__ = ["RetryingStore"]

T = TypeVar("T")


class RetryingStore(ObjectStore):
    def __init__(
        self,
        inner: ObjectStore,
        attempts: int = 5,
        base_delay: float = 0.1,
        max_delay: float = 5.0,
        deadline: float = 30.0,
        *,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """deadline: seconds after the first attempt past which no new attempt starts."""
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        self.inner = inner
        self.url = inner.url
        self.attempts = attempts
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.deadline = deadline
        self._sleep = sleep
        self.retries = 0  # how many retries this wrapper has made (for logs and tests)

    def _run(self, op: str, key: str, fn: Callable[[], T]) -> T:
        start = time.monotonic()
        for attempt in range(self.attempts):
            try:
                return fn()
            except TemporaryStoreError as exc:
                last = exc
                if attempt + 1 == self.attempts:
                    break
                import random  # here: only a retry needs it (~1 ms of every CLI start)

                delay = random.uniform(0, min(self.max_delay, self.base_delay * 2**attempt))
                if time.monotonic() - start + delay > self.deadline:
                    break
                self.retries += 1
                self._sleep(delay)
        tried = attempt + 1
        noun = "attempt" if tried == 1 else "attempts"
        where = f"{self.url}: {op} {key!r}: "
        reason = str(last).removeprefix(where)  # the backends' messages start the same way
        raise StoreError(
            f"{where}{reason} (gave up after {tried} {noun} in {time.monotonic() - start:.1f} s)"
        ) from last

    def get(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        return self._run("get", key, lambda: self.inner.get(key, offset, length))

    def put(self, key: str, data: bytes) -> None:
        self._run("put", key, lambda: self.inner.put(key, data))

    def exists(self, key: str) -> bool:
        return self._run("exists", key, lambda: self.inner.exists(key))

    def delete(self, key: str) -> None:
        self._run("delete", key, lambda: self.inner.delete(key))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        # Retry only until the first item arrives: after that a restart would repeat items
        # the caller has already consumed. A failure later on surfaces as it is.
        def first() -> tuple[ObjectInfo | None, Iterator[ObjectInfo]]:
            it = self.inner.list(prefix)
            return next(it, None), it

        head, it = self._run("list", prefix, first)
        if head is None:
            return
        yield head
        yield from it

    def close(self) -> None:
        self.inner.close()
