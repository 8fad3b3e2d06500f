"""run_helper (lazyfs/sandbox/runtime.py): how the agent runs a short-lived host helper
(the attach helper of a generic sandbox's claim) without subprocess."""

from __future__ import annotations

import os
import time

import pytest

from lazyfs.sandbox.runtime import OutputTooBig, run_helper


def test_it_gives_the_exit_status_and_what_the_helper_wrote() -> None:
    code, said = run_helper(["/bin/sh", "-c", "echo out; echo err >&2; read x; exit 3"])
    assert code == 3
    assert said.split() == ["out", "err"]  # stdin is /dev/null: `read` returns at once


def test_a_helper_killed_by_a_signal_gives_minus_the_signal_as_subprocess_does() -> None:
    code, _ = run_helper(["/bin/sh", "-c", "kill -9 $$"])
    assert code == -9


def test_a_missing_helper_is_an_os_error() -> None:
    with pytest.raises(FileNotFoundError):
        run_helper(["/nonexistent/lazyfs-helper"])


def test_a_helper_that_hangs_is_killed_at_its_timeout() -> None:
    t0 = time.monotonic()
    with pytest.raises(OSError, match="still ran after 0.3 s"):
        run_helper(["/bin/sleep", "30"], timeout=0.3)
    assert time.monotonic() - t0 < 5


def test_no_descriptor_is_left_open() -> None:
    before = set(os.listdir("/proc/self/fd"))
    run_helper(["/bin/true"])
    with pytest.raises(OSError):
        run_helper(["/bin/sleep", "30"], timeout=0.1)
    assert set(os.listdir("/proc/self/fd")) == before


def test_a_helper_that_writes_past_its_limit_is_killed() -> None:
    """With a limit (top's `ps`, whose output a sandbox's command lines can make huge)
    a helper that writes more is killed at once and OutputTooBig raised; without one,
    all it wrote is kept, as before."""
    t0 = time.monotonic()
    with pytest.raises(OutputTooBig, match="wrote more than 100000 bytes"):
        run_helper(["/bin/sh", "-c", "yes; sleep 30"], limit=100_000)
    assert time.monotonic() - t0 < 5
    code, said = run_helper(["/bin/sh", "-c", "head -c 300000 /dev/zero"], limit=300_000)
    assert (code, len(said)) == (0, 300_000)
    code, said = run_helper(["/bin/sh", "-c", "head -c 300000 /dev/zero"])
    assert (code, len(said)) == (0, 300_000)
