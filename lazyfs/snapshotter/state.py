"""The snapshotter's own record of its snapshots: one SQLite file under its root.

containerd keeps its own metadata and talks to a snapshotter only in keys; this file is
what lets the snapshotter answer after a restart. A snapshot's directory is
ROOT/snapshots/<id>/{fs,work}. Rows change in one transaction each; directories are made
before the row that names them is committed and deleted after the row is gone, so a crash
leaves at worst an unnamed directory, which Cleanup removes.

Schema, version 1 (the `meta` table holds `version`):

    snapshots(id, key, parent, kind, created_ns, updated_ns, labels, image, layer, top,
              hydrated, size, inodes)

- key: containerd's key (or, once committed, its name); parent: the parent's key or ''.
- kind: 1 view, 2 active, 3 committed (containerd's enum).
- labels: JSON object of string -> string.
- image/layer/top: for a lazy placeholder, the lazyfs image id whose layer chain it
  stands for, the layer's index in that image, and whether it is the image's last layer
  (then the image's lazy mount is the whole chain). '' / -1 / 0 for ordinary snapshots.
- hydrated: a placeholder whose layer was written into fs/ after all (an ordinary
  snapshot was stacked on a chain the lazy mount does not cover; see hydrate.py).
- size/inodes: disk usage, frozen when the snapshot is committed.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path

SCHEMA_VERSION = 1
SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS snapshots (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    key TEXT NOT NULL UNIQUE,
    parent TEXT NOT NULL,
    kind INTEGER NOT NULL,
    created_ns INTEGER NOT NULL,
    updated_ns INTEGER NOT NULL,
    labels TEXT NOT NULL,
    image TEXT NOT NULL DEFAULT '',
    layer INTEGER NOT NULL DEFAULT -1,
    top INTEGER NOT NULL DEFAULT 0,
    hydrated INTEGER NOT NULL DEFAULT 0,
    size INTEGER NOT NULL DEFAULT 0,
    inodes INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS snapshots_parent ON snapshots (parent);
"""
_COLUMNS = (
    "id, key, parent, kind, created_ns, updated_ns, labels, image, layer, top, hydrated, "
    "size, inodes"
)


class Kind(IntEnum):
    VIEW = 1
    ACTIVE = 2
    COMMITTED = 3


class SnapshotError(Exception):
    """A request containerd made that cannot be done; the service maps `code` to gRPC."""

    code = "UNKNOWN"


class NotFound(SnapshotError):
    code = "NOT_FOUND"


class AlreadyExists(SnapshotError):
    code = "ALREADY_EXISTS"


class FailedPrecondition(SnapshotError):
    code = "FAILED_PRECONDITION"


class InvalidArgument(SnapshotError):
    code = "INVALID_ARGUMENT"


@dataclass
class Snapshot:
    id: int
    key: str
    parent: str
    kind: Kind
    created_ns: int
    updated_ns: int
    labels: dict[str, str] = field(default_factory=dict)
    image: str = ""
    layer: int = -1
    top: bool = False
    hydrated: bool = False
    size: int = 0
    inodes: int = 0

    @property
    def lazy(self) -> bool:
        """A placeholder whose content is only in the store (so far)."""
        return bool(self.image) and not self.hydrated


@dataclass(frozen=True)
class LazyLayer:
    """What a placeholder stands for: layer `layer` of lazyfs image `image`."""

    image: str
    layer: int
    top: bool


def _row(r: tuple) -> Snapshot:
    return Snapshot(
        r[0], r[1], r[2], Kind(r[3]), r[4], r[5], json.loads(r[6]), r[7], r[8], bool(r[9]),
        bool(r[10]), r[11], r[12],
    )  # fmt: skip


