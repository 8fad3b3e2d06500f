"""What a sandbox runs: the image config's Env, WorkingDir and User, the command line's
overrides, resolved against the sandbox's root filesystem.

Every path inside the rootfs is resolved here as the sandbox would see it (symlinks
followed relative to the rootfs, never out of it): the image is untrusted, and this code
runs as root on the host.

A root is one directory (an image's merged tree) or the image's layer trees, top first
(docs/FORMATS.md, "Layer trees"), which the sandbox sees stacked by overlayfs: a path
is then looked up as overlayfs looks it up (`lookup_path`), without a mount.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable, Sequence
from pathlib import Path

from chunker.errors import BadInputError
from lazyfs.sandbox.oci_spec import HOSTNAME, Process

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
MAX_SYMLINKS = 40  # as the kernel's ELOOP limit
OPAQUE_XATTR = "trusted.overlay.opaque"

Root = Path | Sequence[Path]  # a tree, or layer trees top first


def root_of(trees: Sequence[Path]) -> Root:
    """The root a sandbox stands on, from its trees top first: one is a tree."""
    return trees[0] if len(trees) == 1 else tuple(trees)


def root_text(root: Root) -> str:
    """A root as overlayfs's lowerdir names it (and an agent's record keeps it)."""
    return str(root) if isinstance(root, Path) else ":".join(map(str, root))


def is_whiteout(st: os.stat_result) -> bool:
    """overlayfs's mark of a name removed: a 0/0 character device."""
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def is_opaque(where: int | str | os.PathLike) -> bool:
    """Whether a directory (a descriptor or a path, not followed) is overlayfs-opaque:
    it hides what the layers below have under its name."""
    try:
        if isinstance(where, int):
            return os.getxattr(where, OPAQUE_XATTR) == b"y"
        return os.getxattr(where, OPAQUE_XATTR, follow_symlinks=False) == b"y"
    except OSError:
        return False


def merged_dirs(root: Root, parts: list[str]) -> list[Path]:
    """The host directories the directory `parts` of root is merged from, top first, as
    overlayfs merges them; [] if it is no directory there. Each name is looked up in the
    layers where its parent is a directory, so no symlink is ever followed."""
    layers = [root] if isinstance(root, Path) else list(root)
    for depth in range(1, len(parts) + 1):
        below: list[Path] = []
        for layer in layers:
            host = layer.joinpath(*parts[:depth])
            try:
                st = os.lstat(host)
            except OSError:
                continue
            if is_whiteout(st) or not stat.S_ISDIR(st.st_mode):
                break
            below.append(layer)
            if layer is not layers[-1] and is_opaque(host):  # (no layer below: no need)
                break
        layers = below
    return [layer.joinpath(*parts) for layer in layers]


def lookup_path(root: Root, parts: list[str]) -> tuple[Path, os.stat_result] | None:
    """The host path and lstat of `parts` (names) in root, as overlayfs finds it in
    stacked layers: the topmost layer of its parent directory holding the name gives
    it; a whiteout there hides it. No symlink among its ancestors is followed (a name
    under one is not there)."""
    if not parts:
        top = root if isinstance(root, Path) else root[0]
        return top, os.lstat(top)
    return lookup_in(merged_dirs(root, parts[:-1]), parts[-1])


def lookup_in(parents: list[Path], name: str) -> tuple[Path, os.stat_result] | None:
    """lookup_path of one name in a directory whose merged_dirs are `parents`: for a
    caller that looks up many names of one directory."""
    for parent in parents:
        host = parent / name
        try:
            st = os.lstat(host)
        except OSError:
            continue
        return None if is_whiteout(st) else (host, st)
    return None


class CommandNotFound(BadInputError):
    """The command does not exist in the image: exit 127, as a shell."""

    exit_code = 127


class CommandNotExecutable(BadInputError):
    """The command exists but cannot be executed: exit 126, as a shell."""

    exit_code = 126


def resolve_in_root(root: Root, path: str, cwd: str = "/") -> Path | None:
    """The host path of `path` as seen from a process chrooted at `root` with cwd `cwd`,
    all symlinks followed inside root; None if it does not exist."""
    pending = [p for p in (path if path.startswith("/") else f"{cwd}/{path}").split("/") if p]
    parts: list[str] = []
    hops = 0
    while pending:
        name = pending.pop(0)
        if name == ".":
            continue
        if name == "..":
            if parts:
                parts.pop()
            continue
        hit = lookup_path(root, [*parts, name])
        if hit is None:
            return None
        host, st = hit
        if stat.S_ISLNK(st.st_mode):
            hops += 1
            if hops > MAX_SYMLINKS:
                return None
            target = os.readlink(host)
            if target.startswith("/"):
                parts = []
            pending = [p for p in target.split("/") if p] + pending
            continue
        if pending and not stat.S_ISDIR(st.st_mode):
            return None
        parts.append(name)
    if isinstance(root, Path):
        return root.joinpath(*parts)
    hit = lookup_path(root, parts)  # the layer that gives the path (".." may have moved it)
    return None if hit is None else hit[0]


