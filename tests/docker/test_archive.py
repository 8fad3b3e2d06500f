"""The archive endpoints (PUT, GET and HEAD /containers/{id}/archive) through docker-py's
put_archive / get_archive and the docker CLI's `docker cp`, and hostile tars: each is
answered with Docker's error, nothing reaches the host, and the agent and the other
containers are still fine afterwards."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import socket
import subprocess
import tarfile
import time
import tracemalloc
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import docker
import pytest
import requests
from docker.errors import APIError, NotFound
from docker.models.containers import Container

from lazyfs.docker.tar_pack import pack
from testbed.agent import AgentProcess
from testbed.waiting import wait_for
from tests.security.probes import peak_rss

DOCKER = "/usr/bin/docker"  # Debian's docker.io client, as in test_docker_cli.py
MiB, GiB = 2**20, 2**30
Entry = tuple[str, str, bytes | str, int]  # (name, kind, data or link target, mode)


def make_tar(entries: list[Entry], compression: str = "", **extra: object) -> bytes:
    """A tar of (name, kind, data, mode): kind is file, dir, symlink, hardlink, chr, fifo.
    The entries are as root made them (uid 0), unless `extra` says otherwise."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode=f"w:{compression}", format=tarfile.PAX_FORMAT) as tar:
        for name, kind, data, mode in entries:
            info = tarfile.TarInfo(name)
            info.mode, info.mtime = mode, 1_700_000_000
            for key, value in extra.items():
                setattr(info, key, value)
            payload = None
            if kind == "file":
                assert isinstance(data, bytes)
                info.size, payload = len(data), io.BytesIO(data)
            elif kind in ("symlink", "hardlink"):
                assert isinstance(data, str)
                info.type = tarfile.SYMTYPE if kind == "symlink" else tarfile.LNKTYPE
                info.linkname = data
            else:
                info.type = {"dir": tarfile.DIRTYPE, "chr": tarfile.CHRTYPE}.get(
                    kind, tarfile.FIFOTYPE
                )
                info.devmajor, info.devminor = 1, 3  # /dev/null's, for the chr entry
            tar.addfile(info, payload)
    return out.getvalue()


def members(data: bytes) -> dict[str, tuple[tarfile.TarInfo, bytes | None]]:
    """A tar's entries by name: (header, contents of a regular file)."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return {
            m.name: (m, tar.extractfile(m).read() if m.isreg() else None)  # type: ignore[union-attr]
            for m in tar.getmembers()
        }


def fetched(stream: Iterator[bytes]) -> bytes:
    return b"".join(stream)


def sh(c: Container, script: str) -> bytes:
    r = c.exec_run(["sh", "-c", script])
    assert r.exit_code == 0, r.output
    return r.output


def refused(fn: Callable[[], object], status: int, words: str) -> str:
    with pytest.raises(APIError) as err:
        fn()
    assert err.value.status_code == status, err.value.explanation
    assert words in (err.value.explanation or ""), err.value.explanation
    return err.value.explanation or ""


@pytest.fixture
def box(dclient: docker.DockerClient) -> Container:
    return dclient.containers.run("py", ["sleep", "300"], detach=True)


@pytest.fixture
def bystander(dclient: docker.DockerClient) -> Container:
    """A container that nothing done to another one may disturb."""
    c = dclient.containers.run("py", ["sleep", "300"], detach=True)
    c.exec_run(["sh", "-c", "echo mine > /tmp/own"])
    return c


def still_fine_alone(dclient: docker.DockerClient, box: Container) -> None:
    """The agent answers, and the container runs commands and gives its files."""
    assert dclient.ping()
    assert sh(box, "echo fine") == b"fine\n"
    stream, _ = box.get_archive("/etc/hostname")
    assert members(fetched(stream))["hostname"][1] == b"lazyfs\n"


def still_fine(dclient: docker.DockerClient, bystander: Container, box: Container) -> None:
    """As still_fine_alone, and the bystander's files are as it left them."""
    still_fine_alone(dclient, box)
    assert sh(bystander, "cat /tmp/own; ls /tmp") == b"mine\nown\n"


@pytest.fixture
def docker_cli(docker_socket: Path) -> Callable[..., subprocess.CompletedProcess]:
    env = {**os.environ, "DOCKER_HOST": f"unix://{docker_socket}", "DOCKER_CONFIG": "/nonexistent"}

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run([DOCKER, *args], capture_output=True, env=env, timeout=120)
        if check:
            assert r.returncode == 0, (args, r.returncode, r.stdout, r.stderr)
        return r

    return run


# What works.


