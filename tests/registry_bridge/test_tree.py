"""Layer tars -> entries -> merged Tree, checked against `umoci unpack` of the same layers.

Every feature test builds synthetic layers, applies them with iter_layer + Tree, unpacks
the same layers with umoci (the reference extraction), and compares the two trees: paths,
types, modes, owners, sizes, contents, symlink targets, rdev, mtime in ns, xattrs,
hard-link groups and link counts. The rejection tests check the error class and message.
"""

from __future__ import annotations

import io
import os
import stat
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from chunker.errors import BadInputError, UnsafePathError
from chunker.model import Inode, Kind
from registry_bridge.layer_tar import LayerEntry, Op, iter_layer, parse_pax_time
from registry_bridge.tree import Tree
from testbed.layerbuild import (
    DEFAULT_MTIME_NS,
    blockdev,
    build_layer,
    chardev,
    directory,
    fifo,
    file,
    hardlink,
    make_oci_layout,
    opaque,
    symlink,
    whiteout,
)

# A version-2 file capability (cap_net_bind_service, effective): binary with NULs.
CAPABILITY = bytes.fromhex("010000020004000000000000000000000000000000")[:20]
BINARY = bytes(range(256))  # every byte value, not UTF-8

_KIND_OF_IFMT = {kind.s_ifmt: kind for kind in Kind}


# -- the two sides -----------------------------------------------------------------------


def apply_layers(layers: list[bytes]) -> tuple[Tree, dict[Inode, bytes]]:
    """Our side: the merged tree, and each regular file's content read via iter_layer."""
    tree = Tree()
    contents: dict[Inode, bytes] = {}
    for layer in layers:
        entries = []
        for entry, reader in iter_layer(io.BytesIO(layer)):
            if reader is not None:
                assert entry.inode is not None
                contents[entry.inode] = reader.read()
                assert len(contents[entry.inode]) == entry.inode.size
            entries.append(entry)
        tree.apply(entries)
    return tree, contents


