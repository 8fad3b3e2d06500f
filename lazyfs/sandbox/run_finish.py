"""`lazyfs run`'s last step, after its command ended: the OOM message, the sandbox's
delete, the tree's release (with --linger), and the command's exit status.

Three ways in, one ending (`_ending`):
- lazyfs-run-wait itself (lazyfs/sandbox/run_teardown.c), once the command ended, in
  the plain case: the same steps in C, without a new interpreter on the user's clock.
- the finisher: for what run_teardown.c leaves to Python (a directory deeper than plain
  files, a FUSE tree, a call that failed and must be reported), the waiter execs
  `command()`'s line plus the FIELDs `spec()` wrote plus STATUS in the same process. It
  starts over; every step is idempotent.
- `finish()`, in the CLI's own process, when a signal came before the command started
  (lazyfs/sandbox/run.py) or starting it failed.

The sandbox and the tree hold come as the descriptors of their lock files, inherited
through the execs, so until this ends a cleaner sees them held, as while the CLI lived.

The finisher imports only lazyfs/sandbox/teardown.py and lazyfs/tree/tree_release.py,
which take only what Python starts with (and ctypes, fcntl): the sandbox's delete and
the tree's release, not the runtime's or the manager's modules. Its fields are plain
arguments, not JSON, for the same reason (json imports re), and the C side reads them
as they are. Measured here: docs/design-changes.md.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # typing itself costs the finisher ~14 ms of imports here
if TYPE_CHECKING:
    from collections.abc import Callable

    from lazyfs.sandbox.runtime import Sandbox
    from lazyfs.tree.image_mounts import TreeHold

# The finisher's arguments, in this order (then the waiter's STATUS); run_teardown.h
# numbers them the same.
FIELDS = (
    "box",  # the sandbox's id
    "box_dir",  # SANDBOX_DIR/<id>
    "state_dir",  # the runtime's state directory of the sandbox
    "lock_path",  # SANDBOX_DIR/<id>.lock
    "lock_fd",  # the descriptor holding it
    "cgroup_parent",
    "tree",  # the image tree's mount point
    "tree_lock_path",
    "tree_lock_fd",  # the descriptor holding the tree's lock shared
    "linger",  # seconds, as --linger
    "memory",  # --memory in bytes, or "" for none
)


# The finisher's entry: -c, not `-m lazyfs.sandbox.run_finish` (which works too), as -m
# imports runpy, ~3.5 ms of every run here (session 26). -S: no site, ~2.5 ms of every
# run (its .pth files, session 29); the directory lazyfs is imported from comes as the
# first argument instead. -P: the caller's directory (still ours: relative settings stay
# right) is not on sys.path, so nothing there can pass for lazyfs's modules.
_ENTRY = (
    "import sys; sys.path.insert(0, sys.argv.pop(1))"
    "; from lazyfs.sandbox.run_finish import main; sys.exit(main(sys.argv[1:]))"
)
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def command() -> list[str]:
    """The finisher's command line, without the FIELDs and the STATUS the waiter adds.
    Its program is also the interpreter run_teardown.c starts a reaper on."""
    return [sys.executable, "-S", "-P", "-c", _ENTRY, _ROOT]


def spec(box: Sandbox, held: TreeHold, linger: float, memory: int | None) -> list[str]:
    """The finisher's arguments (FIELDS) for this sandbox and tree hold."""
    assert box.lock_fd is not None and held.lock_fd is not None
    values = {
        "box": box.id,
        "box_dir": str(box.dir),
        "state_dir": str(box.state / box.id),
        "lock_path": str(box.lock_path),
        "lock_fd": str(box.lock_fd),
        "cgroup_parent": box.host.cgroup_parent,
        "tree": str(held.path),
        "tree_lock_path": str(held.lock_path),
        "tree_lock_fd": str(held.lock_fd),
        "linger": repr(float(linger)),
        "memory": "" if memory is None else str(memory),
    }
    return [values[name] for name in FIELDS]


def finish(box: Sandbox, held: TreeHold, status: int, linger: float, memory: int | None) -> int:
    """Report an OOM kill, delete the sandbox, release the tree; the run's exit status."""
    return _ending(status, memory, box.oom_kills, box.delete, lambda: held.release(linger))


def _ending(
    status: int,
    memory: int | None,
    oom_kills: Callable[[], int],
    delete: Callable[[], None],
    release: Callable[[], None],
) -> int:
    try:
        try:
            if oom_kills() and memory is not None:
                print(
                    f"lazyfs: the sandbox ran out of memory (--memory {memory / 2**20:g} MiB)"
                    " and was killed",
                    file=sys.stderr,
                )
                status = 137
        finally:
            delete()
    finally:
        release()
    return status


def main(argv: list[str]) -> int:
    from lazyfs.errors import as_one_line

    return as_one_line(lambda: _finish_fields(argv))


def _finish_fields(argv: list[str]) -> int:
    from lazyfs.sandbox.teardown import oom_kills, remove_sandbox
    from lazyfs.tree.tree_release import release_tree

    try:
        if len(argv) != len(FIELDS) + 1:
            raise ValueError
        f = dict(zip(FIELDS, argv[:-1], strict=True))
        status, lock_fd, tree_lock_fd = int(argv[-1]), int(f["lock_fd"]), int(f["tree_lock_fd"])
        linger, memory = float(f["linger"]), int(f["memory"]) if f["memory"] else None
    except ValueError:
        from chunker.errors import BadInputError

        raise BadInputError(
            f"usage: python -m lazyfs.sandbox.run_finish {' '.join(FIELDS).upper()} STATUS"
            f" (lazyfs run's own); got {argv!r}"
        ) from None

    def delete() -> None:
        try:
            remove_sandbox(
                f["box_dir"], f["state_dir"], f["lock_path"], f["cgroup_parent"], f["box"]
            )
        finally:
            os.close(lock_fd)

    def release() -> None:
        try:
            release_tree(tree_lock_fd, f["tree_lock_path"], f["tree"], linger)
        finally:
            os.close(tree_lock_fd)

    return _ending(status, memory, lambda: oom_kills(f["cgroup_parent"], f["box"]), delete, release)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
