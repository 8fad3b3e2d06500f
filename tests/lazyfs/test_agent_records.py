"""The agent's sandbox records on disk (lazyfs/agent/records.py): what a restarted agent
reads back, including what a crash between a save's rename and its unlink leaves."""

from __future__ import annotations

import json
import stat
from dataclasses import asdict
from pathlib import Path

from lazyfs.agent.records import BoxRecord, Records


def _record(box_id: str, state: str = "ready") -> BoxRecord:
    return BoxRecord(id=box_id, image="py", image_id="a" * 64, state=state, runtime="runc",
                     created=1.0, env=["SECRET=1"])  # fmt: skip


def test_saves_replace_the_record_and_a_new_agent_reads_the_last(tmp_path: Path) -> None:
    records = Records(tmp_path)
    records.save(_record("lazyfs-000000000001"))
    records.save(_record("lazyfs-000000000001", "running"))
    records.save(_record("lazyfs-000000000002"))
    files = sorted(p.name for p in records.dir.iterdir())
    assert files == ["lazyfs-000000000001.2.json", "lazyfs-000000000002.1.json"]
    # create's env may hold secrets: only the agent (root) reads the records
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in records.dir.iterdir())
    loaded = Records(tmp_path).load_all()
    assert [(r.id, r.state) for r in loaded] == [
        ("lazyfs-000000000001", "running"),
        ("lazyfs-000000000002", "ready"),
    ]


def test_a_crash_between_rename_and_unlink_leaves_the_newest_as_the_record(
    tmp_path: Path,
) -> None:
    records = Records(tmp_path)
    records.save(_record("lazyfs-000000000001"))
    # What a save that died after its rename leaves: generation 2 next to 1.
    newer = asdict(_record("lazyfs-000000000001", "running"))
    (records.dir / "lazyfs-000000000001.2.json").write_text(json.dumps(newer))
    again = Records(tmp_path)
    assert [(r.id, r.state) for r in again.load_all()] == [("lazyfs-000000000001", "running")]
    assert sorted(p.name for p in again.dir.iterdir()) == ["lazyfs-000000000001.2.json"]
    again.save(_record("lazyfs-000000000001", "running"))  # carries on from generation 2
    again.remove("lazyfs-000000000001")
    assert list(again.dir.iterdir()) == []


def test_an_older_agents_record_is_read_and_an_unreadable_one_removed(tmp_path: Path) -> None:
    records = Records(tmp_path)
    records.dir.mkdir(parents=True)
    (records.dir / "lazyfs-000000000001.json").write_text(
        json.dumps(asdict(_record("lazyfs-000000000001", "running")))
    )
    (records.dir / "lazyfs-000000000002.1.json").write_text("{not json")
    loaded = records.load_all()
    assert [(r.id, r.state) for r in loaded] == [("lazyfs-000000000001", "running")]
    assert sorted(p.name for p in records.dir.iterdir()) == ["lazyfs-000000000001.json"]
    records.save(loaded[0])  # the next save moves it to the new naming
    assert sorted(p.name for p in records.dir.iterdir()) == ["lazyfs-000000000001.1.json"]