MAX_DB = 2**20  # bytes of an /etc/passwd or /etc/group read: a real one is a few KiB
# (a thousand users is ~60 KiB); past this the file is taken as absent. At 4 MiB a file
# of ":\n" lines was two million lists, ~690 MiB of the agent's memory per lookup.
PATTERN_MAX = 256  # the longest name put into a pattern (useradd's limit is 32): a longer
# one, which only a file made to hurt has, is compared line by line (compiling a 512 KiB
# name as a pattern took 77 MB and seconds)
_NAMES_UIDS = re.compile(r"^(?!#)([^:\n]*+):[^:\n]*+:([0-9]++)(?=[:\n]|\Z)", re.M)
_GIDS_MEMBERS = re.compile(r"^(?!#)[^:\n]*+:[^:\n]*+:([0-9]++):([^:\n]*+)", re.M)


def is_number(text: str) -> bool:
    """Whether text is a decimal number as the C library reads an id: ASCII digits.
    str.isdigit() is true of "²" too, which int() refuses: a sandbox's /etc/passwd
    with such an id made a user lookup raise ValueError."""
    return text.isascii() and text.isdigit()


def db_text(raw: bytes) -> str:
    """An /etc/passwd or /etc/group's bytes as the db_ lookups take them (CRLF lines too)."""
    return raw.decode(errors="replace").replace("\r\n", "\n")


# The db_ lookups read such a file as text, as getpwnam does, without a list per line (a
# file of short lines made one object per two bytes of the file): each is one regular
# expression over the text, run in C. Every repetition in them is possessive (`*+`) or
# followed only by what it cannot match, so no line, however long or hostile, makes the
# engine backtrack more than once over it: linear in the file.


def _line(text: str, start: int) -> list[str]:
    end = text.find("\n", start)
    return text[start : None if end < 0 else end].split(":")


def db_entry(text: str, field: int, value: str, least: int = 0) -> list[str] | None:
    """The fields of the first entry (a line neither empty nor a comment) whose
    field-th field (from 0) is `value` and that has at least `least` fields; None."""
    if ":" in value or "\n" in value:
        return None
    more = max(least - field - 1, 0)
    if len(value) > PATTERN_MAX:
        found = re.compile(rf"^(?!#|\n|\Z)(?:[^:\n]*+:){{{field}}}([^:\n]*+)", re.M)
        for m in found.finditer(text):
            if m[1] == value and len(fields := _line(text, m.start())) >= field + 1 + more:
                return fields
        return None
    line = re.search(
        rf"^(?!#|\n|\Z)(?:[^:\n]*+:){{{field}}}{re.escape(value)}(?=[:\n]|\Z)"
        rf"(?=(?::[^:\n]*+){{{more}}})",
        text,
        re.M,
    )
    return None if line is None else _line(text, line.start())


def db_member_gids(text: str, member: str) -> set[int]:
    """The gids of /etc/group's entries (the text) whose member list names `member`."""
    if any(c in member for c in ",:\n"):  # no item of a list is
        return set()
    if len(member) > PATTERN_MAX:
        needle = f",{member},"
        return {int(m[1]) for m in _GIDS_MEMBERS.finditer(text) if needle in f",{m[2]},"}
    # [^:\n]*, backtracks over the list once, trying the name after each comma: the
    # name holds no comma, so each try ends by the next one.
    pattern = rf"^(?!#)[^:\n]*+:[^:\n]*+:([0-9]++):(?:[^:\n]*,)?{re.escape(member)}(?=[,:\n]|\Z)"
    return {int(m[1]) for m in re.finditer(pattern, text, re.M)}


def db_names(text: str, ids: set[int]) -> dict[int, str]:
    """id -> the name of the first entry of /etc/passwd (the text) with that id, for
    `ids` only (one step per entry with a numeric id)."""
    names: dict[int, str] = {}
    for m in _NAMES_UIDS.finditer(text):
        number = int(m[2])
        if number in ids and number not in names:
            names[number] = m[1]
            if len(names) == len(ids):
                break
    return names


def read_db(root: Root, path: str) -> str:
    """/etc/passwd or /etc/group in the rootfs, as text for the db_ lookups ("" if it is
    not a regular file or is over MAX_DB): an image's trees, or a sandbox's root before
    any of its code ran (the path is resolved here and then opened on the host's side).
    A running sandbox's: files.sandbox_db."""
    host = resolve_in_root(root, path)
    if host is None or not host.is_file():
        return ""
    try:
        with open(host, "rb") as f:
            raw = f.read(MAX_DB + 1)
    except OSError:
        return ""
    return "" if len(raw) > MAX_DB else db_text(raw)


