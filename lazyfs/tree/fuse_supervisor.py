"""The FUSE supervisor: owns the node data daemon's FUSE connection, so that a crash of
the daemon (the pyfuse3 worker) does not take the node's image trees down.

    python -m lazyfs.tree.fuse_supervisor MOUNTPOINT [--lock PATH] [--ready-fd N]
        [--starter-lock-fd L] WORKER-ARGS...

It opens /dev/fuse and mounts it at MOUNTPOINT itself (root only), then runs the worker,
`python -m lazyfs.tree.data_daemon MOUNTPOINT WORKER-ARGS... --socket-fd S --device-fd D
--lock-fd M`: D is our /dev/fuse, S one end of a SOCK_SEQPACKET socketpair with us.
libfuse (3.14, fuse_session_mount) takes a mountpoint "/dev/fd/N" as an already-mounted
FUSE fd; the worker gives it a copy of S, where we hand it the kernel's FUSE_INIT and take
its reply to the kernel, and then moves libfuse onto D: from there on the worker reads
requests from, and writes replies to, /dev/fuse itself (lazyfs/tree/fuse_supervision.py
has the details). Over S it then reports each handle it opens and releases.

L, if given, is our copy of the starter's exclusive lock on MOUNTPOINT.lock
(lazyfs/tree/image_mounts.py, `_data_daemon`). We let go of it once we report ready: a
starter that leaves before (`lazyfs run` on bad input, a kill) lets in no second starter,
and no second daemon, while ours comes up.

We keep the kernel's FUSE_INIT and how many handles the kernel holds open per node id.
When the worker dies (killed, crashed: any exit but status 0), we start a new one, give
it the open handle counts (so its idle exit stays right; they include the handles on the
daemon's hold file, by which the node agent keeps it up: data_daemon.py), feed it the
kept FUSE_INIT (libfuse answers EIO to anything before INIT) and drop that INIT's reply
(the kernel had the first one long ago). The new worker asks the kernel to send again
every request the dead one had read and not answered (FUSE_NOTIFY_RESEND). The kernel's
readers only stall for the restart; no tree is remounted. A worker may also exit
non-zero on purpose to be replaced this way: the data daemon does (status 75) when the
cache directory it serves from was deleted or replaced.

A worker exiting with status 0 has exited on purpose (idle, with MOUNTPOINT.lock held
exclusively through the descriptor it shares with us, on SIGTERM, or because the mount is
gone): we unmount and exit. SIGTERM/SIGINT here: stop the worker, unmount, exit.

This process is the one whose death still takes the trees down (its worker leaves when
their socket closes, and the connection aborts with the last /dev/fuse descriptor; a
watchdog then detaches the dead mount). That is why it is small, uses the standard
library only, and does nothing but start workers and keep two tables.

It starts its first worker before anything else, even before it mounts: the worker's
start (a Python process, pyfuse3, the node cache) is most of a cold data daemon's, which
a node's first `lazyfs run` waits for, and this process's own imports and mount then run
beside it. So this module, the entry, imports little (lazyfs/tree/fuse_worker.py), and
the rest (lazyfs/tree/fuse_supervision.py) comes after: 15-20 ms sooner on a cold start.
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
    p.add_argument("--starter-lock-fd", type=int, default=None)
    p.add_argument("--worker-module", default="lazyfs.tree.data_daemon")
    args, worker_args = p.parse_known_args(argv)
    point = os.path.abspath(args.mountpoint)
    oom_biased = set_oom_score_adj()  # and the worker's: it serves every sandbox's files
    for fd in (args.ready_fd, args.starter_lock_fd):
        if fd is not None:
            os.set_inheritable(fd, False)
    lock_fd = os.open(args.lock or f"{point}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    worker_argv = [sys.executable, "-m", args.worker_module, point, *worker_args]
    # Opened before the mount, so that the first worker starts with it. Non-blocking: a
    # request withdrawn between the worker's poll and its read (its reader killed) must
    # not leave that read waiting for the next request (pyfuse3_asyncio.py).
    device_fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
    first_ready, w = os.pipe2(os.O_CLOEXEC)
    try:
        first = Worker(worker_argv, lock_fd, device_fd, w)
    finally:
        os.close(w)
    from lazyfs.tree.fuse_supervision import supervise

    return supervise(
        point,
        worker_argv,
        lock_fd,
        device_fd,
        first,
        first_ready,
        args.ready_fd,
        args.starter_lock_fd,
        oom_biased,
    )


if __name__ == "__main__":
    sys.exit(main())
