"""Descriptors: how many a resident process may hold, and which a detached child must not
inherit.

The resident processes (the node agent, the data daemon, the snapshotter, the gateway)
hold descriptors per sandbox, image or connection, and the usual soft limit is 1,024
(a login shell's, systemd's for a service that does not set LimitNOFILE, as our units in
contrib/systemd do): `raise_open_files_limit` lifts it to the hard limit at their start.

Every process lazyfs starts to outlive its starter (a FUSE daemon:
lazyfs/tree/daemon_start.py; a linger reaper: lazyfs/tree/tree_release.py) is started
with them closed: one of a `lazyfs run` slot (lazyfs/sandbox/run_wait.py) or of a tree's
lock would otherwise stay held for the child's whole life. Only `os`: both starters run
where imports cost (a node's cold start, `lazyfs run`'s finisher)."""

from __future__ import annotations

import os


def inheritable_fds() -> list[int]:
    """This process's descriptors above 2 that a child would inherit (Python opens its
    own non-inheritable: PEP 446)."""
    fds: list[int] = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if fd > 2 and os.get_inheritable(fd):
                fds.append(fd)
        except OSError:
            pass  # the listing's own descriptor, closed by now
    return fds


def raise_open_files_limit() -> None:
    """Lift this process's soft limit on descriptors to its hard limit (see the top). The
    agent holds ~1 per sandbox (its lock) and 1 per image held, the data daemon 3 per
    image in use (data_daemon.py, close_idle_devices): under 1,024 a node ran out before
    1,000 sandboxes. A sandbox's own processes get the limits its spec sets."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
