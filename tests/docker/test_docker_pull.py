"""`docker pull` of an image that is not converted yet: the agent converts it from its
registry (Debian's docker-registry on loopback) into the node's store, with Docker's
progress lines, and it runs at once."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import docker
import pytest
from docker.errors import APIError, ImageNotFound

from testbed.images import TestImages
from testbed.registry import Registry

DOCKER = "/usr/bin/docker"


@pytest.fixture(scope="module")
def pushed(registry_factory: Callable[..., Registry], test_images: TestImages) -> Registry:
    registry = registry_factory("none")
    registry.push(f"oci:{test_images.layout}:python", "team/pyimage:1")
    registry.push(f"oci:{test_images.layout}:base", "team/base:2")
    return registry


def test_pull_converts_from_the_registry(
    dclient: docker.DockerClient, pushed: Registry, docker_socket: Path
) -> None:
    ref = f"{pushed.host}/team/pyimage:1"
    with pytest.raises(ImageNotFound):
        dclient.images.get(ref)
    lines = list(dclient.api.pull(f"{pushed.host}/team/pyimage", tag="1", stream=True,
                                  decode=True))  # fmt: skip
    assert not [line for line in lines if "error" in line], lines
    assert lines[-1]["status"] == f"Status: Downloaded newer image for {ref}"
    image = dclient.images.get(ref)
    assert f"{pushed.host}/team/pyimage:1" in image.tags
    out = dclient.containers.run(ref, ["python3", "-c", "print('pulled')"], remove=True)
    assert out == b"pulled\n"
    # Again: converted already, up to date at once; and through the CLI.
    env = {**os.environ, "DOCKER_HOST": f"unix://{docker_socket}", "DOCKER_CONFIG": "/nonexistent"}
    r = subprocess.run([DOCKER, "pull", ref], capture_output=True, env=env, timeout=120)
    assert r.returncode == 0 and b"Image is up to date" in r.stdout, r


def test_pull_of_a_missing_image_says_why(
    dclient: docker.DockerClient, pushed: Registry, docker_socket: Path
) -> None:
    ref = f"{pushed.host}/team/nosuch:1"
    lines = list(dclient.api.pull(f"{pushed.host}/team/nosuch", tag="1", stream=True,
                                  decode=True))  # fmt: skip
    assert "error" in lines[-1] and lines[-1]["errorDetail"]["message"], lines
    env = {**os.environ, "DOCKER_HOST": f"unix://{docker_socket}", "DOCKER_CONFIG": "/nonexistent"}
    r = subprocess.run([DOCKER, "pull", ref], capture_output=True, env=env, timeout=120)
    assert r.returncode != 0 and r.stderr.strip(), r
    assert dclient.ping()


def test_rmi_takes_the_name_off(
    dclient: docker.DockerClient, pushed: Registry, docker_socket: Path
) -> None:
    ref = f"{pushed.host}/team/base:2"
    dclient.images.pull(f"{pushed.host}/team/base", tag="2")
    c = dclient.containers.create(ref, ["true"])
    with pytest.raises(APIError) as err:  # a container uses it
        dclient.images.remove(ref)
    assert err.value.status_code == 409
    c.remove()
    env = {**os.environ, "DOCKER_HOST": f"unix://{docker_socket}", "DOCKER_CONFIG": "/nonexistent"}
    r = subprocess.run([DOCKER, "rmi", ref], capture_output=True, env=env, timeout=60)
    assert r.returncode == 0 and b"Untagged: " in r.stdout, r
    with pytest.raises(ImageNotFound):
        dclient.images.get(ref)
    with pytest.raises(ImageNotFound):
        dclient.images.remove(ref)  # gone already: Docker's 404
    assert dclient.images.get("py")  # other names are untouched