class State:
    """All snapshot rows; every method is one transaction, serialized by one lock."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.snapshots_dir = root / "snapshots"
        self.snapshots_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._db = sqlite3.connect(root / "metadata.db", check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        with self._db:
            self._db.executescript(SCHEMA)
            row = self._db.execute("SELECT value FROM meta WHERE key='version'").fetchone()
            if row is None:
                self._db.execute("INSERT INTO meta VALUES ('version', ?)", (str(SCHEMA_VERSION),))
            elif row[0] != str(SCHEMA_VERSION):
                raise RuntimeError(f"{root / 'metadata.db'}: unknown schema version {row[0]}")

    def close(self) -> None:
        self._db.close()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock, self._db:
            yield self._db

    # ------------------------------------------------------------------ reading

    def get(self, key: str) -> Snapshot:
        with self._lock:
            r = self._db.execute(f"SELECT {_COLUMNS} FROM snapshots WHERE key=?", (key,))
            found = r.fetchone()
        if found is None:
            raise NotFound(f"snapshot {key} does not exist")
        return _row(found)

    def find(self, key: str) -> Snapshot | None:
        try:
            return self.get(key)
        except NotFound:
            return None

    def all(self) -> list[Snapshot]:
        with self._lock:
            rows = self._db.execute(f"SELECT {_COLUMNS} FROM snapshots ORDER BY id").fetchall()
        return [_row(r) for r in rows]

    def has_children(self, key: str) -> bool:
        with self._lock:
            r = self._db.execute("SELECT 1 FROM snapshots WHERE parent=? LIMIT 1", (key,))
            return r.fetchone() is not None

    def chain(self, snap: Snapshot) -> list[Snapshot]:
        """The snapshot's ancestors, nearest first."""
        out = []
        key = snap.parent
        while key:
            parent = self.get(key)
            out.append(parent)
            key = parent.parent
        return out

    def dir(self, snap: Snapshot) -> Path:
        return self.snapshots_dir / str(snap.id)

    # ------------------------------------------------------------------ changing

    def create(
        self,
        kind: Kind,
        key: str,
        parent: str,
        labels: dict[str, str],
        lazy: LazyLayer | None = None,
    ) -> Snapshot:
        """A new snapshot row with its directories (fs/ and, for active ones, work/)."""
        if not key:
            raise InvalidArgument("snapshot key must not be empty")
        now = time.time_ns()
        with self.transaction() as db:
            if self.find(key) is not None:
                raise AlreadyExists(f"snapshot {key} already exists")
            if parent:
                p = self.find(parent)
                if p is None:
                    raise NotFound(f"parent snapshot {parent} does not exist")
                if p.kind != Kind.COMMITTED:
                    raise InvalidArgument(f"parent {parent} is not a committed snapshot")
            image, layer, top = (lazy.image, lazy.layer, lazy.top) if lazy else ("", -1, False)
            cur = db.execute(
                "INSERT INTO snapshots (key, parent, kind, created_ns, updated_ns, labels, "
                "image, layer, top) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (key, parent, int(kind), now, now, json.dumps(labels), image, layer, int(top)),
            )
            snap = self.get(key)
            assert snap.id == cur.lastrowid
            base = self.dir(snap)
            (base / "fs").mkdir(parents=True, exist_ok=True)
            if kind == Kind.ACTIVE:
                (base / "work").mkdir(exist_ok=True)
        return snap

    def commit(
        self, name: str, key: str, labels: dict[str, str], usage: tuple[int, int]
    ) -> Snapshot:
        if not name:
            raise InvalidArgument("commit needs a name")
        with self.transaction() as db:
            snap = self.get(key)
            if snap.kind != Kind.ACTIVE:
                raise FailedPrecondition(f"snapshot {key} is not active")
            if self.find(name) is not None:
                raise AlreadyExists(f"snapshot {name} already exists")
            db.execute(
                "UPDATE snapshots SET key=?, kind=?, labels=?, updated_ns=?, size=?, inodes=? "
                "WHERE id=?",
                (name, int(Kind.COMMITTED), json.dumps(labels), time.time_ns(), *usage, snap.id),
            )
        return self.get(name)

    def remove(self, key: str) -> Snapshot:
        with self.transaction() as db:
            snap = self.get(key)
            if self.has_children(key):
                raise FailedPrecondition(f"snapshot {key} has children; remove them first")
            db.execute("DELETE FROM snapshots WHERE id=?", (snap.id,))
        return snap

    def set_labels(self, key: str, labels: dict[str, str]) -> Snapshot:
        with self.transaction() as db:
            snap = self.get(key)
            db.execute(
                "UPDATE snapshots SET labels=?, updated_ns=? WHERE id=?",
                (json.dumps(labels), time.time_ns(), snap.id),
            )
        return self.get(key)

    def mark_hydrated(self, snap: Snapshot, usage: tuple[int, int]) -> None:
        with self.transaction() as db:
            db.execute(
                "UPDATE snapshots SET hydrated=1, size=?, inodes=? WHERE id=?", (*usage, snap.id)
            )
