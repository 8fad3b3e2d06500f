"""Waiting in a test for what a server does in its own time."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(cond: Callable[[], object], timeout: float = 20, what: str = "") -> None:
    """Until cond() is true; an AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
