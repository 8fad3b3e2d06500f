"""The agent's file API against files the sandbox made to hurt it (issue 20, findings 1,
2, 4 and the file and body parts of 8).

The agent is root on the host and outside the sandbox's devices cgroup, so a device
node that the sandbox made (runc allows mknod) and the agent opened would reach the
host's device: a loop device over a scratch file of the test's stands for the node's
disk, /dev/kmsg (1:11) for a character device. A FIFO blocked a thread for good; a file
grown while it was read went past the read limit. Each test performs the attack through
the agent (and `lazyfs sandbox cp`) and shows it failing; each probe is also shown
working where it must (the node was made; the device is writable; the FIFO is a FIFO).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from itertools import count, pairwise
from pathlib import Path

import anyio
import pytest

from chunker.errors import BadInputError
from lazyfs.agent import files
from lazyfs.agent.sandbox_io import BUFFERED, SandboxIO, TooSlow
from lazyfs.client import AgentError, Client
from lazyfs.client.model import exec_result
from testbed.agent import AgentProcess
from tests.security.probes import (
    IN_OPEN,
    MiB,
    answer_of,
    assert_health_held,
    health_watch,
    loop_device,
    peak_rss,
    raw_exec,
    refused,
    sh,
    watch,
)

SMALL_LIMIT = 32 * MiB  # LAZYFS_MAX_FILE for the tests that need it (read once at start)
OUTPUT_BUDGET = 256 * MiB  # lazyfs.agent.api's: buffered exec output held at once, node-wide


# ---------------------------------------------------------------- device nodes


def test_a_device_node_made_in_the_sandbox_is_never_written(
    agent: AgentProcess, tmp_path: Path
) -> None:
    """Finding 1 (critical): mknod a block device for a loop device over the test's
    scratch file, then PUT it through the API and `lazyfs sandbox cp`; and a character
    device, /dev/kmsg's 1:11. Each is a 400 that names the type; no byte reaches them."""
    scratch = tmp_path / "scratch.img"
    original = secrets.token_bytes(MiB)
    scratch.write_bytes(original)
    patch = tmp_path / "patch.diff"
    patch.write_bytes(b"PWNED " * 1000)
    token = f"lazyfs-kmsg-{secrets.token_hex(8)}"
    agent.start()
    with loop_device(scratch) as loop, agent.client() as client, client.create("py") as sb:
        rdev = loop.stat().st_rdev
        sh(sb, f"mkdir -p /repo && mknod /repo/patch.diff b {os.major(rdev)} {os.minor(rdev)}")
        sh(sb, "mknod /repo/kmsg c 1 11")
        assert sh(sb, "stat -c %F /repo/patch.diff /repo/kmsg").split("\n")[:2] == [
            "block special file",
            "character special file",
        ]
        message = refused(lambda: sb.write_file("/repo/patch.diff", patch.read_bytes()))
        assert "/repo/patch.diff: is a block device" in message
        cp = agent.cli("cp", str(patch), f"{sb.id}:/repo/patch.diff")
        assert cp.returncode == 2 and b"is a block device" in cp.stderr, cp
        message = refused(lambda: sb.write_file("/repo/kmsg", f"{token}\n".encode()))
        assert "/repo/kmsg: is a character device" in message
        cp = agent.cli("cp", str(patch), f"{sb.id}:/repo/kmsg")
        assert cp.returncode == 2 and b"is a character device" in cp.stderr, cp

        with open(loop, "rb") as dev:  # the device itself, and its backing file
            assert dev.read(len(original)) == original
        subprocess.run(["blockdev", "--flushbufs", str(loop)], check=True)
        assert scratch.read_bytes() == original
        assert token not in subprocess.run(["dmesg"], capture_output=True, text=True).stdout
        # The probe is valid: the node is the device, and the device takes writes.
        with open(loop, "r+b") as dev:
            dev.write(b"probe")
        assert sb.exec(["test", "-b", "/repo/patch.diff"]).exit_code == 0


