"""A sandbox's resource limits (setrlimit), as docker's `--ulimit` (HostConfig.Ulimits)
asks for them: a name, a soft and a hard limit, -1 for unlimited.

    ulimits = parse_ulimits({"nofile": [65536, 65536], "stack": [-1, -1]})

Names as docker takes them (NAMES); a limit not asked is the sandbox's default. The
defaults: open files soft 1,024 and hard 524,288, as Docker 25+ gives (systemd's
default for services, which dockerd passes on), or this node's own hard limit where
that is lower; pending signals and message-queue bytes half of the node's
(SHARED_PER_UID); every other limit the runtime's own, inherited from the agent or the
`lazyfs run` process that started it.

A hard limit above this process's own takes CAP_SYS_RESOURCE, which root in a container
(a CI runner, this machine's sandbox) may lack: then the runtime cannot set it, and
such an ask is refused with the node's limit named (check_node_gives), where runc would
fail with "operation not permitted". So is one for a sandbox with a user namespace of its
own (`userns`), whose limits an unprivileged id of its range sets (it can lower limits,
not raise them: lazyfs/sandbox/userns.py says why).

Where each is applied:
- `lazyfs run`'s sandbox: by the runtime, from the spec (spec_rlimits); with a user
  namespace of its own, by `userns.set_limits` once the runtime has created it;
- the agent's sandboxes: by the exec server, to each command before it starts (exec
  protocol version 5, lazyfs/agent/exec_server.c, header()). A warm sandbox (pooled or
  generic) was made with the defaults, and a command may lower its hard limits but not
  raise them (that takes CAP_SYS_RESOURCE, which a sandbox has not): so a create whose
  limits a warm sandbox cannot give (a hard limit above its default, warm_can_give) gets
  a sandbox made for it, whose spec has them.
"""

from __future__ import annotations

import functools
import resource
from collections.abc import Mapping
from typing import TYPE_CHECKING

from chunker.errors import BadInputError

if TYPE_CHECKING:
    import argparse

# docker's names (go-units) -> the RLIMIT_ number each sets (asm-generic/resource.h, as
# x86_64 and arm64 number them; Python's resource module lacks RLIMIT_LOCKS).
NAMES: dict[str, int] = {
    "cpu": 0,
    "fsize": 1,
    "data": 2,
    "stack": 3,
    "core": 4,
    "rss": 5,
    "nproc": 6,
    "nofile": 7,
    "memlock": 8,
    "as": 9,
    "locks": 10,
    "sigpending": 11,
    "msgqueue": 12,
    "nice": 13,
    "rtprio": 14,
    "rttime": 15,
}
UNLIMITED = -1  # docker's and the API's word for RLIM_INFINITY
# Open files by default, as Docker 25+ (systemd's LimitNOFILE=1024:524288): a program
# that needs more raises its soft limit itself, as on a host.
DEFAULT_NOFILE = (1024, 524288)
CAP_SYS_RESOURCE = 24
# What the kernel counts per uid and checks against the caller's own limit: signals
# queued to a uid's processes, and the bytes of the POSIX message queues it made. A
# sandbox's uid 0 is the host's (no user namespace): with the host's limits one sandbox
# took every pending signal of root (the host's timer_create and sigqueue then failed)
# and all of root's queue bytes with 9 empty queues. A sandbox gets half of the limits
# of the process that starts it, so the host's root processes keep the other half
# whatever the sandboxes hold (docs/security.md, finding 20; other sandboxes still share
# the first half: only a user namespace per sandbox would part them).
SHARED_PER_UID = ("msgqueue", "sigpending")
HALF_OF_UNLIMITED = {"msgqueue": 819200, "sigpending": 65536}  # the host has no limit

Ulimits = tuple[tuple[str, int, int], ...]  # (name, soft, hard), sorted by name


@functools.cache
def _nr_open() -> int:
    """The kernel's most open files a process may be allowed (fs.nr_open)."""
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1048576  # the kernel's default


@functools.cache
def _may_raise() -> bool:
    """Whether this process has CAP_SYS_RESOURCE, and so may raise hard limits."""
    try:
        with open("/proc/self/status") as f:
            eff = next(line for line in f if line.startswith("CapEff:"))
    except (OSError, StopIteration):
        return False
    return bool(int(eff.split()[1], 16) >> CAP_SYS_RESOURCE & 1)


def _own_hard(name: str) -> int:
    return resource.getrlimit(NAMES[name])[1]  # -1: unlimited, as UNLIMITED


def _can_raise(userns: bool) -> bool:
    """Whether a sandbox's hard limits may be above this process's own (see the top)."""
    return not userns and _may_raise()


def default_nofile(userns: bool = False) -> tuple[int, int]:
    """The open files a sandbox gets unless asked: DEFAULT_NOFILE, within this
    process's hard limit where they cannot be raised."""
    soft, hard = DEFAULT_NOFILE
    if not _can_raise(userns) and _above(hard, _own_hard("nofile")):
        hard = _own_hard("nofile")
    return min(soft, hard), hard


@functools.cache
def default_limits(userns: bool = False) -> dict[str, tuple[int, int]]:
    """name -> (soft, hard) a sandbox gets unless asked: the open files, and half of
    this process's own SHARED_PER_UID limits (or HALF_OF_UNLIMITED of them)."""
    limits = {"nofile": default_nofile(userns)}
    for name in SHARED_PER_UID:
        own = resource.getrlimit(NAMES[name])[0]
        half = HALF_OF_UNLIMITED[name] if own == UNLIMITED else own // 2
        limits[name] = (half, half)
    return limits


