"""A mount is only served by the store and cache it was asked for (issue 21).

Two configurations (another cache directory, or another store) on one run dir, one
after the other (the first's tree lingering, then its cache or store deleted) and at
once: each gets a tree of its own, served by a daemon of its own cache and store, and
reads the right bytes. A cache directory deleted, or deleted and made again, under a
running data daemon: its trees, old and new, read the right bytes (the daemon's worker
restarts on the cache at the path, lazyfs/tree/data_daemon.py reopen_cache); with nothing
open it exits at once. A snapshotter or an agent restarted with another cache takes up
no tree and no sandbox of the old one.

Measured on the code before this (keyed by image id alone): every test here failed, a
tree of the other configuration adopted, or EIO (ENOENT on cache_dir/locks/XX in the
data daemon's log).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from chunker.model import Inode, Kind
from chunker.store.backends import open_store
from lazyfs.mount_table import mounts
from lazyfs.settings import Settings
from lazyfs.snapshotter import snapshots_pb2 as pb
from lazyfs.tree.image_mounts import ImageMounts
from testbed.agent import AgentProcess
from testbed.image_builder import ImageBuilder
from testbed.images import TestImages
from testbed.mounted_trees import TREES, one_worker, supervisors
from testbed.mounts import mount_ids
from testbed.processes import daemon_pids, pid_alive, wait_until
from testbed.snapshots import image_trees, lazy_image, mounted, prepare, pull_lazily
from testbed.snapshotter import Snapshotter
from tests.lazyfs.conftest import build_test_image

CHECK_PERIOD = 0.5  # > the data daemon's look at its cache directory (DATA_DAEMON_IDLE)


class Images:
    """Two images in one file:// store: the test image (every kind of entry, a 3 MiB file,
    2500 small files) and a second one with files of its own."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = f"file://{root}"
        store = open_store(self.url)
        try:
            self.first, self.first_files = build_test_image(store)
            other = ImageBuilder(store)
            other.add(b"other", Inode(Kind.DIR, 0o755))
            rng = random.Random(21)
            other.file("other/big.bin", rng.randbytes(2 * 2**20 + 77))
            for i in range(200):
                other.file(f"other/small-{i:03d}", rng.randbytes(rng.randrange(100, 20_000)))
            self.second = other.publish("test/other")
            self.second_files = other
        finally:
            store.close()

    def copy(self, dest: Path) -> str:
        """The same store under another URL (the same image ids)."""
        shutil.copytree(self.root, dest)
        return f"file://{dest}"


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Images:
    return Images(tmp_path_factory.mktemp("identity-store") / "store")


def assert_reads(tree: Path, builder: ImageBuilder) -> None:
    """Every regular file of the image, whole and right (an EIO raises OSError here)."""
    for path, data in builder.data.items():
        assert (tree / path).read_bytes() == data, path


def served_by(tree: Path) -> tuple[str, str]:
    """(cache dir, store URL) of the daemon serving a tree, from its command line: the
    node data daemon's for an EROFS tree, else the tree's own FUSE daemon's."""
    fstype, source = mounts()[str(tree)]
    if fstype == "erofs":
        (pid,) = daemon_pids("lazyfs.tree.fuse_supervisor", os.path.dirname(source))
    else:
        (pid,) = daemon_pids("lazyfs.tree.fuse_mount", str(tree))
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = [os.fsdecode(a) for a in f.read().split(b"\0")]
    return argv[argv.index("--cache") + 1], argv[argv.index("--store") + 1]


def manager(url: str, cache: Path) -> ImageMounts:
    return ImageMounts(url, cache, Settings.from_env())


def two_configurations(
    images: Images, tmp_path: Path, differ: str
) -> tuple[ImageMounts, ImageMounts, Path]:
    """(first, second) managers that differ in their cache or their store, and what to
    delete to take the first one's away (its cache dir, or its store)."""
    if differ == "cache":
        first = manager(images.url, tmp_path / "cache-1")
        return first, manager(images.url, tmp_path / "cache-2"), tmp_path / "cache-1"
    first = manager(images.copy(tmp_path / "store-1"), tmp_path / "cache")
    return first, manager(images.url, tmp_path / "cache"), tmp_path / "store-1"


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("differ", ["cache", "store"])
def test_a_lingering_tree_of_another_configuration_is_never_used(
    images: Images, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tree: str, differ: str
) -> None:
    """The issue's containerd runs: one after the other on one run dir, the first's tree
    lingering after its last user, then the first's cache (or store) deleted."""
    monkeypatch.setenv("LAZYFS_TREE", tree)
    first, second, away = two_configurations(images, tmp_path, differ)
    held = first.hold(images.first)
    old = held.path
    assert (old / "small.txt").read_bytes() == b"hello, lazyfs\n"
    held.release(linger=60)  # lingers: the next user of *its* key takes it up
    assert old in [Path(p) for p in mounts()]
    delete_under_a_daemon(away)
    with second.use(images.first) as path:
        assert path != old
        assert served_by(path) == (str(second.cache_dir), second.store_url)
        assert path == second.tree_path(images.first)
        assert_reads(path, images.first_files)
    assert old in [Path(p) for p in mounts()]  # still the first's, lingering
    if differ == "cache":
        time.sleep(CHECK_PERIOD)
        assert not away.exists()  # nobody read the old tree: its cache was not made again


