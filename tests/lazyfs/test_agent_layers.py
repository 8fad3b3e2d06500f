"""The agent stacks an image's layer trees (`lazyfs convert --layer-trees`,
docs/FORMATS.md "Layer trees") as its sandboxes' lower layers: images on one base share
the base's tree, a sandbox sees the image as its merged tree shows it, cold creates and
generic claims alike, and a restarted agent adopts such a sandbox. The node is checked
clean after each test (running_agent)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from chunker.images import opened_manifest
from chunker.store.backends import open_store
from lazyfs.mount_table import mounts
from lazyfs.sandbox.overlay import lower_trees_in_options
from testbed.agent import AgentProcess, generic_ready, running_agent
from testbed.images import TestImages
from testbed.layerbuild import build_layer, directory, file, whiteout
from testbed.node import convert
from testbed.processes import wait_until

TASK = b"task layer\n"
DEEP = 40  # layers on top of the python image's


@pytest.fixture(scope="module")
def layered_store(test_images: TestImages, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`py`: the python test image with layer trees; `task`: the same plus a layer that
    adds a file and a user and removes /etc/motd, its User that user; `task-root`: the
    same layer with User root. All three on the same base trees."""
    tmp = tmp_path_factory.mktemp("layers")
    layout = tmp / "layout"
    subprocess.run(
        ["skopeo", "copy", "-q", f"oci:{test_images.layout}:python", f"oci:{layout}:python"],
        check=True,
    )
    users = b"root:x:0:0:root:/root:/bin/bash\n"
    layer = tmp / "task.tar"
    layer.write_bytes(
        build_layer(
            [
                directory("task"),
                file("task/id.txt", TASK),
                file("etc/passwd", users + b"runner:x:1234:1234::/home/runner:/bin/sh\n"),
                whiteout("etc/motd"),
            ]
        )
    )
    for tag in ("task", "task-root"):
        subprocess.run(
            ["umoci", "raw", "add-layer", "--image", f"{layout}:python", "--tag", tag, str(layer)],
            check=True,
        )
    subprocess.run(
        ["umoci", "config", "--image", f"{layout}:task", "--config.user", "runner"], check=True
    )
    # `deep`: more layers than one overlay's `lowerdir=` option can list under a test's run
    # directory (lazyfs.sandbox.overlay.lower_trees_in_options: ~20 here)
    subprocess.run(
        ["skopeo", "copy", "-q", f"oci:{layout}:python", f"oci:{layout}:deep"], check=True
    )
    for n in range(DEEP):
        one = tmp / f"deep{n}.tar"
        one.write_bytes(build_layer([directory("deep"), file(f"deep/{n}", b"%d\n" % n)]))
        subprocess.run(
            ["umoci", "raw", "add-layer", "--image", f"{layout}:deep", str(one)], check=True
        )
    store = tmp / "store"
    for tag, name in (
        ("python", "py"),
        ("task", "task"),
        ("task-root", "task-root"),
        ("deep", "deep"),
    ):
        convert(f"oci:{layout}:{tag}", name, store, "--layer-trees")
    return store


@pytest.fixture
def agent(tmp_path: Path, layered_store: Path) -> Iterator[AgentProcess]:
    with running_agent(tmp_path, layered_store) as a:
        yield a


def layer_trees(store: Path, name: str) -> list[str]:
    from chunker.refs import resolve_image

    s = open_store(f"file://{store}")
    with opened_manifest(s, resolve_image(s, name)) as manifest:
        return manifest.layer_trees


