"""Start a process without holding the GIL: posix_spawn(3) called through ctypes.

os.posix_spawn keeps the GIL while glibc's posix_spawn runs, and that call returns only
once the child has exec'd (it is a vfork). Under load the child waits for a CPU before
its exec, and every other thread of the caller waits with it: in the agent, the event
loop. With three threads spawning /bin/true and both cores busy, a loop that sleeps 0.5
ms woke every 1.2-2.7 ms (p50; p99 11-15 ms) with os.posix_spawn, and every 0.58 ms (p99
2.7-3.4 ms) with this call, which ctypes makes with the GIL released
(docs/design-changes.md, session 32). A generic claim starts the attach helper, a cold
create and a delete start runc: at a burst the agent was starting them from four threads
at once.

Only the file actions lazyfs uses: dup2, open and close, applied in the order given.
"""

from __future__ import annotations

import ctypes
import os

from lazyfs.libc import libc

TYPE_CHECKING = False  # every `lazyfs run --linger` finisher imports this: no collections
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

POSIX_SPAWN_SETSID = 0x80  # glibc 2.26+ (<spawn.h>)
# glibc's posix_spawn_file_actions_t is 80 bytes and posix_spawnattr_t 336 on 64-bit
# Linux; both are opaque here, made by their _init functions in room enough for either.
_OPAQUE = 512

Dup2 = tuple[int, int]  # (source fd, target fd)
Open = tuple[int, str, int, int]  # (target fd, path, flags, mode)


def spawn(
    argv: Sequence[str],
    env: Mapping[str, str],
    *,
    dup2: Sequence[Dup2] = (),
    opens: Sequence[Open] = (),
    closes: Sequence[int] = (),
    setsid: bool = False,
) -> int:
    """Start argv[0] (an absolute path; no PATH search) with argv and the environment
    `env`; the child's pid. The file actions run in the child before its exec:
    the opens, then the dup2s, then the closes. OSError if it cannot be started (the
    exec's own error too: glibc reports it)."""
    actions = ctypes.create_string_buffer(_OPAQUE)
    attr = ctypes.create_string_buffer(_OPAQUE)
    _check(libc.posix_spawn_file_actions_init(actions), "posix_spawn_file_actions_init")
    try:
        _check(libc.posix_spawnattr_init(attr), "posix_spawnattr_init")
        try:
            for fd, path, flags, mode in opens:
                _check(
                    libc.posix_spawn_file_actions_addopen(
                        actions, fd, os.fsencode(path), flags, mode
                    ),
                    "posix_spawn_file_actions_addopen",
                )
            for source, target in dup2:
                _check(
                    libc.posix_spawn_file_actions_adddup2(actions, source, target),
                    "posix_spawn_file_actions_adddup2",
                )
            for fd in closes:
                _check(
                    libc.posix_spawn_file_actions_addclose(actions, fd),
                    "posix_spawn_file_actions_addclose",
                )
            if setsid:
                _check(
                    libc.posix_spawnattr_setflags(attr, ctypes.c_short(POSIX_SPAWN_SETSID)),
                    "posix_spawnattr_setflags",
                )
            path = os.fsencode(argv[0])
            args = _strings([os.fsencode(a) for a in argv])
            envp = _strings([os.fsencode(f"{k}={v}") for k, v in env.items()])
            pid = ctypes.c_int()
            err = libc.posix_spawn(ctypes.byref(pid), path, actions, attr, args, envp)
            if err:
                raise OSError(err, os.strerror(err), argv[0])
            return pid.value
        finally:
            libc.posix_spawnattr_destroy(attr)
    finally:
        libc.posix_spawn_file_actions_destroy(actions)


def _strings(items: list[bytes]) -> ctypes.Array:
    """A NULL-terminated char *[] of items (kept alive by the array's own references)."""
    return (ctypes.c_char_p * (len(items) + 1))(*items, None)


def _check(err: int, what: str) -> None:
    """posix_spawn's helpers return an error number, not -1 and errno."""
    if err:
        raise OSError(err, f"{what}: {os.strerror(err)}")
