"""lazyfs/tree/daemon_start.py: a daemon starts detached (own session, working directory
/, stdio on /dev/null and its log, none of its starter's descriptors but the ready
pipe), and its starter gets its pid, its one-line error, or why it never got ready."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from chunker.errors import BadInputError
from lazyfs.errors import MountError
from lazyfs.tree.daemon_start import spawn_daemon

# A stand-in daemon: real Python, reporting on --ready-fd as lazyfs's daemons do
# (lazyfs/tree/mount_watch.py, ready_reporter), then living until killed.
DAEMON = """
import json, os, sys, time
fd = int(sys.argv[sys.argv.index("--ready-fd") + 1])
mode = sys.argv[1]
print("daemon log line", flush=True)
if mode == "die":
    sys.exit(7)
error = "the store is down" if mode == "fail" else None
os.write(fd, (json.dumps({"error": error, "exit_code": 4}) + "\\n").encode())
if mode == "fail":
    sys.exit(4)
time.sleep(60)
"""


@pytest.fixture
def started() -> Iterator[list[int]]:
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def test_a_daemon_starts_detached_with_none_of_our_descriptors(
    tmp_path: Path, started: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # a directory the daemon must not keep busy
    leak = os.open(os.devnull, os.O_RDONLY)
    os.set_inheritable(leak, True)  # as a `lazyfs run` slot's descriptor is
    try:
        log = tmp_path / "logs" / "d.log"
        pid = spawn_daemon([sys.executable, "-c", DAEMON, "serve"], log, "test daemon")
        started.append(pid)
        assert os.readlink(f"/proc/{pid}/cwd") == "/"
        assert os.getsid(pid) == pid  # a session of its own: ^C stays with us
        fds = {int(n) for n in os.listdir(f"/proc/{pid}/fd")}
        assert leak not in fds
        assert os.readlink(f"/proc/{pid}/fd/0") == os.devnull
        assert os.readlink(f"/proc/{pid}/fd/1") == str(log)
        assert log.read_text() == "daemon log line\n"
    finally:
        os.close(leak)


def test_a_daemon_that_cannot_serve_gives_its_one_line_and_exit_code(tmp_path: Path) -> None:
    with pytest.raises(MountError) as err:
        spawn_daemon([sys.executable, "-c", DAEMON, "fail"], tmp_path / "d.log", "test daemon")
    assert str(err.value) == "the store is down"
    assert err.value.exit_code == 4


def test_a_daemon_that_dies_before_it_is_ready_is_named_with_its_status(tmp_path: Path) -> None:
    with pytest.raises(MountError, match="test daemon exited with status 7 before it was ready"):
        spawn_daemon([sys.executable, "-c", DAEMON, "die"], tmp_path / "d.log", "test daemon")


def test_a_log_directory_that_cannot_be_made_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(BadInputError, match="cannot use .*d.log"):
        spawn_daemon([sys.executable, "-c", DAEMON, "serve"], tmp_path / "file" / "d.log", "x")
