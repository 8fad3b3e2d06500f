"""The EROFS writer against the real thing: Debian's fsck.erofs and this kernel's EROFS.

Every image is materialized as a whole device (metadata image + data area holding each
file's real bytes), checked with fsck.erofs, mounted file-backed (mount(2) straight on the
file, as the FUSE-file setup will: mount(8) would slip a loop device in), and every entry
is compared with the input.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import random
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import blake3
import pytest

from chunker.erofs import BLOCK_SIZE, ErofsLayout, build_erofs
from chunker.errors import BadInputError
from chunker.model import ChunkRef, Inode, Kind

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting EROFS needs root")

Entries = list[tuple[bytes, Inode]]
Data = Callable[[Inode], bytes | None]  # a file's bytes; None: zeros (left sparse)

_MS_RDONLY = 1
_libc = ctypes.CDLL(None, use_errno=True)


# -- helpers ---------------------------------------------------------------------------


@pytest.fixture
def work() -> Iterator[Path]:
    """A scratch directory, deleted afterwards whatever happened."""
    with tempfile.TemporaryDirectory(prefix="lazyfs-erofs-test-") as d:
        yield Path(d)


def nlinks(entries: Entries) -> dict[int, int]:
    """Link counts as convert computes them (registry_bridge.tree.Tree.nlink)."""
    counts: dict[int, int] = {}
    by_path = dict(entries)
    for path, inode in entries:
        if inode.kind == Kind.DIR:
            counts.setdefault(id(inode), 2)
            if path:
                parent = by_path[path.rpartition(b"/")[0]]
                counts[id(parent)] = counts.get(id(parent), 2) + 1
        else:
            counts[id(inode)] = counts.get(id(inode), 0) + 1
    return counts


def materialize(meta: Path, layout: ErofsLayout, data: Data, device: Path) -> None:
    """The device the kernel mounts: the metadata image, then each extent's file bytes."""
    image = meta.read_bytes()
    assert len(image) == layout.meta_blocks * BLOCK_SIZE
    with open(device, "wb") as out:
        out.write(image)
        out.truncate(layout.total_blocks * BLOCK_SIZE)
        for first, count, inode in layout.extents:
            assert count == -(-inode.size // BLOCK_SIZE)
            content = data(inode)
            if content is not None:
                assert len(content) == inode.size
                out.seek(first * BLOCK_SIZE)
                out.write(content)


def fsck(device: Path) -> None:
    """fsck.erofs must accept the image (and read every file's data)."""
    run = subprocess.run(["fsck.erofs", str(device)], capture_output=True, text=True)
    assert run.returncode == 0, f"fsck.erofs failed:\n{run.stdout}{run.stderr}"


@contextmanager
def mounted(device: Path, work: Path) -> Iterator[Path]:
    point = Path(tempfile.mkdtemp(prefix="mnt-", dir=work))
    if _libc.mount(bytes(device), bytes(point), b"erofs", _MS_RDONLY, None) != 0:
        err = ctypes.get_errno()
        point.rmdir()
        raise OSError(err, f"mount -t erofs {device}: {os.strerror(err)}")
    try:
        yield point
    finally:
        if subprocess.run(["umount", str(point)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(point)], check=True)
        point.rmdir()


def build_and_mount(
    entries: Entries, data: Data, work: Path, name: str = "img", **kw: object
) -> tuple[ErofsLayout, Path, Path]:
    meta, device = work / f"{name}.meta", work / f"{name}.dev"
    layout = build_erofs(entries, nlinks(entries), meta, **kw)  # type: ignore[arg-type]
    materialize(meta, layout, data, device)
    fsck(device)
    return layout, meta, device


def expect_entry(root: Path, path: bytes, inode: Inode, nlink: int, data: Data) -> os.stat_result:
    """Compare one mounted entry with its input."""
    full = os.path.join(bytes(root), path) if path else bytes(root)
    st = os.lstat(full)
    where = path.decode("utf-8", "backslashreplace") or "/"
    assert stat.S_IFMT(st.st_mode) == inode.kind.s_ifmt, where
    want_mode = 0o777 if inode.kind == Kind.SYMLINK else inode.mode & 0o7777
    assert stat.S_IMODE(st.st_mode) == want_mode, where
    assert (st.st_uid, st.st_gid) == (inode.uid, inode.gid), where
    assert st.st_mtime_ns == inode.mtime_ns, where
    assert st.st_nlink == nlink, where
    if inode.kind == Kind.REG:
        assert st.st_size == inode.size, where
        content = data(inode)
        with open(full, "rb") as f:
            if content is not None:
                assert f.read() == content, where
            else:  # a sparse file: check its last bytes only
                f.seek(max(0, inode.size - 8192))
                assert f.read() == bytes(min(inode.size, 8192)), where
    elif inode.kind == Kind.SYMLINK:
        assert os.readlink(full) == inode.target, where
        assert st.st_size == len(inode.target), where
    elif inode.kind in (Kind.CHR, Kind.BLK):
        assert st.st_rdev == inode.rdev, where
    names = sorted(os.fsencode(n) for n in os.listxattr(full, follow_symlinks=False))
    assert names == sorted(inode.xattrs), where
    for name, value in inode.xattrs.items():
        assert os.getxattr(full, name, follow_symlinks=False) == value, (where, name)
    return st


def expect_tree(root: Path, entries: Entries, data: Data) -> None:
    """Every input entry is there, exactly; hard links share an inode; nothing else is."""
    counts = nlinks(entries)
    ino_of: dict[int, int] = {}
    for path, inode in entries:
        st = expect_entry(root, path, inode, counts[id(inode)], data)
        assert ino_of.setdefault(id(inode), st.st_ino) == st.st_ino, path
    assert len(set(ino_of.values())) == len(ino_of)  # distinct inodes stay distinct
    listed = {b""} | {
        os.path.relpath(os.path.join(d, n), bytes(root))
        for d, dirs, files in os.walk(bytes(root))
        for n in dirs + files
    }
    assert listed == {p for p, _ in entries}


def by_id(contents: dict[int, bytes]) -> Data:
    """Data from a dict keyed by id(inode)."""
    return lambda inode: contents.get(id(inode))


def chunked(size: int, content: bytes | None = None, mode: int = 0o644, **kw: object) -> Inode:
    """A regular file whose chunk list names its content (one chunk), as convert makes."""
    ref = [ChunkRef(blake3.blake3(content).digest(), size, "p", 0, 0)] if content else []
    return Inode(Kind.REG, mode, size=size, chunks=ref, **kw)  # type: ignore[arg-type]


# -- the synthetic tree with every kind and edge case -------------------------------------


def synthetic_tree() -> tuple[Entries, dict[int, bytes], dict[str, Inode]]:
    rnd = random.Random(42)
    contents: dict[int, bytes] = {}
    named: dict[str, Inode] = {}
    entries: Entries = []

    def add(path: bytes, inode: Inode, content: bytes | None = None) -> Inode:
        entries.append((path, inode))
        if content is not None:
            contents[id(inode)] = content
        return inode

    add(b"", Inode(Kind.DIR, 0o755, mtime_ns=1_700_000_000_123_456_789))
    add(b"files", Inode(Kind.DIR, 0o1777, uid=0, gid=0))
    for size in (0, 1, 4095, 4096, 4097, (1 << 20) + 3):
        body = rnd.randbytes(size)
        named[f"size{size}"] = add(
            b"files/size-%d" % size, chunked(size, body, mtime_ns=size * 1_000_000_007), body
        )
    named["big"] = add(b"files/sparse-4g", chunked((4 << 30) + 4097))  # > 32-bit sizes
    shared = rnd.randbytes(10_000)
    named["dup1"] = add(b"files/dup1", chunked(len(shared), shared), shared)
    named["dup2"] = add(b"files/dup2", chunked(len(shared), shared, uid=7), shared)
    hard = rnd.randbytes(777)
    named["hard"] = add(b"files/hard-a", chunked(len(hard), hard, mode=0o4755), hard)
    entries.append((b"files/hard-b", named["hard"]))
    add(b"files/setgid", chunked(3, b"abc", mode=0o2711), b"abc")
    add(b"files/ids", chunked(2, b"hi", uid=(1 << 32) - 2, gid=1 << 31), b"hi")
    add(b"files/old", chunked(1, b"o", mtime_ns=-1), b"o")
    add(b"files/older", chunked(1, b"p", mtime_ns=-86400 * 365 * 10**9 - 123), b"p")
    add(b"files/nochunks", Inode(Kind.REG, 0o600, size=5), b"12345")

    add(b"special", Inode(Kind.DIR, 0o700, uid=1000, gid=1000))
    add(b"special/null", Inode(Kind.CHR, 0o666, rdev=os.makedev(1, 3)))
    add(b"special/sda1", Inode(Kind.BLK, 0o660, gid=6, rdev=os.makedev(8, 1)))
    add(b"special/wide", Inode(Kind.CHR, 0o600, rdev=os.makedev(4095, (1 << 20) - 1)))
    add(b"special/fifo", Inode(Kind.FIFO, 0o644))
    add(b"special/sock", Inode(Kind.SOCK, 0o755))
    add(b"special/link", Inode(Kind.SYMLINK, 0o644, target=b"../files/size-1"))
    add(b"special/dangling", Inode(Kind.SYMLINK, 0o777, target=b"/nowhere/\xff\xfe"))
    add(b"special/longlink", Inode(Kind.SYMLINK, 0o777, target=b"x/" * 2047 + b"y"))
    entries.append((b"special/hard-c", named["hard"]))  # a link in another directory

    acl = (2).to_bytes(4, "little") + b"".join(
        tag.to_bytes(2, "little") + perm.to_bytes(2, "little") + uid.to_bytes(4, "little")
        for tag, perm, uid in ((1, 7, 0xFFFFFFFF), (2, 6, 1000), (4, 5, 0xFFFFFFFF),
                               (0x10, 7, 0xFFFFFFFF), (0x20, 5, 0xFFFFFFFF))
    )  # fmt: skip
    cap = (0x02000001).to_bytes(4, "little") + (1 << 10).to_bytes(4, "little") + bytes(12)
    xa = {
        b"user.a": b"",
        b"user.\xffodd": b"\x00\x01binary",
        b"trusted.overlay.opaque": b"y",
        b"security.capability": cap,
        b"security.selinux": b"system_u:object_r:bin_t:s0\x00",
        b"system.posix_acl_access": acl,
    }
    add(b"xattrs", Inode(Kind.DIR, 0o755, xattrs={**xa, b"system.posix_acl_default": acl}))
    add(b"xattrs/file", chunked(4, b"data", xattrs=xa), b"data")
    add(b"xattrs/bigvalue", chunked(1, b"b", xattrs={b"user.big": rnd.randbytes(65535)}), b"b")
    many = {b"user.k%03d" % k: rnd.randbytes(k) for k in range(300)}
    add(b"xattrs/many", Inode(Kind.DIR, 0o755, xattrs=many))
    add(b"xattrs/many/f", chunked(1, b"m"), b"m")
    add(b"xattrs/symlink", Inode(Kind.SYMLINK, 0o777, target=b"file", xattrs={b"trusted.t": b"1"}))

    # names: 255 bytes, not UTF-8, sorting around "." and "..", spaces and newlines
    add(b"names", Inode(Kind.DIR, 0o755))
    for name in (b"n" * 255, b"\xff\xfe\x80", b"-", b"!", b".hidden", b"..x", b"a b\nc", b"\x01"):
        add(b"names/" + name, chunked(1, b"n"), b"n")
    add(b"names/" + b"d" * 255, Inode(Kind.DIR, 0o755))
    add(b"names/" + b"d" * 255 + b"/" + b"e" * 255, chunked(0))

    # a directory of ~5,000 entries: many dirent blocks
    add(b"big", Inode(Kind.DIR, 0o755))
    for k in range(5000):
        name = b"entry-%05d-" % (k * 7919 % 5000) + b"z" * (k % 40)
        if k % 10 == 0:
            add(b"big/" + name, Inode(Kind.DIR, 0o750, mtime_ns=k))
        elif k % 10 == 1:
            add(b"big/" + name, Inode(Kind.SYMLINK, 0o777, target=b"t%d" % k))
        else:
            body = b"%d" % k
            add(b"big/" + name, chunked(len(body), body), body)

    # deep nesting
    path = b"deep"
    add(path, Inode(Kind.DIR, 0o755))
    for level in range(100):
        path += b"/l%d" % level
        add(path, Inode(Kind.DIR, 0o755, mtime_ns=level))
    add(path + b"/leaf", chunked(4, b"leaf"), b"leaf")
    return entries, contents, named


def test_synthetic_tree_mounts_exactly(work: Path) -> None:
    entries, contents, named = synthetic_tree()
    order = [named["size4097"], named["hard"], named["size1"]]
    # every file has its bytes, except the one meant to be sparse
    files = {id(i) for _, i in entries if i.kind == Kind.REG and i.size}
    assert files - contents.keys() == {id(named["big"])}
    layout, _, device = build_and_mount(
        entries, by_id(contents), work, data_order=order, build_time_ns=1_700_000_000 * 10**9
    )
    starts = [first for first, _, _ in layout.extents]
    assert starts == sorted(starts)
    # data_order first, in its order, right after the metadata; then tree order
    assert [inode for _, _, inode in layout.extents[:3]] == order
    assert layout.extents[0][0] == layout.meta_blocks
    seen: set[object] = {(i.size, tuple(c.id for c in i.chunks)) for i in order}
    rest = []
    for _, inode in entries:  # tree order, one extent per content
        key = (inode.size, tuple(c.id for c in inode.chunks)) if inode.chunks else id(inode)
        if inode.kind == Kind.REG and inode.size and key not in seen:
            seen.add(key)
            rest.append(inode)
    assert [inode for _, _, inode in layout.extents[3:]] == rest
    # identical files share one extent, listed once; extents tile the data area
    assert sum(1 for _, _, i in layout.extents if i in (named["dup1"], named["dup2"])) == 1
    assert all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(layout.extents))
    assert layout.total_blocks == layout.extents[-1][0] + layout.extents[-1][1]
    with mounted(device, work) as root:
        expect_tree(root, entries, by_id(contents))
        assert os.stat(root / "files/sparse-4g").st_size == (4 << 30) + 4097
        with open(root / "files/dup2", "rb") as f:
            assert f.read() == contents[id(named["dup1"])]


