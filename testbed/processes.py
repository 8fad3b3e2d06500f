"""The processes a test or benchmark runs: starting them (with the repository importable),
stopping them, finding them by their command line, and waiting."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

REPO = Path(__file__).parents[1]  # the checkout this package is in


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


def stop_on_sigterm(proc: subprocess.Popen | None, what: str, timeout: float = 30) -> int | None:
    """A service's clean stop: SIGTERM, and its exit status; if it does not end within
    `timeout`, SIGKILL and AssertionError (a service must stop on SIGTERM). `what` names
    it, with its log, in the failure. None if it was never started."""
    if proc is None or proc.poll() is not None:
        return None if proc is None else proc.returncode
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"{what} did not stop on SIGTERM") from None


def subprocess_env() -> dict[str, str]:
    """The environment now (tests set AWS_* and LAZYFS_* with monkeypatch), with this
    checkout importable from a daemon's cwd /."""
    return {**os.environ, "PYTHONPATH": str(REPO)}


def pid_alive(pid: int) -> bool:
    """True while pid exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # ESRCH: reaped between open and read
        return False


def proc_argvs() -> Iterator[tuple[int, list[bytes]]]:
    """(pid, argv) of every process that is still there when read."""
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                yield int(entry), f.read().split(b"\0")
        except OSError:
            continue


def daemon_pids(module: str, mountpoint: str) -> list[int]:
    """Pids of live `python -m MODULE` processes with mountpoint among their arguments."""
    pids = []
    for pid, argv in proc_argvs():
        if module.encode() in argv and os.fsencode(mountpoint) in argv:
            pids.append(pid)
    return [p for p in pids if pid_alive(p)]


def watchdogs_of(owner: int) -> list[int]:
    """Pids of the live unmount watchdogs (lazyfs/tree/mount_watch.py) of the mount owner
    `owner`: `sh -c SCRIPT lazyfs-watchdog OWNER ...`."""
    pids = [pid for pid, argv in proc_argvs() if argv[3:5] == [b"lazyfs-watchdog", b"%d" % owner]]
    return [p for p in pids if pid_alive(p)]


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) a running process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_until(cond, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


CPU_CGROUPS = Path("/sys/fs/cgroup/cpu")  # cgroup v1's cpu controller (this host is hybrid)


@contextmanager
def cpu_share(pid: int, share: float) -> Iterator[None]:
    """The process `pid` (all its threads, and the threads it starts) limited to `share` of
    one CPU, through a cgroup of its own; moved back where it was afterwards. A test that
    must act in the middle of work that takes a fraction of a second slows the worker
    down, instead of hoping to win a race with it."""
    lines = [x.split(":", 2) for x in Path(f"/proc/{pid}/cgroup").read_text().splitlines()]
    (home,) = [
        CPU_CGROUPS / path.lstrip("/") for _, names, path in lines if "cpu" in names.split(",")
    ]
    slow = CPU_CGROUPS / f"lazyfs-test-slow-{pid}"
    slow.mkdir()
    try:
        period = int((slow / "cpu.cfs_period_us").read_text())
        (slow / "cpu.cfs_quota_us").write_text(str(max(1000, int(period * share))))
        (slow / "cgroup.procs").write_text(str(pid))
        yield
    finally:
        for task in (slow / "cgroup.procs").read_text().split():
            with suppress(ProcessLookupError):  # it ended meanwhile
                (home / "cgroup.procs").write_text(task)
        slow.rmdir()
