"""A sandbox's /etc/hosts and /etc/hostname (lazyfs/sandbox/names.py): localhost, its
own name and the extra hosts asked for resolve in every kind of sandbox, as under
Docker, and what the sandbox writes there stays its own."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from chunker.errors import BadInputError
from lazyfs.client import AgentError, Client
from lazyfs.sandbox.names import ExtraHost, parse_extra_hosts, stacked, write_names_layer
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
        pooled = c.create("py")
        assert pooled.info["from_pool"] and pooled.info["extra_hosts"] == []
        for box, name, address in ((named, "db", b"10.0.0.5"), (pooled, "localhost", b"::1")):
            r = box.exec(["getent", "hosts", name])
            assert r.exit_code == 0 and r.stdout.split()[0] == address, r
        for bad in (["db"], "db:1.2.3.4", ["x:host-gateway"], [1]):
            with pytest.raises(AgentError) as err:
                c.create("py", extra_hosts=bad)  # type: ignore[arg-type]
            assert err.value.status == 400 and "extra_hosts" in str(err.value), err.value
    agent.kill9()
    agent.start()
    with agent.client() as c:
        assert c.sandbox(named.id).info["extra_hosts"] == ["db:10.0.0.5"]
        assert c.sandbox(named.id).exec(["getent", "hosts", "db"]).exit_code == 0
        for box in (named, pooled):
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
    layer = write_names_layer(box, image, (ExtraHost("db", "10.0.0.5"),))
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
