"""lazyfs/mount_table.py, the one reader of the kernel's mount table (the product's, the
tests' and the benchmarks'): each field of a mountinfo line where proc(5) puts it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from lazyfs.mount_table import Mount, entries, escape, is_mount_point, parse, unescape


def test_a_line_with_optional_fields_and_escaped_paths() -> None:
    line = (
        rb"36 35 98:0 /mnt1 /mnt/a\040b rw,noatime master:1 shared:2 - ext3 /dev/ro\134ot"
        rb" rw,errors=continue" + b"\n"
    )
    assert parse(line) == Mount(
        point="/mnt/a b",
        device="98:0",
        fstype="ext3",
        source="/dev/ro\\ot",
        mount_id="36",
        options="rw,noatime",
        super_options="rw,errors=continue",
    )


def test_a_line_without_optional_fields() -> None:
    line = b"612 30 0:77 / /run/lazyfs/data rw,nosuid,nodev - fuse.lazyfs-data lazyfs rw,user_id=0"
    m = parse(line)
    assert (m.mount_id, m.device, m.point) == ("612", "0:77", "/run/lazyfs/data")
    assert (m.fstype, m.source) == ("fuse.lazyfs-data", "lazyfs")
    assert (m.options, m.super_options) == ("rw,nosuid,nodev", "rw,user_id=0")


def test_escape_and_unescape_are_inverse() -> None:
    path = "/tmp/a b\tc\nd\\e"
    assert escape(path) == r"/tmp/a\040b\011c\012d\134e"
    assert unescape(escape(path).encode()) == path


def test_entries_reads_a_real_mount(tmp_path: Path) -> None:
    """A tmpfs on a path with a space: its point unescaped, its own options (nosuid) apart
    from the filesystem's (size=), a mount id of its own."""
    point = tmp_path / "a b"
    point.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,nosuid", "testbed-tmpfs", str(point)], check=True
    )
    try:
        table = list(entries())
        (m,) = [m for m in table if m.point == str(point)]
        assert (m.fstype, m.source) == ("tmpfs", "testbed-tmpfs")
        assert "nosuid" in m.options.split(",")
        assert "size=1024k" in m.super_options.split(",")
        assert m.mount_id.isdigit() and [e.mount_id for e in table].count(m.mount_id) == 1
    finally:
        subprocess.run(["umount", str(point)], check=True)
    assert str(point) not in [m.point for m in entries()]


def test_is_mount_point_answers_as_os_path_ismount(tmp_path: Path) -> None:
    """The same answer as os.path.ismount for a mount point (also reached through a
    symlinked parent), the root, a plain directory, a file, a symlink to a mount point
    and a missing path."""
    point = tmp_path / "mnt"
    point.mkdir()
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_bytes(b"")
    (tmp_path / "link").symlink_to(point)
    (tmp_path / "parent-link").symlink_to(tmp_path)
    mount = ["mount", "-t", "tmpfs", "-o", "size=1m", "testbed-tmpfs", str(point)]
    subprocess.run(mount, check=True)
    try:
        (point / "inner").mkdir()
        cases = {
            point: True,
            tmp_path / "parent-link" / "mnt": True,
            Path("/"): True,
            point / "inner": False,
            tmp_path / "dir": False,
            tmp_path / "file": False,
            tmp_path / "link": False,
            tmp_path / "missing": False,
        }
        for path, expected in cases.items():
            assert (is_mount_point(path), os.path.ismount(path)) == (expected, expected), path
    finally:
        subprocess.run(["umount", str(point)], check=True)
    assert not is_mount_point(point)