def resolve_user(
    root: Root, user: str, read: Callable[[Root, str], str] | None = None
) -> tuple[int, int, list[int]]:
    """(uid, gid, additional gids) for an image's User: "", name, uid, name:group, uid:gid
    (names from the rootfs's /etc/passwd and /etc/group; a user's groups from /etc/group
    when no group was given, as docker does). `read`: how the two files are read, as text
    (the agent reads a running sandbox's through its file API)."""
    read = read or read_db
    name, _, group = (user or "root").partition(":")
    passwd = read(root, "/etc/passwd")
    if is_number(name):
        uid = int(name)
        entry = db_entry(passwd, 2, name, least=4)
    elif (entry := db_entry(passwd, 0, name, least=4)) is not None and is_number(entry[2]):
        uid = int(entry[2])
    elif name == "root":
        uid = 0
    else:
        raise BadInputError(f"image user {name!r} is not in the image's /etc/passwd")
    if entry is not None and is_number(entry[3]):
        gid = int(entry[3])
    else:
        gid = uid if is_number(name) else 0  # a bare uid unknown to passwd: its own group
    extra: list[int] = []
    if group:
        if is_number(group):
            gid = int(group)
        else:
            match = db_entry(read(root, "/etc/group"), 0, group, least=3)
            if match is None or not is_number(match[2]):
                raise BadInputError(f"image group {group!r} is not in the image's /etc/group")
            gid = int(match[2])
    elif entry is not None:
        extra = sorted(g for g in db_member_gids(read(root, "/etc/group"), entry[0]) if g != gid)
    return uid, gid, extra


def merge_env(
    image_env: list[str] | None, overrides: list[str], home: str | None, hostname: str = HOSTNAME
) -> list[str]:
    """The image's Env, then --env K=V on top (same key: replaced, in place); PATH and
    HOME defaulted as a runtime does, HOSTNAME as dockerd does (the sandbox's hostname,
    first, so that the image's Env and --env may set it)."""
    env: dict[str, str] = {"HOSTNAME": hostname}
    for item in [*(image_env or []), *overrides]:
        key, sep, value = item.partition("=")
        if not key or not sep:
            raise BadInputError(f"environment entry {item!r} is not KEY=VALUE")
        env[key] = value
    env.setdefault("PATH", DEFAULT_PATH)
    if home:
        env.setdefault("HOME", home)
    if term := os.environ.get("TERM"):
        env.setdefault("TERM", term)
    return [f"{k}={v}" for k, v in env.items()]


def with_hostname(env: list[str], image_env: list[str] | None, hostname: str) -> list[str]:
    """merge_env's `env`, made for the default hostname, for a sandbox named `hostname`:
    its HOSTNAME replaced, unless the image's Env set that itself (then it stays, as
    merge_env leaves it)."""
    if any(item.startswith("HOSTNAME=") for item in image_env or []):
        return env
    return [f"HOSTNAME={hostname}" if item.startswith("HOSTNAME=") else item for item in env]


def find_command(root: Root, command: str, path_var: str, cwd: str) -> None:
    """Raise CommandNotFound / CommandNotExecutable as a shell would for `command`."""
    if "/" in command:
        candidates = [command]
    else:
        candidates = [f"{d or '.'}/{command}" for d in path_var.split(":")]
    found = False
    for candidate in candidates:
        host = resolve_in_root(root, candidate, cwd)
        if host is None or host.is_dir():
            continue
        found = True
        if os.stat(host).st_mode & 0o111:
            return
    if found:
        raise CommandNotExecutable(f"{command}: permission denied in the image")
    raise CommandNotFound(f"{command}: command not found in the image")


def build_process(
    root: Root,
    config: dict,
    command: list[str],
    env: list[str] | None = None,
    cwd: str | None = None,
    from_host: bool = False,
    hostname: str = HOSTNAME,
) -> Process:
    """The sandbox's process from the image config, --env and --cwd, checked against
    the rootfs (the command must exist there, unless it is `from_host`: bound in);
    `hostname` is the sandbox's, for its $HOSTNAME."""
    if not command:
        raise BadInputError("lazyfs run needs a command after --")
    uid, gid, extra = resolve_user(root, config.get("User") or "")
    entry = db_entry(read_db(root, "/etc/passwd"), 2, str(uid), least=6)
    home = entry[5] if entry is not None else "/root" if uid == 0 else "/"
    full_env = merge_env(config.get("Env"), env or [], home, hostname)
    workdir = cwd or config.get("WorkingDir") or "/"
    if not workdir.startswith("/"):
        raise BadInputError(f"--cwd {workdir!r} must be an absolute path")
    path_var = next((e[5:] for e in full_env if e.startswith("PATH=")), DEFAULT_PATH)
    if not from_host:
        find_command(root, command[0], path_var, workdir)
    return Process(
        args=list(command), env=full_env, cwd=workdir, uid=uid, gid=gid, additional_gids=extra
    )
