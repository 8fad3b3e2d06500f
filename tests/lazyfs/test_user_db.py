"""An image's or sandbox's /etc/passwd and /etc/group, looked up as text
(lazyfs.sandbox.process: db_entry, db_member_gids, db_names, resolve_user).

They used to be split into a list per line: a sandbox's 4 MiB file of ":\\n" lines was
two million lists, ~690 MiB of the agent's memory per `docker exec -u` (session 57's
red team, finding 2). Here: the answers are what the list-based code gave for ordinary
files, and hostile files (1 MiB lines, names as long as the file) are answered in well
under a second."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from chunker.errors import BadInputError
from lazyfs.sandbox.process import (
    MAX_DB,
    PATTERN_MAX,
    db_entry,
    db_member_gids,
    db_names,
    read_db,
    resolve_user,
)

PASSWD = """\
root:x:0:0:root:/root:/bin/bash
# a comment: nobody:x:1:1::/:/bin/sh
daemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin

runner:x:1000:1000:Runner,,,:/home/runner:/bin/sh
short:x:5
odd:x:abc:def::/:/bin/sh
twin:x:1001:1001::/a:/bin/sh
twin:x:1002:1002::/b:/bin/sh
nogroup:x:1003:4242::/:/bin/sh
"""
GROUP = """\
root:x:0:
#staff:x:99:runner
daemon:x:1:runner
staff:x:50:alice,runner,bob
users:x:100:runner
runner:x:1000:
dev:x:60:runnerx,xrunner
empty:x:70:
bad:x:7x:runner
more:x:80:bob:runner
late:x:90:bob,runner
staff:x:51:twin
dup:x:50:runner
"""
USERS = [
    "",
    "root",
    "runner",
    "daemon",
    "twin",
    "nogroup",
    "odd",
    "0",
    "1000",
    "1001",
    "4321",
    "runner:staff",
    "runner:1234",
    "1000:50",
    "4321:4321",
    "root:users",
    "daemon:root",
    "short",
    "nosuch",
    "runner:nosuch",
    "runner:bad",
    "runner:a:b",
]


def _old_resolve(passwd_text: str, group_text: str, user: str) -> tuple[int, int, list[int]]:
    """resolve_user as it was before (a list per line): the reference for ordinary files."""

    def split(text: str) -> list[list[str]]:
        return [ln.split(":") for ln in text.splitlines() if ln and not ln.startswith("#")]

    name, _, group = (user or "root").partition(":")
    passwd = split(passwd_text)
    entry = next((f for f in passwd if len(f) >= 4 and f[0] == name), None)
    if name.isdigit():
        uid = int(name)
        entry = next((f for f in passwd if len(f) >= 4 and f[2] == name), None)
    elif entry is not None and entry[2].isdigit():
        uid = int(entry[2])
    elif name == "root":
        uid = 0
    else:
        raise BadInputError(f"image user {name!r} is not in the image's /etc/passwd")
    if entry is not None and entry[3].isdigit():
        gid = int(entry[3])
    else:
        gid = uid if name.isdigit() else 0
    groups = split(group_text)
    extra: list[int] = []
    if group:
        if group.isdigit():
            gid = int(group)
        else:
            match = next((f for f in groups if len(f) >= 3 and f[0] == group), None)
            if match is None or not match[2].isdigit():
                raise BadInputError(f"image group {group!r} is not in the image's /etc/group")
            gid = int(match[2])
    elif entry is not None:
        extra = sorted(
            {
                int(f[2])
                for f in groups
                if len(f) >= 4
                and f[2].isdigit()
                and entry[0] in f[3].split(",")
                and int(f[2]) != gid
            }
        )
    return uid, gid, extra


def _root(tmp: Path, passwd: str | bytes, group: str | bytes) -> Path:
    (tmp / "etc").mkdir(exist_ok=True)
    for name, text in (("passwd", passwd), ("group", group)):
        path = tmp / "etc" / name
        path.write_bytes(text.encode() if isinstance(text, str) else text)
    return tmp


def _outcome(fn, *args):  # noqa: ANN001, ANN202
    try:
        return fn(*args)
    except BadInputError as exc:
        return ("error", str(exc))


@pytest.mark.parametrize("crlf", [False, True])
def test_users_are_resolved_as_before(tmp_path: Path, crlf: bool) -> None:
    """Names, uids, name:group, uid:gid, the supplementary groups, comments and empty
    lines skipped, the first of two entries: as the list-based code resolved them."""
    passwd, group = (t.replace("\n", "\r\n") if crlf else t for t in (PASSWD, GROUP))
    root = _root(tmp_path, passwd, group)
    for user in USERS:
        assert _outcome(resolve_user, root, user) == _outcome(_old_resolve, passwd, group, user), (
            user
        )
    assert resolve_user(root, "runner") == (1000, 1000, [1, 50, 90, 100])
    assert resolve_user(root, "twin") == (1001, 1001, [51])


def test_the_lookups() -> None:
    assert db_entry(PASSWD, 0, "runner") == PASSWD.splitlines()[4].split(":")
    assert db_entry(PASSWD, 2, "1002", least=6) == [
        "twin",
        "x",
        "1002",
        "1002",
        "",
        "/b",
        "/bin/sh",
    ]
    assert db_entry(PASSWD, 0, "short", least=4) is None
    assert db_entry(PASSWD, 0, "short") == ["short", "x", "5"]
    assert db_entry(PASSWD, 0, "nobody") is None  # only in a comment
    assert db_entry(PASSWD, 0, "") is None  # the empty line is no entry
    assert db_entry(PASSWD, 0, "root:x") is None
    assert db_entry("a:x:1\nb:x:2", 0, "b") == ["b", "x", "2"]  # no newline at the end
    assert db_member_gids(GROUP, "runner") == {1, 50, 90, 100}
    assert db_member_gids(GROUP, "bob") == {50, 80, 90}
    assert db_member_gids(GROUP, "alice,runner") == set()
    assert db_member_gids("g:x:5:a,,b\n", "") == {5}  # as "" in "a,,b".split(",")
    assert db_names(PASSWD, {0, 1001, 1003, 7}) == {0: "root", 1001: "twin", 1003: "nogroup"}


def test_long_names_are_looked_up_without_a_pattern() -> None:
    """A name longer than PATTERN_MAX is compared line by line, with the same answers."""
    name = "n" * (PATTERN_MAX + 1)
    passwd = f"{name}x:x:1:1::/:/bin/sh\n{name}:x:2:2\n{name}:x:3:3::/:/bin/sh\n"
    group = f"a:x:10:{name}x,x{name}\nb:x:11:z,{name}\nc:x:12:{name}:more\n#d:x:13:{name}\n"
    assert db_entry(passwd, 0, name, least=4) == [name, "x", "2", "2"]
    assert db_entry(passwd, 0, name, least=5) == [name, "x", "3", "3", "", "/", "/bin/sh"]
    assert db_member_gids(group, name) == {11, 12}
    assert _outcome(_old_resolve, passwd, group, name) == (2, 2, [11, 12])


MiB = 2**20
HOSTILE = [
    ("one line of a,a,a,...:", "g:x:5:" + "a," * (MiB // 2) + "\n"),
    ("one line of a,a,a,... first", "a," * (MiB // 2) + ":\n"),
    ("one line of colons", ":" * MiB + "\n"),
    ("one line of a name", "g:x:5:" + "a" * MiB + "\n"),
    ("short lines", ":\n" * (MiB // 2)),
    ("short group lines", "::0:a\n" * (MiB // 6)),
    ("short passwd lines", "::0\n" * (MiB // 4)),
    ("commas", "," * MiB),
    ("no line end", "a" * MiB),
]
MEMBERS = ["a", "b", "aa", "a" * 200, "a" * (MiB // 2), "a" * (PATTERN_MAX + 1)]


@pytest.mark.parametrize(("what", "text"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_hostile_file_is_answered_at_once(what: str, text: str) -> None:
    """No line, however long, makes a lookup backtrack over it more than once: each
    answer of 1 MiB of hostile text takes a few ms (the list-based code took seconds
    and hundreds of MiB for some of these)."""
    for member in MEMBERS:
        t0 = time.perf_counter()
        db_member_gids(text, member)
        db_entry(text, 0, member, least=4)
        db_entry(text, 3, member)
        assert time.perf_counter() - t0 < 0.5, (what, len(member))
    t0 = time.perf_counter()
    db_names(text, {0, 5, 7})
    db_entry(text, 2, "0", least=6)
    assert time.perf_counter() - t0 < 0.5, what


def test_a_hostile_file_gives_the_right_answers() -> None:
    text = "g:x:5:" + "a," * (MiB // 2) + "b\nh:x:6:" + "a" * MiB + ",c\n"
    assert db_member_gids(text, "b") == {5}
    assert db_member_gids(text, "a") == {5}
    assert db_member_gids(text, "c") == {6}
    assert db_member_gids(text, "a" * MiB) == {6}
    assert db_member_gids(text, "a" * 300) == set()


def test_a_file_over_max_db_is_none(tmp_path: Path) -> None:
    """A real passwd is a few KiB; one over MAX_DB (1 MiB) is taken as absent: root is
    still root, a named user is not found."""
    line = b"runner:x:1000:1000::/home/runner:/bin/sh\n"
    root = _root(tmp_path, line + b":\n" * (MAX_DB // 2), b"")
    assert read_db(root, "/etc/passwd") == ""
    assert resolve_user(root, "root") == (0, 0, [])
    with pytest.raises(BadInputError, match="runner"):
        resolve_user(root, "runner")
    root = _root(tmp_path, line + b":\n" * (MAX_DB // 2 - len(line)), b"")
    assert resolve_user(root, "runner") == (1000, 1000, [])


def test_ids_that_are_not_ascii_digits_are_not_numbers(tmp_path: Path) -> None:
    """str.isdigit() is true of "²" and "١", which the C library does not read as ids
    (and int() refuses the first): a sandbox's /etc/passwd with such an id made a lookup
    raise ValueError. Such a field is no number; such a user is a name."""
    passwd = "root:x:0:0:root:/root:/bin/sh\nsq:x:²:²::/:/bin/sh\nar:x:1000:١::/:/bin/sh\n"
    group = "root:x:0:\nodd:x:²:sq\n"
    root = _root(tmp_path, passwd, group)
    with pytest.raises(BadInputError, match="'sq' is not in"):
        resolve_user(root, "sq")  # its uid is no number: as no entry
    assert resolve_user(root, "ar") == (1000, 0, [])  # its gid is no number: group 0
    with pytest.raises(BadInputError, match="'²' is not in"):
        resolve_user(root, "²")
    with pytest.raises(BadInputError, match="group 'odd' is not in"):
        resolve_user(root, "root:odd")
