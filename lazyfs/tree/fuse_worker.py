"""One worker process of the FUSE supervisor (lazyfs/tree/fuse_supervisor.py, which says
what a worker is), with our end of its socket. Standard library only and small: the
supervisor starts its first worker before it imports anything else, so that the worker's
start runs beside the rest of its own.
"""

from __future__ import annotations

import os
import socket
import subprocess


class Worker:
    """One pyfuse3 worker process and our end of its socket."""

    def __init__(
        self, argv: list[str], lock_fd: int | None, device_fd: int, ready_fd: int | None
    ) -> None:
        """The worker gets `device_fd` (/dev/fuse) and a socket to us (fuse_supervision.py
        says what goes over it)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        fds = [theirs.fileno(), device_fd] + [fd for fd in (lock_fd, ready_fd) if fd is not None]
        argv = [*argv, "--socket-fd", str(theirs.fileno()), "--device-fd", str(device_fd)]
        if lock_fd is not None:
            argv += ["--lock-fd", str(lock_fd)]
        if ready_fd is not None:
            argv += ["--ready-fd", str(ready_fd)]
        try:
            self.proc = subprocess.Popen(argv, pass_fds=fds, stdin=subprocess.DEVNULL, cwd="/")
        finally:
            theirs.close()  # only the worker holds its end: its death is our EOF
        self.sock = ours
        self.pidfd = os.pidfd_open(self.proc.pid)
        self.answered = 0  # messages it sent us
        self.closed_at: float | None = None  # when its socket reached EOF

    def close(self) -> int:
        """Wait for the process; its exit status (negative: killed by that signal)."""
        code = self.proc.wait()
        self.sock.close()
        os.close(self.pidfd)
        return code
