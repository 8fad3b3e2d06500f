"""Starting a FUSE daemon and waiting for its ready line: its starter's side.

A daemon (the node data daemon's supervisor, a FUSE tree's mount daemon) is started
detached: a session of its own (the terminal's ^C must not reach it), stdin on
/dev/null, stdout and stderr appended to its log file, working directory / (never the
caller's, which it would keep busy), and no descriptor of its starter but the write end
of a pipe, given as `--ready-fd N`. It writes one JSON line there once it serves, or
says why it cannot (lazyfs/tree/mount_watch.py, ready_reporter).

Its own module, on os, select and json (and lazyfs's errors): `lazyfs run`
starts the node data daemon from a thread while its main thread imports the rest, and
a cold node waits for that daemon. The start used to import lazyfs/tree/fuse_daemon.py
(logging, subprocess, shutil, ctypes: ~22 ms from a cold page cache by -X importtime)
and start it through subprocess.Popen; a cold `python3 -c print` through `lazyfs run`
is now 10-18 ms sooner per pair, interleaved (docs/design-changes.md, session 33).
os.posix_spawn cannot set the child's working directory, so the daemon is started
through `/bin/sh -c 'cd / && exec "$@"'`, as the linger reaper is
(lazyfs/tree/tree_release.py).
"""

from __future__ import annotations

import json
import os
import select
import time

from chunker.errors import BadInputError
from lazyfs.errors import MountError
from lazyfs.fds import inheritable_fds

TYPE_CHECKING = False
if TYPE_CHECKING:
    from pathlib import Path

START_TIMEOUT = 600.0  # seconds for a daemon to fetch the manifest and mount
_IN_ROOT = ["/bin/sh", "-c", 'cd / && exec "$@"', "sh"]


def spawn_daemon(argv: list[str], logfile: Path, what: str, keep: int | None = None) -> int:
    """Start `argv --ready-fd N` detached, logging to logfile; return its pid once it
    reports ready on fd N, or raise MountError with the one-line error it reported.
    keep: one more of our descriptors the daemon inherits (argv names it)."""
    try:
        logfile.parent.mkdir(parents=True, exist_ok=True)
        out = os.open(logfile, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise BadInputError(f"cannot use {logfile}: {exc.strerror}") from None
    r, w = os.pipe()
    try:
        os.set_inheritable(w, True)
        actions: list[tuple] = [
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_DUP2, out, 1),
            (os.POSIX_SPAWN_DUP2, out, 2),
        ]
        if keep is not None:  # onto itself: inherited by this child only (glibc 2.29+)
            actions.append((os.POSIX_SPAWN_DUP2, keep, keep))
        # None of ours but w: one of a `lazyfs run` slot (lazyfs/sandbox/run_wait.py)
        # would hold the slot for the daemon's whole life.
        actions += [(os.POSIX_SPAWN_CLOSE, fd) for fd in inheritable_fds() if fd not in (w, keep)]
        pid = os.posix_spawn(
            _IN_ROOT[0],
            [*_IN_ROOT, *argv, "--ready-fd", str(w)],
            os.environ,
            file_actions=actions,
            setsid=True,
        )
    except OSError as exc:
        os.close(r)
        raise MountError(f"cannot start the {what}: {exc.strerror}") from None
    finally:
        os.close(w)
        os.close(out)
    try:
        report = read_report(r, START_TIMEOUT)
    except TimeoutError:
        os.kill(pid, 9)  # SIGKILL (the signal module costs its enum import)
        os.waitpid(pid, 0)
        late = f"{what} did not start within {START_TIMEOUT:.0f} s; see {logfile}"
        raise MountError(late) from None
    finally:
        os.close(r)
    if report is not None and report.get("error") is None:
        return pid  # detached on purpose: it outlives us
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if report is None:
        report = {"error": f"{what} exited with status {status} before it was ready"}
    raise MountError(report["error"], int(report.get("exit_code", 1)))


def read_report(fd: int, timeout: float) -> dict | None:
    """The ready line from fd as a dict ({"error": None or a message, "exit_code": N});
    None if the writer went away without one (it died). TimeoutError after `timeout`."""
    deadline = time.monotonic() + timeout
    buf = b""
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError
        data = os.read(fd, 4096)
        if not data:  # every copy of the write end closed
            return None
        buf += data
    return json.loads(buf)
