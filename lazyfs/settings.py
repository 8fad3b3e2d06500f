"""The node's settings, read from the environment in this one place, once by each entry
point (a `lazyfs` command, the agent, the snapshotter, a daemon) and passed down as one
object (Settings); nothing reads them at import time.

| variable | default | what |
|---|---|---|
| LAZYFS_CACHE | /var/cache/lazyfs (root), else ~/.cache/lazyfs | node cache directory |
| LAZYFS_CACHE_SIZE | 10G | size the node cache (chunks, image files) is kept under (K/M/G/T) |
| LAZYFS_FETCH_TIMEOUT | 30 | seconds a read waits for the store before EIO |
| LAZYFS_PREFETCH | 1 | 0 turns start-up traces off (no replay, no recording) |
| LAZYFS_STORE | file://$XDG_DATA_HOME/lazyfs/store | the store, where --store is not given |
| LAZYFS_SNAPSHOTTER_ROOT | /var/lib/lazyfs/snapshotter | the containerd snapshotter's root |
| LAZYFS_RUN_DIR | /run/lazyfs | image mounts, the data daemon's mount, locks (made 0700) |
| LAZYFS_SANDBOX_DIR | /var/lib/lazyfs/sandboxes | sandboxes' writable layers (made 0700) |
| LAZYFS_CGROUP_PARENT | lazyfs | the cgroup (in every hierarchy) holding sandboxes' cgroups |
| LAZYFS_PIDS_RESERVE | pid_max/16, >= 1024 | PIDs the sandboxes leave the node (limits.py) |
| LAZYFS_MEMORY_RESERVE | RAM/8, >= 1G | memory the sandboxes leave the node (limits.py) |
| LAZYFS_TREE | auto | erofs, fuse, or auto: erofs where the kernel and the image allow |
| LAZYFS_DAEMON_IDLE | 60 | seconds the data daemon stays up idle, and keeps an unused image open |
| LAZYFS_AGENT_LINGER | 60 | seconds the agent keeps an image mounted after its last sandbox |
| LAZYFS_AGENT_SOCKET | /run/lazyfs/agent.sock | the agent's unix socket (serve, sandbox, client) |
| LAZYFS_EXEC_SERVER | (scripts dir)/lazyfs-exec-server | the exec server (installed with lazyfs) |
| LAZYFS_RUN_WAIT | (scripts dir)/lazyfs-run-wait | `lazyfs run`'s waiter (installed with lazyfs) |
| LAZYFS_RUN_SLOTS | 2 per CPU | `lazyfs run`s that may be Python (setting up, finishing) at once |
| LAZYFS_REFILL_DEFER | 0.1 | seconds (at most) a refill waits for a claimed sandbox's 1st command |
| LAZYFS_MAX_FILE | 256M | the biggest file the agent's file API reads or writes in one request |

The three cache settings become the node cache's policy object (`Settings.cache`,
node_cache/policy.py), which holds its other knobs too.

Read elsewhere, each for a reason: the variables of other tools' conventions, where the
client for them is made (AWS_* and LAZYFS_S3_READER in chunker/store/s3_http.py and
chunker/store/s3.py, as boto3 reads them; REGISTRY_AUTH_FILE, DOCKER_CONFIG and XDG_*
in registry_bridge/auth.py, as skopeo and docker find their auth files); `lazyfs run`'s
slot, taken before this module is imported (lazyfs/sandbox/run_wait.py, early_slot); and
what passes through to a sandbox's processes (TERM). tests/test_environment_reads.py keeps
that list. A client reads LAZYFS_AGENT_SOCKET alone (`agent_socket()`); the commands
that need only the store read LAZYFS_STORE alone (`store_url()`).

A bad value is a BadInputError naming the variable, raised when the setting is read.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import NamedTuple

from chunker.errors import BadInputError
from lazyfs.sandbox.run_wait import (  # read early by `lazyfs run`
    default_slots,
    default_waiter,
    helpers_dir,
)
from node_cache.policy import CachePolicy

TREE_KINDS = ("auto", "erofs", "fuse")

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(?:([KMGT])(?:i?B)?|B)?\s*", re.IGNORECASE)
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


_CGROUP_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


def parse_size(text: str, what: str = "LAZYFS_CACHE_SIZE") -> int:
    """Bytes from "10G", "512MiB", "1.5T" or "1048576" (units are powers of 1024)."""
    m = _SIZE.fullmatch(text)
    size = int(float(m[1]) * _UNITS[(m[2] or "").upper()]) if m else 0
    if size <= 0:
        raise BadInputError(f"{what}={text!r} is not a size (bytes, or with K, M, G or T)")
    return size


def _seconds(name: str, default: str) -> float:
    text = os.environ.get(name, default)
    try:
        value = float(text)
    except ValueError:
        raise BadInputError(f"{name}={text!r} is not a number of seconds") from None
    if value < 0:
        raise BadInputError(f"{name}={text!r} must not be negative")
    return value


def _count(name: str, default: int) -> int:
    text = os.environ.get(name, str(default))
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise BadInputError(f"{name}={text!r} is not a positive whole number")
    return value


def _optional_count(name: str) -> int | None:
    return _count(name, 1) if os.environ.get(name) else None


def _optional_size(name: str) -> int | None:
    text = os.environ.get(name)
    return parse_size(text, name) if text else None


def default_cache_dir() -> Path:
    """$LAZYFS_CACHE, else /var/cache/lazyfs for root, else ~/.cache/lazyfs."""
    if env := os.environ.get("LAZYFS_CACHE"):
        return Path(env)
    if os.geteuid() == 0:
        return Path("/var/cache/lazyfs")
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lazyfs"


def store_url() -> str:
    """$LAZYFS_STORE, else a directory under the user's data directory."""
    if url := os.environ.get("LAZYFS_STORE"):
        return url
    data = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
    return "file://" + os.path.join(data, "lazyfs", "store")


