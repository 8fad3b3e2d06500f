"""A container's log (lazyfs/docker/container_log.py): in files on the node's disk, not
in the agent's memory. It was a list of pieces in memory, 16 MiB a container and not
charged to its sandbox: four containers printing in a loop raised the agent's RSS by
64 MiB, a thousand would have taken the node's RAM. Session 55's review found the list
also cost the agent per piece (a byte per piece: 1 MB of log cost 110 MB, and one big
write after a million pieces held the event loop 57 s); the files cost the same per byte
whoever cuts them."""

from __future__ import annotations

import random
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import docker
import pytest
from anyio.abc import TaskGroup
from docker.errors import APIError

from lazyfs.docker import container_log
from lazyfs.docker.container_log import HEADER, RECORD_MAX, Cursor, Log
from testbed.agent import AgentProcess
from tests.security.probes import peak_rss

KiB, MiB = 2**10, 2**20


def _log(tasks: TaskGroup, directory: Path, segment_bytes: int, segments: int = 2) -> Log:
    return Log(directory, anyio.CapacityLimiter(2), tasks, segment_bytes, segments)


async def _written(log: Log) -> None:
    """Once the writer has put every record in the files."""
    while log.written < log.end:
        await anyio.sleep(0.001)


async def _all(log: Log, offset: int = 0) -> list[tuple[int, bytes]]:
    cursor = Cursor(offset)
    return [(stream, data) async for _, (stream, data, _) in log.records(cursor, log.end)]


def test_records_come_back_as_written_and_old_segments_go(tmp_path: Path) -> None:
    async def main() -> None:
        async with anyio.create_task_group() as tasks:
            log = _log(tasks, tmp_path, 64 * KiB)
            for i in range(1000):  # ~1 MB of one-line records, 16 segments' worth
                await log.add(1 + i % 2, f"line {i:04d}\n".encode() * 100)
                if i % 7 == 0:
                    await anyio.sleep(0)  # the writer takes a few at a time
            written = 1000 * (HEADER.size + 1000)
            assert log.end == written
            await _written(log)
            kept = sum(s.size for s in log.segments)
            assert len(log.segments) == 2 and 64 * KiB - 1013 <= kept <= 2 * 64 * KiB
            assert log.start == written - kept
            records = await _all(log)
            assert [data for _, data in records] == [
                f"line {i:04d}\n".encode() * 100 for i in range(1000 - len(records), 1000)
            ]
            assert [stream for stream, _ in records] == [1 + i % 2 for i in range(-len(records), 0)]
            # From a dropped offset: the oldest kept on. From the end: nothing.
            assert await _all(log, 0) == records
            assert await _all(log, log.end) == []
            log.close()
            assert await _all(log) == [] and not log.segments

    anyio.run(main)
    assert list(tmp_path.iterdir()) == []  # the files were never named


def test_what_waits_to_be_written_is_read_from_memory(tmp_path: Path) -> None:
    async def main() -> None:
        async with anyio.create_task_group() as tasks:
            log = _log(tasks, tmp_path, 64 * KiB)
            await log.add(1, b"one\n")
            await log.add(2, b"two\n")  # the writer has not run yet: no await since
            assert log.written == 0 and await _all(log) == [(1, b"one\n"), (2, b"two\n")]
            await _written(log)
            assert await _all(log) == [(1, b"one\n"), (2, b"two\n")]
            log.close()

    anyio.run(main)


def test_pieces_cost_their_bytes_and_go_a_segment_at_a_time(tmp_path: Path) -> None:
    """Finding 11 (docs/security.md): a byte a piece once cost the agent 110 B of memory
    each, and a big piece after 130,000 of them dropped each with list.pop(0) (the event
    loop held for minutes). Now a piece costs its bytes and a header on disk, and old
    output goes a file at a time."""

    async def main() -> None:
        async with anyio.create_task_group() as tasks:
            log = _log(tasks, tmp_path, 64 * KiB)
            for i in range(200_000):
                await log.add(1, b"x")
                if i % 1000 == 0:
                    await anyio.sleep(0)
            assert log.end == 200_000 * (HEADER.size + 1)
            await _written(log)
            assert sum(s.size for s in log.segments) <= 2 * 64 * KiB
            t0 = time.monotonic()
            await log.add(2, b"y" * 17 * MiB)
            await _written(log)
            assert time.monotonic() - t0 < 2.0
            pieces = [(stream, len(data)) for stream, data in await _all(log)]
            assert pieces == [(2, RECORD_MAX)] * len(pieces)
            assert len(log.segments) == 2
            assert all(s.size == HEADER.size + RECORD_MAX for s in log.segments)
            log.close()

    anyio.run(main)


