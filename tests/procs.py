"""Stopping a server process a test or benchmark started."""

from __future__ import annotations

import signal
import subprocess


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM, wait up to `timeout` s, then SIGKILL (some servers hang on SIGTERM)."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
