"""Fixtures for real FUSE mounts: a small image built in a file:// store, and the daemon.

`running_mount` starts the real mount daemon as a subprocess, waits for the mount to
answer, and always cleans up, even when the test fails: `fusermount3 -u`, then `-u -z`,
then SIGTERM, then SIGKILL (by the daemon's pid only).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from chunker.backends import open_store
from chunker.chunking import chunk_id, cut
from chunker.images import publish_refs, publish_tree
from chunker.model import Inode, Kind
from chunker.packs import PACK_PREFIX, ChunkIndex, PackWriter, compress_chunk
from chunker.store import ObjectStore
from testbed.agent import AgentProcess, running_agent
from testbed.images import TestImages
from testbed.node import Node, convert

MOUNT_TIMEOUT = 30.0


def subprocess_env() -> dict[str, str]:
    """The environment now (tests set AWS_* and LAZYFS_* with monkeypatch), importable
    from the daemon's cwd /."""
    return {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}


def fuse_mounts() -> list[str]:
    with open("/proc/self/mounts") as f:
        return [line.split()[1] for line in f if line.split()[2].startswith("fuse")]


def wait_until(cond, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def unmount_all(mountpoint: Path, proc: subprocess.Popen | None = None, pid: int = 0) -> None:
    """Leave no mount and no daemon behind: -u, -u -z, SIGTERM, SIGKILL, then abort.

    The abort (fusectl) is for a daemon stuck in a request to its own mount: it cannot
    die until its FUSE connection is aborted.
    """
    point = str(mountpoint)
    conn = fuse_connection(point)
    if point in fuse_mounts():
        subprocess.run(["fusermount3", "-u", point], capture_output=True, timeout=30)
    if point in fuse_mounts():
        subprocess.run(["fusermount3", "-u", "-z", point], capture_output=True, timeout=30)
    pid = proc.pid if proc is not None else pid
    if not pid or not _wait_gone(pid, proc, 0):
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with suppress(ProcessLookupError):
            os.kill(pid, sig)
        if not _wait_gone(pid, proc, 5):
            return
    abort_connection(conn)
    if _wait_gone(pid, proc, 5):
        raise AssertionError(f"mount daemon {pid} would not die")


def _wait_gone(pid: int, proc: subprocess.Popen | None, timeout: float) -> bool:
    """True if pid is still alive after timeout seconds (reaping it if it is our child)."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None:
            with suppress(subprocess.TimeoutExpired):
                proc.wait(0.05)
                return False
        elif not pid_alive(pid):
            return False
        else:
            time.sleep(0.05)
        if time.monotonic() > deadline:
            return True


def fuse_connection(mountpoint: str) -> str:
    """The FUSE connection id (device minor) of the mount at mountpoint, or ''."""
    conn = ""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == mountpoint and fields[2].startswith("0:"):
                conn = fields[2].split(":")[1]
    return conn


def abort_connection(conn: str) -> None:
    if not conn:
        return
    base = "/sys/fs/fuse/connections"
    mounted = False
    if not os.path.exists(f"{base}/{conn}"):
        mounted = subprocess.run(["mount", "-t", "fusectl", "none", base]).returncode == 0
    try:
        with suppress(OSError), open(f"{base}/{conn}/abort", "w") as f:
            f.write("1")
    finally:
        if mounted:
            subprocess.run(["umount", base])


def pid_alive(pid: int) -> bool:
    """True while pid exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


TREES = ("erofs", "fuse")  # the two ways a node serves an image (lazyfs/tree/image_mounts.py)
DATA_DAEMON_IDLE = "0.2"  # seconds: a test's data daemon exits soon after its last tree


@contextmanager
def mounted_tree(
    tree: str, image: str, mountpoint: Path, store_url: str, cache_dir: Path
) -> Iterator[None]:
    """The image mounted at mountpoint the `tree` way; everything it started is gone
    afterwards. erofs: `lazyfs mount` with a private run dir (cache_dir's sibling `run`),
    so the node data daemon is this test's own."""
    if tree == "fuse":
        with running_mount(image, mountpoint, store_url, cache_dir):
            yield
        return
    run_dir = cache_dir.parent / "run"
    env = {
        **subprocess_env(),
        "LAZYFS_TREE": "erofs",
        "LAZYFS_RUN_DIR": str(run_dir),
        "LAZYFS_DAEMON_IDLE": DATA_DAEMON_IDLE,
    }
    done = subprocess.run(
        [sys.executable, "-m", "lazyfs.cli", "mount", image, str(mountpoint)]
        + ["--store", store_url, "--cache", str(cache_dir)],
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=MOUNT_TIMEOUT,
    )
    try:
        assert done.returncode == 0, done.stderr
        yield
    finally:
        stop_erofs_tree(mountpoint, run_dir)


def stop_erofs_tree(mountpoint: Path, run_dir: Path) -> None:
    """Unmount an EROFS tree; once no tree uses the run dir's data daemon, make sure it
    exited (it does by itself, DATA_DAEMON_IDLE after its last device closed)."""
    if (
        os.path.ismount(mountpoint)
        and subprocess.run(["umount", str(mountpoint)], capture_output=True).returncode
    ):
        subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True)
    data = run_dir / "data"
    if any(source.startswith(f"{data}/") for source in erofs_sources()):
        return  # another tree of this test still reads from the daemon
    for point in [p for p in fuse_mounts() if p.startswith(f"{data}/")]:
        pids = data_daemons(point, "lazyfs.tree.fuse_supervisor") + data_daemons(point)
        try:
            wait_until(lambda point=point: point not in fuse_mounts(), 10, "data daemon exit")
        except AssertionError:
            unmount_all(Path(point), pid=pids[0] if pids else 0)
        for pid in pids:
            if _wait_gone(pid, None, 10):
                unmount_all(Path(point), pid=pid)


