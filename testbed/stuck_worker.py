"""A node data daemon worker that gets stuck in its exit when told to (tests only).

    python -m testbed.stuck_worker MOUNTPOINT ...   (lazyfs/tree/data_daemon.py's arguments)

It is the data daemon, plus a thread that waits for the file MOUNTPOINT + ".stuck". When
that file appears, the worker shuts its FUSE socket down, so the supervisor reads EOF
as from a worker that died, but the process does not exit: a non-daemon thread keeps it.
A real worker looks like that when its last thread is stuck in the kernel during its
exit (lazyfs/tree/fuse_supervisor.py, Supervisor.run, says when). The kernel shows that
only in a race, so this module makes it on demand. A worker that finds the file already
there at its start never does this, so the worker that replaces it serves.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

from lazyfs.tree import data_daemon


def _stick_when_flagged(flag: str, fuse_fd: int) -> None:
    while not os.path.exists(flag):
        time.sleep(0.02)
    # daemon=False: a thread started by a daemon thread would be one too, and not keep us
    threading.Thread(target=threading.Event().wait, name="stuck", daemon=False).start()
    socket.socket(fileno=os.dup(fuse_fd)).shutdown(socket.SHUT_RDWR)


def main() -> int:
    args = sys.argv[1:]
    flag = os.path.abspath(args[0]) + ".stuck"
    if not os.path.exists(flag):
        fuse_fd = int(args[args.index("--fuse-fd") + 1])
        threading.Thread(target=_stick_when_flagged, args=(flag, fuse_fd), daemon=True).start()
    return data_daemon.main(args)


if __name__ == "__main__":
    sys.exit(main())
