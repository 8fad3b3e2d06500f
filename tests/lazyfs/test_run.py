"""`lazyfs run`: sandboxes over the shared lazy mount of a real Debian image."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lazyfs.tree.node_files import mount_stats
from testbed.images import TestImages
from testbed.mounts import mounts_below, wait_no_mounts_below

LAZYFS = str(Path(sys.executable).parent / "lazyfs")


@pytest.fixture(scope="module")
def python_store(test_images: TestImages, tmp_path_factory: pytest.TempPathFactory) -> Path:
    store = tmp_path_factory.mktemp("run-store")
    subprocess.run(
        [
            LAZYFS,
            "convert",
            f"oci:{test_images.layout}:python",
            "--name",
            "py",
            "--store",
            f"file://{store}",
        ],
        check=True,
        capture_output=True,
    )
    return store


@pytest.fixture
def node(tmp_path: Path, python_store: Path):
    """A private node: its own cache, run and sandbox dirs; nothing mounted afterwards."""
    env = {
        **os.environ,
        "LAZYFS_STORE": f"file://{python_store}",
        "LAZYFS_CACHE": str(tmp_path / "cache"),
        "LAZYFS_RUN_DIR": str(tmp_path / "run"),
        "LAZYFS_SANDBOX_DIR": str(tmp_path / "sandboxes"),
    }

    def run(
        *command: str, check: bool = True, options: tuple[str, ...] = ()
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [LAZYFS, "run", *options, "py", "--", *command],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"{command} exited {proc.returncode}: {proc.stderr}")
        return proc

    run.env = env  # type: ignore[attr-defined]
    run.tmp = tmp_path  # type: ignore[attr-defined]
    yield run
    # The node data daemon (EROFS trees) exits LAZYFS_DAEMON_IDLE after its last tree.
    left = wait_no_mounts_below(tmp_path)
    for point in reversed(left):
        subprocess.run(["fusermount3", "-u", "-z", point], capture_output=True)
        subprocess.run(["umount", "-l", point], capture_output=True)
    assert left == [], f"mounts left behind: {left}"


def image_trees(tmp_path: Path) -> list[str]:
    """The image trees mounted on the test's node (not the data daemon's own mount)."""
    return [p for p in mounts_below(tmp_path / "run") if "/images/" in p]


def layer_trees(store: Path, name: str = "py") -> list[str]:
    """The ids of the layer trees the image's ref names, bottom first."""
    from chunker.refs import lookup_ref
    from chunker.store.backends import open_store

    found = lookup_ref(open_store(f"file://{store}"), name)
    assert found is not None and found[1] is not None, "converted with layer trees"
    return found[1].layers


def tree_stats(tmp_path: Path) -> list[dict]:
    """The stats of each tree the node's data daemon served: one file per tree, each
    with the daemon's newest node-wide figures (node_files.mount_stats)."""
    return mount_stats(tmp_path / "cache")


