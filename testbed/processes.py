"""Starting and stopping the server processes a test or benchmark runs."""

from __future__ import annotations

import ctypes
import signal
import subprocess


def die_with_parent() -> None:
    """A Popen preexec_fn: the child gets SIGKILL when its parent dies, so a server
    started by a test or benchmark that is killed outright does not linger with its
    ports and sockets (PR_SET_PDEATHSIG = 1)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


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
