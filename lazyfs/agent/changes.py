"""What a sandbox changed in its image's files: its overlay's upper directory against the
trees below it, as `docker diff` shows a container's (GET /containers/{id}/changes).

    changes(box.dir / "upper", lower)  # [Change("/etc", "changed"), Change("/x", "added")]

Each path under the upper directory is one change, sorted by path:
- "deleted": overlayfs's whiteout (a 0/0 character device) for a name the image had;
- "added": a name the image has not (every file under an added directory too);
- "changed": a name the image has, written, its metadata changed, or a directory a
  change lies under (as dockerd lists it). A directory made opaque (removed and made
  again) is changed, and each name the image had in it and it has not is deleted.
Read from the host, without entering the sandbox. The upper directory is the sandbox's
own (its code made every name there, and may swap a directory for a symlink while it is
walked), so each directory is opened with openat2 inside it (files.openat2:
RESOLVE_IN_ROOT, and O_NOFOLLOW: a symlink is listed, never entered), listed through its
descriptor, and nothing else is opened. The image's trees are looked up layer by layer,
never through a symlink (process.lookup_path). Names that are not UTF-8 are shown with
U+FFFD, as dockerd's JSON does. A sandbox that changed more than `limit` paths, or whose
changes' paths come to more than MAX_PATH_BYTES, is refused (TooManyChanges) rather than
answered in part; the walk stops as soon as it has read that many names, so what it
holds is bounded by the limits, not by what the sandbox made (600,000 links in one
directory took the agent from 168 to 707 MB when a directory was listed whole first).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import NamedTuple

from chunker.errors import BadInputError
from lazyfs.agent.files import openat2
from lazyfs.sandbox.process import Root, is_opaque, is_whiteout, lookup_in, merged_dirs

MAX_CHANGES = 100_000
MAX_PATH_BYTES = 32 * 2**20  # of the changes' paths, all told (a path may be 4 KiB long)


class Change(NamedTuple):
    path: str  # absolute, in the sandbox
    kind: str  # "added", "changed" or "deleted"


class TooManyChanges(BadInputError):
    """The sandbox changed more paths than one answer lists."""


def _shown(parts: list[str]) -> str:
    """The path as the sandbox names it, its bytes that are not UTF-8 as U+FFFD."""
    raw = os.fsencode("/" + "/".join(parts))
    return raw.decode("utf-8", "replace")


def _lower_names(dirs: list[Path]) -> set[str]:
    """The names the image has in a directory whose merged_dirs are `dirs`."""
    names: set[str] = set()
    hidden: set[str] = set()
    for here in dirs:  # top first
        try:
            with os.scandir(here) as entries:
                for entry in entries:
                    if entry.name not in names and entry.name not in hidden:
                        whiteout = is_whiteout(entry.stat(follow_symlinks=False))
                        (hidden if whiteout else names).add(entry.name)
        except OSError:
            continue
    return names


class _Budget:
    """What one walk may read and answer: names read (an upper directory's names are
    nearly all changes), changes and their paths' bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.names = 0
        self.path_bytes = 0
        self.found: list[Change] = []

    def refuse(self, what: str) -> TooManyChanges:
        return TooManyChanges(f"the sandbox changed more than {what}; list a directory instead")

    def read(self) -> None:
        self.names += 1
        if self.names > self.limit:
            raise self.refuse(f"{self.limit} paths")

    def add(self, parts: list[str], kind: str) -> None:
        path = _shown(parts)
        self.path_bytes += len(path)
        if len(self.found) >= self.limit:
            raise self.refuse(f"{self.limit} paths")
        if self.path_bytes > MAX_PATH_BYTES:
            raise self.refuse(f"{MAX_PATH_BYTES} bytes of paths")
        self.found.append(Change(path, kind))


def changes(upper: Path, lower: Root, limit: int = MAX_CHANGES) -> list[Change]:
    """The sandbox's changes (see the top), sorted by path."""
    budget = _Budget(limit)
    try:
        root = os.open(upper, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:  # no upper directory: the sandbox went meanwhile
        return []
    try:
        _walk(root, lower, budget)
    finally:
        os.close(root)
    budget.found.sort()
    return budget.found


def _walk(root: int, lower: Root, budget: _Budget) -> None:
    """Each directory's names taken as they are read, so that what is held is the
    changes found and the directories still to walk, never a whole listing."""
    todo: list[tuple[list[str], bool]] = [([], False)]  # (a directory, added: not the image's)
    while todo:
        parts, added = todo.pop()
        try:
            flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
            fd = openat2(root, "/".join(parts), flags) if parts else os.dup(root)
        except OSError:  # gone, or a symlink now: the sandbox runs on
            continue
        try:
            # The image's directories this one stands on, found once for all its names.
            below = [] if added else merged_dirs(lower, parts)
            opaque = bool(parts) and not added and is_opaque(fd)
            here = _directory(fd, parts, below, opaque, budget, todo)
        except OSError:  # its listing failed (removed meanwhile): the sandbox runs on
            continue
        finally:
            os.close(fd)
        if opaque:
            for name in sorted(_lower_names(below) - here):
                budget.add([*parts, name], "deleted")


def _directory(
    fd: int,
    parts: list[str],
    below: list[Path],
    opaque: bool,
    budget: _Budget,
    todo: list[tuple[list[str], bool]],
) -> set[str]:
    """The changes of one directory's names; its subdirectories onto `todo`. Its names
    if it is opaque (to find what it hides), else an empty set."""
    here: set[str] = set()
    with os.scandir(fd) as it:
        for entry in it:
            budget.read()
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed meanwhile
            name = entry.name
            if opaque:
                here.add(name)
            path = [*parts, name]
            if is_whiteout(st):
                if lookup_in(below, name) is not None:
                    budget.add(path, "deleted")
                continue
            new = lookup_in(below, name) is None
            budget.add(path, "added" if new else "changed")
            if stat.S_ISDIR(st.st_mode):
                todo.append((path, new))
    return here
