"""Apply layers in order into one merged tree, as `umoci unpack` (and containerd) do.

The rules, each checked against `umoci unpack` by tests/registry_bridge/test_tree.py:

- An entry replaces whatever was at its path, subtree included, unless both the old and
  the new object are directories: then the directory takes the new metadata (mode, owner,
  mtime and the whole xattr set) and keeps its children.
- Missing parent directories are created: mode 0o755, owned by root. umoci gives them the
  time of unpacking; a content-addressed manifest cannot, so they take the mtime of the
  entry that needed them.
- A hard link makes its path share the target's Inode. The target must exist when the
  link is applied (in a lower layer or earlier in this layer) and must not be a
  directory. Replacing one path of a link group leaves the others alone.
- Whiteouts act on lower layers only: every path this layer adds, and every ancestor of
  such a path, survives a whiteout or opaque marker of this layer whatever the order of
  the entries (umoci's "upper paths"). `.wh.X` removes X and its subtree;
  `.wh..wh..opq` removes everything below its directory. A whiteout of a path that
  does not exist does nothing. Like umoci, this is done in tar order, so only the
  metadata of a kept directory can depend on the order: an opaque marker before
  `d/sub/f` removes the lower `d/sub` (recreated as a missing parent), one after it
  keeps the lower `d/sub` and its metadata.
- Nothing is ever written through a symlink: umoci resolves symlinks inside the root
  for parent directories, but an image whose layers rely on that is refused here, so a
  path in the tree always names exactly one node.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from chunker.errors import BadInputError, UnsafePathError
from chunker.model import Inode, Kind
from registry_bridge.layer_tar import LayerEntry, Op, show_path

IMPLICIT_DIR_MODE = 0o755  # umoci: MkdirAll(dir, 0777) under the usual umask 022


def _split(path: bytes) -> tuple[bytes, bytes]:
    parent, _, name = path.rpartition(b"/")
    return parent, name


def _join(parent: bytes, name: bytes) -> bytes:
    return parent + b"/" + name if parent else name


class Tree:
    """The merged filesystem of an image: paths (bytes, root = b"") to Inode objects."""

    def __init__(self) -> None:
        root = Inode(Kind.DIR, 0o755)
        self._nodes: dict[bytes, Inode] = {b"": root}
        # Names of each directory's children, keyed by the directory's path.
        self._children: dict[bytes, set[bytes]] = {b"": set()}
        # Path of every directory inode, so nlink() can count its subdirectories.
        self._dir_paths: dict[Inode, bytes] = {root: b""}
        # Path counts of the inodes that more than one path points at (hard links).
        self._links: dict[Inode, int] = {}

    def __len__(self) -> int:
        return len(self._nodes)

    def get(self, path: bytes) -> Inode | None:
        return self._nodes.get(path)

    def snapshot(self) -> dict[bytes, Inode]:
        """Every path and its Inode as the tree is now (a copy: later layers do not
        change it; an object a layer replaces is a new Inode, so identity says what a
        layer changed)."""
        return dict(self._nodes)

    def nlink(self, inode: Inode) -> int:
        """Paths pointing at this (non-directory) inode; 2 + subdirectories for a directory."""
        if inode.kind != Kind.DIR:
            return self._links.get(inode, 1)
        path = self._dir_paths[inode]
        return 2 + sum(
            1 for name in self._children[path] if self._nodes[_join(path, name)].kind == Kind.DIR
        )

    def walk(self) -> Iterator[tuple[bytes, Inode]]:
        """Every path, root first, parents before children, siblings sorted by name."""
        stack = [b""]
        while stack:
            path = stack.pop()
            inode = self._nodes[path]
            yield path, inode
            if inode.kind == Kind.DIR:
                stack.extend(_join(path, n) for n in sorted(self._children[path], reverse=True))

    def apply(self, entries: Iterable[LayerEntry]) -> None:
        """Apply one layer's entries, in tar order, on top of what is already here."""
        upper: set[bytes] = set()  # paths this layer put in place, and their ancestors
        for entry in entries:
            if entry.op == Op.INODE:
                assert entry.inode is not None
                self._put(entry.path, entry.inode, upper)
            elif entry.op == Op.HARDLINK:
                self._link(entry.path, entry.link, upper)
            elif entry.op in (Op.WHITEOUT, Op.OPAQUE):
                self._whiteout(entry.path, entry.op == Op.OPAQUE, upper)
            else:
                raise BadInputError(f"layer entry {show_path(entry.path)}: unknown op {entry.op!r}")

    # -- the operations ----------------------------------------------------------------

    def _put(self, path: bytes, inode: Inode, upper: set[bytes]) -> None:
        if path == b"":
            if inode.kind != Kind.DIR:
                raise UnsafePathError("layer entry for the image root is not a directory")
            self._replace_dir(b"", inode)
            return
        self._make_parents(path, inode.mtime_ns)
        old = self._nodes.get(path)
        if old is not None and old.kind == Kind.DIR and inode.kind == Kind.DIR:
            self._replace_dir(path, inode)
        else:
            if old is not None:
                self._remove(path)
            self._insert(path, inode)
        self._mark_upper(path, upper)

    def _link(self, path: bytes, target: bytes, upper: set[bytes]) -> None:
        what = f"hard link {show_path(path)} -> {show_path(target)}"
        if self._symlink_above(target):
            raise UnsafePathError(f"{what}: target is below a symlinked directory")
        inode = self._nodes.get(target)
        if inode is None:
            raise BadInputError(f"{what}: target does not exist")
        if inode.kind == Kind.DIR:
            raise BadInputError(f"{what}: target is a directory")
        if path == b"":
            raise UnsafePathError(f"{what}: the image root must be a directory")
        if target == path or target.startswith(path + b"/"):
            # umoci removes the link's path first, so the target is gone when it links.
            raise BadInputError(f"{what}: the link would replace its own target")
        self._make_parents(path, inode.mtime_ns)
        if path in self._nodes:
            self._remove(path)
        self._insert(path, inode)
        self._links[inode] = self._links.get(inode, 1) + 1
        self._mark_upper(path, upper)

    def _whiteout(self, path: bytes, opaque: bool, upper: set[bytes]) -> None:
        if self._symlink_above(path):
            raise UnsafePathError(f"whiteout {show_path(path)}: entry below a symlinked directory")
        top = self._nodes.get(path)
        if top is None:
            return  # nothing there (maybe removed by an earlier whiteout): a no-op in umoci
        if opaque and top.kind != Kind.DIR:
            return
        # Remove every path under `path` that this layer did not put there. A path in
        # `upper` is kept and searched further; anything else goes with its subtree.
        pending = [path]
        while pending:
            current = pending.pop()
            if current not in upper and not (opaque and current == path):
                self._remove(current)
            elif self._nodes[current].kind == Kind.DIR:
                pending.extend(_join(current, n) for n in self._children[current])

    # -- helpers -----------------------------------------------------------------------

    # Invariant: every ancestor of a node in the tree is a directory (nothing is inserted
    # below a non-directory, and replacing a directory removes its subtree). So the
    # nearest existing ancestor of a path is the only one worth checking.

    def _symlink_above(self, path: bytes) -> bool:
        """Whether the nearest existing ancestor of `path` is a symlink."""
        parent = path
        while parent:
            parent = _split(parent)[0]
            node = self._nodes.get(parent)
            if node is not None:
                return node.kind == Kind.SYMLINK
        return False

    def _make_parents(self, path: bytes, mtime_ns: int) -> None:
        """Check the nearest existing ancestor of `path`; create the missing ones below it."""
        missing: list[bytes] = []
        parent = _split(path)[0]
        while (node := self._nodes.get(parent)) is None:
            missing.append(parent)
            parent = _split(parent)[0]
        if node.kind == Kind.SYMLINK:
            raise UnsafePathError(
                f"layer entry {show_path(path)}: entry below a symlinked directory"
            )
        if node.kind != Kind.DIR:
            raise BadInputError(
                f"layer entry {show_path(path)}: parent {show_path(parent)} is not a directory"
            )
        for directory in reversed(missing):
            self._insert(directory, Inode(Kind.DIR, IMPLICIT_DIR_MODE, mtime_ns=mtime_ns))

    def _insert(self, path: bytes, inode: Inode) -> None:
        parent, name = _split(path)
        self._nodes[path] = inode
        self._children[parent].add(name)
        if inode.kind == Kind.DIR:
            self._children[path] = set()
            self._dir_paths[inode] = path

    def _replace_dir(self, path: bytes, inode: Inode) -> None:
        del self._dir_paths[self._nodes[path]]
        self._nodes[path] = inode
        self._dir_paths[inode] = path

    def _remove(self, path: bytes) -> None:
        """Remove `path` and everything below it."""
        parent, name = _split(path)
        self._children[parent].discard(name)
        pending = [path]
        while pending:
            current = pending.pop()
            inode = self._nodes.pop(current)
            if inode.kind == Kind.DIR:
                del self._dir_paths[inode]
                pending.extend(_join(current, n) for n in self._children.pop(current))
            elif inode in self._links:
                left = self._links[inode] - 1
                if left > 1:
                    self._links[inode] = left
                else:
                    del self._links[inode]

    @staticmethod
    def _mark_upper(path: bytes, upper: set[bytes]) -> None:
        while path not in upper:
            upper.add(path)
            if not path:
                return
            path = _split(path)[0]
