"""Fixtures for the node's tests: a small image built in a file:// store (every kind of
entry), each test's own run dir, a private node for sandboxes and the agent.

What they stand on is in testbed/: mounting a tree and its daemons
(testbed/mounted_trees.py), the image builder (testbed/image_builder.py), the node and
the agent (testbed/node.py, testbed/agent.py).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path

import pytest

from chunker.model import Inode, Kind
from chunker.packs import PACK_PREFIX
from chunker.store.backends import open_store
from chunker.store.interface import ObjectStore
from testbed.agent import AgentProcess, running_agent
from testbed.agent_boundary import AgentBoundary, Boundary
from testbed.image_builder import ImageBuilder
from testbed.images import TestImages
from testbed.mounted_trees import DATA_DAEMON_IDLE, clean_run_dir, supervisors
from testbed.node import LAZYFS, Node, convert, private_node, searchable
from testbed.processes import pid_alive, wait_until

# ---------------------------------------------------------------- building an image


MTIME = 1_600_000_000_123_456_789
BIG_DIR_ENTRIES = 2500


def build_test_image(store: ObjectStore, name: str = "test/image") -> tuple[str, ImageBuilder]:
    """Every kind of entry, hard links, xattrs, setuid, a multi-chunk file, a big directory."""
    b = ImageBuilder(store)
    rng = __import__("random").Random(1234)
    b.file(
        "small.txt",
        b"hello, lazyfs\n",
        uid=1000,
        gid=1001,
        mtime_ns=MTIME,
        xattrs={b"user.comment": b"a small file", b"user.empty": b""},
    )
    b.file("big.bin", rng.randbytes(3 * 2**20 + 12345), mtime_ns=MTIME + 1)
    b.file("empty", b"")
    b.file("suid-bin", b"#!/bin/sh\necho hi\n", mode=0o4755)
    b.seal_pack()
    b.file("corrupt.bin", rng.randbytes(200_000))  # its own pack: corrupted by one test
    b.seal_pack()
    b.add(
        b"dir",
        Inode(Kind.DIR, 0o750, uid=5, gid=6, mtime_ns=MTIME + 2, xattrs={b"user.dir": b"yes"}),
    )
    b.add(b"dir/sub", Inode(Kind.DIR, 0o755))
    b.file("dir/sub/deep.txt", b"deep\n" * 1000)
    hard = b.file("dir/hard1", b"linked content\n", mode=0o600)
    b.add(b"dir/hard2", hard)
    b.add(b"dir/link", Inode(Kind.SYMLINK, 0o777, target=b"../small.txt", mtime_ns=MTIME + 3))
    b.add(b"dir/dangling", Inode(Kind.SYMLINK, 0o777, target=b"/does/not/exist"))
    b.add(b"dev", Inode(Kind.DIR, 0o755))
    b.add(b"dev/null", Inode(Kind.CHR, 0o666, rdev=os.makedev(1, 3)))
    b.add(b"dev/sda", Inode(Kind.BLK, 0o660, gid=6, rdev=os.makedev(8, 0)))
    b.add(b"dev/fifo", Inode(Kind.FIFO, 0o644))
    b.add(b"tmp", Inode(Kind.DIR, 0o1777))
    b.add(b"many", Inode(Kind.DIR, 0o755))
    for i in range(BIG_DIR_ENTRIES):
        b.file(f"many/entry-{i:05d}", b"%d\n" % i)
    return b.publish(name), b


def corrupt_one_chunk(store: ObjectStore, builder: ImageBuilder) -> None:
    """Flip a byte inside the first chunk of the test image's corrupt.bin (in a pack of
    its own): the chunk then fails verification wherever it is read."""
    [(_, inode)] = [(p, i) for p, i in builder.entries if p == b"corrupt.bin"]
    ref = inode.chunks[0]
    assert {c.pack for c in inode.chunks} == {ref.pack}  # a pack of its own
    pack = bytearray(store.get(PACK_PREFIX + ref.pack))
    pack[ref.offset + ref.clen // 2] ^= 0xFF
    store.put(PACK_PREFIX + ref.pack, bytes(pack))


@pytest.fixture(scope="module")
def image_store(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, str, ImageBuilder]]:
    """(store url, image id, builder) for the test image in a fresh file:// store."""
    root = tmp_path_factory.mktemp("store")
    url = f"file://{root}"
    store = open_store(url)
    try:
        image_id, builder = build_test_image(store)
        yield url, image_id, builder
    finally:
        store.close()