def umoci_unpack(tmp_path: Path, layers: list[bytes]) -> Path:
    """The reference side: `umoci unpack` of an OCI layout holding these layers."""
    layout = make_oci_layout(tmp_path / "oci", layers, compression="gzip")
    bundle = tmp_path / "bundle"
    run = subprocess.run(
        ["umoci", "unpack", "--image", f"{layout}:latest", str(bundle)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    return bundle / "rootfs"


Record = dict[str, object]


def _record(kind: Kind, mode: int, uid: int, gid: int, mtime_ns: int) -> Record:
    return {"kind": kind.name, "mode": oct(mode), "uid": uid, "gid": gid, "mtime_ns": mtime_ns}


def tree_records(tree: Tree, contents: dict[Inode, bytes]) -> dict[bytes, Record]:
    out: dict[bytes, Record] = {}
    for path, inode in tree.walk():
        rec = _record(inode.kind, inode.mode, inode.uid, inode.gid, inode.mtime_ns)
        rec["xattrs"] = dict(sorted(inode.xattrs.items()))
        rec["nlink"] = tree.nlink(inode)
        if inode.kind != Kind.DIR:
            rec["size"] = inode.size
        if inode.kind == Kind.REG:
            rec["content"] = contents[inode]
        if inode.kind == Kind.SYMLINK:
            rec["target"] = inode.target
        if inode.kind in (Kind.CHR, Kind.BLK):
            rec["rdev"] = inode.rdev
        out[path] = rec
    return out


def disk_records(root: Path) -> dict[bytes, Record]:
    out: dict[bytes, Record] = {}
    base = os.fsencode(root)
    for top, dirs, files in os.walk(base):
        for name in [b"", *dirs, *files] if top == base else [*dirs, *files]:
            full = os.path.join(top, name) if name else top
            st = os.lstat(full)
            kind = _KIND_OF_IFMT[stat.S_IFMT(st.st_mode)]
            rec = _record(kind, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime_ns)
            rec["xattrs"] = {
                os.fsencode(n): os.getxattr(full, n, follow_symlinks=False)
                for n in sorted(os.listxattr(full, follow_symlinks=False))
            }
            rec["nlink"] = st.st_nlink
            if kind != Kind.DIR:
                rec["size"] = st.st_size
            if kind == Kind.REG:
                rec["content"] = Path(os.fsdecode(full)).read_bytes()
            if kind == Kind.SYMLINK:
                rec["target"] = os.readlink(full)
            if kind in (Kind.CHR, Kind.BLK):
                rec["rdev"] = st.st_rdev
            out[os.path.relpath(full, base).removeprefix(b".")] = rec
    return out


def link_groups_tree(tree: Tree) -> set[frozenset[bytes]]:
    groups: dict[int, set[bytes]] = {}
    for path, inode in tree.walk():
        if inode.kind != Kind.DIR:
            groups.setdefault(id(inode), set()).add(path)
    return {frozenset(g) for g in groups.values() if len(g) > 1}


def link_groups_disk(root: Path) -> set[frozenset[bytes]]:
    groups: dict[int, set[bytes]] = {}
    base = os.fsencode(root)
    for top, _dirs, files in os.walk(base):
        for name in files:
            full = os.path.join(top, name)
            groups.setdefault(os.lstat(full).st_ino, set()).add(os.path.relpath(full, base))
    return {frozenset(g) for g in groups.values() if len(g) > 1}


def assert_same_as_umoci(
    tmp_path: Path, layers: list[bytes], unpack_time: tuple[bytes, ...] = (b"",)
) -> Tree:
    """Apply `layers` both ways and compare everything.

    `unpack_time` names directories whose mtime umoci sets to the time of unpacking, so
    their mtime is not compared (everything else is). A deterministic manifest cannot
    copy that, so the Tree keeps a recorded mtime instead. umoci does it to:
    - directories no layer has an entry for (by default the root): we give them the
      mtime of the entry that needed them;
    - a directory it creates a missing subdirectory in, and a directory a whiteout or
      opaque marker removes lower children from while keeping the directory itself
      (except the directory holding the marker, whose times umoci restores): we keep
      the directory's own mtime.
    """
    tree, contents = apply_layers(layers)
    root = umoci_unpack(tmp_path, layers)
    ours, theirs = tree_records(tree, contents), disk_records(root)
    for path in unpack_time:
        for side in (ours, theirs):
            if path in side:
                side[path]["mtime_ns"] = None
    assert sorted(ours) == sorted(theirs)
    diffs = {
        path: {k: (v, theirs[path].get(k)) for k, v in rec.items() if v != theirs[path].get(k)}
        for path, rec in ours.items()
        if rec != theirs[path]
    }
    assert not diffs, f"(ours, umoci) differ: {diffs}"
    assert link_groups_tree(tree) == link_groups_disk(root)
    assert len(tree) == len(theirs)
    return tree


def _names(*paths: str) -> tuple[bytes, ...]:
    return tuple(os.fsencode(p) for p in paths)


LONG_DIR = "long/" + "d" * 120
LONG_FILE = LONG_DIR + "/" + "f" * 150


# -- features, each compared with umoci -----------------------------------------------


def test_every_entry_kind_and_attribute_pax(tmp_path: Path) -> None:
    layer = build_layer(
        [
            directory("etc", mode=0o750, uid=1, gid=2, mtime_ns=1_600_000_000_111_222_333),
            file("etc/setuid", b"#!/bin/sh\n", mode=0o4755),
            file("etc/setgid", b"x", mode=0o2711, uid=2**31 - 2, gid=2**31 - 3),
            directory("tmp", mode=0o1777),
            file(
                "etc/cap",
                b"ping",
                mode=0o755,
                xattrs={"security.capability": CAPABILITY, "user.bin": BINARY, "user.t": b"v"},
            ),
            # Empty pax values delete the keyword: no xattr, the ustar name and mtime stay.
            file("pax-empty", b"p", xattrs={"user.empty": b""}, pax={"path": "", "mtime": ""}),
            directory("etc/xdir", xattrs={"user.dir": b"\x00\x01"}),
            symlink("etc/rel", "../usr/bin/target"),
            symlink("abs", "/etc/passwd"),
            chardev("dev/null", 1, 3),
            blockdev("dev/sda", 8, 0),
            chardev("dev/big", 259, 70000, mode=0o600, uid=7),
            fifo("run/fifo", mode=0o620),
            file(b"names/caf\xe9-latin1", b"not utf-8"),
            file("names/\u00e9-utf8", b"utf-8"),
            file(LONG_FILE, b"long name"),
            symlink("long-target", "t" * 200),
            hardlink("etc/setuid-link", "etc/setuid"),
            hardlink("long/hl", LONG_FILE),
            file("empty"),
            file("big", os.urandom(300_000)),
            file("old", b"o", mtime_ns=-1_500_000_000),
            file("epoch", b"e", mtime_ns=0),
            file("ns", b"n", mtime_ns=1_700_000_000_000_000_001),
        ]
    )
    tree = assert_same_as_umoci(
        tmp_path, [layer], unpack_time=(b"", *_names("dev", "run", "names", "long", LONG_DIR))
    )
    cap = tree.get(b"etc/cap")
    assert cap is not None and cap.xattrs[b"security.capability"] == CAPABILITY
    assert cap.xattrs[b"user.bin"] == BINARY
    assert tree.get(b"names/caf\xe9-latin1") is not None


def test_gnu_format_long_names_base256_ids_raw_names(tmp_path: Path) -> None:
    layer = build_layer(
        [
            file(LONG_FILE, b"gnu long name", mtime_ns=1_500_000_000 * 10**9),
            symlink("sym", "x" * 300, mtime_ns=10**9),
            hardlink("hl", LONG_FILE, mtime_ns=10**9),
            file("bigid", b"b", uid=2**31 - 2, gid=2**32 - 2, mtime_ns=10**9),
            file(b"raw-\xff\xfe", b"raw bytes in the header", mtime_ns=10**9),
        ],
        fmt="gnu",
    )
    assert b"././@LongLink" in layer  # really the GNU long-name members
    assert_same_as_umoci(tmp_path, [layer], unpack_time=(b"", *_names("long", LONG_DIR)))


def test_whiteout_removes_name_and_subtree_of_lower_layers(tmp_path: Path) -> None:
    lower = build_layer(
        [
            directory("a"),
            directory("a/sub"),
            file("a/sub/f", b"1"),
            file("a/g", b"2"),
            file("b", b"3"),
            hardlink("b2", "b"),
            file("keep", b"4"),
        ]
    )
    upper = build_layer(
        [whiteout("a"), whiteout("b"), whiteout("nothing-here"), whiteout("missing/dir/x")]
    )
    tree = assert_same_as_umoci(tmp_path, [lower, upper])
    assert [p for p, _ in tree.walk()] == [b"", b"b2", b"keep"]
    assert tree.nlink(tree.get(b"b2")) == 1  # type: ignore[arg-type]


def test_whiteout_spares_what_the_same_layer_adds(tmp_path: Path) -> None:
    lower = build_layer(
        [file("x", b"old x"), file("y", b"old y"), directory("d"), file("d/old", b"old")]
    )
    upper = build_layer(
        [
            file("x", b"new x"),
            whiteout("x"),  # after the new x: the new x stays
            whiteout("y"),
            file("y", b"new y"),  # after the whiteout: recreated
            file("d/new", b"new"),
            whiteout("d"),  # d is an ancestor of a new path: only d/old goes
        ]
    )
    tree = assert_same_as_umoci(tmp_path, [lower, upper], unpack_time=(b"", b"d"))
    assert sorted(p for p, _ in tree.walk()) == [b"", b"d", b"d/new", b"x", b"y"]


@pytest.mark.parametrize("marker_first", [True, False], ids=["marker-first", "marker-last"])
def test_opaque_directory(tmp_path: Path, marker_first: bool) -> None:
    lower = build_layer(
        [
            directory("o", mode=0o700),
            file("o/a", b"a"),
            directory("o/sub", mode=0o711),
            file("o/sub/b", b"b"),
            directory("o/sub/deep"),
            file("o/sub/deep/c", b"c"),
            file("outside", b"kept"),
        ]
    )
    adds = [file("o/new", b"new"), file("o/sub/added", b"added")]
    marker = [opaque("o"), opaque("fresh")]
    upper = build_layer(
        marker + adds + [directory("fresh"), file("fresh/f")]
        if marker_first
        else adds + [directory("fresh"), file("fresh/f")] + marker
    )
    # marker first: the marker removes o/sub, umoci recreates it as a missing parent (in o);
    # marker last: o/sub is kept for o/sub/added, and loses its lower children.
    stamped = (b"", b"o", b"o/sub") if marker_first else (b"", b"o/sub")
    tree = assert_same_as_umoci(tmp_path, [lower, upper], unpack_time=stamped)
    assert sorted(p for p, _ in tree.walk()) == [
        b"",
        b"fresh",
        b"fresh/f",
        b"o",
        b"o/new",
        b"o/sub",
        b"o/sub/added",
        b"outside",
    ]


def test_opaque_root(tmp_path: Path) -> None:
    lower = build_layer([file("a", b"a"), directory("d"), file("d/b", b"b"), file("f", b"f")])
    upper = build_layer([file("n", b"n"), opaque("f"), opaque("")])  # opaque on a file: no-op
    tree = assert_same_as_umoci(tmp_path, [lower, upper])
    assert [p for p, _ in tree.walk()] == [b"", b"n"]


def test_directory_over_directory_takes_new_metadata_keeps_children(tmp_path: Path) -> None:
    lower = build_layer(
        [
            directory("d", mode=0o700, uid=5, gid=5, xattrs={"user.old": b"1"}),
            file("d/child", b"c"),
            directory("d/sub"),
        ]
    )
    upper = build_layer(
        [directory("d", mode=0o751, uid=6, gid=7, mtime_ns=5 * 10**18, xattrs={"user.new": b"2"})]
    )
    tree = assert_same_as_umoci(tmp_path, [lower, upper])
    d = tree.get(b"d")
    assert d is not None and d.xattrs == {b"user.new": b"2"} and tree.nlink(d) == 3


def test_replacing_one_type_with_another(tmp_path: Path) -> None:
    lower = build_layer(
        [
            directory("d"),
            directory("d/x"),
            file("d/x/y", b"y"),
            file("f", b"f"),
            directory("s"),
            file("s/inner", b"i"),
            directory("real"),
            symlink("l", "real"),
            file("p", b"p"),
        ]
    )
    upper = build_layer(
        [
            file("d", b"file over dir"),
            directory("f", mode=0o700),
            file("f/c", b"child of the new dir"),
            symlink("s", "elsewhere"),
            directory("l"),
            file("l/c", b"a dir replaced the symlink"),
            fifo("p"),
            file("same-layer", b"first a file"),
            directory("same-layer"),
        ]
    )
    assert_same_as_umoci(tmp_path, [lower, upper])


def test_hard_links(tmp_path: Path) -> None:
    lower = build_layer(
        [
            file("a", b"original", mode=0o640, uid=3),
            hardlink("b", "a"),
            file("c", b"c"),
            directory("dir"),
            file("dir/f", b"in a dir"),
            symlink("s", "somewhere"),
            directory("was-dir"),
            file("was-dir/x", b"x"),
        ]
    )
    upper = build_layer(
        [
            hardlink("d", "a"),  # target from the lower layer
            file("a", b"replaced"),  # b and d keep the old inode
            file("e", b"e"),
            hardlink("sub/f", "e"),  # target earlier in this layer, parent implicit
            hardlink("c", "dir/f"),  # replaces a file of the lower layer
            hardlink("s2", "s"),  # a hard link to a symlink links the symlink itself
            hardlink("was-dir", "e"),  # replaces a directory and its subtree
        ]
    )
    tree = assert_same_as_umoci(tmp_path, [lower, upper], unpack_time=(b"", b"sub"))
    groups = link_groups_tree(tree)
    assert frozenset({b"b", b"d"}) in groups
    assert frozenset({b"e", b"sub/f", b"was-dir"}) in groups
    assert tree.nlink(tree.get(b"a")) == 1  # type: ignore[arg-type]
    assert tree.get(b"s2") is tree.get(b"s")


def test_root_entry_sets_root_metadata(tmp_path: Path) -> None:
    lower = build_layer(
        [directory(".", mode=0o750, uid=4, gid=4, mtime_ns=123_456_789_012), file("a", b"a")]
    )
    upper = build_layer([file("b", b"b")])  # umoci restores the root's metadata after this
    tree = assert_same_as_umoci(tmp_path, [lower, upper], unpack_time=())
    assert tree.get(b"") is not None and tree.get(b"").mode == 0o750  # type: ignore[union-attr]


def test_missing_parents_and_late_directory_entries(tmp_path: Path) -> None:
    layer = build_layer(
        [
            file("a/b/c/d", b"deep"),
            directory("a/b", mode=0o700, uid=9, mtime_ns=2 * 10**18),  # after its children
            fifo("x/y/z"),
        ]
    )
    tree = assert_same_as_umoci(
        tmp_path, [layer], unpack_time=(b"", *_names("a", "a/b/c", "x", "x/y"))
    )
    implicit = tree.get(b"a/b/c")
    assert implicit is not None
    assert (implicit.mode, implicit.uid, implicit.gid) == (0o755, 0, 0)
    assert implicit.mtime_ns == DEFAULT_MTIME_NS  # the mtime of the entry that needed it


def test_aufs_metadata_names_change_nothing(tmp_path: Path) -> None:
    lower = build_layer([file("a", b"a")])
    upper = build_layer(
        [directory(".wh..wh.plnk"), file(".wh..wh.aufs"), directory("d"), file("d/.wh..wh.x")]
    )
    tree = assert_same_as_umoci(tmp_path, [lower, upper])
    assert [p for p, _ in tree.walk()] == [b"", b"a", b"d"]


def test_three_layers(tmp_path: Path) -> None:
    layers = [
        build_layer(
            [
                directory("usr"),
                directory("usr/bin"),
                file("usr/bin/tool", b"v1", mode=0o755),
                hardlink("usr/bin/tool-alias", "usr/bin/tool"),
                directory("var/cache", mode=0o700),
                file("var/cache/x", b"x"),
            ]
        ),
        build_layer(
            [
                file("usr/bin/tool", b"v2", mode=0o755),
                opaque("var/cache"),
                file("var/cache/y", b"y"),
                symlink("usr/bin/tool3", "tool"),
            ]
        ),
        build_layer([whiteout("usr/bin/tool-alias"), file("var/cache/z", b"z"), whiteout("var")]),
    ]
    tree = assert_same_as_umoci(tmp_path, layers, unpack_time=(b"", b"var", b"var/cache"))
    assert sorted(p for p, _ in tree.walk()) == [
        b"",
        b"usr",
        b"usr/bin",
        b"usr/bin/tool",
        b"usr/bin/tool3",
        b"var",
        b"var/cache",
        b"var/cache/z",
    ]


def test_pax_global_header_is_ignored_like_containerd(tmp_path: Path) -> None:
    """containerd and docker skip pax global headers; umoci 0.4.7 refuses the layer
    ("unknown typeflag 'g'"), so the reference here is the same layer without one."""

    def layer(global_headers: dict[str, str] | None) -> bytes:
        out = io.BytesIO()
        with tarfile.open(
            fileobj=out, mode="w", format=tarfile.PAX_FORMAT, pax_headers=global_headers
        ) as tar:
            info = tarfile.TarInfo("f")
            info.size, info.mtime, info.mode = 1, 1000, 0o644
            tar.addfile(info, io.BytesIO(b"1"))
        return out.getvalue()

    with_global = layer({"comment": "git", "mtime": "5.5", "SCHILY.xattr.user.g": "g"})
    assert b"5.5" in with_global
    tree, contents = apply_layers([with_global])
    assert tree_records(tree, contents) == tree_records(*apply_layers([layer(None)]))
    assert_same_as_umoci(tmp_path, [layer(None)])


@pytest.mark.parametrize("fmt", ["gnu", "0.0", "0.1", "1.0"])
def test_sparse_files_from_gnu_tar(tmp_path: Path, fmt: str) -> None:
    """GNU tar --sparse, old GNU 'S' members (with extension blocks: more than 4 pieces)
    and the three pax sparse versions: the file reads back as it was, holes as zeros."""
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "sparse", "wb") as f:
        for n in range(30):  # 30 data pieces, a hole before each and one at the end
            f.seek(n * 65536 + 4096)
            f.write(bytes([n + 1]) * (1000 + 37 * n))
        f.truncate(30 * 65536 + 12345)
    os.utime(src / "sparse", (1_700_000_000, 1_700_000_000))
    options = ["--format=gnu"] if fmt == "gnu" else ["--format=posix", f"--sparse-version={fmt}"]
    layer = subprocess.run(
        ["tar", "-C", src, "--sparse", *options, "--owner=0", "--group=0", "-cf", "-", "sparse"],
        check=True,
        capture_output=True,
    ).stdout
    assert b"GNU.sparse." in layer if fmt != "gnu" else layer[156:157] == b"S"
    tree, contents = apply_layers([layer])
    inode = tree.get(b"sparse")
    assert inode is not None and contents[inode] == (src / "sparse").read_bytes()
    if fmt != "gnu":  # umoci 0.4.7 refuses 'S' members ("unknown typeflag"); Go reads them
        assert_same_as_umoci(tmp_path / "umoci", [layer])


# -- rejections --------------------------------------------------------------------------


def _entries(layer: bytes, consume: bool = True) -> list[LayerEntry]:
    out = []
    for entry, reader in iter_layer(io.BytesIO(layer)):
        if reader is not None and consume:
            reader.read()
        out.append(entry)
    return out


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (file("a/../../etc/passwd", b"x"), "'..' component"),
        (file("../escape", b"x"), "'..' component"),
        (file("/etc/passwd", b"x"), "absolute path"),
        (hardlink("h", "/etc/shadow"), "absolute path"),
        (hardlink("h", "a/../../etc/shadow"), "'..' component"),
        (file("a/.wh..."), "whiteout names no file"),
        (file("a/.wh.."), "whiteout names no file"),
        (file(".", b"the root as a file"), "root must be a directory"),
    ],
    ids=[
        "dotdot",
        "leading-dotdot",
        "absolute",
        "link-absolute",
        "link-dotdot",
        "wh-dotdot",
        "wh-dot",
        "root-file",
    ],
)
def test_unsafe_names_are_refused(spec: object, message: str) -> None:
    with pytest.raises(UnsafePathError, match=message) as caught:
        _entries(build_layer([file("a/ok", b"fine"), spec]))  # type: ignore[list-item]
    assert "\n" not in str(caught.value)


