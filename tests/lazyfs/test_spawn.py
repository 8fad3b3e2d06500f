"""lazyfs/spawn.py: posix_spawn with the GIL released, and the file actions lazyfs uses."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from lazyfs.spawn import spawn


def _exit_status(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_the_child_gets_argv_the_environment_given_and_its_dup2s() -> None:
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        argv = ["/bin/sh", "-c", 'echo "$0 $LAZYFS_SPAWN_TEST"', "arg0"]
        pid = spawn(argv, {"LAZYFS_SPAWN_TEST": "seen"}, dup2=[(w, 1)])
    finally:
        os.close(w)
    with os.fdopen(r, "rb") as out:
        said = out.read()
    assert _exit_status(pid) == 0
    assert said == b"arg0 seen\n"


def test_opens_and_closes_apply_in_the_child(tmp_path: Path) -> None:
    keep = os.open(tmp_path / "inherited", os.O_CREAT | os.O_WRONLY, 0o600)
    os.set_inheritable(keep, True)
    try:
        script = f"echo out; [ -e /proc/$$/fd/{keep} ] && exit 9; exit 0"  # builtins
        pid = spawn(
            ["/bin/sh", "-c", script],
            {},
            opens=[(1, str(tmp_path / "out"), os.O_WRONLY | os.O_CREAT, 0o600)],
            closes=[keep],
        )
    finally:
        os.close(keep)
    assert _exit_status(pid) == 0  # the inherited descriptor was closed
    assert (tmp_path / "out").read_bytes() == b"out\n"


def test_setsid_gives_the_child_a_session_of_its_own() -> None:
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        argv = ["/bin/sh", "-c", "cut -d' ' -f6 /proc/$$/stat"]
        pid = spawn(argv, {"PATH": "/usr/bin:/bin"}, dup2=[(w, 1)], setsid=True)
    finally:
        os.close(w)
    with os.fdopen(r, "rb") as out:
        session = int(out.read())
    assert _exit_status(pid) == 0
    assert session == pid != os.getsid(0)


def test_a_missing_program_is_an_os_error_naming_it() -> None:
    with pytest.raises(FileNotFoundError, match="/nonexistent/lazyfs-helper"):
        spawn(["/nonexistent/lazyfs-helper"], {})


# The child's first action opens a FIFO for reading, which blocks until a writer opens
# it; posix_spawn returns only once the child has exec'd. The writer is the spawning
# process's main thread, which needs the GIL while another thread is inside the spawn.
# os.posix_spawn holds the GIL there: the two wait for each other (the check times out).
_GIL_CHECK = textwrap.dedent(
    """
    import os, sys, threading
    from lazyfs.spawn import spawn
    fifo = sys.argv[1]
    pids = []
    t = threading.Thread(
        target=lambda: pids.append(spawn(["/bin/true"], {}, opens=[(3, fifo, os.O_RDONLY, 0)]))
    )
    t.start()
    fd = os.open(fifo, os.O_WRONLY)  # Python code: runs only if the spawn let go of the GIL
    t.join()
    os.close(fd)
    os.waitpid(pids[0], 0)
    print("spawned")
    """
)


def test_other_threads_run_while_a_child_is_being_started(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    proc = subprocess.Popen(
        [sys.executable, "-c", _GIL_CHECK, str(fifo)], stdout=subprocess.PIPE, text=True
    )
    try:
        out, _ = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        out = "deadlocked: the spawn held the GIL"
    finally:
        # A deadlocked check leaves its vfork child in the FIFO's open: a writer ends it.
        unblock = threading.Thread(target=lambda: os.close(os.open(fifo, os.O_WRONLY)))
        unblock.daemon = True
        if proc.returncode != 0:
            unblock.start()
            unblock.join(5)
    assert out.strip() == "spawned"
