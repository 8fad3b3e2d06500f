"""The exec server: runs INSIDE a sandbox, as its PID 1's command (under tini), so that
a command starts with one fork+exec instead of a `runc exec` (which starts a Go binary
and joins the namespaces each time: 10-30 ms here).

Standard library only, Python 3.6+, because it runs on the image's own python3 (the
agent uses it only for images that have one; others get `runc exec`). Every command it
starts inherits what PID 1 has: the sandbox's user, capabilities, seccomp filter,
cgroup and namespaces, exactly as `runc exec` would give it.

The agent talks to it over a unix socket in the sandbox's private control directory,
/dev/lazyfs (the host's SANDBOX_DIR/<id>/ctl): one connection per command.

    agent -> server: u32 length, JSON {"argv", "cwd", "env": ["K=V"...], "stdin": N},
                     then N bytes of stdin
    server -> agent: frames of u8 kind (1 stdout, 2 stderr, 3 exit), u32 length, bytes;
                     the exit frame's bytes are JSON {"exit_code": N}
    agent closes the connection early: the command's whole process group is killed.

The socket is bound under a temporary name and renamed when it listens, so that the
agent never connects to a socket nobody accepts on.
"""

import contextlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading

CONTROL = sys.argv[1] if len(sys.argv) > 1 else "/dev/lazyfs"
STDOUT, STDERR, EXIT = 1, 2, 3
MAX_HEADER = 16 * 2**20


def recv_exact(conn, n):
    data = b""
    while len(data) < n:
        chunk = conn.recv(min(n - len(data), 1 << 20))
        if not chunk:
            raise EOFError
        data += chunk
    return data


class Connection:
    def __init__(self, conn):
        self.conn = conn
        self.lock = threading.Lock()

    def send(self, kind, data):
        with self.lock:
            self.conn.sendall(struct.pack(">BI", kind, len(data)) + data)


def pump(stream, kind, out):
    try:
        while True:
            data = os.read(stream.fileno(), 65536)
            if not data:
                break
            out.send(kind, data)
    except OSError:
        pass
    finally:
        stream.close()


def feed(stream, data):
    try:
        stream.write(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            stream.close()


def watch_hangup(conn, proc):
    """The agent closing its end means: kill the command (timeout, client gone)."""
    try:
        while conn.recv(4096):
            pass
    except OSError:
        pass
    if proc.poll() is None:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)


def serve_one(conn):
    out = Connection(conn)
    try:
        (size,) = struct.unpack(">I", recv_exact(conn, 4))
        if size > MAX_HEADER:
            return
        req = json.loads(recv_exact(conn, size).decode())
        stdin = recv_exact(conn, req.get("stdin", 0)) if req.get("stdin") else None
    except (EOFError, OSError, ValueError):
        conn.close()
        return
    env = dict(item.split("=", 1) for item in req.get("env", []) if "=" in item)
    try:
        proc = subprocess.Popen(
            req["argv"],
            cwd=req.get("cwd") or "/",
            env=env,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group, killed as one
            close_fds=True,
        )
    except OSError as exc:
        code = 127 if isinstance(exc, FileNotFoundError) else 126
        try:
            out.send(STDERR, ("{}: {}\n".format(req["argv"][0], exc.strerror)).encode())
            out.send(EXIT, json.dumps({"exit_code": code}).encode())
        except OSError:
            pass
        conn.close()
        return
    threads = [
        threading.Thread(target=pump, args=(proc.stdout, STDOUT, out), daemon=True),
        threading.Thread(target=pump, args=(proc.stderr, STDERR, out), daemon=True),
    ]
    if stdin:
        threads.append(threading.Thread(target=feed, args=(proc.stdin, stdin), daemon=True))
    for t in threads:
        t.start()
    threading.Thread(target=watch_hangup, args=(conn, proc), daemon=True).start()
    status = proc.wait()
    for t in threads[:2]:
        t.join(1.0)  # a background child may keep the pipes open: do not wait for it
    code = 128 - status if status < 0 else status
    with contextlib.suppress(OSError):
        out.send(EXIT, json.dumps({"exit_code": code}).encode())
    conn.close()


def main():
    path = os.path.join(CONTROL, "exec.sock")
    tmp = f"{path}.{os.getpid()}"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(tmp)
    server.listen(128)
    os.rename(tmp, path)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    while True:
        conn, _ = server.accept()
        threading.Thread(target=serve_one, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    main()
