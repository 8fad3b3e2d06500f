"""TEMPORARY: stand-ins for chunker.store_file and chunker.retry until they land.

Loaded into test subprocesses through PYTHONPATH (see tests/lazyfs/conftest.py) and into
the test process by import. Does nothing once the real modules exist: delete then.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import types


def _install() -> None:
    if importlib.util.find_spec("chunker.store_file") is not None:
        return
    from chunker.store import ObjectInfo, ObjectNotFound, ObjectStore

    class FileStore(ObjectStore):
        def __init__(self, url: str) -> None:
            self.url = url
            self.root = url[len("file://") :]
            os.makedirs(self.root, exist_ok=True)

        def _path(self, key: str) -> str:
            return os.path.join(self.root, key)

        def get(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
            try:
                with open(self._path(key), "rb") as f:
                    f.seek(offset)
                    return f.read() if length is None else f.read(length)
            except FileNotFoundError:
                raise ObjectNotFound(f"no object {key}") from None

        def put(self, key: str, data: bytes) -> None:
            path = self._path(key)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)

        def exists(self, key: str) -> bool:
            return os.path.exists(self._path(key))

        def delete(self, key: str) -> None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(key))

        def list(self, prefix: str = ""):  # noqa: ANN201
            for dirpath, _, files in os.walk(self.root):
                for name in files:
                    full = os.path.join(dirpath, name)
                    key = os.path.relpath(full, self.root)
                    if key.startswith(prefix):
                        st = os.stat(full)
                        yield ObjectInfo(key, st.st_size, st.st_mtime)

    mod = types.ModuleType("chunker.store_file")
    mod.FileStore = FileStore
    sys.modules["chunker.store_file"] = mod
    if importlib.util.find_spec("chunker.retry") is None:
        retry = types.ModuleType("chunker.retry")
        retry.RetryingStore = lambda store: store
        sys.modules["chunker.retry"] = retry


with contextlib.suppress(ImportError):  # not in the lazyfs venv
    _install()