def agent_socket() -> Path:
    """The agent's socket, and nothing else: what a client reads, so that a setting
    only the node uses (a bad LAZYFS_CACHE_SIZE, say) cannot stop a client."""
    return Path(os.environ.get("LAZYFS_AGENT_SOCKET", "/run/lazyfs/agent.sock"))


class Settings(NamedTuple):  # not a dataclass: see node_cache/policy.py
    cache: CachePolicy  # size, fetch timeout, traces on or off, and the policy's other knobs
    cache_dir: Path
    store_url: str
    run_dir: Path
    sandbox_dir: Path
    cgroup_parent: str
    pids_reserve: int | None  # None: lazyfs.sandbox.limits.sandbox_caps's default for this node
    memory_reserve: int | None
    tree: str
    daemon_idle: float
    agent_linger: float
    agent_socket: Path
    exec_server: Path  # lazyfs/agent/exec_server.c, built by the packaging (setup.py)
    refill_defer: float
    run_wait: Path  # lazyfs/sandbox/run_wait.c, built by the packaging (setup.py)
    attach_root: Path  # lazyfs/sandbox/attach_root.c, built by the packaging (setup.py)
    run_slots: int  # see lazyfs/sandbox/run_wait.py
    max_file: int  # bytes; a file read or written through the agent's API is in its memory
    snapshotter_root: Path

    @classmethod
    def from_env(cls) -> Settings:
        """Every setting; a bad value of any of them raises."""
        tree = os.environ.get("LAZYFS_TREE", "auto").strip().lower()
        if tree not in TREE_KINDS:
            raise BadInputError(f"LAZYFS_TREE={tree!r} is not one of {', '.join(TREE_KINDS)}")
        prefetch = os.environ.get("LAZYFS_PREFETCH", "1").strip().lower()
        cgroup_parent = os.environ.get("LAZYFS_CGROUP_PARENT", "lazyfs")
        if not _CGROUP_NAME.fullmatch(cgroup_parent):
            raise BadInputError(
                f"LAZYFS_CGROUP_PARENT={cgroup_parent!r} must be one cgroup name"
                " (letters, digits, '.', '_', '-')"
            )
        return cls(
            cache=CachePolicy(
                max_bytes=parse_size(os.environ.get("LAZYFS_CACHE_SIZE", "10G")),
                fetch_timeout=_seconds("LAZYFS_FETCH_TIMEOUT", "30"),
                prefetch=prefetch not in ("0", "false", "no"),
            ),
            cache_dir=default_cache_dir(),
            store_url=store_url(),
            run_dir=Path(os.environ.get("LAZYFS_RUN_DIR", "/run/lazyfs")),
            sandbox_dir=Path(os.environ.get("LAZYFS_SANDBOX_DIR", "/var/lib/lazyfs/sandboxes")),
            cgroup_parent=cgroup_parent,
            pids_reserve=_optional_count("LAZYFS_PIDS_RESERVE"),
            memory_reserve=_optional_size("LAZYFS_MEMORY_RESERVE"),
            tree=tree,
            daemon_idle=_seconds("LAZYFS_DAEMON_IDLE", "60"),
            agent_linger=_seconds("LAZYFS_AGENT_LINGER", "60"),
            agent_socket=agent_socket(),
            exec_server=Path(
                os.environ.get("LAZYFS_EXEC_SERVER", f"{helpers_dir()}/lazyfs-exec-server")
            ),
            refill_defer=_seconds("LAZYFS_REFILL_DEFER", "0.1"),
            run_wait=Path(os.environ.get("LAZYFS_RUN_WAIT", default_waiter())),
            attach_root=Path(f"{helpers_dir()}/lazyfs-attach-root"),
            run_slots=_count("LAZYFS_RUN_SLOTS", default_slots()),
            max_file=parse_size(os.environ.get("LAZYFS_MAX_FILE", "256M"), "LAZYFS_MAX_FILE"),
            snapshotter_root=Path(
                os.environ.get("LAZYFS_SNAPSHOTTER_ROOT", "/var/lib/lazyfs/snapshotter")
            ),
        )
