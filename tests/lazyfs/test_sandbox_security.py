"""Code in a sandbox tries to break out of it, and fails (issue 11).

Each attack runs as root inside `lazyfs run` on the real python test image, on runc, and
again in an agent's generic sandbox given the image's root at the claim (issue 23; the
`boundary` fixture).
Where an attack could succeed for a reason unrelated to the sandbox (a missing file, a
typo), the same probe is also run where it must succeed (on the host, or with
--network), so a test cannot pass by testing nothing.
"""

from __future__ import annotations

import os
import platform
import resource
import secrets
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from lazyfs.sandbox.oci_spec import MASKED_PATHS
from lazyfs.sandbox.ulimits import default_nofile
from testbed.agent_boundary import Boundary
from testbed.node import LAZYFS, Node

INIT_MODULE = {"x86_64": 175, "aarch64": 105}[platform.machine()]
MOUNT = {"x86_64": 165, "aarch64": 40}[platform.machine()]


def test_chroot_escape_stays_in_the_sandbox(boundary: Boundary) -> None:
    """The classic escape: chroot into a subdirectory while keeping a cwd outside it,
    then chdir("..") many times and chroot("."). Under pivot_root there is nothing
    above the sandbox's root to reach."""
    marker = boundary.tmp / f"host-marker-{secrets.token_hex(4)}"
    marker.write_text("host secret")
    script = f"""
import os
os.makedirs("/esc", exist_ok=True)
fd = os.open("/", os.O_RDONLY)
os.chroot("/esc")
os.fchdir(fd)
for _ in range(64):
    os.chdir("..")
os.chroot(".")
print(sorted(os.listdir("/"))[:50])
init = {boundary.init_path!r}
print(os.path.exists({str(marker)!r}), os.path.exists("/work"), os.path.exists(init))
"""
    out = boundary.ok("python3", "-c", script).splitlines()
    assert out[1] == "False False True", out  # still the sandbox's root (its init)
    assert marker.exists()  # the probe is valid on the host


def test_mounting_fails(boundary: Boundary) -> None:
    script = f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
