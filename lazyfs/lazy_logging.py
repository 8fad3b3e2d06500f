"""A log line from the modules on `lazyfs run`'s path, which import logging only when they
write one: logging is ~6 ms of every run's imports, and a run that goes well logs nothing
(docs/design-changes.md, sessions 18 and 38). Daemons and the agent import logging
themselves; this only defers the import, the lines go where logging sends them."""

from __future__ import annotations


def info(logger: str, message: str, *args: object) -> None:
    import logging

    logging.getLogger(logger).info(message, *args)


def warning(logger: str, message: str, *args: object) -> None:
    import logging

    logging.getLogger(logger).warning(message, *args)
