"""Inside a sandbox: runs as PID 1 of fresh mount, PID, UTS and IPC namespaces.

    python -I -S lazyfs/sandbox_init.py SPEC_JSON -- COMMAND [ARG...]

(standard library only: lazyfs.sandbox starts it without site, see SANDBOX_INIT there)

Started by lazyfs.sandbox through `unshare`, it mounts the overlay root (lowerdir: the
image's shared read-only lazy mount; upper and work: the sandbox's own directories),
then /proc, /dev (a tmpfs with the usual device nodes, devpts and shm), /sys (read-only)
and /tmp as a container runtime does, chroots, and execs COMMAND. Every mount lives in
this mount namespace only, so they all vanish when the sandbox's last process exits.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import socket
import stat
import sys

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC = 1, 2, 4, 8, 4096, 16384

DEVICES = {
    "null": (1, 3),
    "zero": (1, 5),
    "full": (1, 7),
    "random": (1, 8),
    "urandom": (1, 9),
    "tty": (5, 0),
}


def mount(source: str, target: str, fstype: str, flags: int = 0, data: str = "") -> None:
    if (
        _libc.mount(source.encode(), target.encode(), fstype.encode(), flags, data.encode() or None)
        != 0
    ):
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype} on {target}: {os.strerror(err)}")


def ensure_dir(path: str, mode: int = 0o755) -> None:
    """Create a mount point inside the overlay if the image lacks it (goes to upper)."""
    if not os.path.isdir(path):
        os.makedirs(path, mode, exist_ok=True)


def setup_root(spec: dict) -> str:
    root = spec["root"]
    mount(
        "overlay",
        root,
        "overlay",
        0,
        f"lowerdir={spec['lower']},upperdir={spec['upper']},workdir={spec['work']}",
    )
    ensure_dir(root + "/proc")
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    ensure_dir(root + "/sys")
    mount("sysfs", root + "/sys", "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    ensure_dir(root + "/tmp", 0o1777)
    mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    setup_dev(root + "/dev")
    return root


def setup_dev(dev: str) -> None:
    ensure_dir(dev)
    mount("tmpfs", dev, "tmpfs", MS_NOSUID, "mode=755,size=65536k")
    old = os.umask(0)
    try:
        for name, (major, minor) in DEVICES.items():
            os.mknod(f"{dev}/{name}", stat.S_IFCHR | 0o666, os.makedev(major, minor))
        os.mkdir(f"{dev}/pts", 0o755)
        mount(
            "devpts",
            f"{dev}/pts",
            "devpts",
            MS_NOSUID | MS_NOEXEC,
            "newinstance,ptmxmode=0666,mode=0620",
        )
        os.symlink("pts/ptmx", f"{dev}/ptmx")
        os.mkdir(f"{dev}/shm", 0o1777)
        mount("tmpfs", f"{dev}/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
        for n, name in enumerate(("stdin", "stdout", "stderr")):
            os.symlink(f"/proc/self/fd/{n}", f"{dev}/{name}")
        os.symlink("/proc/self/fd", f"{dev}/fd")
    finally:
        os.umask(old)


def image_env(config: dict) -> dict[str, str]:
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOSTNAME": "lazyfs",
        "HOME": "/root",
    }
    for item in config.get("Env") or []:
        key, _, value = item.partition("=")
        env[key] = value
    if term := os.environ.get("TERM"):
        env.setdefault("TERM", term)
    return env


def main() -> None:
    spec = json.loads(sys.argv[1])
    command = sys.argv[sys.argv.index("--") + 1 :]
    config = spec.get("config") or {}
    root = setup_root(spec)
    socket.sethostname("lazyfs")
    os.chroot(root)
    os.chdir(config.get("WorkingDir") or "/")
    user = config.get("User") or ""
    uid, _, gid = user.partition(":")
    if gid.isdigit():
        os.setgid(int(gid))
    if uid.isdigit():
        os.setgroups([])
        os.setuid(int(uid))
    try:
        os.execvpe(command[0], command, image_env(config))
    except OSError as exc:
        print(f"lazyfs: cannot run {command[0]!r} in the sandbox: {exc.strerror}", file=sys.stderr)
        os._exit(127 if isinstance(exc, FileNotFoundError) else 126)


if __name__ == "__main__":
    main()