r = libc.syscall({MOUNT}, b"none", b"/mnt", b"tmpfs", 0, None)
print(r, os.strerror(ctypes.get_errno()))
"""
    assert boundary.ok("python3", "-c", script).strip() == "-1 Operation not permitted"
    proc = boundary.run("sh", "-c", "unshare -m true || echo refused")
    assert "refused" in proc.stdout


def test_block_device_cannot_be_read(boundary: Boundary) -> None:
    """CAP_MKNOD is in the default set, so the node can be made, but opening it is
    refused: in /dev (the runtime's tmpfs, where device nodes work) by the devices
    cgroup, and anywhere in the sandbox's own files by the overlay's nodev (issue 20)
    before the cgroup is asked: the host's disk stays out of reach. In a user namespace
    of its own the kernel refuses to make the node at all."""
    dev = os.stat("/").st_dev
    major, minor = os.major(dev), os.minor(dev)
    script = f"""
import os, stat
for path in ("/dev/disk", "/tmp/disk"):
    try:
        os.mknod(path, stat.S_IFBLK | 0o600, os.makedev({major}, {minor}))
    except OSError as exc:
        print("not made", exc.strerror)
        continue
    try:
        open(path, "rb").read(512)
        print("read the host's disk")
    except OSError as exc:
        print("refused", exc.strerror)
"""
    expected = [
        "refused Operation not permitted",  # the devices cgroup
        "refused Permission denied",  # nodev
    ]
    if boundary.own_user_namespace:
        expected = ["not made Operation not permitted"] * 2
    assert boundary.ok("python3", "-c", script).splitlines() == expected


def test_loading_a_module_fails(boundary: Boundary) -> None:
    script = f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
image = ctypes.create_string_buffer(b"\\x7fELF" + bytes(60))
r = libc.syscall({INIT_MODULE}, image, 64, b"")
print(r, os.strerror(ctypes.get_errno()))
for name in ("modprobe", "core_pattern"):  # what the kernel would run as root on the host
    try:
        open("/proc/sys/kernel/" + name, "w").write("|/tmp/evil")
        print("wrote", name)
    except OSError as exc:
        print(name, exc.strerror)
"""
    out = boundary.ok("python3", "-c", script).splitlines()
    assert out[0] == "-1 Operation not permitted"
    # This kernel may be built without modules (no /proc/sys/kernel/modprobe at all).
    modprobe = "Read-only file system" if Path("/proc/sys/kernel/modprobe").exists() else ""
    assert out[1] in (f"modprobe {modprobe}", "modprobe No such file or directory"), out
    assert out[2] == "core_pattern Read-only file system"


def test_host_processes_are_invisible_and_cannot_be_traced(boundary: Boundary) -> None:
    host = subprocess.Popen(["sleep", "120"])
    try:
        script = f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
print(os.path.exists("/proc/{host.pid}"))
print(libc.ptrace(16, {host.pid}, None, None), os.strerror(ctypes.get_errno()))  # ATTACH
pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
print(1 in pids and os.getpid() in pids and len(pids) == {1 + boundary.tasks_beside_command})
"""
        out = boundary.ok("python3", "-c", script).splitlines()
        assert out == ["False", "-1 No such process", "True"], out
        assert host.poll() is None  # untouched
    finally:
        host.kill()
        host.wait()


def _tcp_server() -> tuple[socket.socket, int]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.sendall(b"host service\n")
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return server, server.getsockname()[1]


def test_host_loopback_is_unreachable_without_network(boundary: Boundary) -> None:
    server, port = _tcp_server()
    try:
        script = f"""
import socket
try:
    s = socket.create_connection(("127.0.0.1", {port}), timeout=3)
    print(s.recv(100).decode().strip())
except OSError as exc:
    print("refused", type(exc).__name__)
"""
        assert boundary.ok("python3", "-c", script).strip() == "refused ConnectionRefusedError"
        # --network shares the host's network: the same probe then reaches the service.
        shared = boundary.ok("python3", "-c", script, options=("--network",))
        assert shared.strip() == "host service"
    finally:
        server.close()


def test_only_loopback_is_visible(boundary: Boundary) -> None:
    script = (
        "import os; print(sorted(os.listdir('/sys/class/net')));"
        "print([l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]])"
    )
    assert boundary.ok("python3", "-c", script).splitlines() == ["['lo']", "['lo']"]
    host = sorted(os.listdir("/sys/class/net"))
    assert host != ["lo"]  # the host has more: the probe can tell


def test_another_sandboxs_files_and_the_hosts_files_are_invisible(sandbox_node: Node) -> None:
    secret = secrets.token_hex(8)
    digits = secrets.randbelow(10**8)
    host_marker = sandbox_node.tmp / f"host-{secret}"
    host_marker.write_text(secret)
    a = sandbox_node.popen("sh", "-c", f"echo {secret} > /tmp/a-{secret}; exec sleep 60.{digits}")
    try:
        (box,) = sandbox_node.wait_for_sandbox()
        deadline = time.monotonic() + 20
        while not (box / "upper" / "tmp" / f"a-{secret}").exists():
            assert time.monotonic() < deadline, "sandbox A did not write its file"
            time.sleep(0.05)
        # B is a sandbox of another image (base: no python3, so a shell probe).
        script = (
            f"test -e /tmp/a-{secret} && echo A-file; test -e {host_marker} && echo host-file;"
            f"ls /proc/*/root/tmp/a-{secret} /proc/*/cwd/tmp/a-{secret} 2>/dev/null;"
            f"cat /proc/[0-9]*/cmdline | tr '\\0' ' ' | grep -c 60[.]{digits}; echo done"
        )
        out = sandbox_node.run("sh", "-c", script, image="base")
        assert out.stdout == "0\ndone\n", (out.stdout, out.stderr)
    finally:
        a.send_signal(signal.SIGTERM)
        a.communicate(timeout=30)
    assert a.returncode == 128 + signal.SIGTERM


def test_writes_reach_neither_the_image_nor_the_next_sandbox(boundary: Boundary) -> None:
    linger = ("--linger", "5")  # the image's mount stays up across the three runs
    before = boundary.ok("cat", "/etc/os-release", options=linger)
    # <key>/<id>: the image's merged tree, or its layer trees (the agent's, by default)
    lowers = [p for p in boundary.tmp.glob("run/images/*/*") if p.is_dir()]
    assert lowers
    proc = boundary.run(
        "sh",
        "-c",
        "echo changed > /etc/os-release; echo new > /usr/bin/planted; rm -f /bin/ls; echo ok",
        options=linger,
    )
    assert proc.stdout == "ok\n", proc.stderr
    # the image is unchanged
    assert before in [
        (t / "etc" / "os-release").read_text() for t in lowers if _has(t, "etc/os-release")
    ]
    assert not any(_has(t, "usr/bin/planted") for t in lowers)
    assert any(_has(t, "bin/ls") for t in lowers)
    after = boundary.ok(
        "sh", "-c", "cat /etc/os-release; ls /usr/bin/planted 2>&1; ls /bin/ls", options=linger
    )
    assert after.startswith(before) and "No such file" in after and after.endswith("/bin/ls\n")


def _has(tree: Path, path: str) -> bool:
    """Whether the tree (an image's merged tree or one of its layer trees) has path,
    its own symlinks followed within it (Debian's /bin is usr/bin)."""
    return os.path.exists(tree / path)


def test_privileges_are_containerds_defaults(boundary: Boundary) -> None:
    status = boundary.ok("cat", "/proc/self/status")
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    # containerd's 14 capabilities: chown dac_override fowner fsetid kill setgid setuid
    # setpcap net_bind_service net_raw sys_chroot mknod audit_write setfcap.
    assert fields["CapEff"].strip() == "00000000a80425fb"
    assert fields["CapBnd"].strip() == "00000000a80425fb"
    assert fields["NoNewPrivs"].strip() == "1"
    assert fields["Seccomp"].strip() == "2"
    masked = [p for p in MASKED_PATHS if os.path.isfile(p)]  # what this kernel has
    assert masked
    script = f"""
import os
print(all(open(p, "rb").read(100) == b"" for p in {masked!r}), os.listdir("/sys/firmware"))
for path in ("/proc/sys/kernel/hostname", "/sys/kernel/profiling"):
    try:
        open(path, "w").write("x")
        print("wrote", path)
    except OSError as exc:
        print(exc.strerror)
print(sorted(os.listdir("/dev")))
"""
    out = boundary.ok("python3", "-c", script).splitlines()
    assert out[0] == "True []"  # masked
    assert out[1:3] == ["Read-only file system", "Read-only file system"]
    devices = eval(out[3])  # noqa: S307 - our own repr of a list of names
    assert set(devices) <= {
        "core", "fd", "full", "mqueue", "null", "ptmx", "pts", "random", "shm",
        "stderr", "stdin", "stdout", "tty", "urandom", "zero", "console",
        boundary.init_path.removeprefix("/dev/"),
    }, devices  # fmt: skip


def test_other_syscall_abis_are_killed(boundary: Boundary) -> None:
    """The seccomp filter lists only the native ABI: a 32-bit `int 0x80` call is killed
    (SIGSYS) instead of reaching a syscall table the allow-list does not cover."""
    if platform.machine() != "x86_64":
        return
    script = """
import ctypes, mmap
code = bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3])  # mov eax, 20 (getpid); int 0x80; ret
m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
m.write(code)
f = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(m)))
print(f() > 0, flush=True)
"""
    on_host = subprocess.run(["python3", "-c", script], capture_output=True, text=True)
    assert on_host.stdout == "True\n"  # the probe works where nothing filters it
    proc = boundary.run("python3", "-c", script)
    assert proc.returncode == 128 + signal.SIGSYS, (proc.returncode, proc.stderr)


def test_host_root_marker_is_invisible(boundary: Boundary, tmp_path: Path) -> None:
    """A file only the host has (under its /tmp) is not in the sandbox's /tmp."""
    name = f"lazyfs-host-marker-{secrets.token_hex(4)}"
    marker = Path("/tmp") / name
    marker.write_text("host")
    try:
        assert boundary.ok("sh", "-c", f"ls /tmp/{name} 2>&1 || true").count("No such") == 1
    finally:
        marker.unlink()


def test_a_tmpfs_of_its_own_is_nosuid_nodev_noexec_and_bounded(boundary: Boundary) -> None:
    """--tmpfs (docker's): a tmpfs at the path asked, in the sandbox only, always nosuid
    and nodev, noexec unless `exec` is asked, full at its size."""
    script = (
        "grep ' /scratch ' /proc/mounts | cut -d' ' -f3,4;"
        " head -c 2000000 /dev/zero > /scratch/big 2>/dev/null || echo full; rm /scratch/big;"
        " cp /bin/true /scratch/t && /scratch/t 2>/dev/null || echo noexec $?"
    )
    out = boundary.ok("sh", "-c", script, options=("--tmpfs", "/scratch:size=1m,mode=700"))
    fstype, options, *rest = out.split()
    assert fstype == "tmpfs", out
    for option in ("nosuid", "nodev", "noexec", "size=1024k", "mode=700"):
        assert option in options.split(","), out
    assert rest == ["full", "noexec", "126"], out
    script = "cp /bin/true /scratch/t && /scratch/t && echo ran; stat -fc %T /new/dir"
    options = ("--tmpfs", "/scratch:exec", "--tmpfs", "/new/dir:size=1m")  # made, with parents
    assert boundary.ok("sh", "-c", script, options=options) == "ran\ntmpfs\n"
    # Nothing of it is on the host: the sandbox's root is its overlay, gone with it.
    assert not Path("/scratch").exists()
    # /dev/shm, the one path under /dev a sandbox may ask for: it replaces the 64 MiB one.
    out = boundary.ok("sh", "-c", "df -k /dev/shm | tail -1; grep -c ' /dev/shm ' /proc/mounts")
    assert out.split()[1] == "65536", out
    out = boundary.ok(
        "sh",
        "-c",
        "df -k /dev/shm | tail -1; grep -c ' /dev/shm ' /proc/mounts",
        options=("--tmpfs", "/dev/shm:size=128m"),
    )
    assert out.split()[1] == "131072" and out.split()[-1] == "1", out


@pytest.mark.parametrize(
    "asked",
    [
        "/proc/x",
        "/sys",
        "/dev/shm/x",
        "/",
        "relative",
        "/a/../b",
        "/x:suid",
        "/x:dev",
        "/x:size=lots",
        "/x:uid=4294967295",
        "/x:ro,rw",
    ],
)
def test_a_tmpfs_where_or_how_a_sandbox_cannot_have_it_is_refused(
    sandbox_node: Node, asked: str
) -> None:
    proc = sandbox_node.run("true", options=("--tmpfs", asked))
    assert proc.returncode == 2, proc
    (line,) = proc.stderr.splitlines()
    assert line.startswith("lazyfs: --tmpfs "), line


def _status(text: str) -> dict[str, str]:
    return {
        k: v.strip()
        for k, v in (line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)
    }


def test_dropped_capabilities_are_gone_from_every_set(boundary: Boundary) -> None:
    """--cap-drop (docker's): the capabilities named are in no set of the sandbox's
    processes, the bounding set included, so none of its code gets them back."""
    fields = _status(boundary.ok("cat", "/proc/self/status", options=("--cap-drop", "ALL")))
    for key in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert fields[key] == "0000000000000000", (key, fields[key])
    script = (
        "grep -E '^Cap(Eff|Bnd)' /proc/self/status; touch /tmp/f;"
        " chown 1 /tmp/f 2>/dev/null && echo chowned || echo refused"
    )
    dropped = ("--cap-drop", "chown", "--cap-drop", "CAP_NET_RAW")
    out = boundary.ok("sh", "-c", script, options=dropped)
    # The default 0xa80425fb without chown (bit 0) and net_raw (bit 13); the others stay.
    assert _status(out) == {"CapEff": "00000000a80405fa", "CapBnd": "00000000a80405fa"}, out
    assert out.endswith("\nrefused\n"), out
    assert boundary.ok("sh", "-c", script).endswith("\nchowned\n")  # root may, by default


def test_a_read_only_root_refuses_writes_and_keeps_its_tmpfs_writable(boundary: Boundary) -> None:
    """--read-only (docker's): the root is mounted read-only, for root too; a tmpfs of
    its own stays writable, as /dev/shm does."""
    script = (
        "touch /etc/x 2>&1 | grep -o 'Read-only file system';"
        " echo ok > /scratch/y && cat /scratch/y; echo shm > /dev/shm/z && cat /dev/shm/z;"
        " grep '^[^ ]* / ' /proc/mounts | cut -d' ' -f4 | cut -d, -f1"
    )
    out = boundary.ok("sh", "-c", script, options=("--read-only", "--tmpfs", "/scratch"))
    assert out == "Read-only file system\nok\nshm\nro\n", out


def _limits(text: str) -> dict[str, tuple[str, str]]:
    """/proc/PID/limits: its name column -> (soft, hard)."""
    rows = [line[:26].strip() for line in text.splitlines()[1:]]
    values = [line[26:].split()[:2] for line in text.splitlines()[1:]]
    return {name: (v[0], v[1]) for name, v in zip(rows, values, strict=True)}


def test_ulimits_are_set_and_cannot_be_raised_from_inside(boundary: Boundary) -> None:
    """--ulimit (docker's): the limits asked are every process's; a hard one cannot be
    raised from inside, root or not. The default open files are Docker 25+'s, within
    the node's own hard limit where the runtime cannot raise it (no CAP_SYS_RESOURCE)."""
    soft, hard = default_nofile()
    own = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    assert soft == 1024 and hard in (524288, min(own, 524288)), (soft, hard)
    script = "cat /proc/self/limits; ulimit -Hn {} 2>/dev/null && echo raised || echo refused"
    out = boundary.ok("sh", "-c", script.format(hard + 1))
    assert _limits(out.rsplit("\n", 2)[0])["Max open files"] == ("1024", str(hard)), out
    assert out.endswith("\nrefused\n"), out
    asked = ("--ulimit", "nofile=4096:8192", "--ulimit", "stack=16777216", "--ulimit", "core=0")
    out = boundary.ok("sh", "-c", script.format(8193), options=asked)
    limits = _limits(out.rsplit("\n", 2)[0])
    assert limits["Max open files"] == ("4096", "8192"), out
    assert limits["Max stack size"] == ("16777216", "16777216"), out
    assert limits["Max core file size"] == ("0", "0"), out
    assert out.endswith("\nrefused\n"), out
    # Lowering stays allowed, and a soft limit may rise to the hard one.
    out = boundary.ok("sh", "-c", "ulimit -Sn 8192 && ulimit -n 100 && ulimit -Hn", options=asked)
    assert out == "100\n", out


@pytest.mark.parametrize(
    ("asked", "says"),
    [
        ("nope=1", "is not a limit's name"),
        ("nofile=8:4", "soft limit 8 is above its hard limit 4"),
        ("nofile=-1", "nofile may be at most"),
        ("stack=-2", "must be a whole number"),
        ("nofile", "expected NAME=SOFT[:HARD]"),
    ],
)
def test_a_ulimit_that_is_not_one_is_refused(sandbox_node: Node, asked: str, says: str) -> None:
    proc = sandbox_node.run("true", options=("--ulimit", asked))
    assert proc.returncode == 2, proc
    (line,) = proc.stderr.splitlines()
    assert line.startswith("lazyfs: --ulimit") and says in line, line


def test_a_node_whose_runtime_cannot_raise_limits_gives_its_own_and_says_so(
    sandbox_node: Node,
) -> None:
    """Without CAP_SYS_RESOURCE (root in a container may lack it) runc cannot raise a
    hard limit: the default open files come down to the node's, and an ask above the
    node's is one clear line, where runc would fail with "operation not permitted"."""
    lowered = ["prlimit", "--nofile=1024:4096", "capsh", "--drop=cap_sys_resource", "--"]

    def run(*options: str) -> subprocess.CompletedProcess[str]:
        argv = [LAZYFS, "run", *options, "py", "--", "grep", "open files", "/proc/self/limits"]
        line = " ".join(f"'{a}'" for a in argv)
        return subprocess.run(
            [*lowered, "-c", line], env=sandbox_node.env, capture_output=True, text=True
        )

    proc = run()
    assert proc.returncode == 0 and proc.stdout.split()[3:5] == ["1024", "4096"], proc
    proc = run("--ulimit", "nofile=2048:4096")
    assert proc.returncode == 0 and proc.stdout.split()[3:5] == ["2048", "4096"], proc
    proc = run("--ulimit", "nofile=1024:8192")
    assert proc.returncode == 2, proc
    (line,) = proc.stderr.splitlines()
    assert line.startswith("lazyfs: --ulimit: nofile's hard limit 8192 is above this node's 4096")


@pytest.mark.parametrize("asked", ["NOPE", "CAP_", ""])
def test_a_capability_that_is_not_one_is_refused(sandbox_node: Node, asked: str) -> None:
    proc = sandbox_node.run("true", options=("--cap-drop", asked))
    assert proc.returncode == 2, proc
    (line,) = proc.stderr.splitlines()
    assert line.startswith("lazyfs: --cap-drop: ") and "is not a Linux capability" in line, line
