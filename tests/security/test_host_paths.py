"""A local user of the node becomes root through a sandbox's files (issue 20, finding 3),
and host root opens a device node a sandbox made (finding 1, the mount part).

Attack: as root in a sandbox, copy python3 to /tmp/sp, `chmod u+s` it and make a device
node; then, on the host, as `nobody`, run the copy through the host paths of the
sandbox's rootfs and upper dir (it printed /etc/shadow before), and as root open the
device node there. Also a setuid file shipped in the image, through the image tree.

Now: the sandbox dir, each sandbox's dir and the run dir's trees are 0700 (nobody gets
EACCES), and the overlay, the writable layer and the image trees are mounted
nosuid,nodev: a setuid file run through them keeps the caller's euid even when reached
through an open descriptor, and the device node cannot be opened, not even by root. The
probe that runs a setuid file is shown to work where setuid is honoured (the test's own
tmp dir), so it cannot pass by testing nothing.
"""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import time
from pathlib import Path

import pytest

from lazyfs.mount_table import entries
from testbed.agent import AgentProcess
from testbed.node import Node, searchable

# setpriv execs its command while it still holds root's capabilities (they go with the
# exec): env, exec'd by it, is `nobody` without any, and looks the path up as one.
NOBODY = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "env", "--"]
MAKE = "cp /usr/bin/python3 /tmp/sp && chmod u+s /tmp/sp && mknod /tmp/null c 1 3"
SHADOW = "print(open('/etc/shadow').read()[:12])"
EUID = "import os; print(os.geteuid())"


def _wait_for(path: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def _mount_options(point: Path) -> set[str]:
    """The per-mount options of the mount at `point` (the newest one there)."""
    found: set[str] = set()
    for m in entries():
        if m.point == str(point):
            found = set(m.options.split(","))
    assert found, f"nothing is mounted at {point}"
    return found


def _nobody_runs(path: Path, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*NOBODY, str(path), "-c", code], capture_output=True, text=True)