def test_same_input_gives_the_same_bytes(work: Path) -> None:
    entries, contents, named = synthetic_tree()
    nl = nlinks(entries)
    a = build_erofs(entries, nl, work / "a", data_order=[named["size1"]], build_time_ns=5)
    b = build_erofs(entries, nl, work / "b", data_order=[named["size1"]], build_time_ns=5)
    assert (work / "a").read_bytes() == (work / "b").read_bytes()
    assert [(f, c) for f, c, _ in a.extents] == [(f, c) for f, c, _ in b.extents]
    build_erofs(entries, nl, work / "c", data_order=[named["size1"]], build_time_ns=6)
    assert (work / "c").read_bytes() != (work / "a").read_bytes()


def test_empty_root_and_odd_directory_sizes(work: Path) -> None:
    """A lone root, and directories whose last dirent block is exactly full (no inline
    tail possible) or too big to sit next to its inode."""
    entries: Entries = [(b"", Inode(Kind.DIR, 0o700))]
    _, _, device = build_and_mount(entries, lambda i: None, work, "empty")
    with mounted(device, work) as root:
        expect_tree(root, entries, lambda i: None)
    # "." + ".." take 12+1 + 12+2 bytes; fill the rest of the block exactly with names of
    # 12 + 31 bytes: (4096 - 27) / 43 is not whole, so close the gap with one odd name.
    entries = [(b"", Inode(Kind.DIR, 0o755))]
    for n_names in range(1, 200, 7):
        d = b"d%03d" % n_names
        entries.append((d, Inode(Kind.DIR, 0o755)))
        for k in range(n_names):
            entries.append((d + b"/" + b"%03d" % k + b"f" * 28, Inode(Kind.FIFO, 0o644)))
    full = b"full"
    entries.append((full, Inode(Kind.DIR, 0o755)))
    left = BLOCK_SIZE - 27 - 43 * 90  # 199 bytes: one dirent + a 187-byte name
    for k in range(90):
        entries.append((full + b"/a%03d" % k + b"f" * 27, Inode(Kind.FIFO, 0o644)))
    entries.append((full + b"/z" + b"y" * (left - 13), Inode(Kind.FIFO, 0o644)))
    _, _, device = build_and_mount(entries, lambda i: None, work, "sizes")
    with mounted(device, work) as root:
        expect_tree(root, entries, lambda i: None)
        assert os.stat(root / "full").st_size == BLOCK_SIZE