def test_entry_below_a_symlinked_directory_is_refused() -> None:
    lower = _entries(
        build_layer([directory("usr/lib"), file("usr/lib/libc.so"), symlink("lib", "usr/lib")])
    )
    for layer in (
        [file("lib/evil", b"x")],
        [directory("lib/sub")],
        [whiteout("lib/libc.so")],
        [hardlink("lib/h", "usr/lib/libc.so")],
    ):
        tree = Tree()
        tree.apply(lower)
        with pytest.raises(UnsafePathError, match="below a symlinked directory"):
            tree.apply(_entries(build_layer(layer)))  # type: ignore[arg-type]
    same_layer = [symlink("etc", "/tmp"), file("etc/passwd", b"x")]
    with pytest.raises(UnsafePathError, match="below a symlinked directory"):
        Tree().apply(_entries(build_layer(same_layer)))


@pytest.mark.parametrize(
    ("layer", "error", "message"),
    [
        ([hardlink("h", "missing")], BadInputError, "target does not exist"),
        ([directory("d"), hardlink("h", "d")], BadInputError, "target is a directory"),
        ([file("f", b"f"), hardlink("f", "f")], BadInputError, "replace its own target"),
        (
            [directory("real"), file("real/f"), symlink("via", "real"), hardlink("h", "via/f")],
            UnsafePathError,
            "target is below a symlinked directory",
        ),
        ([hardlink("h", "later"), file("later")], BadInputError, "target does not exist"),
    ],
    ids=["missing", "directory", "itself", "through-symlink", "forward-reference"],
)
def test_bad_hard_links_are_refused(layer: list, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        Tree().apply(_entries(build_layer(layer)))


def test_entry_below_a_file_is_refused() -> None:
    with pytest.raises(BadInputError, match="is not a directory"):
        Tree().apply(_entries(build_layer([file("f", b"f"), file("f/x", b"x")])))


def _headers(layer: bytes) -> list[int]:
    """Offsets of the headers of a tar made of one-block headers (short names, no pax)."""
    offsets, pos = [], 0
    while layer[pos : pos + 512].strip(b"\0"):
        offsets.append(pos)
        size = tarfile.nti(layer[pos + 124 : pos + 136])
        pos += 512 + -(-size // 512) * 512
    return offsets


def _patch(layer: bytes, offset: int, start: int, field: bytes, fix_checksum: bool = True) -> bytes:
    block = bytearray(layer[offset : offset + 512])
    block[start : start + len(field)] = field
    if fix_checksum:
        block[148:156] = b"%06o\0 " % tarfile.calc_chksums(bytes(block))[0]
    return layer[:offset] + bytes(block) + layer[offset + 512 :]


SIMPLE = build_layer(
    [file("a", b"A" * 1000, mtime_ns=10**9), file("b", b"B" * 10, mtime_ns=10**9)], fmt="gnu"
)


@pytest.mark.parametrize("consume", [True, False], ids=["read", "skipped"])
def test_truncated_tar_is_refused(consume: bool) -> None:
    assert _entries(SIMPLE) and len(_headers(SIMPLE)) == 2
    for cut in (700, 1024 + 100, 1536 + 5):  # inside a's data, inside b's header, in b's data
        with pytest.raises(BadInputError, match="cut short|broken|unexpected end"):
            _entries(SIMPLE[:cut], consume)


@pytest.mark.parametrize("consume", [True, False], ids=["read", "skipped"])
def test_size_larger_than_the_data_is_refused(consume: bool) -> None:
    last = _headers(SIMPLE)[-1]
    layer = _patch(SIMPLE, last, 124, b"%011o\0" % 100_000)  # b claims 100000 bytes
    with pytest.raises(BadInputError, match="cut short|broken|unexpected end"):
        _entries(layer, consume)


@pytest.mark.parametrize("member", [0, 1], ids=["first", "second"])
def test_bad_header_checksum_is_refused(member: int) -> None:
    offset = _headers(SIMPLE)[member]
    layer = _patch(SIMPLE, offset, 0, b"X", fix_checksum=False)
    with pytest.raises(BadInputError, match="checksum"):
        _entries(layer)


def test_unknown_entry_type_is_refused() -> None:
    layer = _patch(SIMPLE, _headers(SIMPLE)[1], 156, b"D")  # GNU dump-dir
    with pytest.raises(BadInputError, match=r"'b': unsupported tar entry type b'D'"):
        _entries(layer)


def test_bad_pax_number_is_refused() -> None:
    layer = build_layer([file("f", b"x", pax={"uid": "12ab"})])
    with pytest.raises(BadInputError, match="'f': bad pax number"):
        _entries(layer)


def test_empty_stream_and_end_without_zero_blocks_are_fine() -> None:
    # Both read as Go's archive/tar reads them: no entries, and the entries present.
    assert _entries(b"") == []
    assert [
        e.path for e in _entries(SIMPLE.rstrip(b"\0") + b"\0" * (-len(SIMPLE.rstrip(b"\0")) % 512))
    ] == [b"a", b"b"]


# -- the reader and the Tree API -------------------------------------------------------


def test_reader_gives_exactly_the_file_and_goes_stale() -> None:
    layer = build_layer([file("a", b"0123456789" * 10_000), file("b", b"bee"), fifo("p")])
    seen = []
    stale = None
    for entry, reader in iter_layer(io.BytesIO(layer)):
        assert entry.op == Op.INODE and entry.inode is not None
        if entry.path == b"a":
            buf = bytearray(7)
            assert reader is not None and reader.readinto(buf) == 7 and buf == b"0123456"
            stale = reader  # the rest is left unread
        elif entry.path == b"b":
            assert reader is not None and reader.read() == b"bee" and reader.read() == b""
        else:
            assert reader is None
        seen.append(entry.path)
    assert seen == [b"a", b"b", b"p"]
    assert stale is not None
    with pytest.raises(ValueError, match="after the next entry"):
        stale.read()


def test_entries_are_normalized() -> None:
    layer = build_layer(
        [
            directory("./d/"),
            file("./d//./f", b"x"),
            hardlink("./d/h", "./d/./f"),
            whiteout("d/gone"),
            opaque("./d"),
        ]
    )
    assert [(e.op, e.path, e.link) for e in _entries(layer)] == [
        (Op.INODE, b"d", b""),
        (Op.INODE, b"d/f", b""),
        (Op.HARDLINK, b"d/h", b"d/f"),
        (Op.WHITEOUT, b"d/gone", b""),
        (Op.OPAQUE, b"d", b""),
    ]


def test_pax_time_keeps_nanoseconds() -> None:
    assert parse_pax_time("1700000000.123456789") == 1_700_000_000_123_456_789
    assert parse_pax_time("1.5") == 1_500_000_000
    assert parse_pax_time("-1.5") == -1_500_000_000
    assert parse_pax_time("42") == 42 * 10**9
    assert parse_pax_time("1.1234567899") == 1_123_456_789  # cut, like Go
    with pytest.raises(ValueError):
        parse_pax_time("1e9")


def test_walk_order_len_and_nlink() -> None:
    tree = Tree()
    tree.apply(
        _entries(
            build_layer(
                [
                    file(b"\xff", b"1"),
                    file("B", b"2"),
                    directory("a"),
                    directory("a/z"),
                    directory("a/y"),
                    file("a/x", b"3"),
                    hardlink("a/z/l", "B"),
                    file("a-b", b"4"),
                ]
            )
        )
    )
    paths = [p for p, _ in tree.walk()]
    assert paths == [b"", b"B", b"a", b"a/x", b"a/y", b"a/z", b"a/z/l", b"a-b", b"\xff"]
    assert len(tree) == len(paths)
    assert tree.nlink(tree.get(b"")) == 3  # type: ignore[arg-type]
    assert tree.nlink(tree.get(b"a")) == 4  # type: ignore[arg-type]
    assert tree.nlink(tree.get(b"B")) == 2  # type: ignore[arg-type]


def _rss() -> int:
    """This process's resident memory in bytes."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_two_hundred_thousand_entries() -> None:
    """A 200,000-entry image applies in about a second, in tens of MiB beside its entries,
    and removing big subtrees (opaque root, re-adding everything) stays linear."""

    def layer() -> list[LayerEntry]:
        out = [LayerEntry(Op.INODE, b"", Inode(Kind.DIR, 0o755))]
        for d in range(2000):
            out.append(LayerEntry(Op.INODE, b"d%04d" % d, Inode(Kind.DIR, 0o755)))
            for f in range(99):
                out.append(LayerEntry(Op.INODE, b"d%04d/f%02d" % (d, f), Inode(Kind.REG, 0o644)))
        return out

    entries = layer()
    before = _rss()
    tree = Tree()
    tree.apply(entries)
    grown = _rss() - before
    assert len(tree) == 200_001
    assert grown < 150 * 2**20, grown  # measured with tracemalloc: 33 MiB, 43 MiB at peak

    started = time.monotonic()
    # An opaque root that keeps only this layer's file, then everything again.
    tree.apply([LayerEntry(Op.INODE, b"new", Inode(Kind.REG, 0o644)), LayerEntry(Op.OPAQUE, b"")])
    assert len(tree) == 2
    tree.apply(layer())
    walked = [inode for _, inode in tree.walk()]
    links = sum(tree.nlink(inode) for inode in walked)
    elapsed = time.monotonic() - started
    assert len(walked) == 200_002
    assert links == 2 + 2000 + 2 * 2000 + 198_001  # root, dirs, files
    assert elapsed < 20, elapsed  # measured: about 3 s with building the layer
