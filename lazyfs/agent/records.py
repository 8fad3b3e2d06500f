"""What the agent keeps on disk about each sandbox, so that a restarted agent (after a
crash or `kill -9`) can serve its sandboxes again or know which ones it cleaned up.

RUN_DIR/agent/sandboxes/<id>.json, written atomically (temporary name, then rename)
whenever a sandbox changes state, removed when it is deleted. RUN_DIR/agent/lock is
held by the running agent: one agent per run directory.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class BoxRecord:
    id: str
    image: str  # as the client named it
    image_id: str
    state: str  # "ready" (pooled or a warm-up: started, not handed out) | "running"
    runtime: str
    created: float  # wall-clock seconds
    expires: float | None = None  # wall-clock seconds, from the TTL
    env: list[str] = field(default_factory=list)  # create's env, over the image's
    process_env: list[str] = field(default_factory=list)  # the sandbox's full environment
    cwd: str = "/"
    uid: int = 0  # the sandbox's user: files written through the API are its
    gid: int = 0
    cpus: float | None = None
    memory: int | None = None
    pids: int | None = None
    network: bool = False
    from_pool: bool = False


class Records:
    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir / "agent" / "sandboxes"

    def save(self, record: BoxRecord) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".{record.id}.tmp"
        tmp.write_text(json.dumps(asdict(record)))
        os.replace(tmp, self.dir / f"{record.id}.json")

    def remove(self, box_id: str) -> None:
        (self.dir / f"{box_id}.json").unlink(missing_ok=True)

    def load_all(self) -> list[BoxRecord]:
        """Every record; one that does not parse (a torn write cannot happen, but a
        hand-edited file can) is dropped: its sandbox is then cleaned as stale."""
        found = []
        if not self.dir.is_dir():
            return found
        for path in sorted(self.dir.glob("*.json")):
            with contextlib.suppress(OSError, ValueError, TypeError):
                found.append(BoxRecord(**json.loads(path.read_text())))
        return found