# -- hostile input --------------------------------------------------------------------------


def _root() -> Inode:
    return Inode(Kind.DIR, 0o755)


def _one(inode: Inode, name: bytes = b"x") -> Entries:
    return [(b"", _root()), (name, inode)]


def _hardlinked_dir() -> Entries:
    d = Inode(Kind.DIR, 0o755)
    return [(b"", _root()), (b"a", d), (b"b", d)]


def _file_as_parent() -> Entries:
    return [(b"", _root()), (b"a", Inode(Kind.REG, 0o644)), (b"a/b", Inode(Kind.REG, 0o644))]


def _xattr(name: bytes, value: bytes = b"v") -> Entries:
    return _one(Inode(Kind.REG, 0o644, xattrs={name: value}))


HOSTILE: dict[str, Callable[[], Entries]] = {
    "name over 255 bytes": lambda: _one(Inode(Kind.FIFO, 0o644), b"n" * 256),
    "name with NUL": lambda: _one(Inode(Kind.FIFO, 0o644), b"a\0b"),
    "empty name (a//b)": lambda: [(b"", _root()), (b"a", Inode(Kind.DIR, 0o755)),
                                  (b"a//b", Inode(Kind.FIFO, 0o644))],
    "name '..'": lambda: _one(Inode(Kind.FIFO, 0o644), b".."),
    "absolute path": lambda: _one(Inode(Kind.FIFO, 0o644), b"/etc"),
    "parent missing": lambda: _one(Inode(Kind.FIFO, 0o644), b"no/such"),
    "parent is a file": _file_as_parent,
    "duplicate path": lambda: _one(Inode(Kind.FIFO, 0o644)) + [(b"x", Inode(Kind.FIFO, 0o644))],
    "hard-linked directory": _hardlinked_dir,
    "root not first": lambda: [(b"x", Inode(Kind.FIFO, 0o644))],
    "root not a directory": lambda: [(b"", Inode(Kind.REG, 0o644))],
    "no entries": lambda: [],
    "symlink target 4096 bytes": lambda: _one(Inode(Kind.SYMLINK, 0o777, target=b"t" * 4096)),
    "empty symlink target": lambda: _one(Inode(Kind.SYMLINK, 0o777, target=b"")),
    "symlink target with NUL": lambda: _one(Inode(Kind.SYMLINK, 0o777, target=b"a\0b")),
    "xattr without EROFS prefix": lambda: _xattr(b"os2.name"),
    "system xattr that is not an ACL": lambda: _xattr(b"system.foo"),
    "xattr with empty suffix": lambda: _xattr(b"user."),
    "xattr name over 255 bytes": lambda: _xattr(b"user." + b"n" * 251),
    "xattr value over 65535 bytes": lambda: _xattr(b"user.v", bytes(65536)),
    "inline xattrs too large": lambda: _one(Inode(Kind.REG, 0o644, xattrs={
        b"user.%d" % k: bytes(60000) for k in range(5)})),
    "xattr names over listxattr's 64 KiB": lambda: _one(Inode(Kind.REG, 0o644, xattrs={
        b"user." + b"%0250d" % k: b"" for k in range(300)})),
    "malformed ACL": lambda: _xattr(b"system.posix_acl_access", b"\x02\x00\x00\x00junk"),
    "ACL with unknown tag": lambda: _xattr(
        b"system.posix_acl_default", (2).to_bytes(4, "little") + b"\x40\x00\x07\x00" + bytes(4)),
    "uid over 32 bits": lambda: _one(Inode(Kind.FIFO, 0o644, uid=1 << 32)),
    "negative gid": lambda: _one(Inode(Kind.FIFO, 0o644, gid=-1)),
    "mtime over 64-bit seconds": lambda: _one(Inode(Kind.FIFO, 0o644, mtime_ns=10**9 << 63)),
    "device major over 12 bits": lambda: _one(Inode(Kind.CHR, 0o600, rdev=os.makedev(4096, 0))),
    "device minor over 20 bits": lambda: _one(Inode(Kind.BLK, 0o600, rdev=os.makedev(1, 1 << 20))),
    "file size 2^64-1": lambda: _one(Inode(Kind.REG, 0o644, size=(1 << 64) - 1)),
    "data over 2^32 blocks": lambda: _one(Inode(Kind.REG, 0o644, size=1 << 44)),
    "chunks not covering the size": lambda: _one(Inode(Kind.REG, 0o644, size=10, chunks=[
        ChunkRef(bytes(32), 5, "p", 0, 0)])),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_input_is_refused(case: str, work: Path) -> None:
    entries = HOSTILE[case]()
    dest = work / "img"
    dest.write_bytes(b"stale")  # a failed build must not leave the old image either
    with pytest.raises(BadInputError) as exc:
        build_erofs(entries, nlinks(entries), dest)
    assert "\n" not in str(exc.value) and str(exc.value).startswith("erofs: ")
    assert not dest.exists()
    assert os.listdir(work) == []  # no temporary file either


# -- scale ------------------------------------------------------------------------------------


def test_200k_entries_build_fast_and_mount(work: Path) -> None:
    rnd = random.Random(7)
    entries: Entries = [(b"", Inode(Kind.DIR, 0o755))]
    contents: dict[int, bytes] = {}
    for d in range(400):
        top = b"pkg%03d" % d
        entries.append((top, Inode(Kind.DIR, 0o755, mtime_ns=d)))
        for s in range(4):
            sub = top + b"/sub%d" % s
            entries.append((sub, Inode(Kind.DIR, 0o755)))
            for f in range(124):
                path = sub + b"/file_%04d.py" % f
                if f % 31 == 0:
                    entries.append((path, Inode(Kind.SYMLINK, 0o777, target=b"file_0001.py")))
                    continue
                body = b"%d/%d/%d\n" % (d, s, f) * (f % 5)
                inode = chunked(len(body), body, mtime_ns=f * 10**9 + s)
                if f % 50 == 7:
                    inode.xattrs = {b"user.mark": b"%d" % f}
                contents[id(inode)] = body
                entries.append((path, inode))
    assert len(entries) > 199_000
    meta = work / "meta"
    start = time.perf_counter()
    layout = build_erofs(entries, nlinks(entries), meta)
    took = time.perf_counter() - start
    size = meta.stat().st_size
    print(f"\n200k tree: {len(entries)} entries built in {took:.2f} s,"
          f" metadata {size / 2**20:.1f} MiB ({size / len(entries):.0f} B/entry),"
          f" {len(layout.extents)} extents")  # fmt: skip
    assert took < 10
    device = work / "dev"
    materialize(meta, layout, by_id(contents), device)
    fsck(device)
    with mounted(device, work) as root:
        counts = nlinks(entries)
        for path, inode in rnd.sample(entries, 3000):
            expect_entry(root, path, inode, counts[id(inode)], by_id(contents))
        assert sum(len(dirs) + len(files) for _, dirs, files in os.walk(root)) == len(entries) - 1


# -- a real image --------------------------------------------------------------------------


def test_python_image_matches_umoci_unpack(test_images, references, work: Path) -> None:  # noqa: ANN001
    """The python test image's merged tree, as convert builds it, served by EROFS with
    the real bytes, looks exactly like an independent `umoci unpack`."""
    from registry_bridge.decompress import open_layer_tar
    from registry_bridge.layer_tar import iter_layer
    from registry_bridge.transports import open_source
    from registry_bridge.tree import Tree
    from tests.treecompare import assert_trees_equal

    tree = Tree()
    with open_source(f"oci:{test_images.layout}:python") as source:
        for layer in source.layers:
            with open_layer_tar(source, layer) as stream:
                layer_entries = []
                for entry, reader in iter_layer(stream):
                    layer_entries.append(entry)
                    if reader is not None and entry.inode is not None:
                        # one chunk named by the content: enough for the writer's dedup
                        digest = blake3.blake3(reader.read()).digest()
                        entry.inode.chunks = [ChunkRef(digest, entry.inode.size, "p", 0, 0)]
                tree.apply(layer_entries)
    entries = list(tree.walk())
    ref = references("python")
    path_of = {id(inode): path for path, inode in entries}

    def data(inode: Inode) -> bytes:
        return (ref / os.fsdecode(path_of[id(inode)])).read_bytes()

    start = time.perf_counter()
    layout, meta, device = build_and_mount(entries, data, work)
    print(f"\npython image: {len(entries)} entries, built in {time.perf_counter() - start:.2f} s"
          f" with fsck, metadata {meta.stat().st_size / 2**20:.1f} MiB,"
          f" {len(layout.extents)} extents for"
          f" {sum(1 for _, i in entries if i.kind == Kind.REG and i.size)} files")  # fmt: skip
    with mounted(device, work) as root:
        assert_trees_equal(root, ref)
