"""The fleet harness (testbed/fleet.py) the gateway is tested and benchmarked on: real
agents in their own network namespaces, over TLS with a token, on one S3 store behind a
shaped link; a node lost (`kill -9` of its agent and data daemon) and brought back, a
node cut off the network; and nothing of any of it left afterwards.

One fleet for the whole test: its start (SeaweedFS, two agents, two images converted
over the link) is most of the time this takes."""

from __future__ import annotations

import time

import pytest

from lazyfs.client import AgentError, Client
from testbed.agent import assert_lost_with_its_data_daemon
from testbed.fleet import TASK_FILE, Fleet, FleetNode, fleet
from testbed.processes import pid_alive


def _health_needs_the_token(f: Fleet, node: FleetNode) -> None:
    """/health over the node's own TLS address: ok with the token, 401 without."""
    with f.client(node.index) as c:
        assert c.health()["status"] == "ok"
    with Client(url=node.url, verify=f.ca) as anonymous, pytest.raises(AgentError) as err:
        anonymous.health()
    assert err.value.status == 401
    with node.local_client() as c:  # and the unix socket beside it
        assert c.health()["status"] == "ok"


def _task(f: Fleet, i: int, image: str, expected: str) -> None:
    """A sandbox of image on node i prints its image's own task line."""
    with f.client(i) as c, c.create(image) as sb:
        r = sb.exec(["cat", TASK_FILE], timeout=60)
        assert (r.exit_code, r.stdout.decode()) == (0, expected), r.stderr


def test_a_two_node_fleet_on_s3(tmp_path) -> None:
    t0 = time.monotonic()
    with fleet(tmp_path, nodes=2, store="s3", rate="1gbit", delay_ms=4.0) as f:
        assert f.seaweed is not None
        images = f.convert_agent_images(2)
        (a, line_a), (b, line_b) = images.items()
        assert {n.url for n in f.nodes} == {f"https://{n.ip}:7070" for n in f.nodes}
        assert len({n.ip for n in f.nodes}) == 2 and len({n.ns for n in f.nodes}) == 2
        for node in f.nodes:
            _health_needs_the_token(f, node)

        # Cold sandboxes of both images on both nodes: every chunk comes over the link.
        gets, (_, from_store) = f.seaweed.request_count("GET"), f.link_bytes()
        _task(f, 0, a, line_a)
        _task(f, 1, b, line_b)
        assert f.seaweed.request_count("GET") > gets
        assert f.link_bytes()[1] > from_store + 100_000  # the answers crossed the tbf link

        # Node loss: node 1 dies with a sandbox running (agent and data daemon, kill -9).
        with f.client(1) as c:
            kept = c.create(b)
            assert kept.exec(["cat", TASK_FILE]).stdout.decode() == line_b
        killed = f.nodes[1].kill9()
        assert len(killed) >= 3, killed  # the agent, the supervisor, its worker
        assert not any(map(pid_alive, killed)) and f.nodes[1].daemon_pids() == []
        with f.client(1, timeout=2) as c, pytest.raises(AgentError):
            c.health()
        _task(f, 0, b, line_b)  # the other node did not notice

        # Back: same address, run dir and cache. The sandbox outlived it, but its image
        # tree died with the data daemon: it is cleaned up and says so (410), not kept
        # with every uncached read an I/O error (lazyfs/agent/recovery.py).
        f.nodes[1].start()
        with f.client(1) as c:
            assert_lost_with_its_data_daemon(c, kept.id)
        _task(f, 1, a, line_a)

        # Cut off (not refused): a call times out, the other node answers meanwhile.
        with f.nodes[0].partitioned():
            t = time.monotonic()
            with f.client(0, timeout=1) as c, pytest.raises(AgentError, match="in time"):
                c.health()
            assert time.monotonic() - t < 3
            _health_needs_the_token(f, f.nodes[1])
        _health_needs_the_token(f, f.nodes[0])
    assert f.scrubbed == {}, f"the agents left this for the clean-up: {f.scrubbed}"
    assert f.leftovers() == {}
    assert time.monotonic() - t0 < 60
