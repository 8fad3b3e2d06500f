"""The snapshotter and other users of one node (`lazyfs run`, `ImageMounts.use` in this
process) with the same cache and store share each tree, RUN_DIR/images/<key>/<tree id>
(lazyfs/tree/image_mounts.py): an image's layer trees, or its merged tree if it has none.
One mount of each whoever asked, lingering after its last user, kept across a
snapshotter restart, and mounted again when its daemon died.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from lazyfs.mount_table import entries, tree_kind
from lazyfs.settings import Settings
from lazyfs.snapshotter import snapshots_pb2 as pb
from lazyfs.tree.image_mounts import ImageMounts
from testbed.images import TestImages
from testbed.mounted_trees import TREES
from testbed.mounts import fuse_mounts
from testbed.processes import daemon_pids, wait_until
from testbed.snapshots import image_trees, lazy_image, mounted, prepare, pull_lazily, trees
from testbed.snapshotter import Snapshotter

LAZYFS = str(Path(sys.executable).parent / "lazyfs")
# The process whose life is a tree's: for EROFS trees the data daemon's supervisor (it
# holds the FUSE connection; its worker may die and be replaced), else the FUSE daemon.
DAEMONS = ("lazyfs.tree.fuse_supervisor", "lazyfs.tree.fuse_mount")


def node_daemons(run_dir: Path) -> list[tuple[str, int]]:
    """(module, pid) of every data daemon and per-image FUSE daemon of this run dir."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = [os.fsdecode(a) for a in f.read().split(b"\0")]
        except OSError:
            continue
        module = next((m for m in DAEMONS if m in argv), None)
        if module and any(a.startswith(f"{run_dir}/") for a in argv):
            found.append((module, int(entry)))
    return found


def mount_id(point: str) -> str:
    """The mount at point, as mountinfo names it: mount id and device. Equal before and
    after means not remounted (the kernel reuses both once a mount is gone, so a
    remount is told by its daemon instead)."""
    ids = [f"{m.mount_id} {m.device}" for m in entries() if m.point == point]
    assert len(ids) == 1, (point, ids)
    return ids[0]


def assert_trees(sn: Snapshotter, expected: list[str]) -> None:
    """Those trees are mounted once each, served by the data daemon (its supervisor) if
    they are EROFS trees, else each by its own FUSE daemon."""
    assert sorted(trees(sn)) == sorted(expected)
    kinds = {tree_kind(Path(t)) for t in expected}
    daemons = (
        ["lazyfs.tree.fuse_supervisor"]
        if kinds == {"erofs"}
        else ["lazyfs.tree.fuse_mount"] * len(expected)
    )
    assert [m for m, _ in node_daemons(sn.run_dir)] == daemons


