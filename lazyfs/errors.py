"""Domain errors -> errno, in one place, for the FUSE operations; and -> one line and an
exit status for the command line (`as_one_line`).

A FUSE handler may raise only `pyfuse3.FUSEError` (anything else ends pyfuse3's main
loop and leaves a dead mount), so every handler goes through `fuse_errno`. Most specific
class first: `ObjectNotFound` (a pack missing from the store while reading a file that
exists) is an I/O error for the reader, not "no such file".
"""

from __future__ import annotations

import errno
import os
import sys

from chunker.errors import (
    BadInputError,
    CorruptObjectError,
    LazyfsError,
    NotFoundError,
    ObjectNotFound,
    StoreError,
)

ERRNO: list[tuple[type[BaseException], int]] = [
    (CorruptObjectError, errno.EIO),  # wrong bytes are never served
    (ObjectNotFound, errno.EIO),  # the image names a chunk the store lost
    (StoreError, errno.EIO),  # the store is down and retries did not help
    (NotFoundError, errno.ENOENT),
    (BadInputError, errno.EINVAL),
    (LazyfsError, errno.EIO),
]
TYPE_CHECKING = False  # as_one_line is on every command's path: no typing import for it
if TYPE_CHECKING:
    from collections.abc import Callable


def fuse_errno(exc: BaseException) -> int:
    """The errno a reader sees for exc; EIO for anything unexpected (a bug, logged)."""
    if isinstance(exc, OSError) and exc.errno:
        return exc.errno
    for cls, code in ERRNO:
        if isinstance(exc, cls):
            return code
    return errno.EIO


class MountError(LazyfsError):
    """The mount daemon failed to start; carries the daemon's message and exit code."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def as_one_line(command: Callable[[], int]) -> int:
    """Run a command-line entry point: its exit status, or, for an error, one line on
    stderr and a non-zero status, never a traceback (`lazyfs`, `lazyfs run`'s finisher)."""
    try:
        return command()
    except LazyfsError as exc:
        print(f"lazyfs: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:  # e.g. `lazyfs images | head`
        os._exit(1)
    except OSError as exc:  # the local machine said no: a full disk, a permission
        where = f": {exc.filename}" if exc.filename else ""
        print(f"lazyfs: {exc.strerror or exc}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("lazyfs: interrupted", file=sys.stderr)
        return 130