def test_a_device_node_is_refused_without_being_opened(agent: AgentProcess) -> None:
    """Finding 1: read_file opened the node before it checked its type (an open of a
    device runs its driver). A GET, a list and a PUT of a device node: 400, and inotify
    on the node (seen from the host) shows no open, read or write of it."""
    agent.start()
    with agent.client() as client, client.create("py") as sb:
        sh(sb, "mkdir -p /repo && mknod /repo/null c 1 3 && mknod /repo/disk b 7 200")
        rootfs = agent.node.sandboxes / sb.id / "rootfs"
        for name, kind in (("null", "character device"), ("disk", "block device")):
            path = f"/repo/{name}"
            with watch(rootfs / "repo" / name) as seen:
                answers = [
                    answer_of(lambda p=path: sb.read_file(p)),
                    answer_of(lambda p=path: sb.list_dir(p)),
                    answer_of(lambda p=path: sb.write_file(p, b"x")),
                ]
                assert seen() == 0, f"{path} was opened"
            assert [status for status, _ in answers] == [400] * 3, answers
            assert all(m.startswith(f"{path}: is a {kind}") for _, m in answers), answers
        # The probe is valid: the watch sees an open (of a regular file beside the nodes).
        sh(sb, "echo probe > /repo/probe")
        with watch(rootfs / "repo" / "probe") as seen:
            os.close(os.open(rootfs / "repo" / "probe", os.O_RDONLY))
            assert seen() & IN_OPEN
        # And the second line: the overlay is nodev, so even host root's open of a node
        # is refused before any driver runs.
        with pytest.raises(PermissionError):
            os.open(rootfs / "repo" / "null", os.O_RDONLY)
        cp = agent.cli("cp", f"{sb.id}:/repo/null", "-")
        assert cp.returncode == 2 and b"is a character device" in cp.stderr, cp


# ---------------------------------------------------------------- FIFOs


def test_fifos_do_not_wedge_the_agent(agent: AgentProcess) -> None:
    """Finding 2: 41 GETs of a FIFO the sandbox made blocked every thread of the agent's
    pool for good (creates hung, TTLs stopped, SIGTERM did not end it). Now 41 GETs at
    once, then 41 PUTs, each answer 400 at once, /health answers within 100 ms
    throughout, a create and an exec still work, and SIGTERM ends the agent promptly."""
    agent.start()
    with agent.client() as client:
        sb = client.create("py")
        sh(sb, "mkfifo /tmp/fifo && test -p /tmp/fifo")

        def get(_: int) -> tuple[float, str]:
            t0 = time.perf_counter()
            with Client(socket=agent.socket, timeout=20) as c:
                message = refused(lambda: c.sandbox(sb.id).read_file("/tmp/fifo"))
            return time.perf_counter() - t0, message

        def put(_: int) -> tuple[float, str]:
            t0 = time.perf_counter()
            with Client(socket=agent.socket, timeout=20) as c:
                message = refused(lambda: c.sandbox(sb.id).write_file("/tmp/fifo", b"x"))
            return time.perf_counter() - t0, message

        with health_watch(agent) as latencies, ThreadPoolExecutor(41) as pool:
            answers = list(pool.map(get, range(41)))
            answers += list(pool.map(put, range(41)))
            time.sleep(0.5)  # /health keeps being asked after the burst
        assert all("/tmp/fifo: is a FIFO" in message for _, message in answers), answers
        slowest = max(seconds for seconds, _ in answers)
        print(f"slowest FIFO request {slowest * 1000:.0f} ms, /health max", end=" ")
        print(f"{max(latencies) * 1000:.1f} ms over {len(latencies)} asks")
        assert slowest < 5, f"a FIFO request took {slowest:.2f} s"
        assert_health_held(latencies)
        with client.create("py") as other:
            assert other.exec(["echo", "ok"]).stdout == b"ok\n"
        assert sb.exec(["true"]).exit_code == 0
    t0 = time.monotonic()
    assert agent.stop(timeout=20) is not None
    assert time.monotonic() - t0 < 10, "SIGTERM took too long"


# ---------------------------------------------------------------- the read limit

GROWER = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
path, start, target = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with open(path, "wb") as f:
    f.write(os.urandom(start))
