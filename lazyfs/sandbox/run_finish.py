"""`lazyfs run`'s last step, after its command ended: the OOM message, the sandbox's
delete, the tree's release (with --linger), and the command's exit status.

Three ways in, one ending (`_ending`):
- lazyfs-run-wait itself (lazyfs/sandbox/run_teardown.c), once the command ended, in
  the plain case: the same steps in C, without a new interpreter on the user's clock.
- the finisher: for what run_teardown.c leaves to Python (a directory deeper than plain
  files, a FUSE tree, a call that failed and must be reported), the waiter execs
  `command()`'s line plus the fields `spec()` wrote plus STATUS in the same process. It
  starts over; every step is idempotent.
- `finish()`, in the CLI's own process, when a signal came before the command started
  (lazyfs/sandbox/run.py) or starting it failed.

The sandbox and its tree holds (one per tree it stands on: an image's layer trees, or
its merged tree) come as the descriptors of their lock files, inherited through the
execs, so until this ends a cleaner sees them held, as while the CLI lived.

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
    from collections.abc import Callable, Sequence
    from typing import TypeVar

    from lazyfs.sandbox.runtime import Sandbox
    from lazyfs.tree.image_mounts import TreeHold

    T = TypeVar("T")

# The finisher's arguments, in this order, then TREE_FIELDS for each of `trees` trees
# (then the waiter's STATUS); run_teardown.h numbers them the same.
FIELDS = (
    "box",  # the sandbox's id
    "box_dir",  # SANDBOX_DIR/<id>
    "state_dir",  # the runtime's state directory of the sandbox
    "lock_path",  # SANDBOX_DIR/<id>.lock
    "lock_fd",  # the descriptor holding it
    "cgroup_parent",
    "linger",  # seconds, as --linger
    "memory",  # --memory in bytes, or "" for none
    "trees",  # how many trees the sandbox stands on (1 to MAX_TREES)
)
TREE_FIELDS = (
    "tree",  # the tree's mount point
    "tree_lock_path",
    "tree_lock_fd",  # the descriptor holding the tree's lock shared
)
MAX_TREES = 512  # run_teardown.h's


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


def spec(box: Sandbox, holds: Sequence[TreeHold], linger: float, memory: int | None) -> list[str]:
    """The finisher's arguments (FIELDS, then each hold's TREE_FIELDS) for this sandbox
    and its tree holds."""
    assert box.lock_fd is not None and 1 <= len(holds) <= MAX_TREES
    values = {
        "box": box.id,
        "box_dir": str(box.dir),
        "state_dir": str(box.state / box.id),
        "lock_path": str(box.lock_path),
        "lock_fd": str(box.lock_fd),
        "cgroup_parent": box.host.cgroup_parent,
        "linger": repr(float(linger)),
        "memory": "" if memory is None else str(memory),
        "trees": str(len(holds)),
    }
    fields = [values[name] for name in FIELDS]
    for held in holds:
        assert held.lock_fd is not None
        fields += [str(held.path), str(held.lock_path), str(held.lock_fd)]
    return fields


def finish(
    box: Sandbox, holds: Sequence[TreeHold], status: int, linger: float, memory: int | None
) -> int:
    """Report an OOM kill, delete the sandbox, release its trees; the run's exit status."""
    return _ending(status, memory, box.oom_kills, box.delete, lambda: release_all(holds, linger))


def release_all(holds: Sequence[TreeHold], linger: float) -> None:
    """Release every hold, even if one fails (its error raised after)."""
    _each(holds, lambda held: held.release(linger))


def _each(items: Sequence[T], step: Callable[[T], object]) -> None:
    """step(item) for every item, even if one raises (its error raised after the rest)."""
    if items:
        try:
            step(items[0])
        finally:
            _each(items[1:], step)


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
        f = dict(zip(FIELDS, argv, strict=False))
        count, step = int(f.get("trees", "")), len(TREE_FIELDS)
        if not 1 <= count <= MAX_TREES or len(argv) != len(FIELDS) + step * count + 1:
            raise ValueError
        status, lock_fd = int(argv[-1]), int(f["lock_fd"])
        linger, memory = float(f["linger"]), int(f["memory"]) if f["memory"] else None
        rest = argv[len(FIELDS) : -1]
        trees = [(rest[i], rest[i + 1], int(rest[i + 2])) for i in range(0, len(rest), step)]
    except ValueError:
        from chunker.errors import BadInputError

        raise BadInputError(
            f"usage: python -m lazyfs.sandbox.run_finish {' '.join(FIELDS).upper()}"
            f" [{' '.join(TREE_FIELDS).upper()}]... STATUS (lazyfs run's own); got {argv!r}"
        ) from None

    def delete() -> None:
        try:
            remove_sandbox(
                f["box_dir"], f["state_dir"], f["lock_path"], f["cgroup_parent"], f["box"]
            )
        finally:
            os.close(lock_fd)

    def release(tree: tuple[str, str, int]) -> None:
        """The tree released and its descriptor closed."""
        path, lock_path, tree_lock_fd = tree
        try:
            release_tree(tree_lock_fd, lock_path, path, linger)
        finally:
            os.close(tree_lock_fd)

    return _ending(
        status,
        memory,
        lambda: oom_kills(f["cgroup_parent"], f["box"]),
        delete,
        lambda: _each(trees, release),
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