@pytest.mark.parametrize("compression", ["", "gz", "bz2", "xz"])
def test_put_archive_then_cat(box: Container, compression: str) -> None:
    data = make_tar([("hello.txt", "file", b"hello, sandbox\n", 0o644)], compression)
    assert box.put_archive("/tmp", data) is True
    assert sh(box, "cat /tmp/hello.txt") == b"hello, sandbox\n"
    assert sh(box, "stat -c '%a %u %g %Y' /tmp/hello.txt") == b"644 0 0 1700000000\n"


def test_get_archive_of_a_file(box: Container) -> None:
    box.put_archive("/tmp", make_tar([("f.sh", "file", b"#!/bin/sh\necho hi\n", 0o750)]))
    stream, st = box.get_archive("/tmp/f.sh")
    assert st["name"] == "f.sh" and st["size"] == 18 and st["mode"] == 0o750
    assert st["linkTarget"] == "" and st["mtime"] == "2023-11-14T22:13:20Z"
    got = members(fetched(stream))
    assert list(got) == ["f.sh"]
    info, content = got["f.sh"]
    assert content == b"#!/bin/sh\necho hi\n" and info.mode == 0o750 and info.isreg()


def test_get_archive_of_a_directory_round_trips(box: Container) -> None:
    tree = [
        ("tree", "dir", b"", 0o755),
        ("tree/a.txt", "file", b"a\n", 0o600),
        ("tree/sub", "dir", b"", 0o700),
        ("tree/sub/b.bin", "file", bytes(range(256)) * 1000, 0o755),
        ("tree/sub/empty", "file", b"", 0o444),
        ("tree/to-a", "symlink", "a.txt", 0o777),
        ("tree/to-etc", "symlink", "/etc", 0o777),
        ("tree/same-as-a", "hardlink", "tree/a.txt", 0o600),
    ]
    assert box.put_archive("/tmp", make_tar(tree)) is True
    assert sh(box, "cat /tmp/tree/to-a /tmp/tree/same-as-a") == b"a\na\n"
    assert sh(box, "stat -c %h /tmp/tree/a.txt") == b"2\n"
    stream, st = box.get_archive("/tmp/tree")
    assert st["name"] == "tree" and st["mode"] == (1 << 31) | 0o755
    got = members(fetched(stream))
    assert sorted(got) == sorted(name for name, *_ in tree)
    for name, kind, data, mode in tree:
        info, content = got[name]
        if kind == "symlink":
            assert info.issym() and info.linkname == data  # stored, not followed
            continue
        assert info.mode == mode, name
        if kind == "file":
            assert content == data, name
        elif kind == "hardlink":
            assert info.islnk() and info.linkname == "tree/a.txt"
    # Back in, elsewhere: the same tree.
    sh(box, "mkdir /tmp/again")
    stream, _ = box.get_archive("/tmp/tree")
    assert box.put_archive("/tmp/again", fetched(stream)) is True
    assert sh(box, "cd /tmp/again/tree && cat sub/b.bin | md5sum && readlink to-etc") == sh(
        box, "cd /tmp/tree && cat sub/b.bin | md5sum && readlink to-etc"
    )


def test_get_archive_of_a_symlink_and_of_dir_contents(box: Container) -> None:
    box.put_archive("/tmp", make_tar([("d/x", "file", b"x", 0o644), ("ln", "symlink", "d", 0)]))
    stream, st = box.get_archive("/tmp/ln")
    assert st["mode"] & (1 << 27) and st["linkTarget"] == "/tmp/d"
    assert members(fetched(stream))["ln"][0].issym()
    stream, st = box.get_archive("/tmp/ln/.")  # "/." : what the directory holds
    assert st["name"] == "." and st["mode"] & (1 << 31)
    assert members(fetched(stream))["./x"][1] == b"x"


def test_head_archive_answers_the_stat_alone(dclient: docker.DockerClient, box: Container) -> None:
    api = dclient.api
    r = api.head(api._url("/containers/{0}/archive", box.id), params={"path": "/tmp"})
    assert r.status_code == 200 and r.content == b""
    st = json.loads(base64.b64decode(r.headers["X-Docker-Container-Path-Stat"]))
    assert st["name"] == "tmp" and st["mode"] & (1 << 31) and st["mode"] & 0o777 == 0o777
    r = api.head(api._url("/containers/{0}/archive", box.id), params={"path": "/nope"})
    assert r.status_code == 404