def erofs_sources() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [
            line.split(" - ")[1].split()[1]
            for line in f
            if line.split(" - ")[1].split()[0] == "erofs"
        ]


def data_daemons(mountpoint: str, module: str = "lazyfs.tree.data_daemon") -> list[int]:
    """Pids of data daemons (workers) serving this mount point; with
    module="lazyfs.tree.fuse_supervisor", of their supervisors."""
    return daemon_pids(module, mountpoint)


@contextmanager
def running_mount(
    image: str, mountpoint: Path, store_url: str, cache_dir: Path
) -> Iterator[subprocess.Popen]:
    """The real daemon in the foreground of a subprocess, mounted at mountpoint."""
    log = open(cache_dir.parent / f"mount-{mountpoint.name}.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "lazyfs.tree.fuse_mount", image, str(mountpoint)]
        + ["--store", store_url, "--cache", str(cache_dir)],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd="/",
        env=subprocess_env(),
    )
    try:
        deadline = time.monotonic() + MOUNT_TIMEOUT
        while not os.path.ismount(mountpoint):
            if proc.poll() is not None:
                raise AssertionError(f"mount daemon exited with {proc.returncode}; see {log.name}")
            if time.monotonic() > deadline:
                raise AssertionError("mount did not appear")
            time.sleep(0.02)
        yield proc
    finally:
        unmount_all(mountpoint, proc)
        log.close()


# ---------------------------------------------------------------- building an image


