"""`lazyfs run` as lazyfs-run-wait while its command runs (lazyfs/sandbox/run_wait.c): exit
statuses and signals pass through it, it is small, a `kill -9` of it leaves only what the
next run's cleanup removes, and the node-wide slots bound how many runs set up (and
`runtime create`) at once. Real runc, real mounts; sandbox_node checks the node clean."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

from testbed.node import LAZYFS, Node

WAITER = str(Path(LAZYFS).parent / "lazyfs-run-wait")


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def _vm_rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def _waiting(node: Node, proc: subprocess.Popen, timeout: float = 30) -> list[str]:
    """The command line of `proc` once it is the waiter (its sandbox started)."""
    node.wait_for_sandbox()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        argv = _cmdline(proc.pid)
        if argv[:2] == [WAITER, "wait"]:
            return argv
        time.sleep(0.02)
    raise AssertionError(f"lazyfs run did not become the waiter: {_cmdline(proc.pid)}")


def test_exit_statuses_pass_through_the_waiter(sandbox_node: Node) -> None:
    assert sandbox_node.run("true").returncode == 0
    proc = sandbox_node.run("sh", "-c", "echo out; echo err >&2; exit 3")
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "out\n", "err\n")
    assert sandbox_node.run("sh", "-c", "kill -9 $$").returncode == 128 + 9


def test_the_waiting_process_is_the_small_waiter(sandbox_node: Node) -> None:
    proc = sandbox_node.popen("sleep", "300")
    try:
        argv = _waiting(sandbox_node, proc)
        rss = _vm_rss_kb(proc.pid)
        print(f"waiting `lazyfs run`: {argv[0]}, VmRSS {rss} kB")
        assert rss < 3 * 1024, rss
        # it is the sandbox's init's parent, so it can wait for it
        init = int(next(sandbox_node.sandboxes.glob("lazyfs-*/init.pid")).read_text())
        assert int(Path(f"/proc/{init}/stat").read_text().rsplit(")", 1)[1].split()[1]) == (
            proc.pid
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM


def test_signals_to_the_waiter_kill_the_sandbox(sandbox_node: Node) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        proc = sandbox_node.popen("sh", "-c", "trap '' TERM INT HUP; sleep 300")
        _waiting(sandbox_node, proc)
        start = time.monotonic()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 128 + sig, (sig, proc.returncode, err)
        assert time.monotonic() - start < 5
        assert sandbox_node.wait_clean() == {}, sig  # the finisher deleted it all


def test_kill_9_of_the_waiter_is_cleaned_by_the_next_run(sandbox_node: Node) -> None:
    proc = sandbox_node.popen("sleep", "300")
    _waiting(sandbox_node, proc)
    (box,) = sandbox_node.sandboxes.glob("lazyfs-*.lock")
    proc.kill()
    proc.wait(timeout=30)
    for pipe in (proc.stdout, proc.stderr):  # the orphaned sandbox holds the pipes' ends
        pipe.close()
    left = sandbox_node.leftovers()
    assert left["sandbox dirs"] and left["cgroups"] and left["mounts"]  # it did leave them
    assert sandbox_node.ok("echo", "next") == "next\n"
    assert not box.exists()
    assert sandbox_node.wait_clean() == {}


def test_a_missing_waiter_is_one_line_before_anything_is_made(sandbox_node: Node) -> None:
    env = {**sandbox_node.env, "LAZYFS_RUN_WAIT": "/nonexistent/lazyfs-run-wait"}
    proc = subprocess.run(
        [LAZYFS, "run", "py", "--", "true"], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "/nonexistent/lazyfs-run-wait" in proc.stderr and "setup.sh" in proc.stderr
    assert not sandbox_node.sandboxes.exists() or not any(sandbox_node.sandboxes.iterdir())


def _logging_runtime(tmp: Path) -> tuple[Path, Path]:
    """A runtime that is runc, logging when each `run` (create and start: lazyfs run's
    one runtime call before its command runs) or `create` starts and ends."""
    log = tmp / "creates.log"
    wrapper = tmp / "runc-logged"
    runc = shutil.which("runc")
    wrapper.write_text(
        "#!/bin/sh\n"
        'if [ "$3" = run ] || [ "$3" = create ]; then\n'
        f'  echo "start $(date +%s.%N)" >> {log}\n'
        f'  {runc} "$@"; rc=$?\n'
        f'  echo "end $(date +%s.%N)" >> {log}\n'
        "  exit $rc\n"
        "fi\n"
        f'exec {runc} "$@"\n'
    )
    wrapper.chmod(0o755)
    return wrapper, log


def _most_at_once(log: Path) -> int:
    events = sorted(
        (float(t), 1 if kind == "start" else -1)
        for kind, t in (line.split() for line in log.read_text().splitlines())
    )
    now = most = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def test_slots_bound_concurrent_runs(sandbox_node: Node) -> None:
    """With LAZYFS_RUN_SLOTS=1, six runs started at once create their sandboxes one at a
    time (the others wait as the gate, not as Python) and all run right."""
    runtime, log = _logging_runtime(sandbox_node.tmp)
    env = {**sandbox_node.env, "LAZYFS_RUN_SLOTS": "1"}
    procs = [
        subprocess.Popen(
            [LAZYFS, "run", "--runtime", str(runtime), "py", "--", "echo", str(i)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(6)
    ]
    gated = set()
    while any(p.poll() is None for p in procs):
        for p in procs:
            try:
                if _cmdline(p.pid)[:2] == [WAITER, "gate"]:
                    gated.add(p.pid)
            except (OSError, UnicodeDecodeError):
                pass
        time.sleep(0.01)
    outs = [p.communicate(timeout=60) for p in procs]
    assert [(p.returncode, out) for p, (out, _) in zip(procs, outs, strict=True)] == [
        (0, f"{i}\n") for i in range(6)
    ], outs
    assert log.read_text().count("start") == 6
    assert _most_at_once(log) == 1, log.read_text()
    assert gated, "no run waited as the gate"
    print(f"{len(gated)} of 6 runs waited as the gate")
    # the slots are free again: a run with the default count goes straight through
    assert sandbox_node.ok("echo", "after") == "after\n"


def test_the_finisher_starts_without_runpy_and_answers_bad_fields_in_one_line() -> None:
    # what the waiter execs (plus FIELDs and STATUS) for what it leaves to Python: -c,
    # not -m, whose runpy is ~3.5 ms of each run; -S, no site (~2.5 ms)
    from lazyfs.sandbox.run_finish import command

    argv = [*command(), "not", "the", "fields", "0"]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPROFILEIMPORTTIME": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, cwd="/", env=env)
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()}
    assert "runpy" not in imported and "lazyfs.sandbox.run_finish" in imported
    assert "site" not in imported
    errors = [line for line in done.stderr.splitlines() if not line.startswith("import time")]
    assert done.returncode != 0 and len(errors) == 1 and "usage:" in errors[0], done.stderr


def _interpreters(stderr: str) -> int:
    """How many Python processes printed their imports (PYTHONPROFILEIMPORTTIME)."""
    return sum("imported package" in line for line in stderr.splitlines())


def test_the_waiter_tears_down_without_python(sandbox_node: Node) -> None:
    # the plain case: the waiter deletes the sandbox and releases the tree itself, so
    # the CLI is the run's one interpreter (a finisher was ~16 ms of every run)
    env = {**sandbox_node.env, "PYTHONPROFILEIMPORTTIME": "1"}
    proc = subprocess.run(
        [LAZYFS, "run", "py", "--", "sh", "-c", "echo out; exit 3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (proc.returncode, proc.stdout) == (3, "out\n"), proc.stderr
    assert _interpreters(proc.stderr) == 1, proc.stderr
    assert sandbox_node.wait_clean() == {}  # sandbox, cgroups, overlay and tree gone


def test_a_fuse_trees_unmount_is_left_to_the_python_finisher(sandbox_node: Node) -> None:
    # the waiter unmounts an EROFS tree itself; a per-image FUSE tree is the finisher's
    env = {**sandbox_node.env, "LAZYFS_TREE": "fuse", "PYTHONPROFILEIMPORTTIME": "1"}
    proc = subprocess.run(
        [LAZYFS, "run", "py", "--", "echo", "hi"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (proc.returncode, proc.stdout) == (0, "hi\n"), proc.stderr
    assert _interpreters(proc.stderr) == 2, proc.stderr  # the CLI's, then the finisher's
    assert sandbox_node.wait_clean() == {}  # the FUSE tree too


def test_what_the_waiter_leaves_to_python_the_finisher_does(sandbox_node: Node) -> None:
    # a runtime state directory with a directory in it is beyond the waiter's plain case:
    # it hands the whole teardown to the Python finisher mid-way, which starts over
    env = {**sandbox_node.env, "PYTHONPROFILEIMPORTTIME": "1"}
    proc = subprocess.Popen(
        [LAZYFS, "run", "py", "--", "sleep", "300"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _waiting(sandbox_node, proc)
        (box,) = sandbox_node.sandboxes.glob("lazyfs-*.lock")
        state = Path(sandbox_node.env["LAZYFS_RUN_DIR"]) / "oci" / "runc" / box.stem
        (state / "deeper" / "still").mkdir(parents=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert _interpreters(err) == 2, err  # the CLI's, then the finisher's
    finisher_lines = [line for line in err.splitlines() if not line.startswith("import time")]
    assert finisher_lines == [], err  # it said nothing: nothing failed
    assert not state.exists() and not box.exists()
    assert sandbox_node.wait_clean() == {}
