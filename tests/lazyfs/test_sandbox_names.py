"""A sandbox's /etc/hosts and /etc/hostname (lazyfs/sandbox/names.py): localhost, its
own name and the extra hosts asked for resolve in every kind of sandbox, as under
Docker, what the sandbox writes there stays its own, and a hostname asked for is the
sandbox's alone."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
from pathlib import Path

import pytest

from chunker.errors import BadInputError
from lazyfs.client import AgentError, Client
from lazyfs.sandbox.names import (
    ExtraHost,
    SandboxNames,
    parse_extra_hosts,
    parse_hostname,
    stacked,
    write_names_layer,
)
from lazyfs.settings import Settings
from testbed.agent import AgentProcess
from testbed.agent_boundary import Boundary
from testbed.node import Node
from testbed.waiting import wait_for

# Resolves each name as glibc does (what a test suite's servers and clients call).
RESOLVE = """
import socket, sys
for name in sys.argv[1:]:
    try:
        found = sorted({a[4][0] for a in socket.getaddrinfo(name, 80, type=socket.SOCK_STREAM)})
    except socket.gaierror as exc:
        found = ["unresolved: " + exc.strerror]
    print(name, " ".join(found))
"""
# A server on localhost, and a client that reaches it by that name.
LOCALHOST_SERVER = """
import socket
server = socket.create_server(("localhost", 0))
client = socket.create_connection(("localhost", server.getsockname()[1]), timeout=5)
peer, _ = server.accept()
client.sendall(b"ping")
print(peer.recv(4).decode(), socket.gethostname())
"""


def ready(c: Client, image: str = "py") -> int:
    return sum(p["ready"] for p in c.pools() if p["image"] == image)


def test_localhost_and_the_sandboxs_own_name_resolve(boundary: Boundary) -> None:
    """An image without an /etc/hosts of its own (the test image has none, as images
    built by docker) resolved nothing before: "Temporary failure in name resolution"."""
    out = boundary.ok("python3", "-c", RESOLVE, "localhost", "lazyfs", "ip6-localhost")
    assert out.splitlines() == [
        "localhost 127.0.0.1 ::1",
        "lazyfs 127.0.1.1",
        "ip6-localhost ::1",
    ], out
    assert boundary.ok("python3", "-c", LOCALHOST_SERVER) == "ping lazyfs\n"
    assert boundary.ok("cat", "/etc/hostname") == "lazyfs\n"
    assert boundary.ok("sh", "-c", 'echo "$HOSTNAME"') == "lazyfs\n"  # as dockerd sets it
    # The image's /etc is all there beside the two files.
    assert boundary.ok("sh", "-c", "test -s /etc/passwd && test -d /etc/python3 && echo ok") == (
        "ok\n"
    )


def test_extra_hosts_are_in_etc_hosts(boundary: Boundary) -> None:
    options = ("--add-host", "db:10.0.0.5", "--add-host", "v6=[2001:db8::1]")
    out = boundary.ok("python3", "-c", RESOLVE, "db", "v6", "localhost", options=options)
    assert out.splitlines() == ["db 10.0.0.5", "v6 2001:db8::1", "localhost 127.0.0.1 ::1"], out
    assert boundary.ok("tail", "-2", "/etc/hosts", options=options) == (
        "10.0.0.5\tdb\n2001:db8::1\tv6\n"
    )


# What a sandbox says its name is, every way a program asks.
NAMED = 'hostname; cat /etc/hostname; echo "$HOSTNAME"; getent hosts "$(hostname)"'


def test_a_hostname_asked_for_is_the_sandboxs_alone(boundary: Boundary) -> None:
    """docker's --hostname: the sandbox's UTS namespace, /etc/hostname, $HOSTNAME and
    /etc/hosts say it (a generic sandbox is named at its claim), the node keeps its own
    name, and the next sandbox has the default."""
    node_name = socket.gethostname()
    out = boundary.ok("sh", "-c", NAMED, options=("--hostname", "task-7.swe"))
    assert out.split() == ["task-7.swe"] * 3 + ["127.0.1.1", "task-7.swe"], out
    assert socket.gethostname() == node_name
    assert boundary.ok("sh", "-c", NAMED).split() == ["lazyfs"] * 3 + ["127.0.1.1", "lazyfs"]


@pytest.mark.parametrize("asked", ["bad name", "-x", "a" * 65, "a#b"])
def test_a_hostname_that_is_not_one_is_refused(sandbox_node: Node, asked: str) -> None:
    proc = sandbox_node.run("true", options=(f"--hostname={asked}",))
    assert proc.returncode == 2, proc
    (line,) = proc.stderr.splitlines()
    assert line.startswith("lazyfs: --hostname") and "is not a host name" in line, line


def test_the_attach_helper_never_names_the_host(tmp_path: Path) -> None:
    """lazyfs-attach-root refuses a process in the host's UTS namespace (here one with a
    mount namespace of its own, so that the mount namespace's check does not stop it
    first): a stale PID never renames the node."""
    helper = Settings.from_env().attach_root
    node_name = socket.gethostname()
    other = subprocess.Popen(["unshare", "--mount", "sleep", "60"])
    try:
        wait_for(
            lambda: os.readlink(f"/proc/{other.pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt"),
            what="the mount namespace",
        )
        proc = subprocess.run(
            [str(helper), "--hostname", "evil", str(other.pid), str(tmp_path)],
            capture_output=True,
            text=True,
        )
    finally:
        other.kill()
        other.wait()
    assert proc.returncode == 1, proc
    assert "host's uts namespace" in proc.stderr, proc.stderr
    assert socket.gethostname() == node_name


def test_what_a_sandbox_writes_to_etc_hosts_stays_its_own(boundary: Boundary) -> None:
    """Root may edit its /etc/hosts, as under Docker; the edit is in its own writable
    layer, so the next sandbox has the file as it was."""
    script = "echo '10.9.9.9 mine' >> /etc/hosts && getent hosts mine"
    assert boundary.ok("sh", "-c", script).split() == ["10.9.9.9", "mine"]
    out = boundary.ok("python3", "-c", RESOLVE, "mine")
    assert out.startswith("mine unresolved"), out


@pytest.mark.parametrize(
    ("asked", "says"),
    [
        ("db", "is not NAME:IP"),
        ("db:", "is not NAME:IP"),
        ("bad name:10.0.0.1", "is not a host name"),
        ("db:10.0.0.256", "is not an IP address"),
        ("host.docker.internal:host-gateway", "has no route to the node"),
    ],
)
def test_an_extra_host_that_is_not_one_is_refused(
    sandbox_node: Node, asked: str, says: str
) -> None:
    proc = sandbox_node.run("true", options=("--add-host", asked))
    assert proc.returncode == 2, proc
    (line,) = proc.stderr.splitlines()
    assert line.startswith("lazyfs: --add-host") and says in line, line


def test_the_nodes_network_starts_from_the_nodes_hosts(sandbox_node: Node) -> None:
    """--network: the node's /etc/hosts, as docker's --network host; host-gateway is the
    node's loopback, which such a sandbox shares."""
    options = ("--network", "--add-host", "node:host-gateway")
    out = sandbox_node.ok("cat", "/etc/hosts", options=options)
    assert out.startswith(Path("/etc/hosts").read_text()), out
    assert out.endswith("127.0.1.1\tlazyfs\n127.0.0.1\tnode\n"), out


