"""A sandbox's OCI runtime config.json, as a pure function of what the sandbox needs.

The spec follows what containerd gives a container by default (its `oci` package and the
runtime spec's config.md / config-linux.md): new mount, PID, IPC, UTS and network
namespaces; containerd's 14 default capabilities (12 in the host's network namespace:
HOST_NETWORK_CAPABILITIES); no_new_privs; the default seccomp profile
(lazyfs.sandbox.seccomp); /proc and /sys paths masked or read-only as containerd does;
a tmpfs /dev holding only the usual nodes, with the devices cgroup denying all others;
/proc, /sys (read-only), /dev/pts, /dev/shm, /dev/mqueue and /run mounted; the runtime
enters the root with pivot_root (`noPivotRoot` is never set); cgroup limits; open files
1,024 soft and 524,288 hard as Docker 25+ gives, or the node's own hard limit where lower
(lazyfs/sandbox/ulimits.py).

No user namespace by default: root in the sandbox is the host's, with the capabilities
above. With `userns` (`lazyfs run --userns`) it joins one of its own, owned by a range
of unprivileged host ids, over id-mapped image trees (lazyfs/sandbox/userns.py; runc
1.1 cannot id-map a rootfs itself, so the caller does). See docs/design-changes.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from lazyfs.sandbox.confinement import DEFAULT_CONFINEMENT, Confinement
from lazyfs.sandbox.seccomp import default_profile
from lazyfs.sandbox.ulimits import spec_rlimits

if TYPE_CHECKING:
    from lazyfs.sandbox.tmpfs import Tmpfs
    from lazyfs.sandbox.userns import UserNamespace

OCI_VERSION = "1.0.2"
HOSTNAME = "lazyfs"  # every sandbox's, in its own UTS namespace (and its /etc/hosts: names.py)
DEFAULT_PIDS = 4096
# The writable layer's size (a tmpfs: lazyfs/sandbox/runtime.py, "The writable layer"),
# and one inode per BYTES_PER_INODE of it: ext4's default ratio, enough for a source
# checkout (~3 KiB per file in a Linux or CPython tree) while bounding the kernel memory
# inodes take (~1 KiB each in a tmpfs).
DEFAULT_DISK = 10 * 2**30
BYTES_PER_INODE = 16 * 2**10
# The OOM killer's bias for a sandbox's processes (-1000..1000): well above the node's
# own (0), and far above the agent's and the data daemon's (lazyfs/oom.py),
# so that on a node out of memory a sandbox dies first. The runtime sets it with
# CAP_SYS_RESOURCE, which makes it the floor: code in the sandbox cannot lower it.
SANDBOX_OOM_SCORE_ADJ = 500
CPU_PERIOD_US = 100_000

# containerd's default set: what a package manager, a build or a test suite needs as
# root; CAP_SYS_ADMIN, CAP_SYS_MODULE, CAP_SYS_PTRACE, CAP_NET_ADMIN, CAP_SYS_RAWIO, ...
# are not in it.
DEFAULT_CAPABILITIES = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
]

# Dropped when the sandbox shares the host's network namespace (`network`): there,
# CAP_NET_RAW opens AF_PACKET and raw IP sockets on the host's interfaces, lo included,
# which read every packet on the node (it sniffed a bearer token sent to an agent on TCP
# loopback, issue 20) and forge any; CAP_NET_BIND_SERVICE binds the host's ports below
# 1024, which clients of the node trust as the operator's (a sandbox could take :443 or
# :53 before the service that should). In a namespace of its own (the default) both are
# kept, as containerd does: there they reach only the sandbox's own lo and its own
# traffic (ping and a test's server on :80 work as root expects).
HOST_NETWORK_CAPABILITIES = {"CAP_NET_RAW", "CAP_NET_BIND_SERVICE"}

# Kernel interfaces that leak host information or control the host: hidden (bind of
# /dev/null or an empty read-only tmpfs) or made read-only, as containerd does.
MASKED_PATHS = [
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
]
READONLY_PATHS = [
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
]

# The devices cgroup: deny everything, then allow the nodes the runtime creates in /dev
# (null, zero, full, random, urandom, tty, console, ptmx, the pts). A block device made
# with CAP_MKNOD can then not be opened.
_CHAR_DEVICES = [(1, 3), (1, 5), (1, 7), (1, 8), (1, 9), (5, 0), (5, 1), (5, 2), (136, None)]
DEVICE_RULES = [{"allow": False, "access": "rwm"}] + [
    {"allow": True, "type": "c", "major": major, "access": "rwm"}
    | ({"minor": minor} if minor is not None else {})
    for major, minor in _CHAR_DEVICES
]

_NOSUID_NOEXEC_NODEV = ["nosuid", "noexec", "nodev"]
PTYS = 128  # a sandbox's terminals at once (docker exec -t, pexpect, script)
MOUNTS = [
    {"destination": "/proc", "type": "proc", "source": "proc", "options": _NOSUID_NOEXEC_NODEV},
    {
        "destination": "/dev",
        "type": "tmpfs",
        "source": "tmpfs",
        "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
    },
    {
        "destination": "/dev/pts",
        "type": "devpts",
        "source": "devpts",
        # Its own devpts instance with at most PTYS: the node's ptys outside its own
        # instance (kernel.pty.max less the reserve, 3,072) are one pool for every
        # sandbox, and one took them all (docs/security.md, finding 20).
        "options": [
            *["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"],
            f"max={PTYS}",
        ],
    },
    {
        "destination": "/dev/shm",
        "type": "tmpfs",
        "source": "shm",
        "options": [*_NOSUID_NOEXEC_NODEV, "mode=1777", "size=65536k"],
    },
    {
        "destination": "/dev/mqueue",
        "type": "mqueue",
        "source": "mqueue",
        "options": _NOSUID_NOEXEC_NODEV,
    },
    {
        "destination": "/sys",
        "type": "sysfs",
        "source": "sysfs",
        "options": [*_NOSUID_NOEXEC_NODEV, "ro"],
    },
    {
        "destination": "/sys/fs/cgroup",
        "type": "cgroup",
        "source": "cgroup",
        "options": [*_NOSUID_NOEXEC_NODEV, "relatime", "ro"],
    },
    {
        "destination": "/run",
        "type": "tmpfs",
        "source": "tmpfs",
        "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
    },
]


# /sys for a sandbox with a user namespace of its own in the host's network namespace: the
# kernel mounts a sysfs only for the owner of the network namespace, so the host's is bound
# read-only, as runc does for rootless containers; it shows what a sysfs there would.
SYSFS_BIND = {
    "destination": "/sys",
    "type": "none",
    "source": "/sys",
    "options": ["rbind", *_NOSUID_NOEXEC_NODEV, "ro"],
}


# NamedTuples, not dataclasses: `lazyfs run` reads its limits before it starts the node
# data daemon, and the dataclasses module is ~15 ms of a cold start (node_cache/policy.py).


class Limits(NamedTuple):
    """cgroup limits; None means unlimited."""

    cpus: float | None = None  # CPU time per wall second, e.g. 0.5
    memory: int | None = None  # bytes of RAM; swap is limited to the same total, so it OOMs
    pids: int = DEFAULT_PIDS
    disk: int = DEFAULT_DISK  # bytes of the writable layer (its inodes: BYTES_PER_INODE)
    cpu_shares: int | None = None  # relative CPU weight under contention (1024: the default)
    cpuset: str | None = None  # the CPUs it may run on, in the kernel's list form: "0-1,3"

    @property
    def inodes(self) -> int:
        return max(1024, self.disk // BYTES_PER_INODE)


class Process(NamedTuple):
    """What runs in the sandbox, resolved against the image (see lazyfs.sandbox.process)."""

    args: list[str]
    env: list[str]  # "K=V"
    cwd: str = "/"
    uid: int = 0
    gid: int = 0
    additional_gids: tuple[int, ...] | list[int] = ()


class Init(NamedTuple):
    """A static init binary bind-mounted into the sandbox as PID 1 (reaps zombies,
    forwards signals, exits 128+N when the command dies of signal N)."""

    host_path: str
    args: list[str]  # the init's own arguments, before the command
    destination: str = "/dev/init"  # the /dev tmpfs: nothing is written into the image


def limit_resources(limits: Limits) -> dict:
    """The linux.resources entries for the limits (also what `runc update -r` takes)."""
    resources: dict = {"pids": {"limit": limits.pids}}
    if limits.memory is not None:
        resources["memory"] = {"limit": limits.memory, "swap": limits.memory}
    cpu: dict = {}
    if limits.cpus is not None:
        cpu["quota"] = max(1000, round(limits.cpus * CPU_PERIOD_US))
        cpu["period"] = CPU_PERIOD_US
    if limits.cpu_shares is not None:
        cpu["shares"] = limits.cpu_shares
    if limits.cpuset is not None:
        cpu["cpus"] = limits.cpuset
    if cpu:
        resources["cpu"] = cpu
    return resources


def _bind(source: str, destination: str, *options: str) -> dict:
    """A bind mount from the host; never a setuid file or a device node through it."""
    return {
        "destination": destination,
        "type": "bind",
        "source": source,
        "options": ["bind", options[0], "nosuid", "nodev", *options[1:]],
    }


def build_spec(
    rootfs: Path,
    process: Process,
    limits: Limits,
    *,
    cgroups_path: str,
    network: bool = False,
    hostname: str = HOSTNAME,
    init: Init | None = None,
    resolv_conf: str | None = None,
    machine: str | None = None,
    helper: tuple[str, str] | None = None,
    tmpfs: tuple[Tmpfs, ...] = (),
    confinement: Confinement = DEFAULT_CONFINEMENT,
    userns: UserNamespace | None = None,
) -> dict:
    """The config.json of one sandbox. `network`: share the host's network namespace
    (and bind `resolv_conf` read-only at /etc/resolv.conf) instead of a private one
    holding only loopback. `tmpfs`: its own tmpfs mounts, under the binds.
    `confinement`: capabilities dropped from every set, a read-only root (one asked
    for, or a generic sandbox's start-up root) and resource limits
    (lazyfs/sandbox/confinement.py). `userns`: a user namespace of its own, which the
    runtime joins (lazyfs/sandbox/userns.py; its rlimits are then the caller's to give)."""
    root = process.uid == 0
    caps = [c for c in DEFAULT_CAPABILITIES if not (network and c in HOST_NETWORK_CAPABILITIES)]
    caps = confinement.capabilities(caps)
    # A non-root user keeps only the bounding set, as with docker: capabilities come
    # back only through a file's capabilities (which no_new_privs ignores) or setuid.
    capabilities = {
        "bounding": caps,
        "effective": caps if root else [],
        "permitted": caps if root else [],
        "inheritable": [],
        "ambient": [],
    }
    # A tmpfs asked at one of the runtime's own (/dev/shm, the only one allowed) replaces it.
    asked = {t.destination for t in tmpfs}
    mounts = [dict(m) for m in MOUNTS if m["destination"] not in asked]
    mounts += [t.mount() for t in tmpfs]
    args = list(process.args)
    if init is not None:
        mounts.append(_bind(init.host_path, init.destination, "ro"))
        args = [init.destination, *init.args, "--", *args]
    if helper is not None:  # (host file, destination): a static binary, like the init
        mounts.append(_bind(helper[0], helper[1], "ro"))
    if network and resolv_conf:
        mounts.append(_bind(resolv_conf, "/etc/resolv.conf", "ro", "noexec"))
    namespaces = [{"type": t} for t in ("pid", "ipc", "uts", "mount")]
    if not network:
        namespaces.append({"type": "network"})  # a new one: only lo, brought up by runc
    resources: dict = {"devices": DEVICE_RULES, **limit_resources(limits)}
    linux_userns: dict = {}
    if userns is not None:
        namespaces.append({"type": "user", "path": userns.path})
        if network:  # sysfs is the network namespace's, which this one does not own
            mounts = [SYSFS_BIND if m["destination"] == "/sys" else m for m in mounts]
        # runc 1.1 wants the mappings of a namespace it joins too; they are its own.
        linux_userns = {"uidMappings": userns.ids.mappings(), "gidMappings": userns.ids.mappings()}
    return {
        "ociVersion": OCI_VERSION,
        "root": {"path": str(rootfs), "readonly": confinement.read_only},
        "hostname": hostname,
        "process": {
            "terminal": False,
            "user": {
                "uid": process.uid,
                "gid": process.gid,
                "additionalGids": list(process.additional_gids),
            },
            "args": args,
            "env": list(process.env),
            "cwd": process.cwd,
            "capabilities": capabilities,
            "rlimits": spec_rlimits(confinement.ulimits, userns is not None),
            "noNewPrivileges": True,
            "oomScoreAdj": SANDBOX_OOM_SCORE_ADJ,
        },
        "mounts": mounts,
        "linux": {
            "namespaces": namespaces,
            "cgroupsPath": cgroups_path,
            "resources": resources,
            "maskedPaths": list(MASKED_PATHS),
            "readonlyPaths": list(READONLY_PATHS),
            "seccomp": default_profile(machine),
            **linux_userns,
        },
    }
