"""The FUSE supervisor: owns the node data daemon's FUSE connection, so that a crash of
the daemon (the pyfuse3 worker) does not take the node's image trees down.

    python -m lazyfs.tree.fuse_supervisor MOUNTPOINT [--lock PATH] [--ready-fd N] WORKER-ARGS...

It opens /dev/fuse and mounts it at MOUNTPOINT itself (root only), then runs the worker,
`python -m lazyfs.tree.data_daemon MOUNTPOINT WORKER-ARGS... --fuse-fd N --lock-fd M`, with
one end of a SOCK_SEQPACKET socketpair as fd N. libfuse (3.14, fuse_session_mount) takes a
mountpoint "/dev/fd/N" as an already-mounted FUSE fd, so the worker's libfuse reads
requests from, and writes replies to, the socket; this process relays them to and from
/dev/fuse, one message per request or reply (SEQPACKET keeps each whole).

It remembers every request that expects a reply (by `unique`) until the reply passes,
the kernel's FUSE_INIT, and how many handles the kernel holds open per node id. When the
worker dies (killed, crashed: any exit but status 0), it starts a new one, gives it the
open handle counts (so its idle exit stays right; they include the handles on the
daemon's hold file, by which the node agent keeps it up: data_daemon.py), feeds it the
recorded FUSE_INIT first (libfuse answers EIO to anything before INIT) and drops that
INIT's reply (the kernel had the first one long ago), then re-sends every request still
in flight. The kernel never notices: readers only stall for the restart; no tree is
remounted. A worker may also exit non-zero on purpose to be replaced this way: the data
daemon does (status 75) when the cache directory it serves from was deleted or replaced.

A worker exiting with status 0 has exited on purpose (idle, with MOUNTPOINT.lock held
exclusively through the descriptor it shares with us, or on SIGTERM): we unmount and
exit. SIGTERM/SIGINT here: stop the worker, unmount, exit.

This process is the one whose death still takes the trees down (closing /dev/fuse
aborts the connection; a watchdog then detaches the dead mount). That is why it is small,
uses the standard library only, and does nothing but copy bytes and keep three tables.

It starts its first worker before anything else, even before it mounts: the worker's
start (a Python process, pyfuse3, the node cache) is most of a cold data daemon's, which
a node's first `lazyfs run` waits for, and this process's own imports and mount then run
beside it. So this module, the entry, imports little (lazyfs/tree/fuse_worker.py), and
the relay (lazyfs/tree/fuse_relay.py) comes after: 15-20 ms sooner on a cold start.
"""

from __future__ import annotations

import os
import sys

from lazyfs.arguments import Parser
from lazyfs.oom import set_oom_score_adj
from lazyfs.tree.fuse_worker import Worker


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m lazyfs.tree.fuse_supervisor")
    p.add_argument("mountpoint")
    p.add_argument("--lock", default=None, help="the worker's idle lock (default MOUNTPOINT.lock)")
    p.add_argument("--ready-fd", type=int, default=None)
    p.add_argument("--worker-module", default="lazyfs.tree.data_daemon")
    args, worker_args = p.parse_known_args(argv)
    point = os.path.abspath(args.mountpoint)
    oom_biased = set_oom_score_adj()  # and the worker's: it serves every sandbox's files
    if args.ready_fd is not None:
        os.set_inheritable(args.ready_fd, False)
    lock_fd = os.open(args.lock or f"{point}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    worker_argv = [sys.executable, "-m", args.worker_module, point, *worker_args]
    first_ready, w = os.pipe2(os.O_CLOEXEC)
    try:
        first = Worker(worker_argv, lock_fd, w)
    finally:
        os.close(w)
    from lazyfs.tree.fuse_relay import supervise

    return supervise(point, worker_argv, lock_fd, first, first_ready, args.ready_fd, oom_biased)


if __name__ == "__main__":
    sys.exit(main())
