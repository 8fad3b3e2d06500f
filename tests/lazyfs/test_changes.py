"""lazyfs/agent/changes.py on overlayfs's own format, written by hand: an upper
directory over layer trees, as a sandbox's writes leave it (whiteouts, an opaque
directory, names that are not UTF-8, a symlink that must not be followed). Through a
real sandbox: test_agent_api.py, test_agent_generic.py, tests/docker/."""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

import pytest

from lazyfs.agent.changes import MAX_DEPTH, TooManyChanges, changes
from lazyfs.sandbox.process import OPAQUE_XATTR


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, kind in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if kind == "dir":
            path.mkdir(exist_ok=True)
        elif kind == "whiteout":
            os.mknod(path, 0o600 | 0o020000, os.makedev(0, 0))
        else:
            path.write_text(kind)
    return root


def test_an_upper_directory_over_layer_trees(tmp_path: Path) -> None:
    base = _tree(
        tmp_path / "base",
        {"etc/a": "1", "etc/b": "1", "usr/doc/x": "1", "gone": "1", "opt/hidden": "1"},
    )
    top = _tree(
        tmp_path / "top", {"etc/c": "1", "gone": "whiteout", "usr/doc/y": "1", "opt/a": "1"}
    )
    os.setxattr(top / "opt", OPAQUE_XATTR, b"y")  # the top layer's /opt hides the base's
    upper = _tree(
        tmp_path / "upper",
        {
            "etc/a": "2",  # written
            "etc/c": "whiteout",  # removed, from the top layer
            "etc/never": "whiteout",  # a whiteout of a name no layer has: not a change
            "new/dir/f": "1",
            "usr/doc/z": "1",  # the directory removed and made again
            "opt/hidden": "1",  # a name only the hidden base /opt had: new to the image
        },
    )
    os.setxattr(upper / "usr/doc", OPAQUE_XATTR, b"y")
    (upper / "link").symlink_to("/etc")  # a symlink is a change, never followed
    (upper / os.fsdecode(b"bad\xffname")).write_text("1")
    found = [tuple(c) for c in changes(upper, (top, base))]
    assert found == [
        ("/bad\ufffdname", "added"),
        ("/etc", "changed"),
        ("/etc/a", "changed"),
        ("/etc/c", "deleted"),
        ("/link", "added"),
        ("/new", "added"),
        ("/new/dir", "added"),
        ("/new/dir/f", "added"),
        ("/opt", "changed"),
        ("/opt/hidden", "added"),
        ("/usr", "changed"),
        ("/usr/doc", "changed"),
        ("/usr/doc/x", "deleted"),
        ("/usr/doc/y", "deleted"),
        ("/usr/doc/z", "added"),
    ]
    assert changes(tmp_path / "empty-upper", base) == []  # gone: the sandbox went


def test_more_changes_than_the_limit_are_refused_not_cut(tmp_path: Path) -> None:
    upper = _tree(tmp_path / "upper", {f"f{i}": "1" for i in range(5)})
    assert len(changes(upper, tmp_path / "base", limit=5)) == 5
    with pytest.raises(TooManyChanges, match="more than 4 paths"):
        changes(upper, tmp_path / "base", limit=4)


def test_a_symlink_in_the_image_is_never_followed_out_of_it(tmp_path: Path) -> None:
    """The image's /lib is a symlink to the host's /etc (an image may hold any link).
    The sandbox replaced it with a directory of its own: neither the host's /etc/passwd
    nor the names in the host's /etc may show (as changed, or as deleted)."""
    base = tmp_path / "base"
    base.mkdir()
    (base / "lib").symlink_to("/etc")
    upper = _tree(tmp_path / "upper", {"lib/passwd": "mine"})
    os.setxattr(upper / "lib", OPAQUE_XATTR, b"y")
    for lower in (base, (base,)):
        assert [tuple(c) for c in changes(upper, lower)] == [
            ("/lib", "changed"),
            ("/lib/passwd", "added"),
        ]


def test_a_big_directory_is_refused_as_it_is_read_not_after(tmp_path: Path) -> None:
    """Session 55's review: a directory was listed whole (names and stats) before the
    limit was looked at; 600,000 links in one took the agent from 168 to 707 MB per
    `docker diff`. Now the walk stops at the limit's name: what it holds is bounded by
    the limit, whatever the directory holds."""
    upper = tmp_path / "upper"
    (upper / "d").mkdir(parents=True)
    first = upper / "d" / "0"
    first.write_text("x")
    for i in range(1, 20_000):
        os.link(first, upper / "d" / f"{i:0200d}")  # 200-byte names, one inode
    (tmp_path / "image").mkdir()
    tracemalloc.start()
    try:
        with pytest.raises(TooManyChanges, match="more than 1000 paths"):
            changes(upper, tmp_path / "image", limit=1000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * 2**20, peak  # ~1,000 changes' worth; the whole listing was ~11 MB


def test_the_changes_paths_are_bounded_in_bytes_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A change's path may be 4 KiB long: 100,000 of them would be 400 MB of strings."""
    deep = tmp_path / "upper" / "/".join(["d" * 200] * 15)
    deep.mkdir(parents=True)
    for i in range(100):
        (deep / f"f{i}").write_text("x")
    (tmp_path / "image").mkdir()
    assert len(changes(tmp_path / "upper", tmp_path / "image")) == 115
    monkeypatch.setattr("lazyfs.agent.changes.MAX_PATH_BYTES", 100_000)
    with pytest.raises(TooManyChanges, match="more than 100000 bytes of paths"):
        changes(tmp_path / "upper", tmp_path / "image")


def test_what_lies_past_path_max_is_listed(tmp_path: Path) -> None:
    """Session 57: each directory was opened by its whole path from the upper directory,
    and past PATH_MAX (4096 bytes) that failed as if the sandbox had removed it: 20
    levels of 250-byte names hid what lay under them, and the answer said nothing. Now
    each directory is opened by its name from its parent's descriptor, at any depth."""
    upper = tmp_path / "upper"
    upper.mkdir()
    here = os.open(upper, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(40):  # a 10 KB path: past PATH_MAX, as a sandbox makes it
            os.mkdir("d" * 250, dir_fd=here)
            below = os.open("d" * 250, os.O_RDONLY | os.O_DIRECTORY, dir_fd=here)
            os.close(here)
            here = below
        os.close(os.open("hidden-payload", os.O_WRONLY | os.O_CREAT, dir_fd=here))
        os.mkdir("hidden-dir", dir_fd=here)
    finally:
        os.close(here)
    (tmp_path / "image").mkdir()
    found = changes(upper, tmp_path / "image")
    deep = "/" + "/".join(["d" * 250] * 40)
    assert len(found) == 42
    assert found[-2:] == [(deep + "/hidden-dir", "added"), (deep + "/hidden-payload", "added")]
    assert all(kind == "added" for _, kind in found)


def test_a_walk_deeper_than_its_levels_is_refused_not_cut(tmp_path: Path) -> None:
    """The walk holds a descriptor per level; past MAX_DEPTH levels it is refused (a few
    walks of thousands of levels would take the agent's descriptors), never answered
    without what lies deeper."""
    upper = tmp_path / "upper"
    deep = upper.joinpath(*["d"] * (MAX_DEPTH + 1))
    deep.mkdir(parents=True)
    (tmp_path / "image").mkdir()
    with pytest.raises(TooManyChanges, match=f"more than {MAX_DEPTH} levels deep"):
        changes(upper, tmp_path / "image")
    deep.rmdir()  # MAX_DEPTH levels: walked whole
    assert len(changes(upper, tmp_path / "image")) == MAX_DEPTH
