"""`lazyfs run`'s hand-over to its waiter, and the node-wide slots that bound a burst.

A `lazyfs run` is Python only while it needs to be: from its start until its sandbox's
command runs (mount, prepare, `runtime create`, `runtime start`). Then the same process is
lazyfs-run-wait (lazyfs/sandbox/run_wait.c, ~0.7 MB instead of ~26 MB): `exec_waiter`
execs it with the sandbox's init pid and what the teardown needs, which it does itself
once the command ended (run_teardown.c), or for an unusual case through the Python
finisher (lazyfs/sandbox/run_finish.py).

Slots bound how many `lazyfs run`s are Python at once on the node (LAZYFS_RUN_SLOTS,
default 2 per CPU). A run takes one first of all (`early_slot`, from the `lazyfs`
command's entry point, lazyfs/launcher.py, before even argparse is imported) and lets it
go by its exec into the waiter; a waiter that hands over to the Python finisher takes
one of the finishers' own slots (`finish_slots`: half as many) for it. A run that
finds none free waits for one as `lazyfs-run-wait gate` (< 1 MB), not as a Python
process (10 MB bare, 26 MB once it has imported what a run needs), and then starts
again with the slot. Every `runtime create` happens inside a slot, so they are bounded
too (each waits ~10 MB in `runc init` meanwhile). The lock files: run_wait.c's top.

Only os, fcntl and sys at the top: this runs at the start of every run of a burst at
once, each one's memory counts until it has a slot or has become the gate.
"""

from __future__ import annotations

import fcntl
import os
import sys

SLOT_ENV = "LAZYFS_RUN_SLOT"  # set by `lazyfs-run-wait gate`: the slot's descriptor
_held: int | None = None  # this process's slot, once taken


def helpers_dir() -> str:
    """Where the packaging installs the C helpers (setup.py, scripts/build_helpers.py):
    the scripts directory of this Python's install, beside the `lazyfs` command. In a
    venv that is its bin/; sysconfig (8 ms to import, on every `lazyfs run`) only
    outside one."""
    if sys.prefix != sys.base_prefix:
        return f"{sys.prefix}/bin"
    import sysconfig

    return sysconfig.get_path("scripts")


def default_waiter() -> str:
    """Where the packaging installs lazyfs-run-wait (LAZYFS_RUN_WAIT's default)."""
    return f"{helpers_dir()}/lazyfs-run-wait"


def default_slots() -> int:
    """LAZYFS_RUN_SLOTS's default: two per CPU, enough to keep the CPUs busy while one
    run waits for its mount or its runtime."""
    return 2 * (os.cpu_count() or 1)


def waiter_path(settings) -> str:  # noqa: ANN001 - lazyfs.settings.Settings
    """lazyfs-run-wait, which `lazyfs run` needs; BadInputError if it is missing."""
    if not os.access(settings.run_wait, os.X_OK):
        from chunker.errors import BadInputError

        raise BadInputError(
            f"lazyfs run's waiter {settings.run_wait} is missing: installing lazyfs"
            " (scripts/setup.sh, or pip) builds it; or set LAZYFS_RUN_WAIT to where it is"
        )
    return str(settings.run_wait)


def slots_dir(run_dir: str | os.PathLike) -> str:
    return os.path.join(os.path.abspath(run_dir), "run-slots")


def _open(path: str) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)


def try_slot(directory: str, count: int) -> int | None:
    """A free slot's descriptor (held until it is closed), or None: all are taken, or
    others wait in line for one (they go first)."""
    os.makedirs(directory, exist_ok=True)
    queue = _open(os.path.join(directory, "slot-queue.lock"))
    try:
        try:
            fcntl.flock(queue, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # someone waits in line
        for i in range(count):
            fd = _open(os.path.join(directory, f"slot-{i}.lock"))
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                os.close(fd)
        return None
    finally:
        os.close(queue)


def hold_slot(waiter: str, run_dir: str | os.PathLike, count: int) -> int:
    """This `lazyfs run`'s slot: the one it holds already, the one `lazyfs-run-wait gate`
    took for it, or a free one; if there is none, exec the gate, which waits for one and
    then runs this same command line again (so this returns only with a slot). The
    descriptor is not inherited: the exec into the waiter frees the slot."""
    global _held
    if _held is not None:
        return _held
    inherited = os.environ.pop(SLOT_ENV, None)
    if inherited is not None:
        try:
            fd = int(inherited)
            os.set_inheritable(fd, False)  # fails unless it is an open descriptor
            _held = fd
            return fd
        except (ValueError, OSError):
            pass  # not one of ours: take a slot as if no gate had run
    directory = slots_dir(run_dir)
    fd = try_slot(directory, count)
    if fd is not None:
        _held = fd
        return fd
    sys.stdout.flush()
    sys.stderr.flush()
    gate = [waiter, "gate", directory, str(count), "--"]
    os.execv(waiter, [*gate, sys.executable, *sys.orig_argv[1:]])
    raise AssertionError("unreachable")


def early_slot() -> None:
    """hold_slot() as the very first thing `lazyfs run` does, with the settings read here
    from the environment as lazyfs.settings reads them (its table lists them). If any is
    unusable this does nothing: `lazyfs run` then takes its slot after the settings are
    read properly, and reports a bad one."""
    waiter = os.environ.get("LAZYFS_RUN_WAIT", default_waiter())
    try:
        count = int(os.environ.get("LAZYFS_RUN_SLOTS", default_slots()))
    except ValueError:
        return
    if count <= 0 or not os.access(waiter, os.X_OK):
        return
    try:
        hold_slot(waiter, os.environ.get("LAZYFS_RUN_DIR", "/run/lazyfs"), count)
    except OSError:
        return  # e.g. the run dir cannot be made: the run reports it in its own words


def finish_slots(count: int) -> int:
    """How many finishers may run at once: half the setup slots. A finisher lives ~0.1 s,
    so a few keep up with a burst, and setups and finishers together stay within
    1.5 x LAZYFS_RUN_SLOTS Python processes."""
    return max(1, count // 2)


def exec_waiter(
    waiter: str, run_dir: str | os.PathLike, count: int, init_pid: int, fields: list[str],
    finisher: list[str], keep: list[int],
) -> None:  # fmt: skip
    """Become the waiter (never returns, or raises OSError if the exec failed): it waits for
    `init_pid`, then deletes the sandbox and releases the trees that `fields` (run_finish.py's
    FIELDS) name, itself or through `finisher` + fields + [its exit status]. `keep`: the
    descriptors those steps need (made inheritable here). The caller blocked SIGTERM,
    SIGINT and SIGHUP; the waiter takes them over."""
    for fd in keep:
        os.set_inheritable(fd, True)
    sys.stdout.flush()
    sys.stderr.flush()
    argv = [waiter, "wait", str(init_pid), slots_dir(run_dir), str(finish_slots(count))]
    try:
        os.execv(waiter, [*argv, *fields, "--", *finisher])
    finally:
        for fd in keep:
            os.set_inheritable(fd, False)
