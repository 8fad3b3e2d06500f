"""`lazyfs run`: one command in a fresh sandbox of an image, on an OCI runtime.

The image's trees are mounted at most once per node and shared by every concurrent
sandbox that stands on them (lazyfs/tree/image_mounts.py, `ImageMounts.hold`): its layer
trees, when its ref names them (`lazyfs convert` publishes them by default; images on one
base then share the base's trees, their page cache and their metadata), else its merged
tree (an image named by its id, one converted with --no-layer-trees, or one with more
layers than a sandbox's overlay options can list). The sandbox itself (a private overlay
on those trees, the runtime's container, its cgroup) is lazyfs/sandbox/runtime.py's
`Sandbox`, deleted when the command ends, whatever the exit status. While the command
runs, the process is not Python but lazyfs-run-wait (lazyfs/sandbox/run_wait.py says why and how).

On a node whose data daemon is not up (a cold node), its start is the longest step before
the mount: two Python processes, ~0.28 s from a cold page cache. So run() starts it first,
and imports what the rest needs (the store, the manifest, the runtime: ~70 ms warm, more
cold) while it comes up (docs/design-changes.md, session 18).
"""

from __future__ import annotations

import sys
from pathlib import Path

from chunker.errors import BadInputError
from lazyfs.host_dirs import secure_node_dirs
from lazyfs.sandbox.confinement import DEFAULT_CONFINEMENT, Confinement
from lazyfs.sandbox.run_wait import waiter_path
from lazyfs.settings import Settings
from lazyfs.tree.image_mounts import ImageMounts

TYPE_CHECKING = False
if TYPE_CHECKING:
    from lazyfs.sandbox.names import SandboxNames
    from lazyfs.sandbox.oci_spec import Limits
    from lazyfs.sandbox.tmpfs import Tmpfs


def run(
    image: str,
    command: list[str],
    store_url: str,
    cache_dir: Path,
    linger: float = 0.0,
    *,
    limits: Limits | None = None,
    env: list[str] | None = None,
    cwd: str | None = None,
    network: bool = False,
    tmpfs: tuple[Tmpfs, ...] = (),
    confinement: Confinement = DEFAULT_CONFINEMENT,
    names: SandboxNames | None = None,  # its hostname and /etc/hosts' extra hosts (names.py)
    userns: bool = False,  # a user namespace of its own (lazyfs/sandbox/userns.py)
    runtime: str,  # the OCI runtime binary (the CLI's --runtime)
    settings: Settings,
) -> int:
    """Run COMMAND in a fresh sandbox of IMAGE on an OCI runtime, with this process's
    stdio; the image stays mounted `linger` seconds after its last sandbox, for the next.

    Once the command runs, this process becomes lazyfs-run-wait (this does not return):
    it waits for the command, then deletes the sandbox, releases the tree and exits with
    the command's status (lazyfs/sandbox/run_finish.py, lazyfs/sandbox/run_wait.py).
    Returns that status only if SIGTERM, SIGINT or SIGHUP came before the command
    started (128+signal)."""
    if not command:
        raise BadInputError("lazyfs run needs a command after --")
    waiter = waiter_path(settings)
    secure_node_dirs(settings)  # 0700 (lazyfs/host_dirs.py)
    mounts = ImageMounts(store_url, cache_dir, settings)
    starting = mounts.start_data_daemon_soon()  # meanwhile: imports, image and manifest

    from chunker.refs import lookup_ref, resolve_id
    from chunker.store.backends import open_store
    from lazyfs.sandbox.limits import cap_sandboxes
    from lazyfs.sandbox.oci_spec import Limits
    from lazyfs.sandbox.overlay import lower_trees_that_fit
    from lazyfs.sandbox.process import root_of
    from lazyfs.sandbox.run_finish import command as finisher_command
    from lazyfs.sandbox.run_finish import finish, release_all, spec
    from lazyfs.sandbox.run_wait import exec_waiter
    from lazyfs.sandbox.runtime import (
        RuntimeFailed,
        Sandbox,
        SandboxHost,
        SandboxRequest,
        cleanup_stale,
        find_runtime,
    )
    from lazyfs.sandbox.shared_counters import raise_shared_counters
    from lazyfs.tree.node_files import cached_config

    host = SandboxHost.of(settings)
    find_runtime(runtime)  # before mounting a tree
    cap_sandboxes(settings)  # all sandboxes together leave the node its reserve
    if left := raise_shared_counters():  # what one sandbox could take from the host
        print(f"lazyfs run: warning: shared with the host: {', '.join(left)}", file=sys.stderr)
    cleanup_stale(host)  # what a killed `lazyfs run` left: it may still hold an image mount
    store = open_store(store_url)
    found = lookup_ref(store, image)
    if found is not None and found[1] is not None:  # its ref names its layer trees
        image_id, config, trees = found[0], found[1].config, found[1].layers[::-1]
    else:
        image_id = found[0] if found is not None else resolve_id(store, image)
        config, trees = cached_config(store, image_id, cache_dir), []
    if not trees or len(trees) > lower_trees_that_fit(mounts.trees_dir):
        trees = [image_id]  # its merged tree
    limits = limits or Limits()
    request = SandboxRequest(
        config,
        command,
        env or [],
        cwd,
        limits,
        network,
        runtime,
        tmpfs=tmpfs,
        confinement=confinement,
        **({"names": names} if names is not None else {}),
        userns=userns,
    )
    holds = []
    try:
        for tree in trees:  # top first, as the overlay stacks them
            holds.append(mounts.hold(tree))
        if starting is not None:
            starting.join()  # done by now: the mount waited for the daemon's start
        box = Sandbox.prepare(root_of([h.path for h in holds]), request, host)
    except BaseException:
        release_all(holds, linger)
        raise
    try:
        got = box.start_foreground()
    except BaseException:
        finish(box, holds, 0, linger, None)
        raise
    if got is not None:
        return finish(box, holds, 128 + got, linger, limits.memory)
    assert box.pid is not None and box.lock_fd is not None
    fields = spec(box, holds, linger, limits.memory)
    try:
        exec_waiter(
            waiter,
            settings.run_dir,
            settings.run_slots,
            box.pid,
            fields,
            finisher_command(),
            [box.lock_fd, *(h.lock_fd for h in holds if h.lock_fd is not None)],
        )
    except OSError as exc:
        box.kill()
        finish(box, holds, 1, linger, None)
        raise RuntimeFailed(f"cannot run {waiter}: {exc.strerror or exc}") from None
    raise AssertionError("unreachable")
