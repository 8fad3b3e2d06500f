"""Each layer of an image as a tree overlayfs can stack: what a layer changed, in the
form a lower layer of an overlay mount gives it (docs/FORMATS.md, "Layer trees").

An image's merged tree is one tree per image: fifty images built on one base bring up
fifty copies of the base's metadata and read its files through fifty page caches. With
a tree per layer, a node mounts the base's tree once, and an image new to the node
brings up only its own top layers (docs/design-changes.md, session 42).

Layer k's tree is the difference between the merged trees before and after layer k
(`Tree.snapshot`), so it follows exactly the rules registry_bridge/tree.py applies:

- every path whose Inode layer k put there (a new object: a file, a hard link, a
  replaced directory's new metadata), with every ancestor, each as the merged tree has
  it after layer k (an overlay shows a directory's metadata from the topmost layer
  that has it);
- a whiteout (a character device 0/0, overlayfs's own) for every path the layer
  removed whose parent is a directory after it: below a removed path the whiteout of
  the path hides the rest, and a directory that layer k made again in place of a lower
  one gets one whiteout per lower child it no longer has, so no opaque marker is needed.

A hard link from a layer to a file of a lower layer is a file of its own in the layer's
tree (the same chunks, so no byte is stored twice), as it is in a containerd snapshot.
A layer that changed nothing has no tree.
"""

from __future__ import annotations

from chunker.model import Inode, Kind


def _parent(path: bytes) -> bytes:
    return path.rpartition(b"/")[0]


def _components(path: bytes) -> list[bytes]:
    return path.split(b"/") if path else []


WHITEOUT_MODE = 0  # overlayfs looks at the type and the device number only


def layer_tree(
    before: dict[bytes, Inode], after: dict[bytes, Inode]
) -> tuple[list[tuple[bytes, Inode]], dict[int, int]] | None:
    """(entries, nlink) of the layer that turned `before` into `after`, as
    chunker.images.publish_tree takes them: root first, parents before children,
    siblings by name. None if the layer changed nothing."""
    changed = [p for p, inode in after.items() if before.get(p) is not inode]
    whiteouts = {
        p: Inode(Kind.CHR, WHITEOUT_MODE)
        for p in before
        if p not in after
        and (parent := after.get(_parent(p))) is not None
        and parent.kind == Kind.DIR
    }
    if not changed and not whiteouts:
        return None
    paths: set[bytes] = {b""}
    for path in (*changed, *whiteouts):
        while path not in paths:
            paths.add(path)
            path = _parent(path)
    entries = [(p, whiteouts.get(p) or after[p]) for p in sorted(paths, key=_components)]
    links: dict[int, int] = {}
    subdirs: dict[bytes, int] = {}
    for path, inode in entries:
        links[id(inode)] = links.get(id(inode), 0) + 1
        if inode.kind == Kind.DIR and path:
            subdirs[_parent(path)] = subdirs.get(_parent(path), 0) + 1
    nlink = {
        id(inode): 2 + subdirs.get(path, 0) if inode.kind == Kind.DIR else links[id(inode)]
        for path, inode in entries
    }
    return entries, nlink
