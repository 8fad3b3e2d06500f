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
walked), so each directory is opened with openat2 by its name from its parent's
descriptor (files.openat2: RESOLVE_IN_ROOT, and O_NOFOLLOW: a symlink is listed, never
entered), listed through its descriptor, and nothing else is opened. So any depth is
walked: each directory was opened by its whole path from the upper directory once, and
past PATH_MAX (4096 bytes) that failed as if it had gone, so `docker diff` left out all
that lay deeper without a word (session 57). The walk holds one descriptor per level of
the directory it is in, at most MAX_DEPTH levels (past them the walk is refused, as
past its other limits). An error the sandbox's own removals do not explain is raised,
never taken for "gone". The image's trees are looked up layer by layer, never through a
symlink (process.lookup_path).
Names that are not UTF-8 are shown with U+FFFD, as dockerd's JSON does. A sandbox that
changed more than `limit` paths, or whose changes' paths come to more than
MAX_PATH_BYTES, is refused (TooManyChanges) rather than answered in part; the walk stops
as soon as it has read that many names, so what it holds is bounded by the limits, not
by what the sandbox made (600,000 links in one directory took the agent from 168 to
707 MB when a directory was listed whole first).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import NamedTuple

from chunker.errors import BadInputError
from lazyfs.agent.files import openat2
from lazyfs.sandbox.process import Root, is_opaque, is_whiteout, lookup_in, merged_dirs

MAX_CHANGES = 100_000
MAX_PATH_BYTES = 32 * 2**20  # of the changes' paths, all told (a path may be 4 KiB long)
# Directory levels walked: the walk holds a descriptor per level, and thousands of them
# in a few walks at once would take the agent's own (its connections, its runtimes).
MAX_DEPTH = 256
# What an open of a listed directory may meet because the sandbox changed it meanwhile:
# removed, or replaced by a file or a symlink (O_NOFOLLOW).
GONE = {errno.ENOENT, errno.ENOTDIR, errno.ELOOP}


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
    changes found and the directories still to walk, never a whole listing; each
    directory opened by its name from its parent's descriptor, which is held while its
    subdirectories are walked (one descriptor and one name per level)."""
    levels: list[tuple[int, list[tuple[str, bool]]]] = []  # (fd, subdirectories to walk)
    parts: list[str] = []  # the names from the upper directory to levels[-1]'s
    try:
        _visit(os.dup(root), parts, False, lower, budget, levels)
        while levels:
            fd, todo = levels[-1]
            if not todo:
                os.close(levels.pop()[0])
                if levels:
                    parts.pop()
                continue
            name, added = todo.pop()
            try:
                child = openat2(fd, name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            except OSError as exc:
                if exc.errno in GONE:  # the sandbox runs on
                    continue
                raise
            if len(levels) > MAX_DEPTH:
                os.close(child)
                raise TooManyChanges(f"the sandbox's changes go more than {MAX_DEPTH} levels deep")
            parts.append(name)
            _visit(child, parts, added, lower, budget, levels)
    finally:
        for fd, _ in levels:
            os.close(fd)


def _visit(
    fd: int,
    parts: list[str],
    added: bool,
    lower: Root,
    budget: _Budget,
    levels: list[tuple[int, list[tuple[str, bool]]]],
) -> None:
    """The changes of the directory `parts`, open at `fd` (which goes onto `levels`
    first, with the subdirectories to walk found here)."""
    todo: list[tuple[str, bool]] = []  # (name, added: not the image's)
    levels.append((fd, todo))
    # The image's directories this one stands on, found once for all its names.
    below = [] if added else merged_dirs(lower, parts)
    opaque = bool(parts) and not added and is_opaque(fd)
    here = _directory(fd, parts, below, opaque, budget, todo)
    if opaque:
        for name in sorted(_lower_names(below) - here):
            budget.add([*parts, name], "deleted")


def _directory(
    fd: int,
    parts: list[str],
    below: list[Path],
    opaque: bool,
    budget: _Budget,
    todo: list[tuple[str, bool]],
) -> set[str]:
    """The changes of one directory's names; its subdirectories onto `todo` (name,
    added). Its names if it is opaque (to find what it hides), else an empty set."""
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
                todo.append((name, new))
    return here
