"""A sandbox with a user namespace of its own (`lazyfs run --userns`,
lazyfs/sandbox/userns.py): root in it is a range of unprivileged host ids, the namespace
is owned by that range, and the kernel counts what the sandbox holds against the range,
not against the host's root (docs/security.md, finding 20 and "What is left"). The
boundary suites (tests/lazyfs/test_sandbox_security.py, test_sandbox_limits.py,
test_sandbox_names.py) run on such sandboxes too (their `run-userns` cases); these tests
are what only they have.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import resource
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from lazyfs.sandbox.userns import FIRST_ID, IDS
from testbed.node import Node
from testbed.processes import wait_until

NS_GET_OWNER_UID = 0xB704  # ioctl on a user namespace's descriptor (linux/nsfs.h)
INOTIFY_INSTANCES = Path("/proc/sys/fs/inotify/max_user_instances")
KERNEL_DEFAULT_INSTANCES = 128
LIBC = ctypes.CDLL(None, use_errno=True)


@contextmanager
def _running(node: Node, script: str) -> Iterator[Path]:
    """A sandbox running `script` (sh) until the test is done with it: its directory."""
    proc = node.popen("sh", "-c", script)
    try:
        (box,) = node.wait_for_sandbox()
        yield box
    finally:
        proc.terminate()
        proc.communicate(timeout=60)


def _ids(pid: int) -> tuple[list[str], list[str]]:
    """A process's real, effective, saved and fs uids and gids, as the host sees them."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    uid = next(line for line in lines if line.startswith("Uid:")).split()[1:]
    gid = next(line for line in lines if line.startswith("Gid:")).split()[1:]
    return uid, gid


def _owner(pid: int) -> int:
    """The host uid that owns a process's user namespace."""
    fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY)
    try:
        buf = bytearray(4)
        fcntl.ioctl(fd, NS_GET_OWNER_UID, buf)
        return int.from_bytes(buf, "little")
    finally:
        os.close(fd)


def _sandbox_pid(box: Path) -> int:
    return int((box / "init.pid").read_text())


def test_root_in_the_sandbox_is_an_id_range_of_its_own_on_the_host(userns_node: Node) -> None:
    """The sandbox's processes are the range's base on the host, in a namespace the base
    owns; inside, they are root. Two sandboxes at once have ranges apart."""
    script = "echo $(id -u) $(id -g) > /tmp/ids && sleep 60"
    with _running(userns_node, script) as box:
        pid = _sandbox_pid(box)
        wait_until(lambda: (box / "upper" / "tmp" / "ids").exists(), 30, "the sandbox's ids")
        assert (box / "upper" / "tmp" / "ids").read_text() == "0 0\n"
        uid, gid = _ids(pid)
        base = int(uid[0])
        assert base >= FIRST_ID and (base - FIRST_ID) % IDS == 0, uid
        assert uid == [str(base)] * 4 and gid == [str(base)] * 4, (uid, gid)
        assert Path(f"/proc/{pid}/uid_map").read_text().split() == ["0", str(base), str(IDS)]
        assert _owner(pid) == base  # not root: its counters are the range's (see the top)
        with _running(userns_node, "sleep 60") as other:
            (other,) = [b for b in userns_node.wait_for_sandbox(2) if b != box]
            other_base = int(_ids(_sandbox_pid(other))[0][0])
            assert abs(other_base - base) >= IDS, (base, other_base)


def test_its_files_are_the_ranges_on_the_host_and_the_images_inside(userns_node: Node) -> None:
    """The image's files are owned inside as in the image, root writes /etc, and what the
    sandbox makes (a setuid-root copy of sh included) is the range's on the host, never
    root's: a local user running that copy gets the range's base at most."""
    script = (
        "stat -c '%u:%g' /etc/passwd /usr/bin > /tmp/image"
        " && echo x >> /etc/passwd"
        " && cp /bin/sh /tmp/sh && chmod u+s /tmp/sh"
        " && touch /tmp/user && chown 1000:1000 /tmp/user"
        " && touch /tmp/done && sleep 60"
    )
    with _running(userns_node, script) as box:
        upper = box / "upper"
        wait_until(lambda: (upper / "tmp" / "done").exists(), 30, "the sandbox's files")
        base = int(_ids(_sandbox_pid(box))[0][0])
        assert (upper / "tmp" / "image").read_text().split() == ["0:0", "0:0"]
        for path, uid in (("etc/passwd", 0), ("tmp/sh", 0), ("tmp/user", 1000)):
            st = (upper / path).stat()
            assert (st.st_uid, st.st_gid) == (base + uid, base + uid), path
        assert (upper / "tmp" / "sh").stat().st_mode & 0o4000  # setuid, of the base


