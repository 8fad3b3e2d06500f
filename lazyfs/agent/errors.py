"""The agent's own errors; api.py maps each to an HTTP status (ERRORS there)."""

from __future__ import annotations

from chunker.errors import LazyfsError, NotFoundError


class UnknownSandbox(NotFoundError):
    """No sandbox with that id on this agent."""


class SandboxLost(LazyfsError):
    """The sandbox existed before the agent restarted and could not be served again."""


class AtCapacity(LazyfsError):
    """--max-sandboxes reached: a new sandbox is refused rather than thrashing the node."""

    exit_code = 6


class AgentBusy(LazyfsError):
    """Another agent already serves this run directory."""


class SandboxExited(LazyfsError):
    """The sandbox's PID 1 ended (its code killed it): it runs nothing more; delete it."""


class SandboxPaused(LazyfsError):
    """The sandbox is paused (its processes frozen): unpause it to run a command in it."""


class ReadOnlyRoot(LazyfsError):
    """The sandbox's root was made read-only: the file API writes nothing into it."""