def test_docker_cp_both_ways(
    docker_cli: Callable[..., subprocess.CompletedProcess], box: Container, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    (src / "deep").mkdir(parents=True)
    (src / "top.txt").write_bytes(b"top\n")
    (src / "deep" / "run.sh").write_bytes(b"#!/bin/sh\n")
    (src / "deep" / "run.sh").chmod(0o755)
    (tmp_path / "one.txt").write_bytes(b"one file\n")
    docker_cli("cp", str(tmp_path / "one.txt"), f"{box.id}:/tmp/")
    docker_cli("cp", str(tmp_path / "one.txt"), f"{box.id}:/tmp/renamed.txt")
    docker_cli("cp", str(src), f"{box.id}:/tmp/copied")
    assert sh(box, "cat /tmp/one.txt /tmp/renamed.txt /tmp/copied/top.txt") == (
        b"one file\none file\ntop\n"
    )
    assert sh(box, "stat -c %a /tmp/copied/deep/run.sh") == b"755\n"
    out = tmp_path / "out"
    docker_cli("cp", f"{box.id}:/tmp/copied", str(out))
    assert (out / "top.txt").read_bytes() == b"top\n"
    assert (out / "deep" / "run.sh").stat().st_mode & 0o777 == 0o755
    docker_cli("cp", f"{box.id}:/tmp/one.txt", str(tmp_path / "back.txt"))
    assert (tmp_path / "back.txt").read_bytes() == b"one file\n"
    r = docker_cli("cp", f"{box.id}:/tmp/nope", str(tmp_path / "x"), check=False)
    # The CLI words a 404 of its own: "No such container:path: ID:/tmp/nope".
    assert r.returncode != 0 and b"No such container:path" in r.stderr


def test_swe_bench_style_put_then_read_back(box: Container) -> None:
    """What SWE-bench's harness does: mkdir -p the parent, put_archive a patch there,
    then read it in the container (and back through get_archive)."""
    patch = b"diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n+b\n"
    sh(box, "mkdir -p /testbed/eval")
    box.put_archive("/testbed/eval", make_tar([("patch.diff", "file", patch, 0o644)]))
    assert sh(box, "cat /testbed/eval/patch.diff") == patch
    stream, st = box.get_archive("/testbed/eval/patch.diff")
    assert st["size"] == len(patch) and members(fetched(stream))["patch.diff"][1] == patch


def test_copy_in_and_out_of_an_exited_container(dclient: docker.DockerClient) -> None:
    """The sandbox outlives the container's command: `docker cp` out of a finished run
    (a harness fetching its results) works, and into it too."""
    c = dclient.containers.run("py", ["sh", "-c", "echo result > /tmp/out.txt"], detach=True)
    assert c.wait()["StatusCode"] == 0
    stream, st = c.get_archive("/tmp/out.txt")
    assert st["size"] == 7 and members(fetched(stream))["out.txt"][1] == b"result\n"
    assert c.put_archive("/tmp", make_tar([("in.txt", "file", b"in", 0o644)])) is True
    assert members(fetched(c.get_archive("/tmp/in.txt")[0]))["in.txt"][1] == b"in"


def test_files_belong_to_root_or_to_the_sandbox_user(box: Container) -> None:
    """Entries the tar gives to root stay root's; others are the sandbox's user's (the
    test image's user is root, so both are root here: the rule is that no other uid is
    ever taken from a tar)."""
    box.put_archive("/tmp", make_tar([("u.txt", "file", b"u", 0o644)], uid=4242, gid=4343))
    assert sh(box, "stat -c '%u %g' /tmp/u.txt") == sh(box, "echo $(id -u) $(id -g)")


# Missing things.


def test_a_refused_put_is_answered_whatever_its_body(
    dclient: docker.DockerClient, box: Container
) -> None:
    """A streamed PUT refused before its body is read (no such container, no such path)
    is answered with its error, not a reset: closing a connection with the body unread
    made the kernel reset it, and the client, still sending or not yet reading, got
    ConnectionError one time in a few (seen in a suite run)."""
    api = dclient.api
    for size in (10 * 2**10, 200 * 2**10, 2 * MiB):
        data = make_tar([("f", "file", os.urandom(size), 0o644)])
        for _ in range(20):
            with pytest.raises(NotFound):
                api.put_archive("nosuch", "/tmp", data)
            refused(lambda d=data: box.put_archive("/nope", d), 404, "Could not find the file")


def test_an_answer_before_the_body_is_read_says_the_connection_closes(
    docker_socket: Path,
) -> None:
    """A PUT archive refused before its body is read is answered, then its connection
    closes; the answer must say so, or a client sends its next request on it and reads a
    reset (a suite run: docker-py's GET after such a PUT, ConnectionResetError)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(15)
        s.connect(str(docker_socket))
        head = "PUT /containers/nosuch/archive?path=/tmp HTTP/1.1\r\nHost: d\r\n"
        s.sendall(f"{head}Content-Length: 100000\r\n\r\n".encode() + b"x" * 1000)
        answer = b""
        while b"\r\n\r\n" not in answer:
            more = s.recv(65536)
            assert more, answer
            answer += more
    status, *lines = answer.split(b"\r\n\r\n")[0].decode().split("\r\n")
    assert status.startswith("HTTP/1.1 404")
    assert "connection: close" in [line.lower() for line in lines], lines


def test_missing_container_and_missing_path(dclient: docker.DockerClient, box: Container) -> None:
    api = dclient.api
    data = make_tar([("f", "file", b"f", 0o644)])
    for call in (
        lambda: api.put_archive("nosuch", "/tmp", data),
        lambda: api.get_archive("nosuch", "/tmp"),
    ):
        with pytest.raises(NotFound) as err:
            call()
        assert "No such container: nosuch" in err.value.explanation
    words = f"Could not find the file /nope in container {box.id}"
    refused(lambda: box.put_archive("/nope", data), 404, words)
    refused(lambda: box.get_archive("/nope"), 404, words)
    refused(lambda: box.get_archive("/etc/passwd/x"), 404, "Could not find the file")
    refused(lambda: box.put_archive("/etc/passwd", data), 400, "not a directory")
    refused(lambda: api.put_archive(box.id, "", data), 400, "Path cannot be empty")


# Hostile tars.


def host_has_no(*paths: str) -> None:
    for path in paths:
        assert not os.path.lexists(path), f"{path} was written on the host"


def test_dot_dot_entry_is_refused(
    dclient: docker.DockerClient, box: Container, bystander: Container
) -> None:
    for name in ("../../etc/evil", "a/../../../etc/evil", ".."):
        data = make_tar([("ok.txt", "file", b"ok", 0o644), (name, "file", b"evil", 0o644)])
        refused(lambda d=data: box.put_archive("/tmp", d), 400, "outside of")
    assert sh(box, "ls /tmp; ls /etc/evil 2>/dev/null || echo none") == b"none\n"  # nothing
    host_has_no("/etc/evil")
    still_fine(dclient, bystander, box)


def test_absolute_entry_lands_inside_the_destination(
    dclient: docker.DockerClient, box: Container, bystander: Container
) -> None:
    data = make_tar([("/etc/evil", "file", b"evil", 0o644), ("//../../x", "file", b"x", 0o644)])
    assert box.put_archive("/tmp", data) is True
    assert sh(box, "cat /tmp/etc/evil /tmp/x") == b"evilx"
    assert sh(box, "ls /etc/evil 2>/dev/null || echo none") == b"none\n"
    host_has_no("/etc/evil", "/x", "/tmp/x", "/tmp/etc/evil")
    still_fine(dclient, bystander, box)


def test_symlink_then_entry_through_it_stays_in_the_sandbox(
    dclient: docker.DockerClient, box: Container, bystander: Container
) -> None:
    data = make_tar(
        [
            ("link", "symlink", "/etc", 0o777),
            ("link/evil", "file", b"in the sandbox's /etc\n", 0o644),
            ("up", "symlink", "../../../../../../../..", 0o777),
            ("up/evil2", "file", b"at the sandbox's root\n", 0o644),
            ("up/etc/evil3", "file", b"in /etc again\n", 0o644),
        ]
    )
    assert box.put_archive("/tmp", data) is True
    assert sh(box, "readlink /tmp/link /tmp/up") == b"/etc\n../../../../../../../..\n"
    assert sh(box, "cat /etc/evil /evil2 /etc/evil3") == (
        b"in the sandbox's /etc\nat the sandbox's root\nin /etc again\n"
    )
    host_has_no("/etc/evil", "/evil2", "/etc/evil3")
    assert sh(bystander, "ls /etc/evil /evil2 2>/dev/null || echo none") == b"none\n"
    still_fine(dclient, bystander, box)


def test_hard_link_outside_the_archive_is_refused(
    dclient: docker.DockerClient, box: Container, bystander: Container
) -> None:
    for target, why in [
        ("/etc/passwd", "only a file earlier in the same archive"),
        ("etc/passwd", "only a file earlier in the same archive"),
        ("missing", "only a file earlier in the same archive"),
        ("../../etc/passwd", "outside of"),
    ]:
        data = make_tar([("pw", "hardlink", target, 0o644)])
        refused(lambda d=data: box.put_archive("/tmp", d), 400, why)
    # Through a symlink the same tar made: the target is looked up with the destination
    # as the root, where "/etc" is /tmp/etc, the link itself: a loop, refused.
    data = make_tar(
        [
            ("etc", "symlink", "/etc", 0o777),
            ("etc/passwd", "file", b"x", 0o644),  # lands in the sandbox's /etc
            ("pw", "hardlink", "etc/passwd", 0o644),
        ]
    )
    refused(lambda: box.put_archive("/tmp", data), 400, "symbolic links")
    host_passwd = Path("/etc/passwd").read_bytes()
    assert b"root:" in host_passwd and os.stat("/etc/passwd").st_nlink == 1
    assert sh(box, "ls /tmp/pw 2>/dev/null || echo none") == b"none\n"
    still_fine(dclient, bystander, box)


@pytest.mark.parametrize("kind", ["chr", "fifo"])
def test_device_and_fifo_entries_are_refused(
    dclient: docker.DockerClient, box: Container, bystander: Container, kind: str
) -> None:
    data = make_tar([("before", "file", b"b", 0o644), ("node", kind, b"", 0o666)], "gz")
    refused(lambda: box.put_archive("/tmp", data), 400, "cannot be made in a sandbox")
    assert sh(box, "ls /tmp") == b""  # checked whole before anything was written
    still_fine(dclient, bystander, box)


def test_setuid_and_setgid_bits_are_dropped(box: Container) -> None:
    data = make_tar(
        [
            ("suid", "file", b"#!/bin/sh\n", 0o4755),
            ("sgid", "file", b"#!/bin/sh\n", 0o2711),
            ("sdir", "dir", b"", 0o3777),
        ]
    )
    assert box.put_archive("/tmp", data) is True
    assert sh(box, "stat -c '%n %a' /tmp/suid /tmp/sgid /tmp/sdir") == (
        b"/tmp/suid 755\n/tmp/sgid 711\n/tmp/sdir 1777\n"
    )


def test_oversized_tars_are_refused(
    dclient: docker.DockerClient, box: Container, bystander: Container
) -> None:
    # A PAX header of 2 MiB (tarfile would read it whole), compressed to a few KiB.
    info = tarfile.TarInfo("x")
    info.pax_headers = {"comment": "a" * 2 * MiB}
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(info, io.BytesIO(b""))
    refused(lambda: box.put_archive("/tmp", out.getvalue()), 400, "a tar header over")
    # A header that says 2 GiB (the data is not there: refused before it is looked for).
    big = tarfile.TarInfo("big")
    big.size = 2 * GiB
    refused(lambda: box.put_archive("/tmp", big.tobuf(tarfile.GNU_FORMAT)), 413, "more than")
    # Not a tar at all, and a gzip that breaks off.
    refused(lambda: box.put_archive("/tmp", b"not a tar" * 100), 400, "not a valid tar")
    good = make_tar([("f", "file", os.urandom(4096), 0o644)], "gz")
    refused(lambda: box.put_archive("/tmp", good[: len(good) // 2]), 400, "")
    assert sh(box, "ls /tmp") == b""
    still_fine(dclient, bystander, box)


def _answer_to(docker_socket: Path, head: str, size: int) -> bytes:
    """The status line and headers the agent answers a request of `head` whose body is
    `size` zero bytes (sent until the agent closes the connection)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(docker_socket))
        s.sendall(f"{head}\r\nHost: docker\r\nContent-Length: {size}\r\n\r\n".encode())
        chunk, sent = bytes(MiB), 0
        s.settimeout(30)
        try:
            while sent < size:
                sent += s.send(chunk[: size - sent])
        except OSError:
            pass  # closed by the server after its answer: the answer is still there
        answer = b""
        deadline = time.monotonic() + 30
        while b"\r\n\r\n" not in answer and time.monotonic() < deadline:
            try:
                more = s.recv(65536)
            except OSError:
                break
            if not more:
                break
            answer += more
    return answer


