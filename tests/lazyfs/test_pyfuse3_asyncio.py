"""pyfuse3 on asyncio (lazyfs/tree/pyfuse3_asyncio.py): the FUSE daemons start without
importing trio, importlib.metadata, ssl or OpenSSL, run asyncio's own loop, not uvloop's
(lazyfs/tree/daemon_loop.py), and a failure in pyfuse3's request loop fails the daemon,
as on trio."""

from __future__ import annotations

import asyncio
import errno

import pytest

from lazyfs.tree.pyfuse3_asyncio import _Nursery, pyfuse3
from tests.fresh_interpreter import run_fresh


def test_the_daemons_import_no_trio_no_importlib_metadata_no_ssl_and_no_uvloop() -> None:
    # what a daemon imports at its start, then its loop (run_loop) running
    code = (
        "import sys, lazyfs.tree.data_daemon, lazyfs.tree.fuse_mount, lazyfs.tree.fuse_ops\n"
        "assert 'trio' not in sys.modules, sorted(m for m in sys.modules if 'trio' in m)\n"
        "assert 'importlib.metadata' not in sys.modules\n"
        "assert not {'ssl', '_hashlib'} & set(sys.modules), 'OpenSSL loaded'\n"
        "from chunker.store.backends import open_store\n"
        "open_store('file:///nonexistent-lazyfs-store')\n"  # what a daemon opens
        "assert not {'ssl', '_hashlib'} & set(sys.modules), 'OpenSSL loaded'\n"
        "import importlib.metadata\n"  # the real one, once the stand-in is gone
        "assert importlib.metadata.version('pyfuse3')\n"
        "from lazyfs.tree.pyfuse3_asyncio import pyfuse3\n"
        "assert pyfuse3.trio.open_nursery.__module__ == 'lazyfs.tree.pyfuse3_asyncio'\n"
        "import asyncio\n"
        "from lazyfs.tree.daemon_loop import run_loop\n"
        "async def main():\n"
        "    assert type(asyncio.get_running_loop()).__module__ == 'asyncio.unix_events'\n"
        "run_loop(main)\n"
        "assert 'uvloop' not in sys.modules\n"
        "import ssl\n"  # the real one, for whatever needs it afterwards (an S3 store)
        "assert ssl.create_default_context()\n"
        "assert asyncio.sslproto.ssl is None\n"  # the daemons' asyncio goes without TLS
    )
    run_fresh(code)


def test_pyfuse3_runs_on_our_asyncio_layer() -> None:
    layer = pyfuse3.trio
    assert layer.open_nursery is _Nursery
    assert layer.lowlevel is layer and layer.from_thread is layer
    assert layer.current_trio_token() == "asyncio"


def test_a_failing_task_fails_the_nursery_and_cancels_the_others() -> None:
    cancelled = []

    async def fails() -> None:
        await asyncio.sleep(0.01)
        raise OSError(5, "fuse_session_receive_buf failed")

    async def waits() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def main() -> None:
        async with _Nursery() as nursery:
            nursery.start_soon(waits, name="a")
            nursery.start_soon(fails, name="b")

    with pytest.raises(OSError, match="fuse_session_receive_buf"):
        asyncio.run(asyncio.wait_for(main(), 10))
    assert cancelled == [True]


def test_a_request_loop_whose_read_found_nothing_runs_again() -> None:
    """EAGAIN from pyfuse3's read of its non-blocking /dev/fuse (a request withdrawn
    between the poll and the read) runs that request loop again instead of failing the
    daemon; any other error still fails it (above). The race cannot be made on demand
    against the kernel, so the loop here raises what pyfuse3 raises then."""
    runs = []

    async def request_loop(first: str) -> None:
        runs.append(first)
        if len(runs) == 1:
            raise OSError(errno.EAGAIN, "fuse_session_receive_buf failed with EAGAIN")

    async def main() -> None:
        async with _Nursery() as nursery:
            nursery.start_soon(request_loop, "arg", name="pyfuse-01")

    asyncio.run(asyncio.wait_for(main(), 10))
    assert runs == ["arg", "arg"]


def test_terminate_leaves_a_read_that_came_in_alone() -> None:
    """pyfuse3.terminate() wakes the reads of the FUSE fd with ClosedResourceError; a
    read whose fd turned readable already keeps its result (setting an exception on it
    raised InvalidStateError out of terminate(): a daemon stopped just then exited 1)."""
    import pyfuse3.asyncio as upstream

    async def main() -> None:
        loop = asyncio.get_running_loop()
        came_in, waiting = loop.create_future(), loop.create_future()
        came_in.set_result(None)
        upstream._read_futures[999].update((came_in, waiting))
        try:
            pyfuse3.trio.lowlevel.notify_closing(999)
        finally:
            del upstream._read_futures[999]
        assert came_in.result() is None
        with pytest.raises(upstream.ClosedResourceError):
            waiting.result()

    asyncio.run(main())


def test_tasks_that_end_well_end_the_nursery_quietly() -> None:
    done = []

    async def work(n: int) -> None:
        await asyncio.sleep(0.001 * n)
        done.append(n)

    async def main() -> None:
        async with _Nursery() as nursery:
            for n in range(3):
                nursery.start_soon(work, n)

    asyncio.run(main())
    assert sorted(done) == [0, 1, 2]


def test_the_nursery_holds_only_the_tasks_still_running() -> None:
    """pyfuse3 starts and ends request loops with every burst of concurrent reads; a
    nursery that kept the ended ones grew for the data daemon's whole life."""

    async def work() -> None:
        await asyncio.sleep(0)

    async def main() -> None:
        async with _Nursery() as nursery:
            for _ in range(100):
                nursery.start_soon(work)
            assert len(nursery.tasks) == 100
            while nursery.tasks:
                await asyncio.sleep(0.001)
            nursery.start_soon(work)  # still open for more
            assert len(nursery.tasks) == 1

    asyncio.run(asyncio.wait_for(main(), 10))


def test_the_data_daemon_and_its_supervisor_start_without_shutil() -> None:
    """shutil brings zlib, bz2 and lzma (~10 ms from a cold page cache), and tempfile
    brings shutil: neither is on the path of a cold node's first sandbox start."""
    code = (
        "from lazyfs.tree import data_daemon, fuse_supervisor\n"
        "for main in (data_daemon.main, fuse_supervisor.main):\n"
        "    try:\n"
        "        main(['--help'])\n"  # their parsers made, help formatted
        "    except SystemExit:\n"
        "        pass\n"
    )
    done = run_fresh(code, unloaded={"shutil", "tempfile"})
    assert "usage: python -m lazyfs.tree.fuse_supervisor" in done.stdout
