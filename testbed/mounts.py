"""Finding the mounts a test or benchmark made: one reading of /proc/self/mountinfo."""

from __future__ import annotations

import re
from pathlib import Path


def mounts_below(*prefixes: Path | str) -> list[str]:
    """Mount points at or below any of `prefixes`, in mount order (a point mounted twice
    shows twice). Field 5 of mountinfo is the mount point, with space, tab, newline and
    backslash octal-escaped."""
    roots = [str(p).rstrip("/") for p in prefixes]
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), line.split()[4])
            if any(point == r or point.startswith(r + "/") for r in roots):
                found.append(point)
    return found
