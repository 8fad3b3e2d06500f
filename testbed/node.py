"""A private node for sandboxes, and the check that it is left clean.

A `Node` is a scratch directory with its own cache, run and sandbox directories and a
cgroup parent of its own. `leftovers()` says what its sandboxes left (processes in its
cgroups, runtime state, overlay and FUSE mounts, upper directories) and `scrub()` removes
it. The `sandbox_node` fixture (tests/lazyfs/conftest.py) gives each test one over the
python test image, and fails the test if anything was left.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from testbed.mounts import mounts_below
from testbed.nodecheck import cgroup_parents, leftovers, processes_mentioning, sandbox_cgroups

LAZYFS = str(Path(sys.executable).parent / "lazyfs")


def convert(layout_ref: str, name: str, store: Path, *extra: str) -> None:
    subprocess.run(
        [LAZYFS, "convert", layout_ref, "--name", name, "--store", f"file://{store}", *extra],
        check=True,
        capture_output=True,
    )


@dataclass
class Node:
    """A private node; its sandboxes' cgroups go under a cgroup parent of its own, so
    that the checks and the scrub below see this node's sandboxes only, never those of
    another test run (or anything else) on the machine."""

    tmp: Path
    env: dict[str, str]
    options: tuple[str, ...] = ()  # `lazyfs run`'s flags for every sandbox, e.g. --userns
    # What the boundary suites need to know of `lazyfs run`'s sandboxes (beside
    # testbed/agent_boundary.py's): tini is their init, the one task beside a command,
    # and `lazyfs run` says when the memory cgroup killed the command.
    init_path: ClassVar[str] = "/dev/init"
    tasks_beside_command: ClassVar[int] = 1
    says_oom: ClassVar[bool] = True

    def __post_init__(self) -> None:
        self.env = {**self.env, "LAZYFS_CGROUP_PARENT": self.cgroup_parent}

    @property
    def own_user_namespace(self) -> bool:
        """Whether its sandboxes each have a user namespace (`lazyfs run --userns`)."""
        return "--userns" in self.options

    @property
    def cgroup_parent(self) -> str:
        return f"lazyfs-test-{hashlib.sha1(str(self.tmp).encode()).hexdigest()[:12]}"

    @property
    def sandboxes(self) -> Path:
        return self.tmp / "sandboxes"

    def run(
        self,
        *command: str,
        options: tuple[str, ...] = (),
        image: str = "py",
        stdin: str | None = None,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [LAZYFS, "run", *self.options, *options, image, "--", *command],
            env=self.env,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def ok(self, *command: str, options: tuple[str, ...] = ()) -> str:
        proc = self.run(*command, options=options)
        assert proc.returncode == 0, f"{command} exited {proc.returncode}: {proc.stderr}"
        return proc.stdout

    def popen(self, *command: str, options: tuple[str, ...] = ()) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [LAZYFS, "run", *self.options, *options, "py", "--", *command],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def wait_for_sandbox(self, count: int = 1, timeout: float = 30) -> list[Path]:
        """The sandbox directories once `count` of them run their command: the init
        process the runtime recorded has left `runc init` for the container's own."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            boxes = [p for p in self.sandboxes.glob("lazyfs-*") if _started(p)]
            if len(boxes) >= count:
                return boxes
            time.sleep(0.02)
        raise AssertionError("no sandbox started")

    def leftovers(self) -> dict[str, list]:
        """Everything a finished sandbox must not leave behind (testbed/nodecheck.py)."""
        return leftovers(self.tmp, self.sandboxes, self.cgroup_parent)

    def wait_clean(self, timeout: float = 20) -> dict[str, list]:
        """leftovers() once empty, or as they are after `timeout` (a lingering mount's
        reaper needs its linger time)."""
        deadline = time.monotonic() + timeout
        while True:
            left = {k: v for k, v in self.leftovers().items() if v}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.02)  # a look costs ~2 ms; most tests end here, each waiting

    def scrub(self) -> None:
        """Remove what leftovers() reports, by pid, mount point and path."""
        for path in sandbox_cgroups(self.cgroup_parent):
            with contextlib.suppress(OSError):
                for pid in (path / "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
        for pid in processes_mentioning(str(self.tmp)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
        for point in reversed(mounts_below(self.tmp)):
            subprocess.run(["umount", "-l", point], capture_output=True)
        for path in sandbox_cgroups(self.cgroup_parent):
            with contextlib.suppress(OSError):
                path.rmdir()

    def remove_cgroup_parent(self) -> None:
        """The node's own cgroup parent, once its sandboxes' cgroups are gone."""
        for path in cgroup_parents(self.cgroup_parent):
            with contextlib.suppress(OSError):
                path.rmdir()


@contextlib.contextmanager
def private_node(tmp: Path, store: Path, options: tuple[str, ...] = ()) -> Iterator[Node]:
    """A Node in `tmp` (made if missing) over the file:// store at `store`, with its own
    cache, run and sandbox directories. Afterwards whatever a sandbox left is removed,
    then AssertionError if there was anything: a failing test cannot leave the node dirty
    for the next one."""
    tmp.mkdir(exist_ok=True)
    env = {
        **os.environ,
        "LAZYFS_STORE": f"file://{store}",
        "LAZYFS_CACHE": str(tmp / "cache"),
        "LAZYFS_RUN_DIR": str(tmp / "run"),
        "LAZYFS_SANDBOX_DIR": str(tmp / "sandboxes"),
    }
    node = Node(tmp, env, options)
    try:
        yield node
    finally:
        left = node.wait_clean()
        if left:
            node.scrub()
        node.remove_cgroup_parent()
        assert left == {}, f"left behind: {left}"


@contextlib.contextmanager
def searchable(path: Path) -> Iterator[None]:
    """pytest's tmp dirs are 0700, which shuts out every id but root's before the node's
    own directories are tried (a local user, or a sandbox's id range in its own user
    namespace): open the way to `path` (search only, as /var/lib and /run are) for the
    with, and close it again."""
    changed = []
    for d in [path, *path.parents]:
        mode = stat.S_IMODE(d.stat().st_mode)
        if not mode & 0o001:
            os.chmod(d, mode | 0o011)
            changed.append((d, mode))
    try:
        yield
    finally:
        for d, mode in changed:
            os.chmod(d, mode)


def _started(box: Path) -> bool:
    """Whether the sandbox's init has been started (`runtime start`): its process is
    no longer the runtime's (a sandbox whose init is gone already counts as started)."""
    try:
        pid = int((box / "init.pid").read_text())
    except (OSError, ValueError):
        return False  # not created yet, or the file being written
    try:
        return "runc" not in os.readlink(f"/proc/{pid}/exe")
    except FileNotFoundError:
        return True  # it ran and ended
    except OSError:
        return False
