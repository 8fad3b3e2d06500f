"""A sandbox's processes, as `docker top` lists a container's (GET /containers/{id}/top).

dockerd runs the host's `ps` with the client's ps_args (default `-ef`) and keeps the
rows whose PID is in the container's cgroup. Here:
- The processes are those in the sandbox's cgroups, by host PID (as dockerd shows
  them), less the exec server's own: the sandbox's PID 1 and the process serving each
  command are lazyfs's runtime, as containerd's shim is Docker's, outside a container's
  cgroup; a container's top shows its command's processes only.
- Without ps_args they are read from /proc, in the columns busybox's `ps` prints (PID,
  USER, TIME, COMMAND: what docker-py's own test expects of a default top), the user
  named by the sandbox's own /etc/passwd, read through the file API (its code may have
  put a link to a host file, a FIFO or a huge sparse file there). No process is started
  for it.
- With ps_args the host's `ps` (procps) runs with them and its rows are kept by their
  PID column, as dockerd keeps them; output without a PID column is an error.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from chunker.errors import BadInputError
from lazyfs.agent.files import sandbox_db
from lazyfs.sandbox.runtime import Sandbox, run_helper
from lazyfs.sandbox.teardown import cgroup_dirs

TITLES = ["PID", "USER", "TIME", "COMMAND"]
PS = "/usr/bin/ps"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class PsFailed(Exception):
    """The host's `ps` failed or printed no PID column (its words, one line)."""


def sandbox_pids(sandbox: Sandbox) -> set[int]:
    """The host PIDs in the sandbox's cgroups (every hierarchy's: a v1 controller may
    not hold a process another does not)."""
    pids: set[int] = set()
    for path in cgroup_dirs(sandbox.host.cgroup_parent, sandbox.id):
        try:
            pids.update(int(p) for p in Path(path, "cgroup.procs").read_text().split())
        except OSError:
            continue
    return pids


def command_pids(sandbox: Sandbox, exec_server: Path) -> list[int]:
    """sandbox_pids less the exec server's processes (their executable is its binary,
    bound in from the host), in order."""
    server = os.stat(exec_server)
    kept = []
    for pid in sorted(sandbox_pids(sandbox)):
        try:
            exe = os.stat(f"/proc/{pid}/exe")
        except OSError:  # gone meanwhile, or a kernel thread
            continue
        if (exe.st_dev, exe.st_ino) != (server.st_dev, server.st_ino):
            kept.append(pid)
    return kept


def top(sandbox: Sandbox, exec_server: Path, ps_args: str = "") -> dict:
    """{"Titles": [...], "Processes": [[...], ...]}, as dockerd answers. BadInputError
    for ps_args a shell would not split; PsFailed if `ps` fails."""
    pids = command_pids(sandbox, exec_server)
    if ps_args:
        try:
            args = shlex.split(ps_args)
        except ValueError as exc:
            raise BadInputError(f"ps_args {ps_args!r}: {exc}") from None
        return _from_ps(args, set(pids))
    users = _user_names(sandbox.rootfs)
    rows = [row for pid in pids if (row := _row(pid, users)) is not None]
    return {"Titles": TITLES, "Processes": rows}


def _row(pid: int, users: dict[int, str]) -> list[str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:  # it ended meanwhile
        return None
    comm = stat[stat.index("(") + 1 : stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2 :].split()
    seconds = (int(fields[11]) + int(fields[12])) // CLOCK_TICKS  # utime + stime
    args = cmdline.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")
    return [
        str(pid),
        users.get(uid, str(uid)),
        f"{seconds // 60}:{seconds % 60:02d}",
        args or f"[{comm}]",
    ]


def _user_names(rootfs: Path) -> dict[int, str]:
    """uid -> name from the sandbox's /etc/passwd (files.sandbox_db)."""
    names: dict[int, str] = {}
    for fields in sandbox_db(rootfs, "/etc/passwd"):
        if len(fields) >= 3 and fields[2].isdigit():
            names.setdefault(int(fields[2]), fields[0])
    return names


def _from_ps(args: list[str], pids: set[int]) -> dict:
    code, said = run_helper([PS, *args])
    lines = said.splitlines()
    if code != 0 or not lines:
        raise PsFailed(f"ps {shlex.join(args)}: {(lines or [f'exit {code}'])[-1]}")
    titles = lines[0].split()
    if "PID" not in titles:
        raise PsFailed(f"ps {shlex.join(args)}: no PID column in its output")
    at = titles.index("PID")
    rows = []
    for line in lines[1:]:
        fields = line.split()
        if len(fields) > len(titles):  # the last column (a command line) holds blanks
            fields = [*fields[: len(titles) - 1], " ".join(fields[len(titles) - 1 :])]
        if len(fields) > at and fields[at].isdigit() and int(fields[at]) in pids:
            rows.append(fields)
    return {"Titles": titles, "Processes": rows}
