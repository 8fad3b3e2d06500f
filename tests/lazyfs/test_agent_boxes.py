"""A sandbox's states (lazyfs/agent/boxes.py): one table of the allowed transitions, a
refused one is a bug, and the records on disk keep the strings they always had."""

from __future__ import annotations

from pathlib import Path

import pytest

from lazyfs.agent.boxes import TRANSITIONS, AgentBox, BadTransition, BoxState, exec_target
from lazyfs.agent.metrics import STATES
from lazyfs.agent.records import BoxRecord, Records
from lazyfs.sandbox.runtime import Sandbox, SandboxHost

NOWHERE = SandboxHost(Path("/nonexistent"), Path("/nonexistent"), "lazyfs-test")  # never used


def _box(state: BoxState = BoxState.READY) -> AgentBox:
    sandbox = Sandbox("lazyfs-000000000001", "runc", NOWHERE)
    record = BoxRecord(sandbox.id, "py", "0" * 64, "ready", "runc", created=0.0)
    return AgentBox(sandbox, record, exec_target(sandbox, record), state)


def _at(state: BoxState) -> AgentBox:
    """A box moved to `state` along allowed transitions."""
    box = _box(BoxState.RUNNING if state is BoxState.RUNNING else BoxState.READY)
    if state not in (BoxState.READY, BoxState.RUNNING):
        box.move(state)
    return box


@pytest.mark.parametrize(
    ("start", "to"), [(s, t) for s in BoxState for t in BoxState], ids=lambda s: s.value
)
def test_a_move_is_allowed_exactly_when_the_table_lists_it(start: BoxState, to: BoxState) -> None:
    box = _at(start)
    if to in TRANSITIONS[start]:
        box.move(to)
        assert box.state is to
    else:
        with pytest.raises(BadTransition, match=f"{start.value} -> {to.value}"):
            box.move(to)
        assert box.state is start


def test_the_table_covers_every_state() -> None:
    assert set(TRANSITIONS) == set(BoxState)


def test_the_table_keeps_what_the_agent_relies_on() -> None:
    assert BoxState.RUNNING not in TRANSITIONS[BoxState.EXITED]  # never handed out dead
    assert TRANSITIONS[BoxState.DELETING] == {BoxState.DELETING}  # no way back


def test_a_box_starts_ready_or_running_only() -> None:
    with pytest.raises(BadTransition):
        _box(BoxState.EXITED)


def test_a_bad_transition_is_no_domain_error() -> None:
    """A bug: not a LazyfsError, so that no `suppress(LazyfsError)` hides it."""
    from chunker.errors import LazyfsError

    assert not issubclass(BadTransition, LazyfsError)


def test_records_and_views_keep_the_old_strings(tmp_path: Path) -> None:
    assert [s.value for s in BoxState] == ["ready", "warmup", "running", "exited", "deleting"]
    assert STATES == ("ready", "warmup", "running", "exited", "deleting")
    records = Records(tmp_path)
    records.save(BoxRecord("lazyfs-000000000002", "py", "0" * 64, "running", "runc", 0.0))
    (loaded,) = records.load_all()
    assert BoxState(loaded.state) is BoxState.RUNNING
    assert _at(BoxState.EXITED).view()["state"] == "exited"
