"""A sandbox's own tmpfs mounts, as docker's `--tmpfs PATH[:OPTIONS]` and
HostConfig.Tmpfs ask for them: {"/path": "size=64m,mode=1777"}.

At a cold create each is a mount in the sandbox's spec (runc makes it inside the
sandbox's root, before its command runs); a generic sandbox gets them at its claim,
from lazyfs-attach-root right after it takes the image's root, before any command of
the claimant runs (attach_root.c). A sandbox of an image's own pool was made with its
mounts, so a create with tmpfs skips that pool. The pages a sandbox writes there are
charged to its memory cgroup, like its writable layer's, so its `memory` bounds them.

Options are the kernel's tmpfs options a docker user gives (size, nr_inodes, mode, uid,
gid) and the mount flags that take nothing away from the boundary (ro/rw, exec/noexec,
the atime ones); nosuid and nodev are always set, and noexec unless `exec` is asked, as
dockerd does. Anything else is a BadInputError naming it. The destination is an absolute
path without `..`, outside /proc, /sys and /dev (the runtime's own mounts there, the
init and the exec server among them, stay what they are), but for /dev/shm itself: a
tmpfs there replaces the runtime's 64 MiB one, which is how docker's --shm-size is
given (lazyfs/docker/container_api.py).
"""

from __future__ import annotations

import re
from typing import NamedTuple

from chunker.errors import BadInputError

MAX_MOUNTS = 32
FLAGS = {"ro", "rw", "exec", "noexec", "nosuid", "nodev", "noatime", "relatime", "strictatime"}
VALUES = {
    "size": re.compile(r"^[0-9]+[kmg%]?$", re.IGNORECASE),
    "nr_inodes": re.compile(r"^[0-9]+[kmg]?$", re.IGNORECASE),
    "mode": re.compile(r"^[0-7]{3,4}$"),
    "uid": re.compile(r"^[0-9]+$"),
    "gid": re.compile(r"^[0-9]+$"),
}
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8  # <sys/mount.h>
MS_NOATIME, MS_RELATIME, MS_STRICTATIME = 1024, 1 << 21, 1 << 24
MS_FLAGS = {  # the flag options that set a bit (rw and exec: the bits' absence)
    "ro": MS_RDONLY,
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "relatime": MS_RELATIME,
    "strictatime": MS_STRICTATIME,
}
RESERVED = ("/proc", "/sys", "/dev")
SHM = "/dev/shm"  # under /dev, and yet a sandbox's to size


class Tmpfs(NamedTuple):
    destination: str
    options: tuple[str, ...]  # as the user gave them, checked

    def helper_args(self) -> list[str]:
        """DEST FLAGS DATA for lazyfs-attach-root (attach_root.c), which mounts it in a
        generic sandbox at its claim: the spec's entry (mount()) at a cold create, its
        flag options as mount(2)'s flags and the rest as its data."""
        flags = 0
        data = []
        for option in self.mount()["options"]:
            if option in MS_FLAGS:
                flags |= MS_FLAGS[option]
            elif "=" in option:
                data.append(option)
        return [self.destination, str(flags), ",".join(data)]

    def mount(self) -> dict:
        """The spec's mounts entry."""
        forced = ["nosuid", "nodev"] + ([] if "exec" in self.options else ["noexec"])
        return {
            "destination": self.destination,
            "type": "tmpfs",
            "source": "tmpfs",
            "options": [*forced, *(o for o in self.options if o not in forced)],
        }


def parse_tmpfs(value: object, flag: str = "tmpfs") -> tuple[Tmpfs, ...]:
    """The mounts of {"/path": "options"} (None: none); BadInputError naming `flag`."""
    if value is None:
        return ()
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise BadInputError(f'{flag} must map paths to option strings, e.g. {{"/tmp": "size=64m"}}')
    if len(value) > MAX_MOUNTS:
        raise BadInputError(f"{flag}: {len(value)} mounts, more than {MAX_MOUNTS}")
    mounts = tuple(_one(path, options, flag) for path, options in sorted(value.items()))
    destinations = [m.destination for m in mounts]
    if len(set(destinations)) != len(destinations):
        raise BadInputError(f"{flag}: a path is given twice ({', '.join(sorted(value))})")
    return mounts


def _one(path: str, options: str, flag: str) -> Tmpfs:
    parts = path.split("/")
    if not path.startswith("/") or ".." in parts or "\0" in path:
        raise BadInputError(f"{flag} {path!r}: the path must be absolute, without ..")
    destination = "/" + "/".join(p for p in parts if p and p != ".")
    if destination == "/" or (
        destination != SHM
        and any(destination == r or destination.startswith(r + "/") for r in RESERVED)
    ):
        raise BadInputError(f"{flag} {path!r}: a sandbox's tmpfs cannot be mounted there")
    checked = []
    for option in filter(None, options.split(",")):
        name, eq, arg = option.partition("=")
        fits = eq and name in VALUES and VALUES[name].match(arg)
        if fits and name in ("uid", "gid"):
            fits = int(arg) < 2**32 - 1  # the kernel's ids; (uid_t)-1 is none
        if (not eq and name in FLAGS) or fits:
            checked.append(option)
        else:
            raise BadInputError(f"{flag} {path!r}: option {option!r} is not one a sandbox takes")
    for pair in (("ro", "rw"), ("exec", "noexec")):  # which wins would depend on the path
        if set(pair) <= set(checked):
            raise BadInputError(f"{flag} {path!r}: {pair[0]} and {pair[1]} both given")
    return Tmpfs(destination, tuple(checked))


def tmpfs_flags(values: list[str], flag: str = "--tmpfs") -> dict[str, str]:
    """docker's `--tmpfs PATH[:OPTIONS]` (repeatable) as the API's map."""
    asked: dict[str, str] = {}
    for text in values:
        path, _, options = text.partition(":")
        if path in asked:
            raise BadInputError(f"{flag} {path!r} is given twice")
        asked[path] = options
    return asked