def test_the_pool_is_skipped_for_extra_hosts_and_a_restart_keeps_them(
    agent: AgentProcess,
) -> None:
    """A sandbox of the image's pool has its root already: a create with extra hosts
    takes a generic sandbox (given them at its claim) or a cold one, and the pool's
    sandboxes resolve localhost too. The view shows them, after a restart too."""
    agent.start("--pool", "py=1", "--warm", "1")
    with agent.client() as c:
        wait_for(lambda: ready(c) == 1, what="the pool to fill")
        wait_for(lambda: any(p["generic"] and p["ready"] for p in c.pools()), what="generic")
        named = c.create("py", extra_hosts=["db:10.0.0.5"])
        assert named.info["extra_hosts"] == ["db:10.0.0.5"], named.info
        assert ready(c) == 1  # the image's pool kept its sandbox
        wait_for(lambda: any(p["generic"] and p["ready"] for p in c.pools()), what="generic")
        host = c.create("py", hostname="box1")
        assert host.info["hostname"] == "box1" and ready(c) == 1, host.info
        with c.create("py", hostname="box2", env={"HOSTNAME": "set"}) as mine:  # it wins
            r = mine.exec(["sh", "-c", 'echo "$HOSTNAME"; hostname'])
            assert r.stdout == b"set\nbox2\n", r
        pooled = c.create("py")
        assert pooled.info["from_pool"] and pooled.info["extra_hosts"] == []
        for box, name, address in ((named, "db", b"10.0.0.5"), (pooled, "localhost", b"::1")):
            r = box.exec(["getent", "hosts", name])
            assert r.exit_code == 0 and r.stdout.split()[0] == address, r
        for bad in (["db"], "db:1.2.3.4", ["x:host-gateway"], [1]):
            with pytest.raises(AgentError) as err:
                c.create("py", extra_hosts=bad)  # type: ignore[arg-type]
            assert err.value.status == 400 and "extra_hosts" in str(err.value), err.value
        for bad in ("a b", 7, "x" * 65):
            with pytest.raises(AgentError) as err:
                c.create("py", hostname=bad)  # type: ignore[arg-type]
            assert err.value.status == 400 and "hostname" in str(err.value), err.value
    agent.kill9()
    agent.start()
    with agent.client() as c:
        assert c.sandbox(named.id).info["extra_hosts"] == ["db:10.0.0.5"]
        assert c.sandbox(named.id).exec(["getent", "hosts", "db"]).exit_code == 0
        assert c.sandbox(host.id).info["hostname"] == "box1"
        r = c.sandbox(host.id).exec(["sh", "-c", NAMED])
        assert r.stdout.split() == [b"box1"] * 3 + [b"127.0.1.1", b"box1"], r
        for box in (named, pooled, host):
            c.sandbox(box.id).delete()


