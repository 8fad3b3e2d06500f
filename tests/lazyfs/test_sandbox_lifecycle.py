"""A sandbox's life on the runtime: I/O and exit status, the image config, bad input, and
a node left clean however sandboxes end, including a `kill -9` of `lazyfs run` itself."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from testbed.images import TestImages
from testbed.node import Node, convert

# Sandboxes in the "every way to end" test (issue 11 asks for 200).
SANDBOXES = int(os.environ.get("LAZYFS_TEST_SANDBOXES", "200"))


def test_stdio_and_exit_status_pass_through(sandbox_node: Node) -> None:
    proc = sandbox_node.run(
        "sh", "-c", "read line; echo out:$line; echo err >&2; exit 3", stdin="in\n"
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "out:in\n", "err\n")
    for sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGSEGV):
        proc = sandbox_node.run("sh", "-c", f"kill -{int(sig)} $$")
        assert proc.returncode == 128 + sig, (sig, proc.returncode, proc.stderr)


@pytest.fixture(scope="module")
def config_store(
    py_store: Path,
    test_images: TestImages,
    tmp_path_factory: pytest.TempPathFactory,
) -> Path:
    """The python image with User, Env and WorkingDir set in its config (made with umoci
    on a copy of the cached layout, which must stay untouched)."""
    layout = tmp_path_factory.mktemp("cfg") / "layout"
    shutil.copytree(test_images.layout, layout)
    subprocess.run(
        ["umoci", "config", "--image", f"{layout}:python", "--tag", "cfg"]
        + ["--config.user", "nobody:tty", "--config.env", "FROM_IMAGE=yes"]
        + ["--config.env", "SHADOWED=image", "--config.workingdir", "/srv"],
        check=True,
        capture_output=True,
    )
    convert(f"oci:{layout}:cfg", "cfg", py_store)
    return py_store


def test_image_config_user_env_workdir(sandbox_node: Node, config_store: Path) -> None:
    script = 'id -u; id -g; pwd; echo "$FROM_IMAGE $SHADOWED ${EXTRA:-unset}"; touch /etc/x'
    proc = sandbox_node.run("sh", "-c", script, image="cfg")
    out = proc.stdout.splitlines()
    assert out == ["65534", "5", "/srv", "yes image unset"], (out, proc.stderr)
    assert "Permission denied" in proc.stderr  # nobody cannot write the image's /etc
    proc = sandbox_node.run(
        "sh",
        "-c",
        script,
        image="cfg",
        options=("--env", "SHADOWED=flag", "--env", "EXTRA=1", "--cwd", "/tmp"),
    )
    assert proc.stdout.splitlines() == ["65534", "5", "/tmp", "yes flag 1"]


def test_bad_input_is_one_line(sandbox_node: Node) -> None:
    cases = [
        (("--memory", "lots"), "--memory"),
        (("--cpus", "-1"), "--cpus"),
        (("--pids", "many"), "--pids"),
        (("--runtime", "/nonexistent"), "/nonexistent"),
        (("--env", "NOEQUALS"), "NOEQUALS"),
    ]
    for options, word in cases:
        proc = sandbox_node.run("true", options=options)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, (options, proc.stderr)
        assert word in proc.stderr and "Traceback" not in proc.stderr
    proc = sandbox_node.run("no-such-command")
    assert proc.returncode == 127 and proc.stderr.count("\n") == 1, proc.stderr
    assert "no-such-command" in proc.stderr
    proc = sandbox_node.run("/etc/passwd")
    assert proc.returncode == 126 and proc.stderr.count("\n") == 1, proc.stderr


def test_sigterm_of_lazyfs_run_kills_the_sandbox(sandbox_node: Node) -> None:
    proc = sandbox_node.popen("sh", "-c", "trap '' TERM; sleep 300")  # ignores SIGTERM itself
    sandbox_node.wait_for_sandbox()
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM
    assert time.monotonic() - start < 5


def test_kill_9_of_lazyfs_run_is_cleaned_by_the_next_run(sandbox_node: Node) -> None:
    proc = sandbox_node.popen("sleep", "300")
    (box,) = sandbox_node.wait_for_sandbox()
    proc.kill()
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    left = sandbox_node.leftovers()
    assert box in left["sandbox dirs"] and left["cgroups"] and left["mounts"]  # it did leave
    assert sandbox_node.ok("echo", "next") == "next\n"
    assert not box.exists()


def _end_one_way(node: Node, i: int) -> int:
    """Sandbox i ends in way i % 6; returns the exit status seen."""
    linger = ("--linger", "2")
    way = i % 6
    if way == 0:
        return node.run("true", options=linger).returncode
    if way == 1:
        return node.run("sh", "-c", "exit 3", options=linger).returncode
    if way == 2:
        return node.run("sh", "-c", "kill -KILL $$", options=linger).returncode
    if way == 3:  # OOM (big blocks: see test_sandbox_limits on thrashing near the limit)
        return node.run(
            "python3", "-c", "x = [bytearray(8 << 20) for _ in range(40)]",
            options=("--memory", "64M", *linger),
        ).returncode  # fmt: skip
    proc = node.popen("sleep", "300", options=linger)
    node.wait_for_sandbox()
    if way == 4:  # a timeout: the caller sends SIGTERM
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    else:  # lazyfs run itself dies; the next run cleans up
        proc.kill()
        proc.wait(timeout=30)  # not communicate(): the orphaned sandbox holds the pipes
        for pipe in (proc.stdout, proc.stderr):
            pipe.close()
    return proc.returncode


def test_node_stays_clean_after_sandboxes_end_every_way(sandbox_node: Node) -> None:
    start = time.monotonic()
    seen: dict[int, int] = {}
    for i in range(SANDBOXES):
        status = _end_one_way(sandbox_node, i)
        seen[status] = seen.get(status, 0) + 1
    sandbox_node.ok("true")  # the run after the last kill -9 cleans what it left
    elapsed = time.monotonic() - start
    print(f"{SANDBOXES} sandboxes in {elapsed:.1f} s; exit statuses {sorted(seen.items())}")
    assert set(seen) == {0, 3, 137, 143, -9}, seen
