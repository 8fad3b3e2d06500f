"""Harnesses written for Docker, unmodified, on `lazyfs serve --docker-socket`: the
SWE-bench harness's container helpers (PyPI `swebench`) and mini-swe-agent's docker
environment (PyPI `mini-swe-agent`), which runs the `docker` CLI."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import docker
import pytest

from testbed.images import TestImages
from testbed.node import convert
from testbed.swe_image import PATCH as SWE_PATCH
from testbed.swe_image import TAG as SWE_TAG
from testbed.swe_image import ensure_swe_image

DOCKER = "/usr/bin/docker"  # Debian's docker.io


@pytest.fixture
def docker_env(docker_socket: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """DOCKER_HOST on the agent, and Debian's CLI first on PATH (the harnesses run
    `docker` by name)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").symlink_to(DOCKER)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("DOCKER_HOST", f"unix://{docker_socket}")
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker-config"))
    return bin_dir


def gone(client: docker.DockerClient, container_id: str, within: float = 30) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if container_id not in {c.id for c in client.containers.list(all=True)}:
            return True
        time.sleep(0.1)
    return False


def test_swebench_container_helpers(
    dclient: docker.DockerClient, docker_env: Path, tmp_path: Path
) -> None:
    from swebench.harness.docker_utils import (
        cleanup_container,
        copy_to_container,
        exec_run_with_timeout,
    )

    container = dclient.containers.run(
        "py", ["tail", "-f", "/dev/null"], detach=True, name="sweb.eval.task-1"
    )
    # A patch and an eval script copied in, as run_instance does.
    patch = tmp_path / "patch.diff"
    patch.write_text("--- a/x\n+++ b/x\n")
    copy_to_container(container, patch, Path("/tmp/patch.diff"))
    script = tmp_path / "eval.sh"
    script.write_text("cd /testbed && python3 -m unittest -q test_answer\n")
    copy_to_container(container, script, Path("/eval.sh"))
    test = tmp_path / "test_answer.py"
    test.write_text(
        "import unittest\n\nclass T(unittest.TestCase):\n"
        "    def test_answer(self):\n        self.assertEqual(6 * 7, 42)\n"
    )
    copy_to_container(container, test, Path("/testbed/test_answer.py"))
    assert container.exec_run(["cat", "/tmp/patch.diff"]).output == patch.read_bytes()

    output, timed_out, seconds = exec_run_with_timeout(container, "/bin/bash /eval.sh", 60)
    assert not timed_out and "OK" in output, output

    # A command past its timeout: the helper kills it by the exec's Pid, running `kill`
    # as a command. SWE-bench's images have procps's; the minimal test image has only
    # the shell's builtin, so a one-line /usr/local/bin/kill stands in for it.
    shim = tmp_path / "kill"
    shim.write_text('#!/bin/sh\nkill "$@"\n')
    shim.chmod(0o755)
    copy_to_container(container, shim, Path("/usr/local/bin/kill"))
    output, timed_out, seconds = exec_run_with_timeout(container, "sleep 30", timeout=1)
    assert timed_out and seconds < 10
    deadline = time.monotonic() + 10  # its kill is an exec of its own, detached
    while b"sleep\x0030" in container.exec_run(["sh", "-c", "cat /proc/[0-9]*/cmdline"]).output:
        assert time.monotonic() < deadline, "the timed-out command still runs"
        time.sleep(0.1)

    cleanup_container(dclient, container, logging.getLogger("test"))
    assert gone(dclient, container.id)


def test_mini_swe_agent_docker_environment(
    dclient: docker.DockerClient, docker_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MSWEA_SILENT_STARTUP", "1")
    monkeypatch.setenv("MSWEA_GLOBAL_CONFIG_DIR", str(tmp_path / "mswea"))
    from minisweagent.environments.docker import DockerEnvironment
    from minisweagent.exceptions import Submitted

    env = DockerEnvironment(image="py", cwd="/tmp", executable=DOCKER, env={"TASK": "t1"})
    try:
        # An episode's commands, as the agent loop sends them.
        r = env.execute({"command": "pwd; echo $TASK; python3 -c 'print(2 + 2)'"})
        assert (r["returncode"], r["output"]) == (0, "/tmp\nt1\n4\n"), r
        r = env.execute({"command": "printf 'def f():\\n    return 1\\n' > /tmp/m.py"})
        assert r["returncode"] == 0, r
        r = env.execute({"command": "python3 -c 'import m; print(m.f())'"})
        assert r["output"] == "1\n", r
        r = env.execute({"command": "ls /nonexistent"})
        assert r["returncode"] != 0 and "nonexistent" in r["output"], r
        r = env.execute({"command": "sleep 10"}, timeout=1)
        assert r["returncode"] == -1 and "Timeout" in r["extra"]["exception_type"], r
        with pytest.raises(Submitted):
            env.execute({"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo done"})
    finally:
        container_id = env.container_id
        env.cleanup()
    assert container_id is not None and gone(dclient, container_id)


@pytest.fixture(scope="module")
def swe_task(py_store: Path, test_images: TestImages) -> str:
    """The SWE-style task image (testbed/swe_image.py), converted into the agent's store
    under a SWE-bench style name."""
    layout = ensure_swe_image(test_images)
    name = "sweb.eval.x86_64.calc-1:latest"
    convert(f"oci:{layout / 'layout'}:{SWE_TAG}", name, py_store)
    return name


def test_a_swe_bench_evaluation(
    dclient: docker.DockerClient, docker_env: Path, tmp_path: Path, swe_task: str
) -> None:
    """As SWE-bench's run_instance does it: start the task's container, copy the
    model's patch in, `git apply` it, run the eval script with a timeout, read the
    tests' outcome, clean up. Before the patch the test fails; after it, it passes."""
    from swebench.harness.docker_utils import (
        cleanup_container,
        copy_to_container,
        exec_run_with_timeout,
    )

    container = dclient.containers.create(
        swe_task, command="tail -f /dev/null", name="sweb.eval.calc-1", detach=True,
        working_dir="/testbed", user="root",
    )  # fmt: skip
    container.start()
    eval_script = tmp_path / "eval.sh"
    eval_script.write_text("#!/bin/bash\ncd /testbed\npython3 -m unittest -v test_calc\n")
    copy_to_container(container, eval_script, Path("/eval.sh"))
    output, timed_out, _ = exec_run_with_timeout(container, "/bin/bash /eval.sh", 60)
    assert not timed_out and "FAILED (failures=1)" in output, output

    patch = tmp_path / "patch.diff"
    patch.write_text(SWE_PATCH)
    copy_to_container(container, patch, Path("/tmp/patch.diff"))
    applied = container.exec_run("git apply --verbose /tmp/patch.diff", workdir="/testbed")
    assert applied.exit_code == 0, applied.output
    diff = container.exec_run("git -c core.fileMode=false diff", workdir="/testbed")
    assert b"+    return a + b" in diff.output
    output, timed_out, _ = exec_run_with_timeout(container, "/bin/bash /eval.sh", 60)
    assert not timed_out and "test_add (test_calc.TestAdd" in output and "OK" in output, output

    cleanup_container(dclient, container, logging.getLogger("test"))
    assert gone(dclient, container.id)
