"""Fixtures for the Docker Engine API's tests: one agent per module answering Docker's
API on a socket of its own (`lazyfs serve --docker-socket`), with the python test image
converted as `py`, and docker-py's client on it. Each test's containers are removed
after it; the agent's teardown checks the node clean."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import docker
import pytest

from testbed.agent import AgentProcess, running_agent
from tests.lazyfs.conftest import py_store  # noqa: F401 - a fixture, used by name

__all__ = ["py_store"]


@pytest.fixture(scope="module")
def docker_agent(
    tmp_path_factory: pytest.TempPathFactory, py_store: Path
) -> Iterator[AgentProcess]:  # noqa: F811
    tmp = tmp_path_factory.mktemp("docker-agent")
    with running_agent(tmp, py_store) as agent:
        agent.start()  # the Docker API on its default socket, docker.sock beside agent.sock
        yield agent


@pytest.fixture(scope="module")
def docker_socket(docker_agent: AgentProcess) -> Path:
    return docker_agent.node.tmp / "docker.sock"


@pytest.fixture
def dclient(docker_socket: Path) -> Iterator[docker.DockerClient]:
    """docker-py on the agent; whatever containers the test left are removed."""
    client = docker.DockerClient(base_url=f"unix://{docker_socket}", timeout=60)
    try:
        yield client
    finally:
        for container in client.containers.list(all=True):
            container.remove(force=True)
        client.close()