def test_bodies_over_their_limits_are_413(
    dclient: docker.DockerClient, docker_socket: Path, box: Container, bystander: Container
) -> None:
    """A JSON body over http.MAX_BODY (64 MiB) is answered 413 once that much has come;
    an archive whose Content-Length is over archive.MAX_STREAM (2 GiB) at once. The
    rest is not read: the connection is closed after the answer."""
    create = "POST /containers/create HTTP/1.1\r\nContent-Type: application/json"
    assert _answer_to(docker_socket, create, 64 * MiB + 1).startswith(b"HTTP/1.1 413")
    put = f"PUT /containers/{box.id}/archive?path=/tmp HTTP/1.1\r\nContent-Type: application/x-tar"
    t0 = time.monotonic()
    answer = _answer_to(docker_socket, put, 3 * GiB)
    assert answer.startswith(b"HTTP/1.1 413") and time.monotonic() - t0 < 10, answer[:200]
    assert sh(box, "ls /tmp") == b""
    still_fine(dclient, bystander, box)


def test_a_big_archive_comes_in_pieces(
    dclient: docker.DockerClient, docker_agent: AgentProcess, box: Container
) -> None:
    """A PUT's body is spooled as it comes (8 MiB in memory, the rest on disk), not read
    whole: an archive over the old 64 MiB cap unpacks, and costs the agent pieces."""
    data = os.urandom(MiB)
    entries: list[Entry] = [(f"f{i}", "file", data, 0o644) for i in range(96)]
    archive = make_tar(entries)
    with peak_rss(docker_agent.proc.pid) as rise:
        assert box.put_archive("/tmp", archive) is True
        assert rise() < 40 * MiB
    listing = sh(box, "ls /tmp | wc -l; cat /tmp/f0 /tmp/f95 | md5sum")
    assert listing.split() == [b"96", hashlib.md5(data * 2).hexdigest().encode(), b"-"]
    still_fine_alone(dclient, box)