def lowers_of(rootfs: str) -> list[str]:
    """The lowerdirs of the overlay mounted at rootfs, top first: one `lowerdir=` option,
    or one `lowerdir+=` per layer (lazyfs/sandbox/overlay.py). The first is the
    sandbox's own /etc/hosts layer (lazyfs/sandbox/names.py), over the image's trees."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == rootfs:
                opts = line.split(" - ")[1].split()[2].split(",")
                (lower,) = [o for o in opts if o.startswith("lowerdir=")] or [""]
                added = [o.removeprefix("lowerdir+=") for o in opts if o.startswith("lowerdir+=")]
                return lower.removeprefix("lowerdir=").split(":") if lower else added
    raise AssertionError(f"{rootfs} is not mounted")


def test_sandboxes_stand_on_the_layer_trees_and_see_the_merged_image(
    agent: AgentProcess, layered_store: Path
) -> None:
    agent.start("--warm", "2")
    task, py = layer_trees(layered_store, "task-root"), layer_trees(layered_store, "py")
    assert len(task) == len(py) + 1 and task[:-1] == py, "the task image adds one tree"
    with agent.client() as c:
        wait_until(lambda: generic_ready(c) == 2, 30, "the generic pool to fill")
        with c.create("task-root") as generic, c.create("py", network=True) as cold_py:
            assert generic.info["from_pool"]
            lowers = lowers_of(str(agent.node.sandboxes / generic.id / "rootfs"))
            assert Path(lowers[0]) == agent.node.sandboxes / generic.id / "names"
            assert [Path(p).name for p in lowers[1:]] == task[::-1]
            shared = lowers_of(str(agent.node.sandboxes / cold_py.id / "rootfs"))
            assert Path(shared[0]) == agent.node.sandboxes / cold_py.id / "names"
            assert shared[1:] == lowers[2:], "both stand on the same base trees"
            assert generic.exec(["cat", "/task/id.txt"]).stdout == TASK
            r = generic.exec(["sh", "-c", "test -e /etc/motd; echo $?; grep -c runner /etc/passwd"])
            assert r.stdout == b"1\n1\n", r
            assert cold_py.exec(["test", "-e", "/etc/motd"]).exit_code == 0
            assert generic.exec(["python3", "-c", "print(6 * 7)"]).stdout == b"42\n"
            generic.exec(["sh", "-c", "echo mine > /task/id.txt"])
            assert generic.read_file("/task/id.txt") == b"mine\n"
            # The ref said what the image needs: its own (merged) manifest never fetched,
            # and a gateway still sees it mounted and cached here.
            image_id = generic.info["image_id"]
            assert not (agent.node.tmp / "cache/manifests" / f"{image_id}.db").exists()
            report = json.loads(c.request("GET", "/placement").data)
            assert report["images"][image_id]["mounted"], report
            assert image_id in report["cached"], report
            assert not set(task) & set(report["images"]), "layer trees are not images"
        # the image's merged tree was never mounted: only its layers' trees
        mounted = {Path(p).name for p in mounts() if str(agent.node.tmp) in p}
        assert set(task) <= mounted, mounted
        assert not {n for n in mounted if n not in task and len(n) == 64}, mounted


def test_a_cold_create_takes_the_user_from_the_top_layer(agent: AgentProcess) -> None:
    agent.start()
    with agent.client() as c, c.create("task") as sb:
        assert not sb.info["from_pool"]
        r = sb.exec(["sh", "-c", "id -u; cat /task/id.txt"])
        assert r.stdout == b"1234\n" + TASK, r


def test_kill_9_of_the_agent_adopts_a_sandbox_on_layer_trees(agent: AgentProcess) -> None:
    agent.start("--warm", "1")
    with agent.client() as c:
        wait_until(lambda: generic_ready(c) == 1, 30, "the generic pool to fill")
        kept = c.create("task-root")
        kept.exec(["sh", "-c", "echo before > /tmp/mark"])
        # killed with no refill half made (an allocation's file is left for 60 s)
        wait_until(lambda: generic_ready(c) == 1, 30, "the generic pool to refill")
        (saved,) = agent.node.tmp.glob(f"run/agent/sandboxes/{kept.id}*.json")
        record = json.loads(saved.read_text())
        assert len(record["trees"]) >= 2 and ":" in record["tree"]
    agent.kill9()
    agent.start()
    with agent.client() as c:
        assert c.health()["adopted_on_start"] == [kept.id]
        r = c.sandbox(kept.id).exec(["sh", "-c", "cat /tmp/mark /task/id.txt"])
        assert r.stdout == b"before\n" + TASK, r
        c.sandbox(kept.id).delete()


def test_an_image_with_more_layers_than_one_page_of_options_lists_stands_on_them(
    agent: AgentProcess, layered_store: Path
) -> None:
    """More layer trees than a `lowerdir=` option lists in mount(2)'s page: the overlay is
    put together layer by layer (`lowerdir+`, lazyfs/sandbox/overlay.py)."""
    trees = layer_trees(layered_store, "deep")
    assert len(trees) > lower_trees_in_options(agent.node.tmp / "run/images/0123456789abcdef")
    agent.start("--warm", "1")
    with agent.client() as c:
        wait_until(lambda: generic_ready(c) == 1, 30, "the generic pool to fill")
        with c.create("deep") as generic, c.create("deep", network=True) as cold:
            assert generic.info["from_pool"] and not cold.info["from_pool"]
            for sb in (generic, cold):
                lowers = lowers_of(str(agent.node.sandboxes / sb.id / "rootfs"))
                assert Path(lowers[0]) == agent.node.sandboxes / sb.id / "names"
                assert [Path(p).name for p in lowers[1:]] == trees[::-1]
                r = sb.exec(["sh", "-c", f"cat /deep/0 /deep/{DEEP - 1} /etc/os-release"])
                assert r.stdout.startswith(b"0\n%d\nPRETTY_NAME" % (DEEP - 1)), r
                assert sb.exec(["python3", "-c", "print(6 * 7)"]).stdout == b"42\n"


def test_lazyfs_run_stacks_an_image_of_many_layers_too(
    agent: AgentProcess, layered_store: Path
) -> None:
    trees = layer_trees(layered_store, "deep")
    show_root = "grep -o 'lowerdir+=[^,]*' /proc/self/mountinfo | wc -l; cat /deep/0"
    done = agent.node.run("sh", "-c", show_root, image="deep")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{len(trees) + 1}\n0\n", done.stdout  # and its /etc/hosts layer
