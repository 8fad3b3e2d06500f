"""The C library, loaded once for the modules that call it through ctypes.

By its soname, not through ctypes.util.find_library("c"), which runs `ldconfig -p` (a
fork and an exec, 10-20 ms here) in every process that imports it: the CLI, the data
daemon's supervisor and its worker all did, one after the other, on a cold start."""

import ctypes

libc = ctypes.CDLL("libc.so.6", use_errno=True)
MNT_DETACH = 2  # umount2(2): detach now, free once the last user has gone
