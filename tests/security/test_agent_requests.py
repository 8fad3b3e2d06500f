"""Issue 20, findings 7 and 8: what reaches the agent, and what a request leaves behind.

- TLS on the TCP listener (`lazyfs serve --listen --tls-cert --tls-key`): a client that
  does not trust the certificate is refused, one given the CA works; plain HTTP to the
  port gets no answer; the bearer token never crosses the wire in clear (the test puts
  a recording proxy between client and agent); a non-loopback --listen without TLS is
  one error line and exit 2.
- A create whose client goes away is undone: a raw client sends POST /sandboxes and
  hangs up at several points of a slow (cold) create; afterwards the agent has no
  sandbox, the node no sandbox directory, and a --max-sandboxes 1 agent still has room.
- An agent-wide default TTL: a sandbox whose client set no ttl expires after
  --default-ttl and is deleted then.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lazyfs.client import AgentError, Client
from lazyfs.client.aio import AsyncClient
from testbed.agent import AgentProcess
from testbed.node import LAZYFS

TOKEN = "tls-test-token-0123456789abcdef"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, made with the openssl command."""
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"]
        + ["-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1"]
        + ["-subj", "/CN=lazyfs-test", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )
    return cert, key


def _token_file(tmp: Path) -> Path:
    path = tmp / "token"
    path.write_text(TOKEN + "\n")
    return path


@pytest.fixture
def tls_agent(agent: AgentProcess, tmp_path: Path) -> tuple[AgentProcess, int, Path]:
    """The agent serving TCP with TLS on 127.0.0.1: (agent, port, the certificate)."""
    cert, key = _self_signed(tmp_path)
    port = _free_port()
    agent.start(
        "--listen",
        f"127.0.0.1:{port}",
        "--token-file",
        str(_token_file(tmp_path)),
        "--tls-cert",
        str(cert),
        "--tls-key",
        str(key),
    )
    return agent, port, cert


