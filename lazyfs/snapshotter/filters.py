"""containerd's filter syntax, as List requests use it.

A request carries several filters; a snapshot is listed when any of them matches. A filter
is a comma-separated conjunction of terms `FIELD OP VALUE` (OP: `==`, `!=`, `~=` regex) or
a bare `FIELD` (present and non-empty). FIELD is a dotted path whose parts may be quoted:
`labels."containerd.io/snapshot.ref"`; VALUE is a bare word or a quoted string. Fields:
name, parent, kind (view, active, committed) and labels.KEY. For example containerd finds
a remote snapshot with
    labels."containerd.io/snapshot.ref"==sha256:abc,parent==default/4/sha256:def
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from lazyfs.snapshotter.state import InvalidArgument, Kind, Snapshot

Term = tuple[tuple[str, ...], str, str]  # (field path, operator or "", value)

_QUOTED = r'"(?:[^"\\]|\\.)*"'
_TOKEN = re.compile(rf'\s*({_QUOTED}|==|!=|~=|[.,]|[^\s.,="!~]+)')
_KIND_NAMES = {Kind.VIEW: "view", Kind.ACTIVE: "active", Kind.COMMITTED: "committed"}


def _unquote(token: str) -> str:
    if token.startswith('"'):
        return re.sub(r"\\(.)", r"\1", token[1:-1])
    return token


def _tokens(text: str) -> list[str]:
    out, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            if text[pos:].strip():
                raise InvalidArgument(f"cannot parse filter {text!r} at {text[pos:]!r}")
            break
        out.append(m.group(1))
        pos = m.end()
    return out


def parse(text: str) -> list[Term]:
    """One filter: its conjunction of terms."""
    tokens, terms, i = _tokens(text), [], 0
    while i < len(tokens):
        path = [_unquote(tokens[i])]
        i += 1
        while i + 1 < len(tokens) and tokens[i] == ".":
            path.append(_unquote(tokens[i + 1]))
            i += 2
        op, value = "", ""
        if i < len(tokens) and tokens[i] in ("==", "!=", "~="):
            op = tokens[i]
            # A bare value runs to the next comma (it may contain dots: sha256:..., a.b).
            j = i + 1
            parts = []
            while j < len(tokens) and tokens[j] != ",":
                parts.append(_unquote(tokens[j]))
                j += 1
            value, i = "".join(parts), j
        if i < len(tokens):
            if tokens[i] != ",":
                raise InvalidArgument(f"cannot parse filter {text!r} near {tokens[i]!r}")
            i += 1
        if not path[0] or path[0] in ("==", "!=", "~=", ",", "."):
            raise InvalidArgument(f"cannot parse filter {text!r}")
        terms.append((tuple(path), op, value))
    return terms


def _field(snap: Snapshot, path: tuple[str, ...]) -> str | None:
    head = path[0]
    if head == "name" and len(path) == 1:
        return snap.key
    if head == "parent" and len(path) == 1:
        return snap.parent
    if head == "kind" and len(path) == 1:
        return _KIND_NAMES[snap.kind]
    if head == "labels" and len(path) >= 2:
        return snap.labels.get(".".join(path[1:]))
    raise InvalidArgument(f"unknown filter field {'.'.join(path)!r}")


def _matches(snap: Snapshot, terms: Sequence[Term]) -> bool:
    for path, op, value in terms:
        actual = _field(snap, path)
        if op == "":
            ok = bool(actual)
        elif op == "==":
            ok = actual == value
        elif op == "!=":
            ok = actual != value
        else:
            try:
                ok = actual is not None and re.search(value, actual) is not None
            except re.error as exc:
                raise InvalidArgument(f"bad regular expression {value!r}: {exc}") from None
        if not ok:
            return False
    return True


def matcher(filters: Sequence[str]) -> Callable[[Snapshot], bool]:
    """A predicate true for snapshots that any filter matches (all, when none is given)."""
    parsed = [parse(f) for f in filters if f.strip()]
    if not parsed:
        return lambda snap: True
    return lambda snap: any(_matches(snap, terms) for terms in parsed)
