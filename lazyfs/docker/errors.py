"""lazyfs's errors as the Docker API answers them: Docker's shape, `{"message": ...}`,
and its statuses, with the wording clients key on (docker-py raises ImageNotFound for a
404 that says "No such image", and `containers.run` pulls on it)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import wraps
from typing import Any

from chunker.errors import BadInputError, LazyfsError, NotFoundError, StoreError
from lazyfs.agent.errors import AtCapacity, SandboxExited, SandboxLost, UnknownSandbox
from lazyfs.agent.sandbox_io import TooSlow
from lazyfs.docker.http import Answer, HttpError, Request

Handler = Callable[[Any, Request], Awaitable[Answer]]

# lazyfs's errors as Docker answers them; the first that matches.
ERRORS: list[tuple[type[BaseException], int]] = [
    (SandboxLost, 404),
    (UnknownSandbox, 404),
    (NotFoundError, 404),
    (SandboxExited, 409),
    (AtCapacity, 429),
    (BadInputError, 400),
    (StoreError, 503),
    (TooSlow, 504),  # a sandbox's files did not answer in time
    (LazyfsError, 500),
]


def docker_errors(fn: Handler) -> Handler:
    """lazyfs's errors as Docker's: status and one line."""

    @wraps(fn)
    async def handler(self: Any, request: Request) -> Answer:
        try:
            return await fn(self, request)
        except LazyfsError as exc:
            status = next(s for cls, s in ERRORS if isinstance(exc, cls))
            raise HttpError(status, str(exc).splitlines()[0] if str(exc) else repr(exc)) from None

    return handler