ifd = libc.inotify_init1(0)
assert libc.inotify_add_watch(ifd, path.encode(), 0x01) >= 0  # IN_ACCESS: it is read
print("ready", flush=True)
os.read(ifd, 4096)
fd = os.open(path, os.O_WRONLY)
os.ftruncate(fd, target)  # sparse: no disk, and reads of it cost no I/O
print("grown", flush=True)
"""


def test_a_file_grown_while_it_is_read_stops_at_the_limit(agent: AgentProcess) -> None:
    """Finding 4: the size was checked once, then the file read to its end while the
    sandbox grew it (1.59 GB returned, the agent at 3.1 GB). The sandbox grows its file
    from 24 MiB to 320 MiB (past the old 256 MiB limit too) as soon as the agent reads
    it; the GET is a 400 (grown before it was opened), an answer cut short (the client's
    error says so), or at most the limit; the agent's peak RSS rises by a few of the
    read's pieces (it held the file, up to the limit, until session 56). A cut is one
    line of the agent's log, not a traceback."""
    agent.node.env["LAZYFS_MAX_FILE"] = "32M"
    agent.start()
    pid = agent.proc.pid  # type: ignore[union-attr]
    cuts = 0
    with agent.client() as client, client.create("py") as sb:
        grower_path = "/tmp/grow.py"
        sb.write_file(grower_path, GROWER.encode())
        for round_ in range(3):
            path = f"/tmp/grown-{round_}"
            args = ["python3", grower_path, path, str(24 * MiB), str(320 * MiB)]
            events = sb.exec_stream(args)
            assert next(events) == ("stdout", b"ready\n")
            with peak_rss(pid) as rise:
                try:
                    data = sb.read_file(path)
                except AgentError as exc:
                    cut = "the answer was cut short: the file grew past" in str(exc)
                    cuts += cut
                    assert cut or (exc.status == 400 and str(SMALL_LIMIT) in str(exc)), exc
                else:
                    assert len(data) <= SMALL_LIMIT, f"{len(data)} bytes past the limit"
                grown = rise()
            rest = list(events)
            assert ("stdout", b"grown\n") in rest and rest[-1][1].exit_code == 0, rest
            print(f"grown file: peak RSS +{grown / MiB:.0f} MiB")
            assert grown < 8 * MiB, f"the agent's peak RSS rose {grown / MiB:.0f} MiB"
            assert sh(sb, f"stat -c %s {path}") == f"{320 * MiB}\n"  # the attack did happen
    # A cut is the sandbox's doing, not the agent's fault: one line each, no traceback.
    log = agent.logs[-1].read_text()
    assert "Traceback" not in log and "Exception in ASGI" not in log, log
    assert log.count("grew past") == cuts, log


def test_big_files_are_read_in_pieces_not_held(agent: AgentProcess) -> None:
    """A sandbox can make the file a harness reads as big as the agent's limit at no
    cost to itself (sparse); three reads of one at once held 3 x 200 MiB of the agent
    until session 56 (the whole file, then the answer). Now the agent's peak RSS rises
    by its pieces, and every copy comes whole."""
    agent.start()  # the default limit, 256M
    pid = agent.proc.pid  # type: ignore[union-attr]
    with agent.client() as client, client.create("py") as sb:
        sh(sb, "truncate -s 200M /tmp/sparse && printf end >> /tmp/sparse")
        with peak_rss(pid) as rise, ThreadPoolExecutor(3) as pool:
            copies = list(pool.map(lambda _: sb.read_file("/tmp/sparse"), range(3)))
            grown = rise()
        for data in copies:
            assert len(data) == 200 * MiB + 3 and data[-4:] == b"\0end"
        del copies
        print(f"three reads: peak RSS +{grown / MiB:.0f} MiB")
        assert grown < 32 * MiB, f"the agent's peak RSS rose {grown / MiB:.0f} MiB"
        assert refused(lambda: sb.read_file("/tmp/none"), 404)


# ---------------------------------------------------------------- request bodies


