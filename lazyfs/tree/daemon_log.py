"""A long-lived daemon's log file, kept to at most twice LOG_KEEP bytes.

The node data daemon writes to a file in the node cache (its starter appends its stdout
and stderr there: lazyfs/tree/daemon_start.py), and the node agent keeps it up for
weeks: a line per image it opens, closes or forgets, and nothing ever rotated the file.
Once it passes LOG_KEEP, its content is copied to `<log>.1` (the one before is replaced)
and the file is truncated: every writer (the daemon, its supervisor, a worker before a
restart) appends (O_APPEND), so each goes on at the new end. Copy and truncate, not
rename, because those writers' descriptors are the file's own and no process but this
one could be told to reopen it. A line written between the copy and the truncation is
lost; that is rare and only a log line.
"""

from __future__ import annotations

import os
import stat

LOG_KEEP = 8 << 20  # bytes of the current log file before it moves to <log>.1
OUT = 1  # the daemon's stdout: its log file, when its starter gave it one


def keep_log_bounded(fd: int = OUT, keep: int = LOG_KEEP) -> bool:
    """Move the log file open as `fd` to <log>.1 if it holds more than `keep` bytes;
    whether it did. Nothing for a descriptor that is not a regular file (a daemon run
    in a terminal)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size <= keep:
        return False
    path = os.readlink(f"/proc/self/fd/{fd}")
    if not os.path.isabs(path) or path.endswith(" (deleted)"):
        return False
    _copy(path, path + ".1")
    os.ftruncate(fd, 0)
    return True


def _copy(src_path: str, dst_path: str) -> None:
    """src's bytes into dst, made or replaced (sendfile: no shutil to import into a
    daemon whose start a cold node waits for)."""
    src = os.open(src_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        dst = os.open(dst_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            while os.sendfile(dst, src, None, 1 << 20) > 0:
                pass
        finally:
            os.close(dst)
    finally:
        os.close(src)
