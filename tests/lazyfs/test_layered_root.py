"""A path in an image's layer trees, looked up without a mount
(lazyfs.sandbox.process, for the agent's user and command lookups), is what the same
trees stacked by overlayfs show: each case is checked against a real overlay mount."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from lazyfs.sandbox.process import resolve_in_root, resolve_user
from testbed.mounts import stacked

PATHS = [
    "/etc/passwd",
    "/etc/motd",
    "/etc/gone/file",
    "/bin/sh",
    "/usr/lib/link/f",
    "/usr/lib/real/f",
    "/usr/lib/real/lower-only",
    "/dir-now-file",
    "/dir-now-file/inner",
    "/file-now-dir/inner",
    "/merged/a",
    "/merged/b",
    "/merged/../etc/passwd",
    "/nowhere",
]


def build(tmp: Path) -> list[Path]:
    """Three layers, top first, with whiteouts, type changes and symlinks across them."""
    bottom, middle, top = (tmp / n for n in ("bottom", "middle", "top"))
    for layer, files in (
        (
            bottom,
            {
                "etc/passwd": "root:x:0:0::/root:/bin/sh\n",
                "etc/motd": "hi",
                "etc/gone/file": "x",
                "usr/lib/real/f": "lower",
                "usr/lib/real/lower-only": "l",
                "dir-now-file/inner": "i",
                "file-now-dir": "f",
                "merged/a": "a",
                "bin/sh": "sh",
            },
        ),
        (middle, {"usr/lib/real/f": "middle", "merged/b": "b", "file-now-dir/inner": "new"}),
        (
            top,
            {
                "etc/passwd": "root:x:0:0::/root:/bin/sh\nrunner:x:7:8::/home/r:/bin/sh\n",
                "dir-now-file": "now a file",
            },
        ),
    ):
        for rel, text in files.items():
            (layer / rel).parent.mkdir(parents=True, exist_ok=True)
            (layer / rel).write_text(text)
    os.symlink("real", middle / "usr/lib/link")
    for layer, rel in ((top, "etc/motd"), (middle, "etc/gone")):
        (layer / rel).parent.mkdir(parents=True, exist_ok=True)
        os.mknod(layer / rel, 0o020000, os.makedev(0, 0))  # overlayfs's whiteout
    return [top, middle, bottom]


def content(path: Path | None) -> str | None:
    return None if path is None or not path.is_file() else path.read_text()


@pytest.fixture
def layers(tmp_path: Path) -> Iterator[tuple[list[Path], Path]]:
    lowers = build(tmp_path)
    view = tmp_path / "view"
    view.mkdir()
    with stacked(lowers, view):
        yield lowers, view


@pytest.mark.parametrize("path", PATHS)
def test_a_path_in_layer_trees_is_what_the_overlay_shows(layers, path: str) -> None:
    lowers, view = layers
    through_overlay = resolve_in_root(view, path)
    found = resolve_in_root(lowers, path)
    assert (found is None) == (through_overlay is None or not through_overlay.exists()), found
    assert content(found) == content(through_overlay)


def test_the_user_comes_from_the_topmost_passwd(layers) -> None:
    lowers, _ = layers
    assert resolve_user(lowers, "runner") == (7, 8, [])
