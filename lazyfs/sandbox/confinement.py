"""What a sandbox's processes are held to beyond the default, as docker's `--cap-drop`,
`--read-only` and `--ulimit` (HostConfig.CapDrop, ReadonlyRootfs, Ulimits) ask for it.

- cap_drop: capabilities taken from the sandbox's default set (oci_spec's
  DEFAULT_CAPABILITIES, containerd's 14), from every set of its processes, the bounding
  set included, so that nothing in the sandbox gets them back. Names as docker takes
  them: "CHOWN", "cap_chown" or "CAP_CHOWN", and "ALL" for every one. A capability that
  is not in the default set may be named (it is not there to drop: docker allows it too);
  a name that is no Linux capability is a BadInputError.
- read_only: the sandbox's root is mounted read-only. Its tmpfs mounts, /dev/shm and the
  runtime's own mounts stay writable, as with docker; the file API and `docker cp` refuse
  to write into it.
- ulimits: resource limits of its processes (lazyfs/sandbox/ulimits.py, which says where
  they are applied).

Where each is applied:
- `lazyfs run`'s sandbox: by the runtime, from the spec (its capabilities,
  root.readonly);
- the agent's sandboxes: the capabilities by the exec server, from every command it
  starts (exec protocol version 4, lazyfs/agent/exec_server.c; cap_mask() is what it is
  sent), in a warm sandbox (made with the defaults) and in one made for the create
  alike, so that a Docker exec's User still works with CAP_SETUID dropped, as runc
  changes the user before it drops capabilities; the exec server itself, PID 1, keeps
  them, out of the sandbox's reach (exec_server.c says why). The read-only root: the
  runtime's in a sandbox made for the create; lazyfs-attach-root's when a generic
  sandbox takes the image's root (attach_root.c). A sandbox of the image's own pool has
  its root already, so a create with read_only skips that pool (lazyfs/agent/node.py).
Adding capabilities (docker's CapAdd, Privileged) is not offered: see docs/security.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from chunker.errors import BadInputError
from lazyfs.sandbox.ulimits import Ulimits, add_ulimit_flag, flag_ulimits, parse_ulimits

if TYPE_CHECKING:
    import argparse

# Linux's capabilities, by number (include/uapi/linux/capability.h, up to 6.x).
LINUX_CAPABILITIES = (
    "CHOWN",
    "DAC_OVERRIDE",
    "DAC_READ_SEARCH",
    "FOWNER",
    "FSETID",
    "KILL",
    "SETGID",
    "SETUID",
    "SETPCAP",
    "LINUX_IMMUTABLE",
    "NET_BIND_SERVICE",
    "NET_BROADCAST",
    "NET_ADMIN",
    "NET_RAW",
    "IPC_LOCK",
    "IPC_OWNER",
    "SYS_MODULE",
    "SYS_RAWIO",
    "SYS_CHROOT",
    "SYS_PTRACE",
    "SYS_PACCT",
    "SYS_ADMIN",
    "SYS_BOOT",
    "SYS_NICE",
    "SYS_RESOURCE",
    "SYS_TIME",
    "SYS_TTY_CONFIG",
    "MKNOD",
    "LEASE",
    "AUDIT_WRITE",
    "AUDIT_CONTROL",
    "SETFCAP",
    "MAC_OVERRIDE",
    "MAC_ADMIN",
    "SYSLOG",
    "WAKE_ALARM",
    "BLOCK_SUSPEND",
    "AUDIT_READ",
    "PERFMON",
    "BPF",
    "CHECKPOINT_RESTORE",
)
ALL = "ALL"


class Confinement(NamedTuple):
    cap_drop: tuple[str, ...] = ()  # "CAP_X" names, or ("ALL",)
    read_only: bool = False
    ulimits: Ulimits = ()

    def capabilities(self, default: list[str]) -> list[str]:
        """`default` (CAP_ names) without the dropped ones."""
        if ALL in self.cap_drop:
            return []
        return [c for c in default if c not in self.cap_drop]


DEFAULT_CONFINEMENT = Confinement()  # nothing asked beyond the default


def cap_mask(cap_drop: tuple[str, ...] | list[str]) -> int:
    """The capabilities to drop as the exec server takes them: bit N for capability N,
    every bit for ALL (capabilities a later kernel adds included)."""
    if ALL in cap_drop:
        return (1 << 64) - 1
    return sum(1 << LINUX_CAPABILITIES.index(c.removeprefix("CAP_")) for c in set(cap_drop))


def parse_cap_drop(value: object, what: str = "cap_drop") -> tuple[str, ...]:
    """Capability names as docker takes them -> sorted "CAP_X" names, or ("ALL",)."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadInputError(f"{what} must be a list of capability names")
    names = set()
    for raw in value:
        name = raw.strip().upper()
        if name == ALL:
            return (ALL,)
        bare = name.removeprefix("CAP_")
        if bare not in LINUX_CAPABILITIES:
            raise BadInputError(f"{what}: {raw!r} is not a Linux capability")
        names.add(f"CAP_{bare}")
    return tuple(sorted(names))


def parse_confinement(
    cap_drop: object,
    read_only: object,
    ulimits: object = None,
    what: tuple[str, str, str] = ("cap_drop", "read_only", "ulimits"),
) -> Confinement:
    """The API's (or the CLI's) three fields, checked; `what` names them in an error."""
    if read_only is None:
        read_only = False
    if not isinstance(read_only, bool):
        raise BadInputError(f"{what[1]} must be true or false")
    return Confinement(
        parse_cap_drop(cap_drop, what[0]), read_only, parse_ulimits(ulimits, what[2])
    )


def add_confinement_flags(parser: argparse.ArgumentParser) -> None:
    """--cap-drop, --read-only and --ulimit, as `lazyfs run` and `lazyfs sandbox create`
    take them."""
    parser.add_argument(
        "--cap-drop",
        metavar="CAP",
        action="append",
        default=None,
        help="drop this capability from the sandbox (docker's: CHOWN, NET_RAW, ..., ALL);"
        " repeatable",
    )
    parser.add_argument(
        "--read-only",
        action="store_true",
        help="mount the sandbox's root read-only (its --tmpfs mounts stay writable)",
    )
    add_ulimit_flag(parser)


def flag_confinement(args: argparse.Namespace) -> Confinement:
    flags = ("--cap-drop", "--read-only", "--ulimit")
    confinement = parse_confinement(args.cap_drop, args.read_only, None, flags)
    return confinement._replace(ulimits=flag_ulimits(args.ulimit))