def test_a_big_piece_is_cut_into_records_a_read_can_hold(tmp_path: Path) -> None:
    async def main() -> None:
        async with anyio.create_task_group() as tasks:
            log = _log(tasks, tmp_path, 8 * MiB, segments=4)
            big = bytes(range(256)) * (17 * MiB // 256)
            await log.add(2, b"x")
            await log.add(1, big)
            await _written(log)
            records = await _all(log)
            assert records[0] == (2, b"x")
            assert b"".join(data for _, data in records[1:]) == big
            assert {len(data) for _, data in records[1:-1]} == {RECORD_MAX}
            # Records fill segments to their size, not past it.
            assert [s.size // RECORD_MAX for s in log.segments] == [127, 127, 18]
            log.close()

    anyio.run(main)


def test_a_read_under_way_ends_well_when_its_segment_goes(tmp_path: Path) -> None:
    """A read holds its own descriptor: the log closed (its container removed) while the
    read waits for a thread, the read still gives what it was after."""

    async def main() -> None:
        limiter = anyio.CapacityLimiter(1)
        async with anyio.create_task_group() as tasks:
            log = Log(tmp_path, limiter, tasks, 4 * KiB, 2)
            await log.add(1, b"a" * 3000)
            await _written(log)
            got: list = []

            async def read() -> None:
                got.extend([r async for r in log.records(Cursor(), log.end)])

            holder = object()
            await limiter.acquire_on_behalf_of(holder)  # the read waits for this thread
            tasks.start_soon(read)
            await anyio.sleep(0.1)
            log.close()
            limiter.release_on_behalf_of(holder)
        assert [(offset, piece[:2]) for offset, piece in got] == [(0, (1, b"a" * 3000))]

    anyio.run(main)


def _real_or_cut(lines: list[bytes], width: int = 6) -> list[int]:
    """The numbers of lines of `seq`'s output read through gaps: each line is a whole
    number or, just before a gap, the start of one (never two joined: longer than
    width); the whole ones go up. Returns the whole ones."""
    assert all(0 < len(line) <= width for line in lines), [x for x in lines if len(x) > width]
    numbers = [int(line) for line in lines if len(line) == width]
    assert numbers == sorted(set(numbers))
    return numbers


def test_a_reader_that_falls_behind_never_joins_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer cutting its output anywhere, a reader slower than it: the parts the
    reader had not read yet are dropped under it. The reader's lines are each a line
    written, or one cut where a gap begins; never the start of one joined to the end of
    another (a first version gave 25290306: "25" before a gap, "290306" after)."""
    monkeypatch.setattr(container_log, "PENDING_BYTES", 4 * KiB)  # to the files soon
    rng = random.Random(56)
    text = b"".join(b"%d\n" % i for i in range(100_000, 160_000))

    async def main() -> list[bytes]:
        out: list[bytes] = []
        written = anyio.Event()

        async def read(log: Log) -> None:
            cursor = Cursor()
            while True:
                changed = log.changed
                async for _, (_, data, _) in log.records(cursor, log.end):
                    out.append(data)
                    if rng.random() < 0.2:
                        await anyio.sleep(0.001)  # behind: the writer goes on
                if written.is_set() and cursor.offset >= log.end:
                    return
                await changed.wait()

        async with anyio.create_task_group() as tasks:
            log = _log(tasks, tmp_path, 16 * KiB)
            tasks.start_soon(read, log)
            at = 0
            while at < len(text):
                size = rng.randint(1, 5000)
                await log.add(1, text[at : at + size])
                at += size
            written.set()
            log.poke()
        return out

    out = anyio.run(main)
    lines = b"".join(out).split(b"\n")
    assert lines[-1] == b""
    numbers = _real_or_cut(lines[1:-1])  # the first line may be cut where the log began
    assert numbers[-1] == 159_999 and len(numbers) < 60_000 - 1000  # it did fall behind


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs: a disk the log fills."""
    where = tmp_path / "small"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "small", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_a_full_disk_loses_output_and_nothing_else(
    small_disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ten segments of 64 KiB on a disk of 256 KiB: a write past its end fails, that
    output and the files before it are lost (the log stays one run of records), and the
    next writes go on in new files."""
    monkeypatch.setattr(container_log, "WRITE_DELAY", 0.001)  # a write per add

    async def main() -> None:
        async with anyio.create_task_group() as tasks:
            log = _log(tasks, small_disk, 64 * KiB, segments=10)
            for i in range(100):  # 800 KiB of output
                await log.add(1, bytes([65 + i % 26]) * 8 * KiB + b"\n")
                await _written(log)
            assert log._failed and log.start > 0
            records = await _all(log)
            assert records and [data[:1] * 8 * KiB + b"\n" for _, data in records] == [
                data for _, data in records
            ]
            assert records[-1][1][:1] == bytes([65 + 99 % 26])  # the last write is kept
            log.close()

    anyio.run(main)


def test_chatty_containers_cost_the_agent_no_memory(
    dclient: docker.DockerClient, docker_agent: AgentProcess
) -> None:
    """Four containers print 23 MB each; the log in memory held 16 MiB of each."""
    script = "seq 1 3000000"
    with peak_rss(docker_agent.proc.pid) as rise:
        boxes = [dclient.containers.run("py", ["sh", "-c", script], detach=True) for _ in range(4)]
        for box in boxes:
            assert box.wait(timeout=120)["StatusCode"] == 0
        assert rise() < 24 * MiB
    for box in boxes:
        assert box.logs(tail=2) == b"2999999\n3000000\n"
        whole = box.logs()
        assert 8 * MiB - 128 * KiB <= len(whole) <= 16 * MiB and whole.endswith(b"\n3000000\n")
        box.remove()


def test_max_size_and_max_file_bound_the_log(dclient: docker.DockerClient) -> None:
    """Within max-size x max-file, plus what waits to be written (up to two batches of
    PENDING_BYTES and a write); at least (max-file - 1) x max-size less a write."""
    options = {"max-size": "1m", "max-file": "3"}
    config = docker.types.LogConfig(type="json-file", config=options)
    box = dclient.containers.run(
        "py", ["sh", "-c", "seq 1 1000000"], detach=True, log_config=config
    )  # 6.9 MB
    assert box.wait(timeout=60)["StatusCode"] == 0
    whole = box.logs()
    waiting = 2 * (container_log.PENDING_BYTES + 64 * KiB)
    assert 2_000_000 - 64 * KiB <= len(whole) <= 3_000_000 + waiting
    assert whole.endswith(b"\n1000000\n")
    api = dclient.api
    for options, said in (
        ({"max-size": "-1"}, "max-size: '-1' is not a positive size"),
        ({"max-size": "lots"}, "max-size: 'lots' is not a positive size"),
        ({"max-file": "0"}, "max-file: '0': it cannot be less than 1"),
    ):
        asked = docker.types.LogConfig(type="json-file", config=options)
        with pytest.raises(APIError) as err:
            api.create_container(
                "py", ["true"], host_config=api.create_host_config(log_config=asked)
            )
        assert err.value.status_code == 400 and err.value.explanation == said


def test_a_log_followed_while_it_rotates(dclient: docker.DockerClient) -> None:
    """`docker logs -f` reading as the log's old segments go: every line it gets is a
    line the command printed (or one cut where a gap begins), in order, to the last."""
    config = docker.types.LogConfig(type="json-file", config={"max-size": "64k"})
    box = dclient.containers.run(
        "py", ["sh", "-c", "sleep 0.5; seq 1 300000"], detach=True, log_config=config
    )
    t0 = time.monotonic()
    lines = b"".join(box.logs(stream=True, follow=True)).split(b"\n")
    assert time.monotonic() - t0 < 60
    assert lines[-1] == b""
    assert _real_or_cut(lines[:-1])[-1] == 300000