def test_what_the_sandbox_made_is_stored_not_opened(box: Container) -> None:
    """A FIFO in the sandbox is a header in the tar (opening it would block), a link is
    a link."""
    sh(box, "mkdir /tmp/d && mkfifo /tmp/d/pipe && ln -s /etc/shadow /tmp/d/ln")
    stream, _ = box.get_archive("/tmp/d")
    got = members(fetched(stream))
    assert got["d/pipe"][0].isfifo() and got["d/ln"][0].linkname == "/etc/shadow"


class _Unread(io.RawIOBase):
    """An iterator of bytes as a file, for tarfile's stream mode."""

    def __init__(self, pieces: Iterator[bytes]) -> None:
        self.pieces, self.left = pieces, b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        if not self.left:
            self.left = next(self.pieces, b"")
        n = min(len(buffer), len(self.left))
        buffer[:n], self.left = self.left[:n], self.left[n:]
        return n


def _copied_out(box: Container, path: str) -> tuple[str, int, bytes]:
    """get_archive of one file, read as it comes: (its name, size, last 16 bytes)."""
    stream, _ = box.get_archive(path, chunk_size=MiB)
    with tarfile.open(fileobj=io.BufferedReader(_Unread(iter(stream))), mode="r|") as tar:
        member = next(iter(tar))
        source = tar.extractfile(member)
        assert source is not None
        size, tail = 0, b""
        while piece := source.read(MiB):
            size, tail = size + len(piece), (tail + piece)[-16:]
        return member.name, size, tail