def check_node_gives(ulimits: Ulimits, what: str = "ulimits", userns: bool = False) -> None:
    """BadInputError for a hard limit that cannot be set: above this process's own,
    without CAP_SYS_RESOURCE or in a sandbox with a user namespace of its own."""
    if _can_raise(userns):
        return
    why = (
        "a sandbox with its own user namespace cannot have more"
        if userns
        else "raising it takes CAP_SYS_RESOURCE, which the node's runtime lacks"
    )
    for name, _soft, hard in ulimits:
        if _above(hard, _own_hard(name)):
            raise BadInputError(
                f"{what}: {name}'s hard limit {hard} is above this node's {_own_hard(name)} ({why})"
            )


def _limit(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < UNLIMITED:
        raise BadInputError(f"{what} must be a whole number of 0 or more, or -1 (unlimited)")
    return value


def _above(a: int, b: int) -> bool:
    """Whether limit a is above limit b, -1 being unlimited."""
    return b != UNLIMITED and (a == UNLIMITED or a > b)


def ulimit(name: object, soft: object, hard: object, what: str = "ulimits") -> tuple[str, int, int]:
    """One limit, checked: a known name, soft at most hard, open files within the
    kernel's ceiling (fs.nr_open; never unlimited)."""
    if not isinstance(name, str) or name not in NAMES:
        known = ", ".join(NAMES)
        raise BadInputError(f"{what}: {name!r} is not a limit's name (one of {known})")
    soft = _limit(soft, f"{what}: {name}'s soft limit")
    hard = _limit(hard, f"{what}: {name}'s hard limit")
    if _above(soft, hard):
        raise BadInputError(f"{what}: {name}'s soft limit {soft} is above its hard limit {hard}")
    if name == "nofile" and _above(hard, _nr_open()):
        raise BadInputError(f"{what}: nofile may be at most {_nr_open()} (fs.nr_open)")
    return name, soft, hard


def parse_ulimits(value: object, what: str = "ulimits") -> Ulimits:
    """The API's field: {"nofile": [soft, hard], ...} (or null) -> Ulimits."""
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise BadInputError(f'{what} must be an object of limits, as {{"nofile": [1024, 4096]}}')
    out = []
    for name, pair in value.items():
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            raise BadInputError(f"{what}: {name!r} must be [soft, hard]")
        out.append(ulimit(name, *pair, what=what))
    return tuple(sorted(out))


def as_field(ulimits: Ulimits) -> dict[str, list[int]]:
    """Ulimits as the API, the clients and a sandbox's record spell them."""
    return {name: [soft, hard] for name, soft, hard in ulimits}


def parse_flag(text: str) -> tuple[str, int, int]:
    """`--ulimit NAME=SOFT[:HARD]`, as docker takes it (HARD defaults to SOFT)."""
    name, eq, values = text.partition("=")
    soft_text, _, hard_text = values.partition(":")
    try:
        soft = int(soft_text)
        hard = int(hard_text) if hard_text else soft
    except ValueError:
        soft = hard = None  # type: ignore[assignment]
    if not eq or soft is None:
        raise BadInputError(f"--ulimit {text!r}: expected NAME=SOFT[:HARD], as nofile=1024:4096")
    return ulimit(name, soft, hard, what="--ulimit")


def add_ulimit_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ulimit",
        metavar="NAME=SOFT[:HARD]",
        action="append",
        default=None,
        help="a resource limit of the sandbox's processes, as docker's (nofile=65536,"
        " stack=-1: -1 is unlimited); repeatable",
    )


def flag_ulimits(values: list[str] | None) -> Ulimits:
    """--ulimit's values; a name given twice: the last one, as docker."""
    return tuple(sorted({u[0]: u for u in map(parse_flag, values or [])}.values()))


def _rlim(value: int) -> int:
    """As the OCI spec (a uint64) takes it; Python's resource.RLIM_INFINITY is -1."""
    return 2**64 - 1 if value == UNLIMITED else value


def spec_rlimits(ulimits: Ulimits, userns: bool = False) -> list[dict]:
    """The OCI spec's process.rlimits: the defaults (default_limits), and what was
    asked."""
    asked = {name: (soft, hard) for name, soft, hard in ulimits}
    for name, default in default_limits(userns).items():
        asked.setdefault(name, default)
    return [
        {"type": f"RLIMIT_{name.upper()}", "soft": _rlim(soft), "hard": _rlim(hard)}
        for name, (soft, hard) in sorted(asked.items())
    ]


def warm_can_give(ulimits: Ulimits) -> bool:
    """Whether a sandbox made with the defaults can give its commands these limits: no
    hard limit above the default's (a command may lower its hard limits, not raise them).
    The defaults are the spec's open files and, for the rest, this process's own limits,
    which the runtime it starts passes on."""
    for name, _soft, hard in ulimits:
        base = default_limits()[name][1] if name in default_limits() else _own_hard(name)
        if _above(hard, base):
            return False
    return True


def header(ulimits: Ulimits) -> str:
    """The limits as the exec server takes them (docs/FORMATS.md, exec protocol
    version 5): "RESOURCE:SOFT:HARD" for each, comma-separated, -1 for unlimited."""
    return ",".join(f"{NAMES[name]}:{soft}:{hard}" for name, soft, hard in ulimits)
