"""A store that counts: `CountingStore` delegates every call to a real store, appends one
line per GET to a log shared by all processes, and notes the prefixes it lists. It
instruments the store, it does not imitate it (tests/node_cache/test_cache.py,
tests/lazyfs/test_export.py, tests/chunker/test_push_gc.py)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

from chunker.store.interface import ObjectInfo, ObjectStore


class CountingStore(ObjectStore):
    """Delegates to a real store; logs each GET as one JSON line (O_APPEND: atomic)."""

    def __init__(self, inner: ObjectStore, log: Path, delay: float = 0.0) -> None:
        self.inner = inner
        self.url = inner.url
        self.log = log
        self.delay = delay  # added latency per GET, to widen the race window
        self.listed: list[str] = []  # the prefixes listed (this process's calls only)

    def get(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        line = json.dumps({"pid": os.getpid(), "key": key, "offset": offset, "length": length})
        fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)
        if self.delay:
            time.sleep(self.delay)
        return self.inner.get(key, offset, length)

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        self.listed.append(prefix)
        return self.inner.list(prefix)


def gets(log: Path) -> list[dict]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines()]
