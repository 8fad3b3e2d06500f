"""One worker process of the FUSE supervisor (lazyfs/tree/fuse_supervisor.py, which says
what a worker is), with our end of the socket the supervisor relays /dev/fuse through.
Standard library only and small: the supervisor starts its first worker before it
imports anything else, so that the worker's start runs beside the rest of its own.
"""

from __future__ import annotations

import os
import socket
import subprocess

SOCK_BUF = 4 << 20  # a 1 MiB reply must fit one SEQPACKET message (default 208 KiB)
SO_SNDBUFFORCE, SO_RCVBUFFORCE = 32, 33  # asm-generic/socket.h; not in Python's socket


class Worker:
    """One pyfuse3 worker process and our end of its socket."""

    def __init__(self, argv: list[str], lock_fd: int | None, ready_fd: int | None) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for sock in (ours, theirs):  # FORCE: above net.core.[rw]mem_max, as root
            sock.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, SOCK_BUF)
            sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, SOCK_BUF)
        ours.setblocking(False)
        fds = [theirs.fileno()] + [fd for fd in (lock_fd, ready_fd) if fd is not None]
        argv = [*argv, "--fuse-fd", str(theirs.fileno())]
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