def _euid_through_fd(path: Path) -> str:
    """The euid a setuid file gives `nobody` who execs it through a descriptor that root
    opened (so no directory's mode is in the way: only the mount's nosuid)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        proc = subprocess.run(
            [*NOBODY, f"/proc/self/fd/{fd}", "-c", EUID],
            capture_output=True,
            text=True,
            pass_fds=(fd,),
        )
    finally:
        os.close(fd)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def _setuid_probe_works(tmp: Path) -> None:
    """A setuid-root copy of the sandbox's python3 on a mount that honours setuid gives
    `nobody` euid 0 through the same probe."""
    control = tmp / "setuid-control"
    control.mkdir()
    copy = control / "sp"
    copy.write_bytes(Path("/usr/bin/python3").read_bytes())
    os.chmod(copy, 0o4755)
    assert _euid_through_fd(copy) == "0"


def _assert_private(*dirs: Path) -> None:
    for d in dirs:
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, f"{d} is {oct(d.stat().st_mode)}"


def _assert_search_only(sandboxes: Path) -> None:
    """The sandbox directory lets others through to what they cannot open (each
    sandbox's own directory is 0700) and list nothing (lazyfs/host_dirs.py)."""
    assert stat.S_IMODE(sandboxes.stat().st_mode) == 0o711, oct(sandboxes.stat().st_mode)
    proc = subprocess.run([*NOBODY, "ls", str(sandboxes)], capture_output=True, text=True)
    assert proc.returncode != 0 and "Permission denied" in proc.stderr, proc


def _assert_sandbox_files_refused(box: Path) -> None:
    """Every way from the host into the sandbox's setuid copy and device node fails."""
    for layer in ("rootfs", "upper"):
        sp, null = box / layer / "tmp" / "sp", box / layer / "tmp" / "null"
        assert sp.stat().st_mode & stat.S_ISUID and stat.S_ISCHR(null.stat().st_mode)
        proc = _nobody_runs(sp, SHADOW)
        assert proc.returncode != 0 and "Permission denied" in proc.stderr, proc
        assert "Traceback" not in proc.stderr, proc  # not even started: the path is shut
        assert _euid_through_fd(sp) == "65534", layer  # nosuid: not root
        with pytest.raises(PermissionError):  # nodev, even for root
            open(null, "rb").close()
    assert {"nosuid", "nodev"} <= _mount_options(box / "rootfs")  # the overlay
    assert {"nosuid", "nodev"} <= _mount_options(box)  # the writable layer (upper/)


def _assert_image_tree_refused(run_dir: Path) -> None:
    """The image's own setuid files (the python image has su, passwd, mount, ...)."""
    (keyed,) = [p for p in (run_dir / "images").iterdir() if p.is_dir()]  # its cache+store
    _assert_private(keyed)
    trees = [p for p in keyed.iterdir() if p.is_dir()]  # merged, or the layer trees
    assert trees and all({"nosuid", "nodev"} <= _mount_options(tree) for tree in trees)
    shipped = [
        p
        for tree in trees
        if (tree / "usr" / "bin").is_dir()
        for p in (tree / "usr" / "bin").iterdir()
        if p.stat().st_mode & stat.S_ISUID
    ]
    assert shipped, "the image has no setuid file to try"
    proc = subprocess.run([*NOBODY, str(shipped[0]), "--help"], capture_output=True, text=True)
    assert proc.returncode != 0 and "Permission denied" in proc.stderr, proc


@pytest.mark.parametrize("tree", ["erofs", "fuse"])
def test_sandbox_files_give_a_local_user_nothing_through_lazyfs_run(
    sandbox_node: Node, tree: str
) -> None:
    _setuid_probe_works(sandbox_node.tmp)
    sandbox_node.env["LAZYFS_TREE"] = tree
    sandbox_node.env["LAZYFS_DAEMON_IDLE"] = "0.2"  # gone before the node is checked clean
    proc = sandbox_node.popen("sh", "-c", f"{MAKE} && sleep 60")
    stack = contextlib.ExitStack()
    try:
        (box,) = sandbox_node.wait_for_sandbox()
        _wait_for(box / "upper" / "tmp" / "null")
        stack.enter_context(searchable(sandbox_node.tmp))
        _assert_sandbox_files_refused(box)
        _assert_image_tree_refused(sandbox_node.tmp / "run")
        _assert_search_only(sandbox_node.sandboxes)
        _assert_private(box, sandbox_node.tmp / "run")
        _assert_private(*(sandbox_node.tmp / "run" / d for d in ("images", "data", "oci")))
    finally:
        stack.close()
        proc.terminate()
        proc.communicate(timeout=60)


def test_sandbox_files_give_a_local_user_nothing_through_the_agent(agent: AgentProcess) -> None:
    node = agent.node
    _setuid_probe_works(node.tmp)
    agent.start()
    with agent.client() as c, searchable(node.tmp):
        box = c.create("py")
        result = box.exec(["sh", "-c", MAKE])
        assert result.exit_code == 0, result.stderr
        box_dir = node.sandboxes / box.id
        run = node.tmp / "run"
        _assert_sandbox_files_refused(box_dir)
        _assert_image_tree_refused(run)
        _assert_search_only(node.sandboxes)
        _assert_private(box_dir, run, run / "images", run / "agent")
        _assert_private(run / "agent" / "sandboxes")  # the records
        box.delete()


def test_existing_loose_directories_are_tightened(sandbox_node: Node) -> None:
    """An install from before: its sandbox and run dirs were 0755."""
    sandbox_node.env["LAZYFS_DAEMON_IDLE"] = "0.2"
    for d in (sandbox_node.sandboxes, sandbox_node.tmp / "run" / "images"):
        d.mkdir(parents=True)
        os.chmod(d, 0o755)
    os.chmod(sandbox_node.tmp / "run", 0o755)
    sandbox_node.ok("true")
    assert stat.S_IMODE(sandbox_node.sandboxes.stat().st_mode) == 0o711
    _assert_private(sandbox_node.tmp / "run")
    _assert_private(sandbox_node.tmp / "run" / "images")


def test_a_shared_directory_is_refused_not_shut(sandbox_node: Node) -> None:
    """LAZYFS_SANDBOX_DIR pointed at a sticky (shared) directory: lazyfs says so in one
    line instead of making it 0700 for everyone else."""
    shared = sandbox_node.tmp / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    sandbox_node.env["LAZYFS_SANDBOX_DIR"] = str(shared)
    proc = sandbox_node.run("true")
    assert proc.returncode != 0 and "shared directory (sticky)" in proc.stderr, proc
    assert len(proc.stderr.splitlines()) == 1
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
