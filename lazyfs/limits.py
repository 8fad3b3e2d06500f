"""Sandbox limits from text (the command line's flags, the agent API's fields)."""

from __future__ import annotations

from chunker.errors import BadInputError
from lazyfs.oci_spec import DEFAULT_PIDS, Limits
from lazyfs.settings import parse_size


def positive(text: object, kind: type, flag: str, what: str) -> float | None:
    """A positive int or float from text (None stays None); BadInputError naming `flag`."""
    if text is None:
        return None
    try:
        value = kind(text)
    except (TypeError, ValueError):
        value = 0
    if not value > 0 or value != value or value == float("inf"):
        raise BadInputError(f"{flag} {text!r} is not {what}")
    return value


def parse_limits(
    cpus: object = None, memory: object = None, pids: object = None, prefix: str = "--"
) -> Limits:
    """Limits from `--cpus 0.5 --memory 2G --pids 100` (or the API's cpus/memory/pids,
    with prefix ""); a value that does not parse is one BadInputError line."""
    size = None
    if memory is not None:
        try:
            size = parse_size(str(memory)) if not isinstance(memory, int) else memory
        except BadInputError:
            size = 0
        if not isinstance(size, int) or size <= 0:
            raise BadInputError(
                f"{prefix}memory {memory!r} is not a size (bytes, or with K, M, G or T)"
            )
    n_cpus = positive(cpus, float, f"{prefix}cpus", "a positive number of CPUs, e.g. 0.5")
    n_pids = positive(pids, int, f"{prefix}pids", "a whole number of processes, 1 or more")
    return Limits(cpus=n_cpus, memory=size, pids=int(n_pids) if n_pids else DEFAULT_PIDS)
