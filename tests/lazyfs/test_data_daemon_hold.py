"""Holding the node data daemon up (ImageMounts.hold_data_daemon, the node agent's): a
held daemon outlives $LAZYFS_DAEMON_IDLE with nothing mounted and exits once let go; the
hold survives `kill -9` of the worker (the supervisor tells the next one), and after the
supervisor's own death the next start takes it again. The agent holds it from its start,
so a cold create starts no daemon, and starts it again if its supervisor dies."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from lazyfs.agent.node import DAEMON_CHECK
from lazyfs.settings import Settings
from lazyfs.tree.image_mounts import ImageMounts
from testbed.agent import AgentProcess
from testbed.mounted_trees import DATA_DAEMON_IDLE, data_daemons, one_worker, supervisors
from testbed.mounts import mount_ids
from testbed.processes import pid_alive, wait_until

IDLE_PERIODS = 5  # a held daemon must outlive this many idle periods
OUTLIVE = IDLE_PERIODS * float(DATA_DAEMON_IDLE)


def manager(tmp_path: Path) -> ImageMounts:
    """A mount manager with an empty store: the data daemon needs no image to run."""
    store = tmp_path / "store"
    store.mkdir(exist_ok=True)
    return ImageMounts(f"file://{store}", tmp_path / "cache", Settings.from_env())


@pytest.mark.usefixtures("no_leftovers")
def test_a_held_data_daemon_outlives_its_idle_time_and_exits_once_released(
    tmp_path, private_run_dir
) -> None:
    mounts = manager(tmp_path)
    hold = mounts.hold_data_daemon()
    assert mounts.hold_data_daemon() is hold  # one per manager
    hold.ensure()
    point = str(mounts.data_dir)
    (supervisor,) = supervisors(private_run_dir)
    worker = one_worker(point)
    time.sleep(OUTLIVE)
    assert data_daemons(point) == [worker] and supervisors(private_run_dir) == [supervisor]
    assert hold.held()
    hold.ensure()  # held already: no second handle, no second daemon
    assert supervisors(private_run_dir) == [supervisor]
    hold.release()
    wait_until(lambda: not pid_alive(supervisor), 10, "the idle exit after the release")
    assert not pid_alive(worker) and point not in mount_ids()


@pytest.mark.usefixtures("no_leftovers")
def test_the_hold_survives_kill_9_of_the_worker(tmp_path, private_run_dir) -> None:
    mounts = manager(tmp_path)
    hold = mounts.hold_data_daemon()
    hold.ensure()
    point = str(mounts.data_dir)
    (supervisor,) = supervisors(private_run_dir)
    first = one_worker(point)
    os.kill(first, signal.SIGKILL)
    second = one_worker(point, {first})
    time.sleep(OUTLIVE)  # the new worker adopted the hold's handle: it stays
    assert data_daemons(point) == [second] and supervisors(private_run_dir) == [supervisor]
    assert hold.held()
    os.kill(second, signal.SIGKILL)  # and once more, from the second worker's count
    third = one_worker(point, {first, second})
    time.sleep(OUTLIVE)
    assert data_daemons(point) == [third]
    hold.release()  # the release reaches the third worker: it exits idle
    wait_until(lambda: not pid_alive(supervisor), 10, "the idle exit after the release")
    assert point not in mount_ids()


@pytest.mark.usefixtures("no_leftovers")
def test_after_the_supervisors_death_the_next_start_holds_the_new_daemon(
    tmp_path, private_run_dir
) -> None:
    mounts = manager(tmp_path)
    hold = mounts.hold_data_daemon()
    hold.ensure()
    point = str(mounts.data_dir)
    (dead,) = supervisors(private_run_dir)
    os.kill(dead, signal.SIGKILL)
    wait_until(lambda: point not in mount_ids(), 10, "the watchdog's detach")
    assert not hold.held()
    # What the manager's next EROFS mount does first (ImageMounts._data_daemon).
    hold.ensure()
    (supervisor,) = supervisors(private_run_dir)
    assert supervisor != dead
    time.sleep(OUTLIVE)
    assert hold.held() and supervisors(private_run_dir) == [supervisor]
    hold.release()
    wait_until(lambda: not pid_alive(supervisor), 10, "the idle exit after the release")


@pytest.mark.usefixtures("no_leftovers")
def test_two_holders_keep_it_up_until_both_let_go(tmp_path, private_run_dir) -> None:
    """Two managers of one node (two processes' worth): the daemon counts both handles."""
    a, b = manager(tmp_path), manager(tmp_path)
    hold_a, hold_b = a.hold_data_daemon(), b.hold_data_daemon()
    hold_a.ensure()
    hold_b.ensure()
    (supervisor,) = supervisors(private_run_dir)
    hold_a.release()
    time.sleep(OUTLIVE)
    assert supervisors(private_run_dir) == [supervisor]
    hold_b.release()
    wait_until(lambda: not pid_alive(supervisor), 10, "the idle exit after both releases")


def _supervisor(agent: AgentProcess) -> int:
    (pid,) = supervisors(agent.node.tmp / "run")
    return pid


def test_the_agent_holds_the_data_daemon_from_its_start(agent: AgentProcess) -> None:
    """Started with no pools, the agent has the data daemon up, so a cold create starts
    none; it stays up with no tree mounted, and goes after the agent stops."""
    agent.node.env["LAZYFS_AGENT_LINGER"] = "0"  # a tree goes with its last sandbox
    agent.start()
    supervisor = _supervisor(agent)
    time.sleep(OUTLIVE)
    assert _supervisor(agent) == supervisor
    with agent.client() as c:
        box = c.create("py")
        assert box.exec(["python3", "-c", "print('hello')"]).stdout == b"hello\n"
        assert _supervisor(agent) == supervisor  # the create started no data daemon
        box.delete()
    images = agent.node.tmp / "run" / "images"
    wait_until(lambda: not any(p.startswith(f"{images}/") for p in mount_ids()), 10, "the unmount")
    time.sleep(OUTLIVE)
    assert _supervisor(agent) == supervisor  # no tree, still held
    agent.stop()
    wait_until(lambda: not pid_alive(supervisor), 10, "the idle exit after the agent stopped")


def test_the_agent_starts_it_again_after_the_supervisors_death(agent: AgentProcess) -> None:
    """The supervisor's death ends the hold; within DAEMON_CHECK the agent starts a new
    data daemon and holds that one, so the next cold create starts none."""
    agent.node.env["LAZYFS_AGENT_LINGER"] = "0"
    agent.start()
    dead = _supervisor(agent)
    point = next(p for p in mount_ids() if p.startswith(f"{agent.node.tmp}/run/data/"))
    os.kill(dead, signal.SIGKILL)
    wait_until(
        lambda: supervisors(agent.node.tmp / "run") not in ([], [dead]),
        DAEMON_CHECK + 10,
        "the agent's restart of the data daemon",
    )
    supervisor = _supervisor(agent)
    wait_until(lambda: point in mount_ids(), 10, "the new data mount")
    with agent.client() as c:
        box = c.create("py")
        assert box.exec(["echo", "up"]).stdout == b"up\n"
        box.delete()
    assert _supervisor(agent) == supervisor
    images = agent.node.tmp / "run" / "images"
    wait_until(lambda: not any(p.startswith(f"{images}/") for p in mount_ids()), 10, "the unmount")
    time.sleep(OUTLIVE)
    assert _supervisor(agent) == supervisor  # held
    agent.stop()
    wait_until(lambda: not pid_alive(supervisor), 10, "the idle exit after the agent stopped")