@pytest.fixture
def mountpoint(tmp_path: Path) -> Path:
    mp = tmp_path / "mnt"
    mp.mkdir()
    return mp


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture(autouse=True)
def private_run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Every test gets its own LAZYFS_RUN_DIR (image trees, the node data daemon), never
    the node's /run/lazyfs; whatever data daemon a test started is gone afterwards."""
    run_dir = tmp_path / "run"
    monkeypatch.setenv("LAZYFS_RUN_DIR", str(run_dir))
    monkeypatch.setenv("LAZYFS_DAEMON_IDLE", DATA_DAEMON_IDLE)
    yield run_dir
    clean_run_dir(run_dir)


# ---------------------------------------------------------------- a private node


@pytest.fixture(scope="module")
def py_store(test_images: TestImages, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A file:// store with the python test image as `py` and the base image as `base`."""
    store = tmp_path_factory.mktemp("sandbox-store")
    convert(f"oci:{test_images.layout}:python", "py", store)
    # A second image, for tests that need sandboxes of two images.
    convert(f"oci:{test_images.layout}:base", "base", store)
    return store


@pytest.fixture
def sandbox_node(tmp_path: Path, py_store: Path) -> Iterator[Node]:
    """A private node for `lazyfs run` with its own cache, run and sandbox directories.
    At teardown whatever a sandbox left is removed, then the test fails if there was
    anything: a failing test cannot leave the node dirty for the next one."""
    with private_node(tmp_path, py_store) as node:
        yield node


@pytest.fixture
def userns_node(tmp_path: Path, py_store: Path) -> Iterator[Node]:
    """sandbox_node whose sandboxes each have a user namespace of their own (`lazyfs run
    --userns`); the way to its sandbox directory is open to their ids."""
    with searchable(tmp_path), private_node(tmp_path, py_store, ("--userns",)) as node:
        yield node


@pytest.fixture
def agent(tmp_path: Path, py_store: Path) -> Iterator[AgentProcess]:
    """A fresh agent process for one test (not started: call .start(ARGS)); stopped and
    the node checked clean afterwards."""
    with running_agent(tmp_path, py_store) as a:
        yield a


@pytest.fixture(params=["run", "run-userns", "generic"])
def boundary(request: pytest.FixtureRequest, tmp_path: Path, py_store: Path) -> Iterator[Boundary]:
    """The sandbox boundary's suites run on each kind of sandbox: `lazyfs run`'s, with
    and without a user namespace of its own, and the agent's generic ones, which take
    the image's root at the claim (issue 23)."""
    if request.param.startswith("run"):
        node = "userns_node" if request.param == "run-userns" else "sandbox_node"
        yield request.getfixturevalue(node)
        return
    with running_agent(tmp_path, py_store) as agent:
        yield AgentBoundary(agent.start("--warm", "2"))


@pytest.fixture
def no_leftovers(private_run_dir: Path) -> Iterator[None]:
    """Whatever supervisor a test left (a failure) is stopped: its pid, SIGTERM, SIGKILL."""
    yield
    for pid in supervisors(private_run_dir):
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with suppress(ProcessLookupError):
                os.kill(pid, sig)
            with suppress(AssertionError):
                wait_until(lambda pid=pid: not pid_alive(pid), 5, "supervisor exit")
                break


@pytest.fixture(scope="module")
def converted(test_images: TestImages, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A file:// store holding the python image (base layer + python3 layer)."""
    store = tmp_path_factory.mktemp("snap-store")
    subprocess.run(
        [LAZYFS, "convert", f"oci:{test_images.layout}:python", "--store", f"file://{store}"],
        check=True,
        capture_output=True,
    )
    return store


@pytest.fixture(scope="module")
def converted_merged(test_images: TestImages, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """As `converted`, but without layer trees (`--no-layer-trees`): its containers stand on
    its merged tree."""
    store = tmp_path_factory.mktemp("snap-store-merged")
    subprocess.run(
        [LAZYFS, "convert", f"oci:{test_images.layout}:python", "--store", f"file://{store}"]
        + ["--no-layer-trees"],
        check=True,
        capture_output=True,
    )
    return store


@pytest.fixture(scope="module")
def user_store(
    py_store: Path, test_images: TestImages, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """py_store plus "nobody-py": the python image whose config's User is nobody:tty."""
    layout = tmp_path_factory.mktemp("user") / "layout"
    shutil.copytree(test_images.layout, layout)
    subprocess.run(
        ["umoci", "config", "--image", f"{layout}:python", "--tag", "nobody"]
        + ["--config.user", "nobody:tty"],
        check=True,
        capture_output=True,
    )
    convert(f"oci:{layout}:nobody", "nobody-py", py_store)
    return py_store
