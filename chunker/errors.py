"""Every error lazyfs reports to a user.

Each class carries the message shown on stderr (one line) and the exit code of the
command line. Code raises these for anything a user can cause (bad input, a missing
image, a store that is down); anything else is a bug and may show a traceback.
"""


class LazyfsError(Exception):
    """Base class: `str(exc)` is the one line shown to the user."""

    exit_code = 1


class BadInputError(LazyfsError):
    """The source image, a layer, a name or an argument is malformed or unsafe."""

    exit_code = 2


class DigestMismatchError(BadInputError):
    """A blob's content does not match the digest that names it."""


class UnsafePathError(BadInputError):
    """A layer entry would land outside the image root."""


class NotFoundError(LazyfsError):
    """An image, ref, tag or object that was asked for does not exist."""

    exit_code = 3


class ObjectNotFound(NotFoundError):
    """A key is missing from the object store."""


class StoreError(LazyfsError):
    """The object store failed in a way retrying did not fix."""

    exit_code = 4


class TemporaryStoreError(StoreError):
    """A failure worth retrying (timeouts, throttling, 5xx, dropped connections)."""


class CorruptObjectError(LazyfsError):
    """An object from the store failed verification: never served, never trusted."""

    exit_code = 5
