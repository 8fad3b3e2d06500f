"""`lazyfs run`'s last step, after its command ended: the OOM message, the sandbox's
delete, the tree's release (with --linger), and the command's exit status.

`finish()` is the one way a `lazyfs run` ends, whether it waited as lazyfs-run-wait
(lazyfs/sandbox/run_wait.c, which execs `python -m lazyfs.sandbox.run_finish SPEC STATUS`
in the same process: SPEC is the JSON `spec()` wrote, STATUS the result the waiter saw) or stayed in
Python because a signal came before the command started (lazyfs/sandbox/run.py). The
sandbox and the tree hold come as the descriptors of their lock files, inherited through
the execs, so until this ends a cleaner sees them held, as while the CLI lived.

A finisher of a burst lives ~0.1 s: it imports only what the delete and the release need.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from lazyfs.errors import as_one_line

if TYPE_CHECKING:
    from lazyfs.sandbox.runtime import Sandbox
    from lazyfs.tree.image_mounts import TreeHold


def spec(box: Sandbox, held: TreeHold, linger: float, memory: int | None) -> str:
    """What the finisher needs, as its first argument."""
    return json.dumps(
        {
            "box": box.id,
            "runtime": box.runtime,
            "host": box.host.as_json(),
            "lock_fd": box.lock_fd,
            "tree": str(held.path),
            "tree_lock_fd": held.lock_fd,
            "linger": linger,
            "memory": memory,
        }
    )


def finish(box: Sandbox, held: TreeHold, status: int, linger: float, memory: int | None) -> int:
    """Report an OOM kill, delete the sandbox, release the tree; the run's exit status."""
    try:
        try:
            if box.oom_kills() and memory is not None:
                print(
                    f"lazyfs: the sandbox ran out of memory (--memory {memory / 2**20:g} MiB)"
                    " and was killed",
                    file=sys.stderr,
                )
                status = 137
        finally:
            box.delete()
    finally:
        held.release(linger)
    return status


def main(argv: list[str]) -> int:
    return as_one_line(lambda: _finish_spec(argv))


def _finish_spec(argv: list[str]) -> int:
    from chunker.errors import BadInputError
    from lazyfs.sandbox.runtime import Sandbox, SandboxHost
    from lazyfs.tree.image_mounts import TreeHold

    try:
        what, status = json.loads(argv[0]), int(argv[1])
        host = SandboxHost.from_json(what["host"])
        box = Sandbox.adopt(what["box"], what["runtime"], host, what["lock_fd"], status)
        held = TreeHold.adopt(Path(what["tree"]), what["tree_lock_fd"])
        linger, memory = what["linger"], what["memory"]
    except (IndexError, ValueError, KeyError, TypeError):
        raise BadInputError(
            "usage: python -m lazyfs.sandbox.run_finish SPEC STATUS (lazyfs run's own);"
            f" got {argv!r}"
        ) from None
    return finish(box, held, status, linger, memory)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
