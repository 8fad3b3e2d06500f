"""A sandbox's private overlay on an image's tree or layer trees, and how many layer trees
one overlay can stack.

mount(2) takes its options in one page, so an overlay named by one `lowerdir=A:B:...`
option lists ~30 trees of RUN_DIR/images/<key>/<64-hex id> (docker shortens its layer
paths for the same limit). Linux 6.8 lets the new mount API add lower layers one by one
(fsconfig `lowerdir+`), up to overlayfs's own limit of 500 layers. A sandbox overlay
whose options fit a page is still mounted with one mount(2) (the common case, and one
syscall instead of one per layer); a longer one is put together with fsopen, fsconfig,
fsmount and move_mount. An image with more layers than `lower_trees_that_fit` runs from
its merged tree.

containerd mounts the overlays the snapshotter answers from their option strings: those
stay within `lower_trees_in_options`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from pathlib import Path

from lazyfs.libc import libc
from lazyfs.sandbox.process import Root, root_text

MS_NOSUID, MS_NODEV = 2, 4
MOUNT_OPTIONS_MAX = 4096  # mount(2) takes one page of options
OVERLAY_RESERVE = 1024  # of it for "lowerdir=", the upper and work directories
OVERLAY_MAX_LOWERS = 500  # overlayfs's OVL_MAX_STACK
LOWERDIR_PLUS = (6, 8)  # the kernel release whose overlayfs takes `lowerdir+`

# The new mount API: these syscall numbers are the same on every architecture (424 on).
SYS_MOVE_MOUNT, SYS_FSOPEN, SYS_FSCONFIG, SYS_FSMOUNT = 429, 430, 431, 432
FSOPEN_CLOEXEC = FSMOUNT_CLOEXEC = 1
FSCONFIG_SET_STRING, FSCONFIG_CMD_CREATE = 1, 6
MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 0x2, 0x4
MOVE_MOUNT_F_EMPTY_PATH = 0x4
AT_FDCWD = -100


def lower_trees_in_options(trees_dir: Path) -> int:
    """How many trees of trees_dir (each named by a 64-hex id) one overlay's `lowerdir=`
    option can list within mount(2)'s page of options."""
    return (MOUNT_OPTIONS_MAX - OVERLAY_RESERVE) // (len(str(trees_dir)) + 1 + 64 + 1)


def lower_trees_that_fit(trees_dir: Path) -> int:
    """How many trees of trees_dir one sandbox overlay (mount_overlay) can stack:
    overlayfs's limit where the kernel takes `lowerdir+`, else what one page lists."""
    if _kernel_at_least(LOWERDIR_PLUS):
        return OVERLAY_MAX_LOWERS
    return lower_trees_in_options(trees_dir)


def mount_overlay(lower: Root, upper: Path, work: Path, target: Path) -> None:
    """The sandbox's private overlay at target: `lower` is the image's tree, or its layer
    trees top first (lazyfs.sandbox.process.Root). OSError if it cannot be mounted."""
    opts = f"lowerdir={root_text(lower)},upperdir={upper},workdir={work}"
    if len(opts) < MOUNT_OPTIONS_MAX:
        ret = libc.mount(b"overlay", bytes(target), b"overlay", MS_NOSUID | MS_NODEV, opts.encode())
        if ret != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mount overlay on {target}: {os.strerror(err)}")
        return
    lowers = [lower] if isinstance(lower, Path) else list(lower)
    _mount_layer_by_layer(lowers, upper, work, target)


def _mount_layer_by_layer(lowers: list[Path], upper: Path, work: Path, target: Path) -> None:
    """mount_overlay through the new mount API: each lower layer its own `lowerdir+`."""
    fs = _syscall(SYS_FSOPEN, b"overlay", FSOPEN_CLOEXEC)
    if fs < 0:
        _raise(f"mount overlay on {target}: fsopen")
    try:
        settings = [
            ("source", "overlay"),  # as mount(2)'s: the mount table shows it so
            *(("lowerdir+", p) for p in lowers),
            ("upperdir", upper),
            ("workdir", work),
        ]
        for key, value in settings:
            if _syscall(SYS_FSCONFIG, fs, FSCONFIG_SET_STRING, key.encode(), os.fsencode(value), 0):
                _raise(f"mount overlay on {target}: {key} {value}", fs)
        if _syscall(SYS_FSCONFIG, fs, FSCONFIG_CMD_CREATE, None, None, 0):
            _raise(f"mount overlay on {target}", fs)
        mnt = _syscall(SYS_FSMOUNT, fs, FSMOUNT_CLOEXEC, MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV)
        if mnt < 0:
            _raise(f"mount overlay on {target}: fsmount", fs)
        try:
            if _syscall(SYS_MOVE_MOUNT, mnt, b"", AT_FDCWD, bytes(target), MOVE_MOUNT_F_EMPTY_PATH):
                _raise(f"mount overlay on {target}: move_mount")
        finally:
            os.close(mnt)
    finally:
        os.close(fs)


def _syscall(number: int, *args: object) -> int:
    return libc.syscall(ctypes.c_long(number), *args)


def _raise(what: str, fs: int | None = None) -> None:
    """OSError for the call that just failed, with the kernel's own words on it if the
    filesystem context logged any (each message a line "e ..." read from its fd)."""
    err = ctypes.get_errno()
    said = ""
    if fs is not None:
        with contextlib.suppress(OSError):  # nothing logged
            said = os.read(fs, 1024).decode(errors="replace").strip().removeprefix("e ")
    raise OSError(err, f"{what}: {said or os.strerror(err)}")


def _kernel_at_least(release: tuple[int, int]) -> bool:
    parts = os.uname().release.split("-")[0].split(".")
    try:
        return (int(parts[0]), int(parts[1])) >= release
    except (IndexError, ValueError):
        return False
