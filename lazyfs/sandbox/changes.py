"""What a sandbox changed in its image's files: its overlay's upper directory against the
trees below it, as `docker diff` shows a container's (GET /containers/{id}/changes).

    changes(box.dir / "upper", lower)  # [Change("/etc", "changed"), Change("/x", "added")]

Each path under the upper directory is one change, sorted by path:
- "deleted": overlayfs's whiteout (a 0/0 character device) for a name the image had;
- "added": a name the image has not (every file under an added directory too);
- "changed": a name the image has, written, its metadata changed, or a directory a
  change lies under (as dockerd lists it). A directory made opaque (removed and made
  again) is changed, and each name the image had in it and it has not is deleted.
Read from the host, without entering the sandbox: the upper directory is the sandbox's
own (its code made every name there), so nothing is followed (no symlink, no mount),
nothing opened but directories, and names that are not UTF-8 are shown with U+FFFD, as
dockerd's JSON does. A sandbox that changed more than `limit` paths is refused
(TooManyChanges) rather than answered in part.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import NamedTuple

from chunker.errors import BadInputError
from lazyfs.sandbox.process import Root, is_whiteout, lookup_path

OPAQUE_XATTR = "trusted.overlay.opaque"
MAX_CHANGES = 100_000


class Change(NamedTuple):
    path: str  # absolute, in the sandbox
    kind: str  # "added", "changed" or "deleted"


class TooManyChanges(BadInputError):
    """The sandbox changed more paths than one answer lists."""


def _opaque(path: bytes) -> bool:
    try:
        return os.getxattr(path, OPAQUE_XATTR, follow_symlinks=False) == b"y"
    except OSError:
        return False


def _shown(parts: list[str]) -> str:
    """The path as the sandbox names it, its bytes that are not UTF-8 as U+FFFD."""
    raw = os.fsencode("/" + "/".join(parts))
    return raw.decode("utf-8", "replace")


def _lower_names(lower: Root, parts: list[str]) -> set[str]:
    """The names the image has in the directory `parts` (its layers merged)."""
    layers = [lower] if isinstance(lower, Path) else list(lower)
    names: set[str] = set()
    hidden: set[str] = set()
    for layer in layers:  # top first, down to a layer where it is no directory
        here = layer.joinpath(*parts)
        try:
            if not stat.S_ISDIR(os.lstat(here).st_mode):
                break
            with os.scandir(here) as entries:
                for entry in entries:
                    if entry.name in names or entry.name in hidden:
                        continue
                    whiteout = is_whiteout(entry.stat(follow_symlinks=False))
                    (hidden if whiteout else names).add(entry.name)
        except OSError:
            continue
        if _opaque(os.fsencode(here)):
            break
    return names


def changes(upper: Path, lower: Root, limit: int = MAX_CHANGES) -> list[Change]:
    """The sandbox's changes (see the top), sorted by path."""
    found: list[Change] = []

    def add(parts: list[str], kind: str) -> None:
        if len(found) >= limit:
            raise TooManyChanges(
                f"the sandbox changed more than {limit} paths; list a directory instead"
            )
        found.append(Change(_shown(parts), kind))

    todo: list[tuple[list[str], bool]] = [([], False)]  # (a directory, added: not the image's)
    while todo:
        parts, added = todo.pop()
        where = upper.joinpath(*parts)
        try:
            with os.scandir(where) as it:
                entries = [(e.name, e.stat(follow_symlinks=False)) for e in it]
        except OSError:  # gone meanwhile: the sandbox runs on
            continue
        if parts and not added and _opaque(os.fsencode(where)):
            here = {name for name, _ in entries}
            for name in sorted(_lower_names(lower, parts) - here):
                add([*parts, name], "deleted")
        for name, st in entries:
            path = [*parts, name]
            if is_whiteout(st):
                if not added and lookup_path(lower, path) is not None:
                    add(path, "deleted")
                continue
            new = added or lookup_path(lower, path) is None
            add(path, "added" if new else "changed")
            if stat.S_ISDIR(st.st_mode):
                todo.append((path, new))
    found.sort()
    return found