def _raw(agent: AgentProcess, head: str, body: Iterable[bytes] = ()) -> str:
    """One HTTP request on the agent's socket, the body sent while the answer may come
    early; the answer's status line and JSON (the agent closes or keeps the connection)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(15)
        s.connect(str(agent.socket))
        s.sendall(head.encode())
        for chunk in body:
            try:
                s.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            more = s.recv(65536)
            if not more:
                break
            answer += more
    return answer.decode(errors="replace")


def test_request_bodies_are_capped(agent: AgentProcess, tmp_path: Path) -> None:
    """Finding 8: request bodies were read whole, whatever their size. A PUT that says
    10 GiB is a 413 before any of it is read; one without a length (chunked) is a 413
    once past the limit, not read further; a JSON body past 64 MiB too. The agent's peak
    RSS rises by less than the limit meanwhile."""
    agent.node.env["LAZYFS_MAX_FILE"] = "32M"
    agent.start()
    pid = agent.proc.pid  # type: ignore[union-attr]
    with agent.client() as client, client.create("py") as sb:
        url = f"/sandboxes/{sb.id}/files?path=/tmp/big"
        with peak_rss(pid) as rise:
            answer = _raw(
                agent, f"PUT {url} HTTP/1.1\r\nHost: a\r\nContent-Length: {10 * 2**30}\r\n\r\n"
            )
            assert answer.startswith("HTTP/1.1 413") and '"too_large"' in answer, answer
            chunks = (b"100000\r\n" + b"x" * MiB + b"\r\n" for _ in range(256))
            head = f"PUT {url} HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
            answer = _raw(agent, head, chunks)
            assert answer.startswith("HTTP/1.1 413") and '"too_large"' in answer, answer
            exec_url = f"/sandboxes/{sb.id}/exec"
            head = f"POST {exec_url} HTTP/1.1\r\nHost: a\r\nContent-Length: {100 * MiB}\r\n\r\n"
            answer = _raw(agent, head)
            assert answer.startswith("HTTP/1.1 413") and '"too_large"' in answer, answer
            grown = rise()
            print(f"bodies: peak RSS +{grown / MiB:.0f} MiB")
            assert grown < 1.5 * SMALL_LIMIT, f"the agent's peak RSS rose {grown / MiB:.0f} MiB"
        assert refused(lambda: sb.write_file("/tmp/big", b"x" * (SMALL_LIMIT + 1)), 413)
        big = tmp_path / "big"
        big.write_bytes(b"x" * (SMALL_LIMIT + 1))
        cp = agent.cli("cp", str(big), f"{sb.id}:/tmp/big")
        assert cp.returncode != 0 and b"more than" in cp.stderr, cp
        assert sb.exec(["test", "-e", "/tmp/big"]).exit_code == 1
        sb.write_file("/tmp/big", b"x" * SMALL_LIMIT)  # the limit itself is fine
        assert sh(sb, "stat -c %s /tmp/big") == f"{SMALL_LIMIT}\n"
        assert len(sb.read_file("/tmp/big")) == SMALL_LIMIT


def test_a_put_through_a_dangling_symlink_is_a_400(agent: AgentProcess) -> None:
    """Finding 8: a PUT whose parent is a symlink to nothing was a 500 (mkdir's EEXIST);
    it is the sandbox's doing, so a 400 that says what is there."""
    agent.start()
    with agent.client() as client, client.create("py") as sb:
        sh(sb, "ln -s /nowhere/at/all /tmp/dangling && ln -s /tmp/dangling /tmp/chain")
        for path in ("/tmp/dangling/f", "/tmp/chain/f", "/tmp/dangling/deeper/f"):
            message = refused(lambda p=path: sb.write_file(p, b"x"))
            assert "is a symbolic link" in message, message
        assert sb.exec(["test", "-e", "/tmp/dangling"]).exit_code == 1  # made nothing
        sb.write_file("/tmp/dangling2/f", b"made")  # a missing directory is still made
        assert sb.read_file("/tmp/dangling2/f") == b"made"
        # A file where a directory is needed, and a link as the file itself.
        sh(sb, "touch /tmp/plain && ln -s /etc/hostname /tmp/link")
        assert refused(lambda: sb.write_file("/tmp/plain/f", b"x"), 404)
        assert "is a symbolic link" in refused(lambda: sb.write_file("/tmp/link", b"x"))
        assert sb.read_file("/tmp/link") == sb.read_file("/etc/hostname")  # read: followed
        # An existing file is replaced through the inode checked (an image file: copy-up).
        before = sb.read_file("/etc/issue")
        sb.write_file("/etc/issue", b"replaced\n")
        assert sh(sb, "cat /etc/issue") == "replaced\n" and before != b"replaced\n"


# ---------------------------------------------------------------- exec output


def test_big_buffered_exec_outputs_do_not_stall_the_agent(agent: AgentProcess) -> None:
    """Finding 8: six buffered execs of 60 MB of output at once froze /health for 2.9 s
    (base64 on the event loop) and took the agent to 1.8 GB (no cap across execs). Now
    /health answers within 100 ms throughout, the output held at once stays within the
    node's budget (flagged truncated past it), and the peak RSS rise is bounded."""
    agent.start()
    pid = agent.proc.pid  # type: ignore[union-attr]
    with agent.client() as client:
        boxes = [client.create("py") for _ in range(3)]
        try:
            argv = ["head", "-c", "60M", "/dev/zero"]
            with peak_rss(pid) as rise, health_watch(agent) as latencies:
                with ThreadPoolExecutor(6) as pool:  # decoded after the window (raw_exec)
                    raws = list(
                        pool.map(lambda i: raw_exec(agent, boxes[i % 3].id, argv), range(6))
                    )
                grown = rise()
            results = [exec_result(json.loads(raw)) for raw in raws]
            del raws
            sizes = [len(r.stdout) for r in results]
            print(f"/health max {max(latencies) * 1000:.1f} ms over {len(latencies)} asks")
            print(f"stdout sizes {[s // MiB for s in sizes]} MiB, peak RSS +{grown / MiB:.0f} MiB")
            assert_health_held(latencies)
            assert grown < 2 * OUTPUT_BUDGET, f"the agent's peak RSS rose {grown / MiB:.0f} MiB"
            assert all(r.exit_code == 0 for r in results), results
            # Answers sent give their budget back, so the sum may pass it, not all 360 MB.
            assert sum(sizes) < 6 * 60 * MiB, sizes
            assert all(r.stdout.count(0) == len(r.stdout) for r in results)
            # Once answered, the budget is back: one exec gets its whole output.
            assert len(boxes[0].exec(argv).stdout) == 60 * MiB
        finally:
            for box in boxes:
                box.delete()


def test_a_big_answer_goes_out_in_pieces_with_the_event_loop_turning_between() -> None:
    """What keeps /health answered in the test above, without its timing: an answer over
    PIECE is written a piece at a time, and the event loop's other tasks run
    between pieces. Written whole, one 80 MB answer held the loop 132 ms (the client
    reading as fast as it came), and that test failed in 4 of 17 runs."""
    from lazyfs.agent.api import OutputBudget, _HeldResponse, _Output
    from lazyfs.serving import PIECE

    size = 3 * PIECE + 5
    budget = OutputBudget()
    output = _Output(budget)
    output.held = budget.take(size)  # as emit() does while the output comes
    sent: list[tuple[str, int, bool, int]] = []  # type, body bytes, more_body, loop turns

    async def main() -> None:
        turns = 0
        done = anyio.Event()

        async def other_work() -> None:
            nonlocal turns
            while not done.is_set():
                turns += 1
                await anyio.sleep(0)

        async def send(message: dict) -> None:
            body = message.get("body", b"")
            sent.append((message["type"], len(body), message.get("more_body", False), turns))

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(other_work)
            await anyio.sleep(0)
            await _HeldResponse(bytearray(size), output)({"type": "http"}, None, send)
            done.set()

    anyio.run(main)
    assert sent[0][0] == "http.response.start"
    bodies = sent[1:]
    assert sum(b[1] for b in bodies) == size
    assert max(b[1] for b in bodies) <= PIECE
    assert [b[2] for b in bodies] == [True] * (len(bodies) - 1) + [False]
    assert all(later[3] > earlier[3] for earlier, later in pairwise(bodies)), sent
    assert budget.left == OutputBudget().left  # the output's budget is given back


# ---------------------------------------------------------------- the file workers

STUCK = """
import anyio, os
from lazyfs.agent.sandbox_io import SandboxIO, TooSlow

async def main():
    io = SandboxIO(threads=2, timeout=0.3)
    r, w = os.pipe()
    for _ in range(3):  # two stuck reads fill its pool; the third waits for a slot
        try:
            await io.run(os.read, r, 1)
        except TooSlow as exc:
            print("504", exc)
    print(await anyio.to_thread.run_sync(lambda: "the default pool answers"))
    os.write(w, b"xx")  # the stuck threads end: their slots come back
    await anyio.sleep(0.1)
    print("after", await io.run(len, "abc"))
    try:
        await io.run(os.read, r, 1)  # stuck for good, and abandoned
    except TooSlow:
        print("abandoned")

anyio.run(main)
print("exiting", flush=True)
"""


def test_a_stuck_file_operation_answers_504_and_holds_nothing_else() -> None:
    """Finding 2, the other half: a file operation that never ends (a FIFO read did)
    answers 504 after its timeout; it holds a slot of the file pool only, not a thread
    that creates, deletes or TTLs need, until it really ends; and the process still
    exits with it blocked (the old pool's threads kept the agent from exiting)."""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", STUCK], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:3] == ["504 the sandbox's file did not answer in 0.3 s"] * 3, lines
    assert lines[3:] == ["the default pool answers", "after 3", "abandoned", "exiting"], lines
    assert time.monotonic() - t0 < 10


def test_a_streamed_file_operation_holds_pieces_and_stops_with_its_reader() -> None:
    """SandboxIO.stream (a `docker cp` out): its producer runs at most BUFFERED items
    ahead of the reader; a reader that goes away stops it and its slot comes back; its
    error reaches the reader; and a stream that outlives the timeout is TooSlow."""

    async def main() -> None:
        io = SandboxIO(threads=1, timeout=0.5)
        made: list[int] = []
        stopped = threading.Event()

        def endless(put: Callable[[int], None]) -> None:
            try:
                for i in count():
                    put(i)
                    made.append(i)
            finally:
                stopped.set()

        items = await io.stream(endless)
        assert [await anext(items) for _ in range(3)] == [0, 1, 2]
        await anyio.sleep(0.1)
        assert 3 <= len(made) <= 3 + BUFFERED, made
        await items.aclose()
        assert await anyio.to_thread.run_sync(stopped.wait, 5)

        def broken(put: Callable[[str], None]) -> None:
            put("first")
            raise ValueError("broken")

        items = await io.stream(broken)  # the one slot is free again
        assert await anext(items) == "first"
        with pytest.raises(ValueError, match="broken"):
            await anext(items)
        await items.aclose()

        items = await io.stream(lambda put: [put("a"), time.sleep(1.0)])
        assert await anext(items) == "a"
        with pytest.raises(TooSlow, match="did not stream in 0.5 s"):
            await anext(items)
        await items.aclose()

    anyio.run(main)


def test_a_listing_stops_at_its_cap_as_names_are_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Session 55's review: list_dir read every name, then every stat, then built the
    JSON on the event loop: 600,000 links in one directory (10 MB of the sandbox's
    disk) made a 178 MB answer, +700 MB of agent memory and a 2.4 s stall of /health.
    Now a directory over MAX_LISTED names is refused as its names are read, and the
    JSON is made in the file pool's thread (lazyfs/agent/api.py)."""
    monkeypatch.setattr(files, "MAX_LISTED", 100)
    (tmp_path / "repo").mkdir()
    for i in range(100):
        (tmp_path / "repo" / f"f{i}").write_text("x")
    assert len(files.list_dir(tmp_path, "/repo")) == 100
    (tmp_path / "repo" / "one-more").write_text("x")
    with pytest.raises(BadInputError, match="more than 100 entries"):
        files.list_dir(tmp_path, "/repo")
