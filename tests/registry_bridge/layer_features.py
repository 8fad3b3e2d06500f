"""The synthetic layers the convert tests build images from: one image per layer
feature (whiteouts, hard links, devices, long and non-UTF-8 names, ...), each a list of
layers, bottom first (testbed/layerbuild.py entries)."""

from __future__ import annotations

import os

from testbed import layerbuild as lb

NON_UTF8 = b"caf\xe9-\xff"
LONG = "d" * 120 + "/" + "n" * 150
CAP = b"\x01\x00\x00\x02\x00\x20\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00"

FEATURES: dict[str, list[list[lb.Entry]]] = {
    "whiteouts-and-opaque-dirs": [
        [
            lb.directory("a"),
            lb.file("a/x", b"x"),
            lb.directory("a/sub"),
            lb.file("a/sub/y", b"y"),
            lb.directory("o"),
            lb.file("o/lower", b"l"),
            lb.file("gone", b"g"),
        ],
        [lb.whiteout("a/sub"), lb.whiteout("gone"), lb.file("o/new", b"n"), lb.opaque("o")],
    ],
    "hard-links-within-and-across-layers": [
        [lb.directory("h"), lb.file("h/f", b"data" * 1000, mode=0o640), lb.hardlink("h/g", "h/f")],
        [lb.hardlink("h/k", "h/f"), lb.file("h/g", b"replaced")],
    ],
    "symlinks-devices-fifos": [
        [
            lb.symlink("abs", "/etc/passwd"),
            lb.symlink("rel", "../../x"),
            lb.symlink("dangling", "nowhere/at/all"),
            lb.directory("dev"),
            lb.chardev("dev/null", 1, 3),
            lb.blockdev("dev/loop9", 7, 9),
            lb.fifo("dev/pipe"),
        ],
    ],
    "special-mode-bits-and-ids": [
        [
            lb.file("suid", b"s", mode=0o4755),
            lb.file("sgid", b"s", mode=0o2711),
            lb.directory("tmp", mode=0o1777),
            lb.file("bigids", b"b", uid=2**31 - 2, gid=65534 * 3),
        ],
    ],
    "pax-long-names-xattrs-ns-mtimes": [
        [
            lb.directory("d" * 120),
            lb.file(LONG, b"long", mtime_ns=1_600_000_000_987_654_321),
            lb.symlink("longlink", LONG * 1),
            lb.file("cap", b"c", xattrs={"security.capability": CAP, "user.note": b"\x00\xff"}),
        ],
    ],
    "gnu-long-names": [
        [lb.directory("g" * 110), lb.file("g" * 110 + "/" + "f" * 120, b"gnu")],
    ],
    "non-utf8-names": [
        [
            lb.directory(NON_UTF8),
            lb.file(NON_UTF8 + b"/\xfe\xfd", b"bytes"),
            lb.symlink(b"l\xff", NON_UTF8),
        ],
    ],
    "file-replaced-by-dir-and-back": [
        [lb.file("fd", b"file"), lb.directory("df"), lb.file("df/child", b"c")],
        [lb.directory("fd"), lb.file("fd/inner", b"i"), lb.file("df", b"now a file")],
    ],
    "large-multi-chunk-file": [
        [lb.file("big", os.urandom(3_000_000) + b"\0" * 2_000_000)],
        [lb.file("big2", b"\0" * 2_000_000 + os.urandom(10))],
    ],
}
