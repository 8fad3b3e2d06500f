"""A node data daemon worker that gets stuck in its exit when told to (tests only).

    python -m testbed.stuck_worker MOUNTPOINT ...   (lazyfs/tree/data_daemon.py's arguments)

It is the data daemon, plus a thread that waits for the file MOUNTPOINT + ".stuck". When
that file appears, the worker's event loop stops for good (a signal handler that never
returns, on the main thread) and then its socket to the supervisor is shut down, so the
supervisor reads EOF as from a worker that died, but the process does not exit and
answers nothing more. A real worker looks like that when its last thread is stuck in the
kernel during its exit (lazyfs/tree/fuse_supervision.py, Supervisor.run, says when). The
kernel shows that only in a race, so this module makes it on demand. A worker that finds
the file already there at its start never does this, so the worker that replaces it
serves.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time

from lazyfs.tree import data_daemon

_stopped = threading.Event()


def _stop_here(_signum: int, _frame: object) -> None:
    _stopped.set()
    threading.Event().wait()  # the loop's thread, forever


def _stick_when_flagged(flag: str, socket_fd: int) -> None:
    while not os.path.exists(flag):
        time.sleep(0.02)
    os.kill(os.getpid(), signal.SIGUSR1)
    _stopped.wait()
    socket.socket(fileno=os.dup(socket_fd)).shutdown(socket.SHUT_RDWR)


def main() -> int:
    args = sys.argv[1:]
    flag = os.path.abspath(args[0]) + ".stuck"
    if not os.path.exists(flag):
        signal.signal(signal.SIGUSR1, _stop_here)
        socket_fd = int(args[args.index("--socket-fd") + 1])
        threading.Thread(target=_stick_when_flagged, args=(flag, socket_fd), daemon=True).start()
    return data_daemon.main(args)


if __name__ == "__main__":
    sys.exit(main())
