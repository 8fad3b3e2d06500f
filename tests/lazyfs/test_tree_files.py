"""An image tree's files beside it (RUN_DIR/images/<key>/<id>: the mount point, its lock
files and its device record) go with the tree's last user, who removes them once the tree
is unmounted (lazyfs/tree/tree_release.py, forget_tree). Before, every image a node ever
mounted left all four for good. The lock file can go because every taker checks, once it
holds it, that it locked the file at the path, and opens it again if not."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from lazyfs.agent.trees import unmount_unused_trees
from lazyfs.mount_table import mounts as mount_table
from lazyfs.settings import Settings
from lazyfs.tree import image_mounts
from lazyfs.tree.image_mounts import ImageMounts
from lazyfs.tree.tree_release import forget_tree, same_file
from testbed.agent import AgentProcess
from testbed.image_builder import publish_one_file_images
from testbed.node import Node
from testbed.processes import wait_until

pytestmark = pytest.mark.usefixtures("no_leftovers")


def beside_trees(run_dir: Path) -> list[str]:
    """What is in RUN_DIR/images/<key>/, every key's."""
    images = run_dir / "images"
    return sorted(p.name for key in images.iterdir() if key.is_dir() for p in key.iterdir())


def mounted_below(path: Path) -> list[str]:
    return [p for p in mount_table() if p.startswith(f"{path}/")]


def test_the_last_user_of_a_tree_removes_its_files(tmp_path: Path, private_run_dir: Path) -> None:
    url = f"file://{tmp_path}/store"
    content = publish_one_file_images(url, 3)
    mounts = ImageMounts(url, tmp_path / "cache", Settings.from_env())
    for image_id, data in content.items():
        with mounts.use(image_id) as tree:
            assert (tree / "which").read_bytes() == data
            name = tree.name
            assert {name, f"{name}.lock", f"{name}.mount.lock", f"{name}.device"} <= set(
                beside_trees(private_run_dir)
            )
        assert beside_trees(private_run_dir) == []  # before: four left per image
    assert mounted_below(private_run_dir / "images") == []


def test_a_user_that_locked_a_removed_lock_file_takes_the_new_one(
    tmp_path: Path, private_run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user opens the tree's lock file, and before it locks it the tree's last user
    unmounts the tree and removes the file. Locked without the check, the removed file
    made that user's hold one that no later user shares: its release unmounted the
    tree under the next user's feet. The window is too short to hit at will, so the
    first user's open is made here before the last user's release."""
    url = f"file://{tmp_path}/store"
    content = publish_one_file_images(url, 1)
    (image_id,) = content
    mounts = ImageMounts(url, tmp_path / "cache", Settings.from_env())
    first = mounts.hold(image_id)
    opened_early = open(first.lock_path, "a+b")  # noqa: SIM115 - handed to the hold below
    first.release()  # the last user: unmounted, its files removed
    assert not first.lock_path.exists()

    real_open = open
    handed: list[bool] = []

    def open_late(path: object, mode: str = "r", *args: object) -> object:
        if Path(str(path)) == first.lock_path and not handed:
            handed.append(True)
            return opened_early  # the file this user had opened before the release
        return real_open(path, mode, *args)

    monkeypatch.setattr(image_mounts, "open", open_late, raising=False)
    late = mounts.hold(image_id)
    monkeypatch.undo()
    assert handed  # it was given the removed file first
    try:
        assert late.lock_fd is not None and same_file(late.lock_fd, str(late.lock_path))
        with mounts.use(image_id) as tree:  # a later user, sharing the tree with it
            late.release()  # not the last user: the tree stays
            assert (tree / "which").read_bytes() == content[image_id]
    finally:
        late.release()
    assert beside_trees(private_run_dir) == []


def test_users_coming_and_going_at_once_always_read_their_tree(
    tmp_path: Path, private_run_dir: Path
) -> None:
    """Threads hold and release the same images over and over (each thread its own
    lock file descriptions, as processes have): every read is right, and the node ends
    with nothing mounted and nothing left beside the trees."""
    url = f"file://{tmp_path}/store"
    content = publish_one_file_images(url, 2)
    mounts = ImageMounts(url, tmp_path / "cache", Settings.from_env())
    daemon = mounts.hold_data_daemon()  # one data daemon throughout, as an agent keeps
    daemon.ensure()
    errors: list[BaseException] = []

    def churn(image_id: str) -> None:
        try:
            for _ in range(25):
                with mounts.use(image_id) as tree:
                    assert (tree / "which").read_bytes() == content[image_id]
        except BaseException as exc:  # reported below, with the others
            errors.append(exc)

    try:
        threads = [threading.Thread(target=churn, args=(i,)) for i in content for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        daemon.release()
    assert errors == []
    assert mounted_below(private_run_dir / "images") == []
    assert beside_trees(private_run_dir) == []


def test_a_lingering_tree_leaves_nothing_after_its_reaper(sandbox_node: Node) -> None:
    assert sandbox_node.ok("echo", "hi", options=("--linger", "1")) == "hi\n"
    run_dir = sandbox_node.tmp / "run"
    assert beside_trees(run_dir)  # lingering: mounted, its lock held by nobody
    wait_until(lambda: beside_trees(run_dir) == [], 15, "the reaper's removal")
    assert mounted_below(run_dir / "images") == []
    sandbox_node.ok("true")  # `lazyfs run` without --linger: its finisher removes them
    assert beside_trees(run_dir) == []


def test_an_agent_removes_the_files_of_trees_it_let_go_and_those_left_before(
    agent: AgentProcess,
) -> None:
    """The files of a tree the agent let go go with it; at its start, an agent removes
    those that earlier versions left beside trees nobody holds (unmount_unused_trees)."""
    run_dir = agent.node.tmp / "run"
    left = run_dir / "images" / "0123456789abcdef" / ("f" * 64)  # an earlier version's
    left.mkdir(parents=True)
    for suffix in (".lock", ".mount.lock", ".device"):
        left.with_name(left.name + suffix).touch()
    agent.node.env["LAZYFS_AGENT_LINGER"] = "0"  # a tree goes with its last sandbox
    agent.start()
    assert beside_trees(run_dir) == []
    with agent.client() as c, c.create("py") as sb:
        assert sb.exec(["true"]).exit_code == 0
        assert beside_trees(run_dir)  # its trees, held
    wait_until(lambda: beside_trees(run_dir) == [], 15, "the trees' files to go")
    assert mounted_below(run_dir / "images") == []


def test_a_tree_still_mounted_keeps_its_files(tmp_path: Path, private_run_dir: Path) -> None:
    """A tree that could not be unmounted keeps its lock file: without it, no restarted
    agent would find the tree to unmount it (unmount_unused_trees goes by lock files)."""
    url = f"file://{tmp_path}/store"
    content = publish_one_file_images(url, 1)
    (image_id,) = content
    mounts = ImageMounts(url, tmp_path / "cache", Settings.from_env())
    held = mounts.hold(image_id)
    try:
        files = beside_trees(private_run_dir)
        forget_tree(str(held.lock_path), str(held.path))  # as if its unmount had not taken
        assert beside_trees(private_run_dir) == files
        assert (held.path / "which").read_bytes() == content[image_id]
    finally:
        held.close()  # gone without releasing, as a crashed user: the tree stays mounted
    assert mounted_below(private_run_dir / "images")
    unmount_unused_trees(private_run_dir)  # a restarted agent's: unmounted, files removed
    assert mounted_below(private_run_dir / "images") == []
    assert beside_trees(private_run_dir) == []