def test_the_layers_etc_takes_the_images_and_a_linked_etc_gets_none(tmp_path: Path) -> None:
    """The layer's /etc shows the image's owner, mode and times (overlayfs shows a merged
    directory's from its topmost layer); an /etc that is a symlink gets no layer, which
    would hide what it leads to."""
    image = tmp_path / "image"
    (image / "etc").mkdir(parents=True)
    os.chown(image / "etc", 7, 8)
    os.chmod(image / "etc", 0o750)
    os.utime(image / "etc", ns=(1_000_000_000, 2_000_000_000))
    box = tmp_path / "box"
    box.mkdir()
    layer = write_names_layer(box, image, SandboxNames(extra_hosts=(ExtraHost("db", "10.0.0.5"),)))
    assert layer == box / "names"
    st = os.lstat(layer / "etc")
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode), st.st_mtime_ns) == (
        7,
        8,
        0o750,
        2_000_000_000,
    )
    hosts = (layer / "etc" / "hosts").read_text()
    assert hosts.startswith("127.0.0.1\tlocalhost\n") and hosts.endswith("10.0.0.5\tdb\n")
    assert stat.S_IMODE(os.lstat(layer / "etc" / "hosts").st_mode) == 0o644
    assert stacked(layer, image) == (layer, image)
    assert stacked(None, (image,)) == (image,)
    # Layer trees: the topmost layer holding /etc decides; none at all gets a plain one.
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "etc").symlink_to("/etc")
    assert write_names_layer(tmp_path / "box2", (linked, image)) is None
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "box3").mkdir()
    layer = write_names_layer(tmp_path / "box3", empty)
    assert layer is not None and stat.S_IMODE(os.lstat(layer / "etc").st_mode) == 0o755


def test_hostnames_are_checked_as_a_hosts_file_and_the_kernel_take_them() -> None:
    assert parse_hostname(None) == parse_hostname("") == "lazyfs"
    assert parse_hostname("a" * 64) == "a" * 64  # the kernel's HOST_NAME_MAX
    for bad in ("a" * 65, "a b", "a\nb", "-a", "a.", ["a"]):
        with pytest.raises(BadInputError):
            parse_hostname(bad)


def test_extra_hosts_are_parsed_as_docker_takes_them() -> None:
    assert parse_extra_hosts(None) == ()
    assert parse_extra_hosts(["a:1.2.3.4", "b=::1", "c:[2001:db8::1]", "d:2001:db8::2"]) == (
        ExtraHost("a", "1.2.3.4"),
        ExtraHost("b", "::1"),
        ExtraHost("c", "2001:db8::1"),
        ExtraHost("d", "2001:db8::2"),
    )
    assert parse_extra_hosts(["gw:host-gateway"], network=True) == (ExtraHost("gw", "127.0.0.1"),)
    for bad in ("a:1.2.3.4", ["a b:1.2.3.4"], ["#x:1.2.3.4"], ["x:1.2.3"], [None]):
        with pytest.raises(BadInputError):
            parse_extra_hosts(bad)