def test_a_big_file_is_streamed_not_held(
    dclient: docker.DockerClient, docker_agent: AgentProcess, box: Container
) -> None:
    """A GET's tar is sent as it is made. It was held whole: a sparse file of 1000 MB
    (28 kB of the sandbox's disk) took the agent's memory to 1.07 GB per GET, 3.1 GB
    with three at once, none of it the sandbox's. Now three at once of that file come
    whole and cost the agent pieces."""
    sh(box, "truncate -s 1000M /tmp/sparse && printf 'the end' >> /tmp/sparse")
    with peak_rss(docker_agent.proc.pid) as rise, ThreadPoolExecutor(3) as pool:
        copies = list(pool.map(lambda _: _copied_out(box, "/tmp/sparse"), range(3)))
        assert copies == [("sparse", 1000 * MiB + 7, b"\0" * 9 + b"the end")] * 3
        assert rise() < 50 * MiB
    still_fine_alone(dclient, box)


def test_an_error_after_the_headers_cuts_the_answer_short(
    dclient: docker.DockerClient,
    box: Container,
    docker_cli: Callable[..., subprocess.CompletedProcess],
) -> None:
    """Once a GET's headers are out, an error (here a tree deeper than the walk goes)
    can only break the answer off: docker-py and the docker CLI see a body cut short,
    never a tar that ends as if it were whole."""
    sh(box, "mkdir -p /tmp/deep/" + "/".join(["d"] * 300) + " && echo x > /tmp/deep/first")
    stream, _ = box.get_archive("/tmp/deep")
    with pytest.raises(requests.exceptions.ChunkedEncodingError):
        fetched(stream)
    r = docker_cli("cp", f"{box.id}:/tmp/deep", "-", check=False)
    assert r.returncode != 0 and b"unexpected EOF" in r.stderr, r.stderr
    still_fine_alone(dclient, box)


DEEP_LINKS = r"""
import os, sys
levels, links, pairs = map(int, sys.argv[1:])
os.makedirs("/tmp/bomb"); os.chdir("/tmp/bomb")
for _ in range(levels):
    os.mkdir("d" * 250); os.chdir("d" * 250)
open("f", "w").write("x")
for i in range(links):
    os.link("f", "l%d" % i)
for i in range(pairs):
    open("p%d" % i, "w").write(str(i))
    os.link("p%d" % i, "q%d" % i)
"""