def lazyfs_run(sn: Snapshotter, image: str, tmp_path: Path, *command: str) -> str:
    env = {**os.environ, "LAZYFS_RUN_DIR": str(sn.run_dir),
           "LAZYFS_SANDBOX_DIR": str(tmp_path / "sandboxes")}  # fmt: skip
    # The snapshotter's store and cache: one data daemon serves both.
    argv = [LAZYFS, "run", image, "--store", sn.store_url, "--cache", str(sn.cache)]
    done = subprocess.run([*argv, "--", *command], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_snapshotter_and_run_share_the_trees_that_linger_then_go(
    snapshotter_factory: Callable[..., Snapshotter],
    converted: Path,  # noqa: F811 - the fixture
    test_images: TestImages,
    tmp_path: Path,
) -> None:
    sn = snapshotter_factory(f"file://{converted}", linger=2.0)
    stub = sn.stub()
    chain = pull_lazily(stub, test_images, "python")
    layers = image_trees(sn, lazy_image(sn, chain))
    assert len(layers) == 2  # the python image's layer trees, top first
    wait_until(lambda: sorted(trees(sn)) == sorted(layers), 20, "the trees the pull mounts ahead")
    first = [mount_id(t) for t in layers]
    (m,) = prepare(stub, "default/9/ctr", chain[-1]).mounts
    assert f"lowerdir={':'.join(layers)}" in m.options
    top = Path(layers[0]).name
    with ImageMounts(sn.store_url, sn.cache, Settings.from_env()).use(top) as path:
        assert str(path) == layers[0]
        assert_trees(sn, layers)
        # `lazyfs run` by the image's name stands on its layer trees too.
        out = lazyfs_run(sn, f"oci:{test_images.layout}:python", tmp_path,
                         "python3", "-c", "print('shared')")  # fmt: skip
        assert out == "shared\n"
        assert_trees(sn, layers)
    assert [mount_id(t) for t in layers] == first  # three users, never mounted twice
    assert sorted(trees(sn)) == sorted(layers)  # the snapshotter's container still uses them
    stub.Remove(pb.RemoveSnapshotRequest(key="default/9/ctr"))
    released = time.monotonic()
    assert_trees(sn, layers)  # linger for the next container
    wait_until(lambda: trees(sn) == [], 15, "the lingering trees to go")
    assert time.monotonic() - released >= 1.5
    # The snapshotter keeps the node data daemon up while it serves, as the agent does
    # (a node's next container must not wait for its start); stopped, it lets it go.
    time.sleep(1.0)  # five times the daemon's idle time in tests
    assert [m for m, _ in node_daemons(sn.run_dir)] == ["lazyfs.tree.fuse_supervisor"]
    sn.stop()
    wait_until(lambda: node_daemons(sn.run_dir) == [], 15, "its daemon to exit")


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_snapshotter_restart_keeps_the_trees_in_use(
    snapshotter_factory: Callable[..., Snapshotter],
    converted: Path,  # noqa: F811 - the fixture
    test_images: TestImages,
    tmp_path: Path,
    how: str,
) -> None:
    sn = snapshotter_factory(f"file://{converted}")
    stub = sn.stub()
    chain = pull_lazily(stub, test_images, "python")
    layers = image_trees(sn, lazy_image(sn, chain))
    mounts = prepare(stub, "default/9/ctr", chain[-1]).mounts
    first = [mount_id(t) for t in layers]
    with mounted(mounts, tmp_path / "rootfs") as root:
        if how == "kill":
            sn.kill()
        else:
            sn.stop()
        assert sorted(trees(sn)) == sorted(layers) and [mount_id(t) for t in layers] == first
        sn.start()
        # The restarted snapshotter holds the trees again: another user's last exit
        # (no linger) must not unmount them.
        for tree in layers:
            with ImageMounts(sn.store_url, sn.cache, Settings.from_env()).use(Path(tree).name):
                pass
        assert [mount_id(t) for t in layers] == first
        assert_trees(sn, layers)
        assert (root / "usr" / "bin" / "python3").stat().st_size > 0
        stub = sn.stub()
    stub.Remove(pb.RemoveSnapshotRequest(key="default/9/ctr"))
    assert trees(sn) == []  # no linger: the snapshotter was its last user


@pytest.mark.parametrize("tree_kind_", TREES)
def test_a_tree_whose_daemon_died_is_mounted_again(
    snapshotter_factory: Callable[..., Snapshotter],
    converted: Path,  # noqa: F811 - the fixture
    test_images: TestImages,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    tree_kind_: str,
) -> None:
    monkeypatch.setenv("LAZYFS_TREE", tree_kind_)
    sn = snapshotter_factory(f"file://{converted}")
    stub = sn.stub()
    chain = pull_lazily(stub, test_images, "python")
    layers = image_trees(sn, lazy_image(sn, chain))
    tree = layers[0]  # the top layer's tree: the one whose daemon dies (FUSE trees)
    prepare(stub, "default/9/ctr", chain[-1])
    assert all(tree_kind(Path(t)) == tree_kind_ for t in layers)
    module = DAEMONS[0] if tree_kind_ == "erofs" else DAEMONS[1]
    (pid,) = [p for m, p in node_daemons(sn.run_dir) if tree_kind_ == "erofs" or
              daemon_pids(m, tree) == [p]]  # fmt: skip
    os.kill(pid, signal.SIGKILL)  # a daemon this test's snapshotter started (for EROFS
    # its supervisor: a killed worker is replaced without the tree noticing)
    wait_until(lambda: (module, pid) not in node_daemons(sn.run_dir), 10, "the daemon to die")
    # Its watchdog then detaches its mount by path (lazyfs/tree/fuse_mount.py); let it finish first,
    # or it may detach the new mount stacked at the same path.
    dead = tree if tree_kind_ == "fuse" else f"{sn.run_dir}/data/"
    wait_until(lambda: not [p for p in fuse_mounts() if p.startswith(dead)], 10, "detach")
    other = tmp_path / "other"
    if tree_kind_ == "erofs":
        # Another user starts a new data daemon first: the old tree still reads from the
        # dead one, though the data daemon's mount answers again.
        other.mkdir()
        ImageMounts(sn.store_url, sn.cache, Settings.from_env()).mount(Path(tree).name, other)
    try:
        mounts = stub.Mounts(pb.MountsRequest(key="default/9/ctr")).mounts
        if tree_kind_ == "erofs":
            ((_module, new_pid),) = node_daemons(sn.run_dir)  # the one `other` started
        else:
            (new_pid,) = daemon_pids(module, tree)
        assert new_pid != pid
        with mounted(mounts, tmp_path / "rootfs") as root:
            data = (root / "usr" / "bin" / "python3").read_bytes()  # data, not just metadata
            assert data.startswith(b"\x7fELF") and len(data) > 1_000_000
        assert tree_kind(Path(tree)) == tree_kind_
        assert sorted(trees(sn)) == sorted(layers)  # the dead tree detached, not stacked under
    finally:
        if os.path.ismount(other):
            subprocess.run(["umount", str(other)], check=True)
    stub.Remove(pb.RemoveSnapshotRequest(key="default/9/ctr"))
    assert trees(sn) == []