@pytest.mark.parametrize("node", ["userns_node", "sandbox_node"], ids=["userns", "host-root"])
def test_inotify_instances_are_the_sandboxs_own(request: pytest.FixtureRequest, node: str) -> None:
    """At the kernel's default of 128 inotify instances per user, a sandbox takes all it
    can. With a user namespace of its own that is 128 of its range's, and the host's root
    still makes one; without, they were root's (the control: the host is refused)."""
    sandboxes: Node = request.getfixturevalue(node)
    script = (
        "while [ ! -e /tmp/go ]; do sleep 0.05; done;"
        " python3 -c 'import ctypes, os, time; l = ctypes.CDLL(None);"
        " fds = [l.inotify_init() for _ in range(1000)];"
        ' n = sum(fd >= 0 for fd in fds); open("/tmp/n.tmp", "w").write(str(n));'
        ' os.rename("/tmp/n.tmp", "/tmp/n"); time.sleep(600)\''
    )
    before = INOTIFY_INSTANCES.read_text()
    try:
        with _running(sandboxes, script) as box:
            # `lazyfs run` raised the limit as it started (finding 20): the kernel's
            # default again, as on a node that keeps it.
            INOTIFY_INSTANCES.write_text(str(KERNEL_DEFAULT_INSTANCES))
            (box / "rootfs" / "tmp" / "go").write_text("")  # through its overlay
            held = box / "rootfs" / "tmp" / "n"
            wait_until(held.exists, 30, "the sandbox's inotify instances")
            taken = int(held.read_text())
            fd = LIBC.inotify_init()  # the host's root
            if fd >= 0:
                os.close(fd)
    finally:
        INOTIFY_INSTANCES.write_text(before)
    if node == "userns_node":
        assert taken == KERNEL_DEFAULT_INSTANCES and fd >= 0, (taken, fd)
    else:
        assert fd < 0, (taken, fd)


def test_a_sandbox_directory_its_range_cannot_reach_is_one_clear_line(
    sandbox_node: Node,
) -> None:
    """pytest's tmp directories are 0700: the runtime's init, the range's base, could not
    walk to the sandbox's root, and lazyfs says which directory shuts it out."""
    proc = sandbox_node.run("true", options=("--userns",))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert "LAZYFS_SANDBOX_DIR" in lines[0] and "does not let other users through" in lines[0]


def test_trees_that_take_no_id_map_are_one_clear_line(userns_node: Node) -> None:
    """The per-image FUSE trees take no idmap (pyfuse3 does not announce it)."""
    userns_node.env["LAZYFS_TREE"] = "fuse"
    userns_node.env["LAZYFS_DAEMON_IDLE"] = "0.2"
    proc = userns_node.run("true")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert "cannot map ids" in lines[0], lines


def test_a_hard_limit_above_the_nodes_is_refused(userns_node: Node) -> None:
    """Its limits are set by an id of its range, which can lower a hard limit but never
    raise it: one above the node's own is refused up front, whatever the node's root may."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    proc = userns_node.run("true", options=("--ulimit", f"nofile=64:{hard + 1}"))
    assert proc.returncode != 0 and "cannot have more" in proc.stderr, proc.stderr
    # Each asked limit set, cpu (RLIMIT_ number 0) and locks (not in Python's resource
    # module) among them.
    asked = ("--ulimit", "nofile=64:128", "--ulimit", "cpu=100:200", "--ulimit", "locks=5:6")
    script = "ulimit -Sn; ulimit -Hn; ulimit -St; ulimit -Ht; grep locks /proc/self/limits"
    out = userns_node.ok("sh", "-c", script, options=asked).split()
    assert out[:4] == ["64", "128", "100", "200"] and out[-3:-1] == ["5", "6"], out