def _entries(stream: Iterator[bytes]) -> Iterator[tuple[str, bytes, str, bytes | None]]:
    """A tar read as it comes, each header let go once read (tarfile keeps them all):
    (name, type, link name, a regular file's contents)."""
    with tarfile.open(fileobj=io.BufferedReader(_Unread(iter(stream))), mode="r|") as tar:
        for m in tar:
            source = tar.extractfile(m) if m.isreg() else None
            yield m.name, m.type, m.linkname, source.read() if source else None
            tar.members.clear()


def test_a_deep_tree_of_hard_links_costs_the_agent_pieces(
    dclient: docker.DockerClient, docker_agent: AgentProcess, box: Container
) -> None:
    """Session 57: a GET's tar was written through tarfile.TarFile, which keeps every
    header it wrote, and every hard-linked file's first name was kept: 100 levels of
    250-byte names and 12,000 links of one 1-byte file (4 kB of the sandbox's disk) took
    the agent's peak RSS up 303 MiB. Here 3,000 links of one file and 1,000 files of two
    names each, under the same 25 KB path: the tar is right (each file once, its other
    names links to it while the link map has room, then stored again whole: tar_pack.
    LINKED), and it costs the agent pieces and the link map, not its headers (~150 MiB
    on the code before)."""
    r = box.exec_run(["python3", "-c", DEEP_LINKS, "100", "3000", "1000"])
    assert r.exit_code == 0, r.output
    deep = "/".join(["bomb"] + ["d" * 250] * 100)
    dirs, files, links = 0, {}, {}
    with peak_rss(docker_agent.proc.pid) as rise:
        stream, _ = box.get_archive("/tmp/bomb", chunk_size=MiB)
        for name, kind, link, data in _entries(stream):
            if kind == tarfile.DIRTYPE:
                dirs += 1
                continue
            parent, base = name.rsplit("/", 1)
            assert parent == deep, parent[:300]
            if kind == tarfile.LNKTYPE:
                assert link.rsplit("/", 1)[0] == deep
                links[base] = link.rsplit("/", 1)[1]
            else:
                assert kind == tarfile.REGTYPE, (base, kind)
                files[base] = data
        grew = rise()
    print(f"agent peak +{grew / MiB:.1f} MiB")
    assert grew < 24 * MiB
    assert dirs == 101
    # One file of 3,001 names: stored once, every other name a link to it.
    assert files["f"] == b"x" and {links.get(f"l{i}") for i in range(3000)} == {"f"}
    # Two names each: the first stored, the second a link to it or, once the link map
    # is full (~330 names of 25 KB), the file again.
    linked = 0
    for i in range(1000):
        assert files[f"p{i}"] == str(i).encode()
        if f"q{i}" in links:
            assert links[f"q{i}"] == f"p{i}" and f"q{i}" not in files
            linked += 1
        else:
            assert files[f"q{i}"] == str(i).encode()
    assert 200 < linked < 500, linked
    assert len(files) + len(links) == 5001
    still_fine_alone(dclient, box)


def _packed(root: Path, path: str, out: Path) -> None:
    """tar_pack.pack of `path` in `root` (a directory as a sandbox's rootfs) into `out`."""
    with out.open("wb") as f:
        pack(root, path, lambda piece: f.write(piece) if isinstance(piece, bytes) else None)