@pytest.mark.parametrize("tree", TREES)
def test_two_configurations_at_once_each_read_from_their_own(
    images: Images, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tree: str
) -> None:
    monkeypatch.setenv("LAZYFS_TREE", tree)
    first, second, away = two_configurations(images, tmp_path, "cache")
    with first.use(images.first) as a, second.use(images.first) as b:
        assert a != b
        assert served_by(a) == (str(first.cache_dir), first.store_url)
        assert served_by(b) == (str(second.cache_dir), second.store_url)
        assert (a / "small.txt").read_bytes() == b"hello, lazyfs\n"
        delete_under_a_daemon(away)  # the first's cache goes: the second's tree does not care
        assert_reads(b, images.first_files)
        if tree == "erofs":  # and the first's data daemon reopens its own
            assert_reads(a, images.first_files)


@pytest.mark.parametrize("how", ["deleted", "made again"])
def test_a_cache_directory_deleted_under_the_data_daemon(
    images: Images, tmp_path: Path, private_run_dir: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A tree mounted and read, then its cache directory deleted (and made again, empty):
    the old tree's next reads and a new tree's are right; the worker was restarted on the
    cache at the path, the supervisor and the old tree stayed."""
    monkeypatch.setenv("LAZYFS_TREE", "erofs")
    cache = tmp_path / "cache"
    node = manager(images.url, cache)
    old = node.hold(images.first)
    try:
        assert (old.path / "small.txt").read_bytes() == b"hello, lazyfs\n"
        (supervisor,) = supervisors(private_run_dir)
        worker = one_worker(str(node.data_dir))
        tree_mount = mount_ids()[str(old.path)]
        delete_under_a_daemon(cache)
        if how == "made again":
            cache.mkdir()
        assert_reads(old.path, images.first_files)  # a read fails: the worker restarts
        with node.use(images.second) as new:
            assert_reads(new, images.second_files)
        assert supervisors(private_run_dir) == [supervisor]
        # Replaced at a failed read, or at the once-a-second look: the old tree's files may
        # all be in its page cache already (warmed from the trace the first case recorded).
        wait_until(lambda: not pid_alive(worker), 5, "the worker's replacement")
        one_worker(str(node.data_dir), {worker})  # its successor serves
        assert mount_ids()[str(old.path)] == tree_mount  # never remounted
        wait_until((cache / "index").is_dir, 10, "the new worker's cache, on the path")
    finally:
        old.release()


def delete_under_a_daemon(away: Path) -> None:
    """rm -rf of a cache directory (or a store) that a daemon serves from. For a cache, the
    mount's own background reads go first (its trace's replay and the new tree's warm-up):
    while they run the daemon makes files under the cache (stripe locks, chunks), and an
    rm -rf then races them ("Directory not empty", seen in CI with the FUSE tree)."""
    if (away / "mounts").is_dir():
        wait_until(lambda: background_done(away), 30, "the replay and the warm-up")
    shutil.rmtree(away)


def background_done(cache: Path) -> bool:
    """Whether the trace replay and tree warm-up of every image mounted from this cache are
    over (their daemons' stats files)."""
    for path in (cache / "mounts").glob("*.json"):
        stats = json.loads(path.read_text())
        if stats.get("trace") in ("starting", "replaying") or stats.get("warm") in (
            "starting",
            "warming",
        ):
            return False
    return True


def test_a_data_daemon_with_nothing_open_exits_when_its_cache_directory_goes(
    images: Images, tmp_path: Path, private_run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Long before its idle time: the next user starts a daemon on the cache it asks for."""
    monkeypatch.setenv("LAZYFS_TREE", "erofs")
    monkeypatch.setenv("LAZYFS_DAEMON_IDLE", "600")
    cache = tmp_path / "cache"
    node = manager(images.url, cache)
    with node.use(images.first) as tree:
        assert (tree / "small.txt").read_bytes() == b"hello, lazyfs\n"
    (supervisor,) = supervisors(private_run_dir)
    time.sleep(CHECK_PERIOD)
    assert pid_alive(supervisor)  # idle, within its 600 s
    delete_under_a_daemon(cache)
    wait_until(lambda: not pid_alive(supervisor), 5, "the data daemon's exit")
    assert str(node.data_dir) not in mount_ids()
    with node.use(images.first) as tree:
        assert_reads(tree, images.first_files)
    for pid in supervisors(private_run_dir):  # the new one: idle for 600 s otherwise
        os.kill(pid, signal.SIGTERM)
        wait_until(lambda pid=pid: not pid_alive(pid), 10, "the new data daemon's exit")


def test_a_restarted_snapshotter_with_another_cache_takes_up_none_of_the_old_trees(
    snapshotter_factory: Callable[..., Snapshotter],
    converted: Path,  # noqa: F811 - the fixture
    test_images: TestImages,
    references: Callable[[str], Path],
    tmp_path: Path,
) -> None:
    """A container's snapshot made by a snapshotter with one cache; the snapshotter
    restarted (same root) with another cache, the first cache deleted: the container's
    mounts now stand on a tree of the new cache, which reads right; the old tree is
    left to the container that uses it, and nothing makes its deleted cache again."""
    sn = snapshotter_factory(f"file://{converted}")
    stub = sn.stub()
    chain = pull_lazily(stub, test_images, "python")
    image_id = lazy_image(sn, chain)
    (m,) = prepare(stub, "default/9/ctr", chain[-1]).mounts
    old_tree = lowerdir(m)
    # Every tree's trace replay and warm-up over before the cache goes: one whose stats
    # were not published yet passed background_done, read the deleted cache, and a read
    # that fails makes the cache again (data_daemon.py): seen once in a fresh clone's
    # run, on a busy host.
    stats, trees = sn.cache / "mounts", len(image_trees(sn, image_id))
    wait_until(
        lambda: len(list(stats.glob("*.json"))) >= trees and background_done(sn.cache),
        30,
        "every tree's stats, replay and warm-up",
    )
    sn.stop()
    old_cache, sn.cache = sn.cache, sn.base / "cache-2"
    delete_under_a_daemon(old_cache)
    sn.start()
    stub = sn.stub()
    mounts_now = stub.Mounts(pb.MountsRequest(key="default/9/ctr")).mounts
    (m,) = mounts_now
    new_tree = lowerdir(m)
    assert new_tree != old_tree
    assert served_by(new_tree) == (str(sn.cache), sn.store_url)
    assert str(new_tree) == image_trees(sn, image_id)[-1]
    reference = references("python")
    with mounted(mounts_now, tmp_path / "rootfs") as root:
        for path in ["usr/bin/python3", *_python_sources(reference)]:
            assert _sha(root / path) == _sha(reference / path), path
    time.sleep(CHECK_PERIOD)
    assert not old_cache.exists()
    stub.Remove(pb.RemoveSnapshotRequest(key="default/9/ctr"))


def test_a_restarted_agent_with_another_cache_adopts_no_sandbox_of_the_old_one(
    agent: AgentProcess,
) -> None:
    """kill -9 of the agent, its cache deleted, a new agent on the run dir with another
    cache: the old sandbox stands on the old cache's tree, so it is cleaned up, not
    adopted, and so is that tree; a new sandbox reads right."""
    node = agent.node
    agent.start()
    with agent.client() as c:
        old = c.create("py")
        assert old.exec(["true"]).exit_code == 0
    agent.kill9()
    old_cache = Path(node.env["LAZYFS_CACHE"])
    delete_under_a_daemon(old_cache)
    node.env["LAZYFS_CACHE"] = str(node.tmp / "cache-2")
    agent.start()
    images = node.tmp / "run" / "images"
    with agent.client() as c:
        health = c.health()
        assert health["adopted_on_start"] == []
        assert old.id in health["cleaned_on_start"]
        assert not [p for p in mount_ids() if p.startswith(f"{images}/")]  # unmounted
        box = c.create("py")
        r = box.exec(["python3", "-c", "import email.parser, json, sqlite3; print('ok')"])
        assert (r.exit_code, r.stdout) == (0, b"ok\n"), r.stderr
        trees = [p for p in mount_ids() if p.startswith(f"{images}/")]  # merged or layers
        key = ImageMounts(node.env["LAZYFS_STORE"], node.tmp / "cache-2", Settings.from_env()).key
        assert trees and {Path(tree).parent for tree in trees} == {images / key}
        box.delete()
    assert not old_cache.exists()


def lowerdir(m: pb.Mount) -> Path:
    """The lowest lowerdir of an overlay mount: the image's bottom tree."""
    (option,) = [o for o in m.options if o.startswith("lowerdir=")]
    return Path(option.removeprefix("lowerdir=").split(":")[-1])


def _python_sources(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in (root / "usr/lib/python3.11").glob("*.py"))


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