@dataclass
class ImageBuilder:
    """Builds a manifest directly (no converter): paths in, image published in the store."""

    store: ObjectStore
    entries: list[tuple[bytes, Inode]] = field(default_factory=list)
    data: dict[str, bytes] = field(default_factory=dict)  # path -> expected content
    writer: PackWriter | None = None
    pending: list[tuple[Inode, list[bytes]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.writer = PackWriter(self.store, ChunkIndex())
        self.add(b"", Inode(Kind.DIR, 0o755, mtime_ns=1_500_000_000_000_000_001))

    def add(self, path: bytes, inode: Inode) -> Inode:
        self.entries.append((path, inode))
        return inode

    def file(self, path: str, content: bytes, mode: int = 0o644, **kw) -> Inode:  # noqa: ANN003
        assert self.writer is not None
        cids = []
        for view in cut(content):
            cid = chunk_id(view)
            self.writer.add(cid, compress_chunk(view), len(view))
            cids.append(cid)
        self.data[path] = content
        inode = self.add(path.encode(), Inode(Kind.REG, mode, size=len(content), **kw))
        self.pending.append((inode, cids))
        return inode

    def seal_pack(self) -> None:
        """End the current pack (to keep one file's chunks in a pack of their own)."""
        assert self.writer is not None
        self.writer.flush()

    def publish(self, name: str) -> str:
        assert self.writer is not None
        self.writer.flush()
        for inode, cids in self.pending:
            inode.chunks = [self.writer.index.ref(c) for c in cids]
        nlink: dict[int, int] = {}
        for _, inode in self.entries:
            nlink[id(inode)] = nlink.get(id(inode), 0) + 1
        for path, inode in self.entries:  # a directory: 2 + its subdirectories
            if inode.kind == Kind.DIR:
                prefix = path + b"/" if path else b""
                nlink[id(inode)] = 2 + sum(
                    1
                    for p, i in self.entries
                    if i.kind == Kind.DIR
                    and p.startswith(prefix)
                    and p != path
                    and b"/" not in p[len(prefix) :]
                )
        image_id = publish_tree(self.store, self.entries, nlink, {"config": "{}"}).image_id
        publish_refs(self.store, image_id, name, "")
        return image_id


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


def clean_run_dir(run_dir: Path) -> None:
    """Leave nothing of a run dir running: linger reapers, shared image trees (and their
    FUSE daemons), the node data daemon. By pid only, and only this run dir's."""
    for pid in reapers(run_dir):
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    images = f"{run_dir}/images/"
    for point in reversed([p for p in _mount_points() if p.startswith(images)]):
        if point in fuse_mounts():
            pids = daemon_pids("lazyfs.tree.fuse_mount", point)
            unmount_all(Path(point), pid=pids[0] if pids else 0)
        elif subprocess.run(["umount", point], capture_output=True).returncode:
            subprocess.run(["umount", "-l", point], capture_output=True)
    for point in [p for p in fuse_mounts() if p.startswith(f"{run_dir}/data/")]:
        for pid in data_daemons(point, "lazyfs.tree.fuse_supervisor") + data_daemons(point):
            unmount_all(Path(point), pid=pid)
        unmount_all(Path(point))


def _mount_points() -> list[str]:
    with open("/proc/self/mounts") as f:
        return [line.split()[1] for line in f]


def reapers(run_dir: Path) -> list[int]:
    """Pids of linger reapers (lazyfs/tree/image_mounts.py) of trees in this run dir, and of
    the sleeps they wait in."""
    found = []
    for pid, argv in proc_argvs():
        if b"reap" in argv and any(a.startswith(os.fsencode(f"{run_dir}/images/")) for a in argv):
            found.append(pid)
            with suppress(OSError), open(f"/proc/{pid}/task/{pid}/children") as f:
                found += [int(c) for c in f.read().split()]
    return found


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
    node = Node(
        tmp_path,
        {
            **os.environ,
            "LAZYFS_STORE": f"file://{py_store}",
            "LAZYFS_CACHE": str(tmp_path / "cache"),
            "LAZYFS_RUN_DIR": str(tmp_path / "run"),
            "LAZYFS_SANDBOX_DIR": str(tmp_path / "sandboxes"),
        },
    )
    yield node
    left = node.wait_clean()
    if left:
        node.scrub()
    node.remove_cgroup_parent()
    assert left == {}, f"left behind: {left}"


@pytest.fixture
def agent(tmp_path: Path, py_store: Path) -> Iterator[AgentProcess]:
    """A fresh agent process for one test (not started: call .start(ARGS)); stopped and
    the node checked clean afterwards."""
    with running_agent(tmp_path, py_store) as a:
        yield a
