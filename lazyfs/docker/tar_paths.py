"""What the archive endpoints' two halves share (tar_unpack.py for PUT, tar_pack.py for
GET and HEAD): how a sandbox path is cleaned, and how the sandbox's own files' errors
become Docker's answers."""

from __future__ import annotations

import contextlib
import errno
import lzma
import posixpath
import tarfile
import zlib
from collections.abc import Iterator

from lazyfs.agent.files import SANDBOX_ERRNOS
from lazyfs.docker.http import HttpError

MiB, GiB = 2**20, 2**30
CHUNK = 256 * 2**10  # bytes copied, and a GET's bytes sent, at a time (< MAX_HEADER)
# Errors the sandbox's own files cause (a name that is a file, not a directory): 400.
ENTRY_ERRNOS = SANDBOX_ERRNOS | {errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EXDEV}


class PathNotFound(Exception):
    """The path a request names is not in the sandbox (404, Docker's words)."""


def clean_path(path: str) -> str:
    """An absolute path without "." or ".." parts (normpath keeps a leading "//")."""
    return posixpath.normpath("/" + path.lstrip("/"))


@contextlib.contextmanager
def entry_errors(what: str) -> Iterator[None]:
    """An OSError the sandbox's files cause, as the 400 it is (ENOSPC and the like stay
    500s); BadInputError (files.py's) is made a 400 by docker_errors. A tar that breaks
    off in an entry's data is a 400 too."""
    try:
        yield
    except OSError as exc:
        if exc.errno in ENTRY_ERRNOS:
            raise HttpError(400, f"{what}: {exc.strerror}") from None
        raise
    except (tarfile.TarError, EOFError, lzma.LZMAError, zlib.error) as exc:
        raise HttpError(400, f"{what}: {exc}") from None
