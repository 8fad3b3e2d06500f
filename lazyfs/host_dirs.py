"""The node's private directories: 0700, so that a local user who is not root reaches
nothing in them (issue 20, finding 3: through a sandbox's rootfs or upper dir, or an image
tree, a setuid copy of python3 made in a sandbox let `nobody` read /etc/shadow).

The run directory and its trees (image mounts: RUN_DIR/images and
each key's directory in it, lazyfs/tree/image_mounts.py; the data daemon's mount, the
runtime's state, the agent's records) are made 0700 where they are made, and
tightened to it at the agent's start and before each `lazyfs run` (installs from before
this were 0755). Their parents (/var/lib/lazyfs, /run) stay as they are: they hold
nothing. Both settings must name directories of lazyfs's own: a sticky one (/tmp) is
refused rather than shut to every other user.

The sandbox directory is 0711: others may pass through it, not list it, as through
dockerd's root. A sandbox with a user namespace of its own walks to its root as an
unprivileged id (lazyfs/sandbox/userns.py). What it holds is no one else's: each sandbox's
own directory is its writable layer's tmpfs, mounted mode=0700 (owned by root, or by the
sandbox's id range; lazyfs/sandbox/runtime.py), under a random name; the lock files are
0600.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from chunker.errors import BadInputError
from lazyfs.settings import Settings

PRIVATE = 0o700
SEARCH_ONLY = 0o711  # the sandbox directory's (see the top)
RUN_DIR_TREES = ("images", "data", "oci", "agent")


def private_dir(path: Path, setting: str | None = None, private: int = PRIVATE) -> Path:
    """`path`, a directory of mode `private` (made, with its parents, if missing; set to
    it if it is anything else). `setting` names the variable that chose it: a sticky
    directory (/tmp, /var/tmp: shared by convention) is then refused rather than shut."""
    path.mkdir(mode=private, parents=True, exist_ok=True)
    mode = path.stat().st_mode
    if setting is not None and mode & stat.S_ISVTX:
        raise BadInputError(
            f"{setting}={path} is a shared directory (sticky); lazyfs makes its directory"
            " 0700, so give it one of its own (e.g. a subdirectory)"
        )
    if stat.S_IMODE(mode) != private:
        os.chmod(path, private)
    return path


def secure_node_dirs(settings: Settings) -> None:
    """Make or tighten the node's private directories (a few stat calls when they are
    right already)."""
    private_dir(settings.sandbox_dir, "LAZYFS_SANDBOX_DIR", SEARCH_ONLY)
    run_dir = private_dir(settings.run_dir, "LAZYFS_RUN_DIR")
    for name in RUN_DIR_TREES:
        private_dir(run_dir / name)