@contextlib.contextmanager
def recording_proxy(port: int) -> Iterator[tuple[int, bytearray]]:
    """A TCP proxy on 127.0.0.1 to `port` that keeps every byte the client sent:
    (its port, those bytes)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    sent = bytearray()
    stop = threading.Event()

    def pump(client: socket.socket) -> None:
        with client, socket.create_connection(("127.0.0.1", port)) as upstream:
            ends = {client: upstream, upstream: client}
            while not stop.is_set():
                for s in select.select(list(ends), [], [], 0.1)[0]:
                    data = s.recv(65536)
                    if not data:
                        return
                    if s is client:
                        sent.extend(data)
                    ends[s].sendall(data)

    def accept() -> None:
        while not stop.is_set():
            if select.select([listener], [], [], 0.1)[0]:
                threading.Thread(target=pump, args=(listener.accept()[0],), daemon=True).start()

    thread = threading.Thread(target=accept)
    thread.start()
    try:
        yield listener.getsockname()[1], sent
    finally:
        stop.set()
        thread.join()
        listener.close()


# ------------------------------------------------------------------ TLS


def test_tls_client_must_trust_the_certificate(tls_agent: tuple[AgentProcess, int, Path]) -> None:
    _, port, cert = tls_agent
    url = f"https://127.0.0.1:{port}"
    with Client(url=url, token=TOKEN) as c, pytest.raises(AgentError, match="TLS"):
        c.health()  # the system's CAs do not know a self-signed certificate
    with Client(url=url, token=TOKEN, verify=cert) as c:
        assert c.health()["status"] == "ok"
        with c.create("py") as sb:
            assert sb.exec(["echo", "over tls"]).stdout == b"over tls\n"

    async def use_async() -> str:
        async with AsyncClient(url=url, token=TOKEN) as c:
            with pytest.raises(AgentError, match="TLS"):
                await c.health()
        async with AsyncClient(url=url, token=TOKEN, verify=cert) as c:
            return (await c.health())["status"]

    assert asyncio.run(use_async()) == "ok"


def test_plain_http_to_the_tls_port_gets_no_answer(
    tls_agent: tuple[AgentProcess, int, Path],
) -> None:
    _, port, _ = tls_agent
    with Client(url=f"http://127.0.0.1:{port}", token=TOKEN) as c, pytest.raises(AgentError):
        c.health()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"GET /health HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode())
        answer = s.recv(1000)
    assert not answer.startswith(b"HTTP/"), answer


def test_the_token_never_crosses_the_wire_in_clear(
    tls_agent: tuple[AgentProcess, int, Path],
) -> None:
    _, port, cert = tls_agent
    with (
        recording_proxy(port) as (proxy, sent),
        Client(url=f"https://127.0.0.1:{proxy}", token=TOKEN, verify=cert) as c,
    ):
        assert c.health()["status"] == "ok"
        assert c.list() == []
    assert sent[:1] == b"\x16", bytes(sent[:16])  # a TLS handshake record
    assert TOKEN.encode() not in sent and b"Bearer" not in sent and b"/health" not in sent


def _serve(agent: AgentProcess, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`lazyfs serve ARGS` on a socket of its own, which must end by itself."""
    argv = [LAZYFS, "serve", "--socket", str(tmp / "refused.sock"), *args]
    proc = subprocess.Popen(
        argv, env=agent.node.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
        raise AssertionError(f"`{' '.join(args)}` served instead of refusing: {err}") from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def test_plain_tcp_off_loopback_is_refused(agent: AgentProcess, tmp_path: Path) -> None:
    token = str(_token_file(tmp_path))
    for address in (f"0.0.0.0:{_free_port()}", f"[::]:{_free_port()}"):
        refused = _serve(agent, tmp_path, "--listen", address, "--token-file", token)
        assert refused.returncode == 2, refused.stderr
        lines = refused.stderr.strip().splitlines()
        assert len(lines) == 1 and "--tls-cert" in lines[0], refused.stderr
    cert, _ = _self_signed(tmp_path)
    half = _serve(agent, tmp_path, "--listen", "127.0.0.1:1", "--token-file", token, "--tls-cert")
    assert half.returncode == 2
    alone = _serve(
        agent, tmp_path, "--listen", "127.0.0.1:1", "--token-file", token, "--tls-cert", str(cert)
    )
    assert alone.returncode == 2 and "--tls-key" in alone.stderr, alone.stderr


# ------------------------------------------------------------------ a create's client leaves


def _post_and_hang_up(socket_path: Path, after: float) -> None:
    body = json.dumps({"image": "py"}).encode()
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(socket_path))
        s.sendall(
            b"POST /sandboxes HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        time.sleep(after)


def _node_sandboxes(agent: AgentProcess) -> list[str]:
    return sorted(p.name for p in agent.node.sandboxes.glob("lazyfs-*"))


def _settled_empty(agent: AgentProcess, client: Client, timeout: float = 30) -> bool:
    """Whether the agent and the node hold no sandbox, once every create that was in
    progress had time to end (a create with the slow runtime below takes ~2.2 s)."""
    time.sleep(SLOW_RUN + 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not client.list() and not _node_sandboxes(agent):
            return True
        time.sleep(0.2)
    return False


# A runtime whose `run` takes SLOW_RUN seconds more: half before runc makes the
# container, half after, so that hang-ups land at known points of the runtime's work
# (here a cold create is ~0.1 s, too short to aim at).
SLOW_RUN = 2.0
RUNC = shutil.which("runc")
SLOW_RUNTIME = f"""#!/bin/sh
case " $* " in
*" run "*) sleep {SLOW_RUN / 2}; "{RUNC}" "$@"; rc=$?; sleep {SLOW_RUN / 2}; exit $rc;;
esac
exec "{RUNC}" "$@"
"""
# Seconds after the request when the client hangs up: in the image lookup and tree
# mount, in the runtime's thread before runc runs, and once runc made the container but
# before the thread returns.
HANG_UPS = (0.01, SLOW_RUN * 0.3, SLOW_RUN * 0.8)


def test_a_create_whose_client_leaves_is_undone(agent: AgentProcess, tmp_path: Path) -> None:
    runtime = tmp_path / "slow-runc"
    runtime.write_text(SLOW_RUNTIME)
    runtime.chmod(0o755)
    agent.start("--max-sandboxes", "1", "--runtime", str(runtime))
    with agent.client() as c:
        for after in HANG_UPS:
            _post_and_hang_up(agent.socket, after)
            assert _settled_empty(agent, c), (after, c.list(), _node_sandboxes(agent))
            assert c.health()["sandboxes"] == 0
        # The capacity came back: the one slot is free for a create that stays.
        with c.create("py") as sb:
            assert sb.exec(["true"]).exit_code == 0
    # The hang-ups during the runtime's work waited for it, then deleted what it made
    # (the first may come before or during it, as the machine goes).
    assert agent.log().count("its client hung up during the create; deleting it") >= 2, agent.log()


# ------------------------------------------------------------------ default TTL


def test_a_sandbox_without_ttl_gets_the_default_ttl(agent: AgentProcess) -> None:
    agent.start()
    with agent.client() as c, c.create("py") as sb:
        view = _view(c, sb.id)
        assert view["expires"] == pytest.approx(view["created"] + 3600, abs=5)
    agent.stop()
    agent.start("--default-ttl", "1")
    with agent.client() as c:
        short = c.create("py")
        kept = c.create("py", ttl=600)
        assert _view(c, short.id)["expires"] == pytest.approx(time.time() + 1, abs=1.5)
        assert _view(c, kept.id)["expires"] == pytest.approx(time.time() + 600, abs=5)
        deadline = time.monotonic() + 10
        while short.id in {b["id"] for b in c.list()} and time.monotonic() < deadline:
            time.sleep(0.1)
        assert {b["id"] for b in c.list()} == {kept.id}
        kept.delete()
    agent.stop()
    agent.start("--default-ttl", "none")
    with agent.client() as c, c.create("py") as sb:
        assert _view(c, sb.id)["expires"] is None


def test_a_bad_default_ttl_is_one_line(agent: AgentProcess, tmp_path: Path) -> None:
    for value in ("-1", "soon", "inf"):
        bad = _serve(agent, tmp_path, "--default-ttl", value)
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def _view(client: Client, box_id: str) -> dict:
    return next(b for b in client.list() if b["id"] == box_id)