def test_python_runs_and_fetches_a_small_fraction(node, python_store) -> None:
    out = node("python3", "-c", 'print("hello")')
    assert out.stdout == "hello\n"
    # An EROFS tree's device is released (its stats final) just after the unmount.
    deadline = time.monotonic() + 5
    while any(t["mounted"] for t in tree_stats(node.tmp)) and time.monotonic() < deadline:
        time.sleep(0.05)
    trees = tree_stats(node.tmp)
    assert sorted(t["image"] for t in trees) == sorted(layer_trees(python_store))
    stats = trees[0]  # its node-wide figures are the daemon's newest, as every tree's
    info = json.loads(
        subprocess.run(
            [LAZYFS, "inspect", "py", "--json"],
            env=node.env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    fraction = stats["bytes_fetched"] / info["stored_bytes"]
    print(
        f"fetched {stats['bytes_fetched']} of {info['stored_bytes']} stored bytes"
        f" ({fraction:.1%}), {stats['store_requests']} requests"
    )
    assert fraction < 0.15
    assert all(t["errors"] == 0 and t["mounted"] is False for t in trees)


def test_sandbox_is_a_container_like_root(node) -> None:
    """PID 1 is the init lazyfs mounts at /dev/init (tini); the command runs under it."""
    script = (
        "import os; print(open('/proc/1/cmdline').read().split(chr(0))[0], os.getppid());"
        "print(os.path.exists('/proc/self/status'), os.path.exists('/dev/null'));"
        "open('/tmp/x', 'w').write('t'); open('/dev/null', 'w').write('n');"
        "print(open('/etc/os-release').readline().strip())"
    )
    out = node("python3", "-c", script).stdout.splitlines()
    assert out == ["/dev/init 1", "True True", 'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"']


def test_exit_status_is_passed_through_and_writes_are_private(node) -> None:
    assert node("sh", "-c", "echo changed > /etc/hostname; exit 7", check=False).returncode == 7
    assert node("cat", "/etc/hostname").stdout != "changed\n"
    assert node("missing-command", check=False).returncode == 127
    assert list((node.tmp / "sandboxes").iterdir()) == []  # upper layers deleted


def test_concurrent_runs_share_one_mount(node, python_store) -> None:
    """Two sandboxes of one image at once: one mount of each of its layer trees, two
    overlays, running together (a second sandbox must not wait for the first one to end)."""
    spans: list[tuple[float, float]] = []

    def sandbox() -> None:
        out = node("sh", "-c", "date +%s.%N; sleep 2; date +%s.%N").stdout.split()
        spans.append((float(out[0]), float(out[1])))

    threads = [threading.Thread(target=sandbox) for _ in range(2)]
    for t in threads:
        t.start()
    trees_seen = set()
    while any(t.is_alive() for t in threads):
        trees_seen.update(image_trees(node.tmp))
        threads[0].join(0.1)
    for t in threads:
        t.join()
    assert len(spans) == 2
    (a0, a1), (b0, b1) = spans
    assert max(a0, b0) < min(a1, b1), f"the sandboxes ran one after the other: {spans}"
    layers = layer_trees(python_store)
    assert len(layers) > 1 and sorted(Path(p).name for p in trees_seen) == sorted(layers)
    assert image_trees(node.tmp) == []  # the last one out unmounted them


def test_linger_keeps_the_mount_for_the_next_run(node) -> None:
    """With --linger the image stays mounted after its last sandbox: the next sandbox is
    served by the same daemon, and the linger time restarts from the last sandbox's end."""
    linger = ("--linger", "3")
    node("true", options=linger)
    first_end = time.monotonic()
    trees = image_trees(node.tmp)  # the image's layer trees
    assert len(trees) > 1
    (daemon,) = {t["pid"] for t in tree_stats(node.tmp)}
    assert_detached(started_reapers(node.tmp))
    node("sleep", "1", options=linger)  # ends >= 1 s later: the linger restarts there
    assert {t["pid"] for t in tree_stats(node.tmp)} == {daemon}  # the same daemon served it
    time.sleep(max(0.0, first_end + 3.5 - time.monotonic()))
    assert image_trees(node.tmp) == trees  # the first reapers left them alone
    deadline = time.monotonic() + 20
    while image_trees(node.tmp) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert image_trees(node.tmp) == []  # the second reapers unmounted them


def test_inspect_shows_the_mounts_of_an_images_layer_trees(node, python_store) -> None:
    node("true")
    deadline = time.monotonic() + 5  # each device's final stats come just after its unmount
    while any(t["mounted"] for t in tree_stats(node.tmp)) and time.monotonic() < deadline:
        time.sleep(0.05)
    out = subprocess.run(
        [LAZYFS, "inspect", "py", "--json"], env=node.env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    layers = layer_trees(python_store)
    assert info["layer_trees"] == layers
    assert sorted(m["image"] for m in info["mounts"]) == sorted(layers)
    assert all(m["mounted"] is False and m["tree"] == "erofs" for m in info["mounts"])


def test_an_image_named_by_id_runs_on_its_merged_tree(node, python_store) -> None:
    """Its ref, which names the layer trees, is not read: the merged tree serves it."""
    from chunker.refs import lookup_ref
    from chunker.store.backends import open_store

    found = lookup_ref(open_store(f"file://{python_store}"), "py")
    assert found is not None
    image_id = found[0]
    argv = [LAZYFS, "run", "--linger", "2", image_id, "--", "python3", "-c", "print(6 * 7)"]
    proc = subprocess.run(argv, env=node.env, capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout) == (0, "42\n"), proc.stderr
    assert [Path(p).name for p in image_trees(node.tmp)] == [image_id]


def reapers(tmp: Path) -> list[int]:
    """The pids of the reapers (lazyfs/tree/tree_release.py) of this test's node."""
    found = []
    for entry in os.scandir("/proc"):
        try:
            argv = Path(entry.path, "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"lazyfs.tree.tree_release" in argv and any(str(tmp).encode() in a for a in argv):
            found.append(int(entry.name))
    return found


def started_reapers(tmp: Path, timeout: float = 5.0) -> list[int]:
    """The reapers once one has been started: lazyfs-run-wait forks its reaper and exits
    without waiting, so `lazyfs run` can return before the child has exec'd the reaper's
    shell (until then its argv is lazyfs-run-wait's; CI saw none at that moment once)."""
    deadline = time.monotonic() + timeout
    while not (found := reapers(tmp)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return found


def assert_detached(pids: list[int]) -> None:
    """Each reaper is the leader of a session of its own, on /dev/null, and holds no other
    descriptor: one of the tree's lock or of a run slot would hold it for `linger`.

    A match that is not a session leader can only be the reaper shell's child between its
    fork and its exec of `sleep` (its argv still the shell's; seen once in a fresh-clone
    suite): it must be in a reaper's session. That child, caught while the loader maps
    `sleep`'s libraries, has one of them open for a moment (libc.so.6 as fd 3, seen once
    in session 55's fresh-clone suite): a descriptor held for `linger` is still there a
    second later, the loader's is not."""
    assert pids
    detached = dict.fromkeys((0, 1, 2), "/dev/null")
    for pid in pids:
        deadline = time.monotonic() + 1.0
        while (fds := _fds(pid)) != detached and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fds == detached, fds
        assert os.getsid(pid) == pid or os.getsid(pid) in pids
    assert any(os.getsid(pid) == pid for pid in pids)


def _fds(pid: int) -> dict[int, str]:
    return {int(fd): os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}


def _cli_imports(node, *options: str) -> set[str]:
    """The modules one `lazyfs run OPTIONS py -- true` imports (PYTHONPROFILEIMPORTTIME);
    fails unless exactly one interpreter ran."""
    proc = subprocess.run(
        [LAZYFS, "run", *options, "py", "--", "true"],
        env={**node.env, "PYTHONPROFILEIMPORTTIME": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    processes: list[set[str]] = []  # each interpreter's imports
    for line in proc.stderr.splitlines():
        if "imported package" in line:
            processes.append(set())
        elif line.startswith("import time:"):
            processes[-1].add(line.rsplit("|", 1)[-1].strip())
    (cli,) = processes
    assert "lazyfs.sandbox.run" in cli
    return cli


def test_a_warm_run_imports_only_what_it_uses(node) -> None:
    """What `lazyfs run` imports is on the user's clock in every run: a warm `-- true`
    with the image lingering took ~120 ms, ~45 of it imports. The CLI needs no logging,
    dataclasses, tempfile or zstandard for a tree that is there, nor the manifest
    (sqlite3) once the image's config is in the node cache, nor subprocess to start the
    runtime; and no Python finisher runs after the command (lazyfs-run-wait tears down
    and starts the tree's reaper itself)."""
    node("true", options=("--linger", "1"))  # mounts the tree and caches the manifest
    unused = {"logging", "dataclasses", "inspect", "tempfile", "zstandard", "sqlite3", "subprocess"}
    assert _cli_imports(node, "--linger", "1") & unused == set()


def test_a_cold_run_imports_only_what_it_uses(node) -> None:
    """A run that mounts the image's tree (a new node here) fetches and opens its
    manifest (zstandard, sqlite3, tempfile), but needs no logging, subprocess or
    dataclasses (inspect, ast, dis, tokenize) to mount an EROFS tree: they were ~14 ms
    of its imports, read from a cold disk (docs/design-changes.md, session 38)."""
    cli = _cli_imports(node)
    assert "chunker.manifest" in cli  # it did fetch the manifest: the run was cold
    assert cli & {"logging", "subprocess", "dataclasses", "inspect"} == set()


def test_bad_input(node) -> None:
    env = node.env
    proc = subprocess.run(
        [LAZYFS, "run", "no-such-image", "--", "true"], env=env, capture_output=True, text=True
    )
    assert proc.returncode != 0 and proc.stderr.count("\n") == 1 and "no-such-image" in proc.stderr
    proc = subprocess.run([LAZYFS, "run", "py"], env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and proc.stderr.count("\n") == 1
    proc = subprocess.run(
        [LAZYFS, "run", "--linger", "-1", "py", "--", "true"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and proc.stderr.count("\n") == 1 and "--linger" in proc.stderr
    proc = subprocess.run(
        [LAZYFS, "run", "py", "--", "true"],
        env={**env, "LAZYFS_CGROUP_PARENT": "../escape"},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "LAZYFS_CGROUP_PARENT" in proc.stderr