def test_a_tar_is_written_as_tarfile_writes_it(tmp_path: Path) -> None:
    """The tar is written without tarfile.TarFile (which keeps every header it wrote),
    byte for byte as TarFile writes the same entries, each directory's names sorted as
    dockerd's walk sorts them; it extracts to the same tree."""
    tree = tmp_path / "root" / "tree"
    (tree / "sub" / ("n" * 150)).mkdir(parents=True)
    (tree / "a").write_bytes(b"a\n")
    os.link(tree / "a", tree / "sub" / "same-as-a")
    (tree / "sub" / "rand").write_bytes(os.urandom(300_000))
    (tree / "sub" / ("n" * 150) / "deep").write_bytes(b"deep")
    (tree / "to-a").symlink_to("a")
    (tree / "empty").touch()
    os.mkfifo(tree / "fifo")
    _packed(tmp_path / "root", "/tree", tmp_path / "out.tar")
    data = (tmp_path / "out.tar").read_bytes()
    with tarfile.open(fileobj=io.BytesIO(data)) as src:
        entries = src.getmembers()
        again = io.BytesIO()
        with tarfile.open(fileobj=again, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for m in entries:
                tar.addfile(m, src.extractfile(m) if m.isreg() else None)
        assert again.getvalue() == data
        src.extractall(tmp_path / "out")
    assert [m.name for m in entries] == [
        "tree",
        *("tree/a", "tree/empty", "tree/fifo", "tree/sub"),
        *(f"tree/sub/{'n' * 150}", f"tree/sub/{'n' * 150}/deep"),
        *("tree/sub/rand", "tree/sub/same-as-a", "tree/to-a"),
    ]
    out = tmp_path / "out" / "tree"
    for name in ("a", "empty", "sub/rand", f"sub/{'n' * 150}/deep", "sub/same-as-a"):
        assert (out / name).read_bytes() == (tree / name).read_bytes(), name
    assert os.path.samefile(out / "a", out / "sub" / "same-as-a")
    assert os.readlink(out / "to-a") == "a" and (out / "fifo").is_fifo()


def test_a_big_directory_is_written_as_it_is_read_not_held(tmp_path: Path) -> None:
    """A directory's names were listed whole and sorted before the first was written,
    on every level of the walk, and each header kept after it: 30,000 200-byte names
    (links of one file) held ~30 MB here. Now a directory too big to sort within the
    walk's budget (tar_pack.HELD) is written in the order it is read."""
    d = tmp_path / "root" / "d"
    d.mkdir(parents=True)
    (d / "0").write_text("x")
    for i in range(1, 30_000):
        os.link(d / "0", d / f"{i:0200d}")
    tracemalloc.start()
    try:
        _packed(tmp_path / "root", "/d", tmp_path / "out.tar")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * MiB, peak
    with tarfile.open(tmp_path / "out.tar") as tar:
        entries = tar.getmembers()
    assert len(entries) == 30_001 and entries[0].name == "d"
    assert {m.name for m in entries[1:]} == {f"d/{n}" for n in os.listdir(d)}
    (first,) = [m for m in entries if m.isreg()]
    assert all(m.islnk() and m.linkname == first.name for m in entries[1:] if m is not first)


def test_directory_and_file_do_not_replace_each_other(box: Container) -> None:
    sh(box, "mkdir -p /tmp/dir/inner && echo keep > /tmp/dir/inner/k && echo f > /tmp/file")
    refused(
        lambda: box.put_archive("/tmp", make_tar([("dir", "file", b"x", 0o644)])),
        400,
        "cannot overwrite directory",
    )
    refused(
        lambda: box.put_archive("/tmp", make_tar([("file", "dir", b"", 0o755)])),
        400,
        "cannot overwrite non-directory",
    )
    refused(
        lambda: box.put_archive("/tmp", make_tar([("file/x", "file", b"x", 0o644)])),
        400,
        "Not a directory",
    )
    assert sh(box, "cat /tmp/dir/inner/k /tmp/file") == b"keep\nf\n"
    # A file over a file, a link over a file: replaced, as dockerd does.
    data = make_tar([("file", "file", b"new\n", 0o600), ("dir/inner/k", "symlink", "/x", 0)])
    assert box.put_archive("/tmp", data) is True
    assert sh(box, "cat /tmp/file; readlink /tmp/dir/inner/k") == b"new\n/x\n"


def test_a_container_removed_while_its_tar_is_read(
    dclient: docker.DockerClient, box: Container, docker_agent: AgentProcess
) -> None:
    """A GET holds the sandbox's root open while its client reads: removing the
    container meanwhile is not held up, the rest of the answer is whole or cut short
    (never a tar that ends early as if whole), and nothing of the sandbox is left."""
    sh(box, "truncate -s 300M /tmp/sparse")
    stream, _ = box.get_archive("/tmp/sparse", chunk_size=MiB)
    first = next(iter(stream))
    t0 = time.monotonic()
    box.remove(force=True)
    assert time.monotonic() - t0 < 10
    try:
        rest = sum(len(piece) for piece in stream)
    except requests.exceptions.ChunkedEncodingError:
        pass  # cut short: the client knows
    else:
        assert len(first) + rest >= 300 * MiB + 2 * 512, rest
    assert box.id not in [c.id for c in dclient.containers.list(all=True)]

    def sandbox_left() -> dict[str, list]:
        """What the node holds but the image's trees and the data daemon, which it keeps
        while its agent runs: the sandbox's writable layer, mounts and cgroups."""
        left = docker_agent.node.leftovers()
        left.pop("processes", None)
        left["mounts"] = [m for m in left.get("mounts", []) if "/run/" not in m]
        return {k: v for k, v in left.items() if v}

    wait_for(lambda: not sandbox_left(), 30, "the sandbox's clean-up")
