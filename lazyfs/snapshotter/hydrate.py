"""Writing one converted layer into a snapshot directory, as containerd's overlay applier
would have: the rare path where an ordinary snapshot is stacked on a lazy placeholder of an
inner layer (an unconverted image sharing a converted image's lower layers).

The layer comes from its layer record (chunker/layerrec.py), found through the image
config's diff_ids; file contents come through the node cache (verified, shared with the
lazy mounts, which have often read the same chunks already).
Overlay's on-disk format: a whiteout is a 0/0 character device, an opaque directory has
`trusted.overlay.opaque=y`; a hard link to a file of a lower layer first copies that file
up, as the kernel does when containerd links inside a mounted overlay. Every path is
opened below a directory fd with O_NOFOLLOW, so no name in a layer can escape the
directory.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path

from chunker import layerrec
from chunker.errors import CorruptObjectError
from chunker.model import ChunkRef, Inode, Kind
from chunker.store.interface import ObjectStore
from lazyfs.snapshotter.remote import image_diff_ids

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
OPAQUE_XATTR = "trusted.overlay.opaque"
ReadChunks = Callable[[list[ChunkRef]], list[bytes]]  # NodeCache.read


def layer_diff_id(store: ObjectStore, cache_dir: Path, image_id: str, index: int) -> str:
    diff_ids = image_diff_ids(store, cache_dir, image_id)
    if not 0 <= index < len(diff_ids):
        raise CorruptObjectError(f"image {image_id} has no layer {index}")
    return diff_ids[index]


def hydrate_layer(
    store: ObjectStore,
    cache_dir: Path,
    image_id: str,
    index: int,
    dest: Path,
    lower_dirs: list[Path],
    read_chunks: ReadChunks,
) -> None:
    """Write layer `index` of the image into the empty directory dest; lower_dirs are the
    layers below it (nearest first), already on disk."""
    diff_id = layer_diff_id(store, cache_dir, image_id, index)
    records = layerrec.decode(store.get(layerrec.record_key(diff_id)), diff_id)
    root = os.open(dest, _DIR)
    try:
        _LayerWriter(read_chunks, root, lower_dirs).apply(records)
    finally:
        os.close(root)


class _LayerWriter:
    def __init__(self, read_chunks: ReadChunks, root: int, lower_dirs: list[Path]) -> None:
        self.read_chunks = read_chunks
        self.root = root
        self.lower_dirs = lower_dirs
        self.dir_times: list[tuple[bytes, int]] = []

    def apply(self, records: list[layerrec.Record]) -> None:
        for op, path, inode, link in records:
            if not path:  # the layer's root directory: only its attributes
                if inode is not None and inode.kind == Kind.DIR:
                    self._set_root(inode)
                continue
            parent, name = self._parent(path)
            try:
                if op == layerrec.OP_INODE:
                    assert inode is not None
                    self._remove(parent, name, keep_dir=inode.kind == Kind.DIR)
                    self._create(parent, name, path, inode)
                elif op == layerrec.OP_HARDLINK:
                    self._remove(parent, name)
                    self._link(parent, name, link)
                elif op == layerrec.OP_WHITEOUT:
                    self._remove(parent, name)
                    os.mknod(name, stat.S_IFCHR | 0o000, os.makedev(0, 0), dir_fd=parent)
                else:  # opaque: the directory hides every lower child
                    fd = self._dir(parent, name, path)
                    try:
                        os.setxattr(fd, OPAQUE_XATTR, b"y")
                    finally:
                        os.close(fd)
            finally:
                os.close(parent)
        for path, mtime in reversed(self.dir_times):  # children changed them
            os.utime(path, ns=(mtime, mtime), dir_fd=self.root, follow_symlinks=False)

    # ------------------------------------------------------------------ entries

    def _create(self, parent: int, name: bytes, path: bytes, inode: Inode) -> None:
        kind = inode.kind
        if kind == Kind.DIR:
            os.close(self._dir(parent, name, path))
            self.dir_times.append((path, inode.mtime_ns))
        elif kind == Kind.REG:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600,
                         dir_fd=parent)  # fmt: skip
            try:
                offset = 0
                for ref, data in zip(inode.chunks, self.read_chunks(inode.chunks), strict=True):
                    os.pwrite(fd, data, offset)
                    offset += ref.size
                os.ftruncate(fd, inode.size)
            finally:
                os.close(fd)
        elif kind == Kind.SYMLINK:
            os.symlink(inode.target, name, dir_fd=parent)
        else:
            os.mknod(name, kind.s_ifmt | 0o600, inode.rdev, dir_fd=parent)
        os.chown(name, inode.uid, inode.gid, dir_fd=parent, follow_symlinks=False)
        if kind != Kind.SYMLINK:
            os.chmod(name, inode.mode, dir_fd=parent)
        for key, value in inode.xattrs.items():
            try:
                os.setxattr(_proc_path(parent, name), key, value, follow_symlinks=False)
            except OSError as exc:
                if not (kind == Kind.SYMLINK and exc.errno == errno.EPERM):
                    raise
        if kind != Kind.DIR:
            os.utime(name, ns=(inode.mtime_ns,) * 2, dir_fd=parent, follow_symlinks=False)

    def _set_root(self, inode: Inode) -> None:
        os.chown(self.root, inode.uid, inode.gid)
        os.chmod(self.root, inode.mode)
        for key, value in inode.xattrs.items():
            os.setxattr(self.root, key, value)
        self.dir_times.insert(0, (b".", inode.mtime_ns))

    def _link(self, parent: int, name: bytes, target: bytes) -> None:
        tparent, tname = self._parent(target)
        try:
            try:
                os.lstat(tname, dir_fd=tparent)
            except FileNotFoundError:
                self._copy_up(tparent, tname, target)
            os.link(tname, name, src_dir_fd=tparent, dst_dir_fd=parent, follow_symlinks=False)
        finally:
            os.close(tparent)

    def _copy_up(self, parent: int, name: bytes, path: bytes) -> None:
        """Copy a regular file of a lower layer into this one (data, owner, mode, xattrs)."""
        src = self._lower_open(path, os.O_RDONLY | os.O_NOFOLLOW)
        if src is None:
            raise CorruptObjectError(f"layer links to {path!r}, which no layer below holds")
        try:
            st = os.fstat(src)
            dst = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600,
                          dir_fd=parent)  # fmt: skip
            try:
                while os.sendfile(dst, src, None, 1 << 20):
                    pass
                for key in os.listxattr(src):
                    os.setxattr(dst, key, os.getxattr(src, key))
                os.fchown(dst, st.st_uid, st.st_gid)
                os.fchmod(dst, stat.S_IMODE(st.st_mode))
                os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
            finally:
                os.close(dst)
        finally:
            os.close(src)

    # ------------------------------------------------------------------ paths

    def _parent(self, path: bytes) -> tuple[int, bytes]:
        """An fd on path's parent directory in this layer (made if missing) and the name."""
        parts = path.split(b"/")
        fd = os.dup(self.root)
        try:
            for i, part in enumerate(parts[:-1]):
                nxt = self._dir(fd, part, b"/".join(parts[: i + 1]))
                os.close(fd)
                fd = nxt
        except BaseException:
            os.close(fd)
            raise
        return fd, parts[-1]

    def _dir(self, parent: int, name: bytes, path: bytes) -> int:
        """An fd on directory name below parent; a missing one is made with the attributes
        of the same directory in the layers below, as overlay's copy-up would."""
        try:
            return os.open(name, _DIR, dir_fd=parent)
        except FileNotFoundError:
            pass
        os.mkdir(name, 0o755, dir_fd=parent)
        fd = os.open(name, _DIR, dir_fd=parent)
        lower = self._lower_open(path, _DIR)
        if lower is not None:
            try:
                st = os.fstat(lower)
                os.fchown(fd, st.st_uid, st.st_gid)
                os.fchmod(fd, stat.S_IMODE(st.st_mode))
                self.dir_times.append((path, st.st_mtime_ns))
            finally:
                os.close(lower)
        return fd

    def _remove(self, parent: int, name: bytes, keep_dir: bool = False) -> None:
        """Make room for an entry: what this layer already has at name goes."""
        try:
            st = os.lstat(name, dir_fd=parent)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=parent)
        elif not keep_dir:
            _rmtree_at(parent, name)

    def _lower_open(self, path: bytes, flags: int) -> int | None:
        """Open path in the nearest layer below that has it; None if a whiteout or no layer
        does. Components are never followed through symlinks."""
        for layer in self.lower_dirs:
            fd = os.open(layer, _DIR)
            try:
                parts = path.split(b"/")
                for part in parts[:-1]:
                    nxt = os.open(part, _DIR, dir_fd=fd)
                    os.close(fd)
                    fd = nxt
                st = os.lstat(parts[-1], dir_fd=fd)
                if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                    return None  # whited out from here down
                return os.open(parts[-1], flags | os.O_CLOEXEC, dir_fd=fd)
            except OSError:
                continue
            finally:
                os.close(fd)
        return None


def _proc_path(dir_fd: int, name: bytes) -> bytes:
    return f"/proc/self/fd/{dir_fd}/".encode() + name


def _rmtree_at(parent: int, name: bytes) -> None:
    fd = os.open(name, _DIR, dir_fd=parent)
    try:
        for child in os.listdir(fd):
            st = os.lstat(child, dir_fd=fd)
            if stat.S_ISDIR(st.st_mode):
                _rmtree_at(fd, os.fsencode(child))
            else:
                os.unlink(child, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent)
