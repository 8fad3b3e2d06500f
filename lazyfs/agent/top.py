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
  for it. Each command line is its first CMDLINE_MAX bytes (see there).
- With ps_args the host's `ps` (procps) runs with them and its rows are kept by their
  PID column, as dockerd keeps them; output without a PID column is an error, and so
  is output over PS_OUTPUT_MAX (see there).
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from chunker.errors import BadInputError
from lazyfs.agent.files import sandbox_db
from lazyfs.sandbox.process import db_names
from lazyfs.sandbox.runtime import OutputTooBig, Sandbox, run_helper
from lazyfs.sandbox.teardown import cgroup_dirs

TITLES = ["PID", "USER", "TIME", "COMMAND"]
PS = "/usr/bin/ps"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# Bytes of a process's command line shown. A sandbox may give one up to ~6 MiB of
# arguments (its stack limit is its own to raise) and fork hundreds of children that
# share those pages copy-on-write: read whole, one top of 300 such took the agent's
# peak RSS up 4.5 GB. 4 KiB is more than a terminal's `docker top` or `ps` shows of one
# (they cut it at the screen's width) and holds the head of any real command line;
# procps's ps, piped as dockerd runs it, prints it whole.
CMDLINE_MAX = 4096
# Bytes of `ps` output (ps_args) read: the whole node's processes, each line with its
# command line whole when piped, up to 128 KiB (procps 4's cut): a sandbox's 4,096
# processes (its pids limit) of such command lines would be 512 MiB, all held. A node's
# thousands of ordinary processes fit many times over; past it `ps` is killed and top
# is a 500 that says so.
PS_OUTPUT_MAX = 16 * 2**20


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
    rows = [row for pid in pids if (row := _row(pid)) is not None]
    if rows:
        users = _user_names(sandbox.rootfs, {int(row[1]) for row in rows})
        for row in rows:
            row[1] = users.get(int(row[1]), row[1])
    return {"Titles": TITLES, "Processes": rows}


def _row(pid: int) -> list[str] | None:
    """The process's row, its user by number."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        with open(f"/proc/{pid}/cmdline", "rb", buffering=0) as f:
            cmdline = f.read(CMDLINE_MAX)  # one read(2): the kernel copies this much
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:  # it ended meanwhile
        return None
    comm = stat[stat.index("(") + 1 : stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2 :].split()
    seconds = (int(fields[11]) + int(fields[12])) // CLOCK_TICKS  # utime + stime
    args = cmdline.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")
    return [
        str(pid),
        str(uid),
        f"{seconds // 60}:{seconds % 60:02d}",
        args or f"[{comm}]",
    ]


def _user_names(rootfs: Path, uids: set[int]) -> dict[int, str]:
    """uid -> name of `uids` from the sandbox's /etc/passwd (files.sandbox_db)."""
    return db_names(sandbox_db(rootfs, "/etc/passwd"), uids)


def _from_ps(args: list[str], pids: set[int]) -> dict:
    try:
        code, said = run_helper([PS, *args], limit=PS_OUTPUT_MAX)
    except OutputTooBig:
        raise PsFailed(
            f"ps {shlex.join(args)}: its output passed {PS_OUTPUT_MAX >> 20} MiB"
        ) from None
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
