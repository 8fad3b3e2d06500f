"""Importing a module while modules it would import stand in for the real ones, so that a
FUSE daemon's start imports only what it uses: asyncio without ssl
(lazyfs/tree/daemon_loop.py), pyfuse3 without trio and importlib.metadata
(lazyfs/tree/pyfuse3_asyncio.py). Each of them says why, with its measurements.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType


@contextmanager
def standing_in(modules: dict[str, ModuleType | None]) -> Iterator[None]:
    """During the block, each of `modules` not imported yet is its stand-in (None: `import
    NAME` raises ImportError, as for a module Python was built without). Afterwards the
    stand-ins are gone, so a later import gets the real module."""
    placed = {name: module for name, module in modules.items() if name not in sys.modules}
    sys.modules.update(placed)
    try:
        yield
    finally:
        for name, module in placed.items():
            if name in sys.modules and sys.modules[name] is module:
                del sys.modules[name]
