"""The descriptors a detached child must not inherit.

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
