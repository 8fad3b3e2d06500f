"""What the security tests share: probes of the node from the host (inotify on a path, a
process's peak RSS, /health latencies asked by a process of its own) and small calls
on a sandbox."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from lazyfs.client import AgentError, Sandbox
from testbed.agent import AgentProcess

MiB = 2**20
IN_OPEN, IN_ACCESS, IN_MODIFY = 0x20, 0x01, 0x02
libc = ctypes.CDLL(None, use_errno=True)


@contextmanager
def loop_device(backing: Path) -> Iterator[Path]:
    dev = subprocess.run(
        ["losetup", "-f", "--show", str(backing)], check=True, capture_output=True, text=True
    ).stdout.strip()
    try:
        yield Path(dev)
    finally:
        subprocess.run(["losetup", "-d", dev], check=True)


@contextmanager
def watch(path: Path, mask: int = IN_OPEN | IN_ACCESS | IN_MODIFY) -> Iterator[Callable[[], int]]:
    """inotify on `path` (a node in the sandbox's rootfs, seen from the host): yields a
    function giving the event mask seen so far. O_PATH opens make no event; real ones do."""
    ifd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    assert ifd >= 0
    try:
        assert libc.inotify_add_watch(ifd, os.fsencode(path), mask) >= 0, path

        def seen() -> int:
            events = 0
            try:
                data = os.read(ifd, 65536)
            except BlockingIOError:
                return 0
            while data:  # struct inotify_event: wd, mask, cookie, len, name
                events |= int.from_bytes(data[4:8], "little")
                data = data[16 + int.from_bytes(data[12:16], "little") :]
            return events

        yield seen
    finally:
        os.close(ifd)


def rss(pid: int, field: str = "VmRSS") -> int:
    """Bytes, from /proc/PID/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for {pid}")


@contextmanager
def peak_rss(pid: int) -> Iterator[Callable[[], int]]:
    """How far the process's peak RSS (VmHWM, reset here) rose above its RSS now."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    start = rss(pid)
    yield lambda: rss(pid, "VmHWM") - start


HEALTH_LOOP = """
import select, sys, time
from lazyfs.client import Client
with Client(socket=sys.argv[1], timeout=30) as c:
    while not select.select([sys.stdin], [], [], 0.01)[0]:  # until the test closes stdin
        t0 = time.perf_counter()
        c.health()
        print(time.perf_counter() - t0, flush=True)
"""


@contextmanager
def health_watch(agent: AgentProcess) -> Iterator[list[float]]:
    """/health asked every 10 ms beside the test's work, by a process of its own (this
    one's threads would hold the GIL while they decode big answers): its latencies, in
    seconds, filled in when the block ends."""
    latencies: list[float] = []
    # At nice -10: the asker is the instrument. On 2 cores shared with six commands
    # writing 60 MB each, its own wait for a core was once 113 ms of a "slow" answer.
    asker = subprocess.Popen(
        ["nice", "-n", "-10", sys.executable, "-c", HEALTH_LOOP, str(agent.socket)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(0.3)  # its start
        yield latencies
    finally:
        out, _ = asker.communicate(timeout=60)  # closes its stdin: it stops
        latencies += [float(line) for line in out.split()]
    assert latencies, "no /health answered"


HEALTH_WITHIN = 0.1  # seconds: the bound for /health during an abuse round
HEALTH_STALL = 0.5  # seconds: no single answer this late (finding 8 froze it 2.9 s)


def assert_health_held(latencies: list[float]) -> None:
    """/health stayed answered: 99% of asks within 100 ms and none past 500 ms.

    Not "every ask within 100 ms": on 2 cores shared with the round's commands, one ask
    of 261 once took 100.1 ms in CI, while the stalls these tests guard against are many
    asks long (six 60 MB answers encoded on the event loop cost ~170 ms each; the
    2.9 s freeze of finding 8)."""
    late = sorted(s for s in latencies if s >= HEALTH_WITHIN)
    report = f"/health: {len(late)} of {len(latencies)} asks took 100 ms or more: "
    report += ", ".join(f"{s * 1000:.0f} ms" for s in late[-10:])
    assert len(late) <= len(latencies) // 100, report
    assert not late or late[-1] < HEALTH_STALL, report


def refused(call: Callable[[], object], status: int = 400) -> str:
    with pytest.raises(AgentError) as err:
        call()
    assert err.value.status == status, err.value
    return str(err.value)


def answer_of(call: Callable[[], object]) -> tuple[int, str]:
    """(status, message) of a call that should fail; (200, "") if it did not."""
    try:
        call()
    except AgentError as exc:
        return exc.status, str(exc)
    return 200, ""


def sh(sb: Sandbox, script: str) -> str:
    r = sb.exec(["sh", "-c", script])
    assert r.exit_code == 0, r
    return r.stdout.decode()


def raw_exec(agent: AgentProcess, box_id: str, argv: list[str]) -> bytearray:
    """POST /exec's JSON answer as it came, undecoded: a test that measures the agent
    while big answers come decodes them afterwards (lazyfs.client.exec_result), since
    decoding hundreds of MB here loads the cores the agent is measured on. The calling
    thread runs at niceness 10 (Linux keeps it per thread): the test's own reading is
    not what is measured, and on 2 cores it would otherwise compete with the agent."""
    os.setpriority(os.PRIO_PROCESS, 0, 10)
    transport = httpx.HTTPTransport(uds=str(agent.socket))
    with httpx.Client(transport=transport, timeout=120) as client:
        url = f"http://agent/sandboxes/{box_id}/exec"
        with client.stream("POST", url, json={"argv": argv}) as answer:
            body = bytearray()
            for chunk in answer.iter_raw():
                body += chunk
            assert answer.status_code == 200, bytes(body[:200])
            return body
