"""The FUSE supervisor's relay: it mounts the data daemon's FUSE connection, copies each
request to the worker and each reply back, keeps what a new worker needs (the kernel's
FUSE_INIT, the requests in flight, the handles open per node), and starts that new worker
when one dies. lazyfs/tree/fuse_supervisor.py, the process's entry, says why and how; it
imports this module only after it has started the first worker.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import json
import logging
import os
import queue
import select
import signal
import struct
import subprocess
import threading
import time

from lazyfs.libc import MNT_DETACH, libc
from lazyfs.mount_table import mount_device
from lazyfs.oom import refused_message
from lazyfs.tree.fuse_worker import Worker
from lazyfs.tree.mount_watch import raise_read_ahead, read_report, start_watchdog

log = logging.getLogger("lazyfs.tree.fuse_supervisor")

FSTYPE = "fuse.lazyfs-data"
SOURCE = "lazyfs-data"
MS_RDONLY, MS_NOSUID, MS_NODEV = 1, 2, 4
START_TIMEOUT = 600.0

# linux/fuse.h: opcodes we look at, and the two headers (the in-header's first 32 bytes).
FUSE_FORGET, FUSE_OPEN, FUSE_RELEASE, FUSE_INIT = 2, 14, 18, 26
FUSE_INTERRUPT, FUSE_NOTIFY_REPLY, FUSE_BATCH_FORGET = 36, 41, 42
NO_REPLY = frozenset({FUSE_FORGET, FUSE_INTERRUPT, FUSE_NOTIFY_REPLY, FUSE_BATCH_FORGET})
IN_HEADER = struct.Struct("<IIQQ")  # len, opcode, unique, nodeid
OUT_HEADER = struct.Struct("<IiQ")  # len, error, unique
# libfuse 3.14 reads up to 256 pages + 4 KiB and replies with up to 1 MiB of data; the
# kernel refuses a /dev/fuse read smaller than max_write + the WRITE headers.
BUF_SIZE = (1 << 20) + (64 << 10)
MAX_QUEUED = 4096  # requests read from /dev/fuse but not yet taken by the worker
GIVE_UP_AFTER = 10  # workers in a row that died without answering anything
# Seconds from a worker's socket closing to its exit before it counts as stuck in that exit
# (see Supervisor.run): a normal exit takes milliseconds between the two.
EXIT_GRACE = 1.0


class Supervisor:
    def __init__(
        self, mountpoint: str, worker_argv: list[str], lock_fd: int | None, first: Worker
    ) -> None:
        """`first`: the first worker, started already (fuse_supervisor.py says why)."""
        self.mountpoint = mountpoint
        self.worker_argv = worker_argv
        self.lock_fd = lock_fd
        self.fuse_fd = -1
        self.device = ""  # major:minor of our mount
        self.inflight: dict[int, tuple[int, int, bytes]] = {}  # unique -> opcode, node, msg
        self.handles: collections.Counter[int] = collections.Counter()  # node id -> opens
        self.init: bytes | None = None  # the kernel's FUSE_INIT, as it came
        self.discard: int | None = None  # unique of a replayed INIT: its reply is ours
        self.queue: collections.deque[bytes] = collections.deque()  # to send to the worker
        self.worker = first
        self.stuck: list[Worker] = []  # replaced while stuck in their exit; reaped later
        self.restarts = 0  # workers in a row that answered nothing
        self.crashed_at = 0.0
        self.notices: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self.notifier: threading.Thread | None = None
        self.rbuf = bytearray(BUF_SIZE)
        self.wbuf = bytearray(BUF_SIZE)

    # ------------------------------------------------------------------ mount

    def mount(self) -> None:
        self.fuse_fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
        data = f"fd={self.fuse_fd},rootmode=40000,user_id=0,group_id=0,allow_other"
        flags = MS_NOSUID | MS_NODEV | MS_RDONLY
        if libc.mount(
            SOURCE.encode(), os.fsencode(self.mountpoint), FSTYPE.encode(), flags, data.encode()
        ):
            err = ctypes.get_errno()
            os.close(self.fuse_fd)
            raise OSError(err, f"cannot mount {self.mountpoint}: {os.strerror(err)}")
        self.device = mount_device(self.mountpoint)
        # Our death aborts the connection: the watchdog detaches the dead mount then.
        start_watchdog(self.mountpoint, self.device, ["umount", "-l", "--", self.mountpoint])

    def unmount(self) -> None:
        if self.fuse_fd < 0:
            return
        point = os.fsencode(self.mountpoint)
        # Only our own mount (nobody unmounted it); detach it if a tree still holds it.
        if mount_device(self.mountpoint) == self.device and libc.umount2(point, 0) != 0:
            libc.umount2(point, MNT_DETACH)
        os.close(self.fuse_fd)  # aborts whatever the kernel still had queued
        self.fuse_fd = -1

    # ------------------------------------------------------------------ the relay

    def run(self, first_ready: int, ready_fd: int | None) -> int:
        """Relay until the mount or the worker ends; first_ready: the read end of the first
        worker's ready pipe, whose report goes on to ready_fd (our starter's)."""
        self._first_worker_ready(first_ready, ready_fd)
        rfd, wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wfd)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)  # the wakeup fd carries it
        while True:
            w = self.worker
            poll = select.poll()  # afresh: the worker's fds change on a restart
            poll.register(self.fuse_fd, select.POLLIN if len(self.queue) < MAX_QUEUED else 0)
            if w.closed_at is None:  # once at EOF, it would report POLLHUP on every poll
                poll.register(w.sock, select.POLLIN | (select.POLLOUT if self.queue else 0))
            poll.register(w.pidfd, select.POLLIN)
            poll.register(rfd, select.POLLIN)
            for old in self.stuck:
                poll.register(old.pidfd, select.POLLIN)
            ready = {fd for fd, _ in poll.poll(self._exit_wait(w))}
            if rfd in ready:
                log.info("signalled: stopping the worker and unmounting")
                self._stop_worker()
                self.unmount()
                return 0
            if w.sock.fileno() in ready:
                self._from_worker()
            if self.fuse_fd in ready and not self._from_kernel():
                log.info("%s was unmounted: stopping the worker", self.mountpoint)
                self._stop_worker()
                os.close(self.fuse_fd)
                self.fuse_fd = -1
                return 0
            self._to_worker()
            self._reap_stuck(ready)
            if w.pidfd in ready:
                self._from_worker()  # replies it sent before it died
                code = w.close()
                if code == 0:
                    log.info("worker %d exited: unmounting", w.proc.pid)
                    self.unmount()
                    return 0
                if not self._restart(w, code):
                    self.unmount()
                    return 1
            elif w.closed_at is not None and self._exit_wait(w) == 0:
                # Its socket is closed but it has not exited: one of its threads is stuck
                # in the exit itself. That happens when the worker held the last use of
                # an EROFS tree of ours (the warmer reads through new trees): dropping
                # it waits for a read in flight, which only a worker can answer. So a
                # new worker answers it, and the old one can finish its exit.
                self.stuck.append(w)
                if not self._restart(w, None):
                    self.unmount()
                    return 1

    @staticmethod
    def _exit_wait(w: Worker) -> int | None:
        """poll()'s timeout in ms: none, or what is left of a closed worker's EXIT_GRACE."""
        if w.closed_at is None:
            return None
        return max(0, int((w.closed_at + EXIT_GRACE - time.monotonic()) * 1000))

    def _reap_stuck(self, ready: set[int]) -> None:
        for old in [old for old in self.stuck if old.pidfd in ready]:
            self.stuck.remove(old)
            log.info("replaced worker %d finished its exit: status %d", old.proc.pid, old.close())

    def _from_kernel(self) -> bool:
        """Read what the kernel has queued; False once the mount is gone."""
        view = memoryview(self.rbuf)
        for _ in range(64):  # then give the replies a turn
            try:
                n = os.readv(self.fuse_fd, [self.rbuf])
            except BlockingIOError:
                return True
            except InterruptedError:
                continue
            except OSError as exc:
                if exc.errno == errno.ENODEV:  # unmounted, or the connection aborted
                    return False
                if exc.errno == errno.ENOENT:  # a request interrupted before we read it
                    continue
                raise
            _, opcode, unique, node = IN_HEADER.unpack_from(self.rbuf)
            msg = bytes(view[:n])
            if opcode == FUSE_INIT:
                self.init = msg
            if opcode not in NO_REPLY:
                self.inflight[unique] = (opcode, node, msg)
            self.queue.append(msg)
        return True

    def _to_worker(self) -> None:
        sock = self.worker.sock
        while self.queue:
            try:
                sock.send(self.queue[0])
            except BlockingIOError:
                return
            except OSError:  # it died; its pidfd says so next, and we re-send
                return
            self.queue.popleft()

    def _from_worker(self) -> None:
        w = self.worker
        view = memoryview(self.wbuf)
        while True:
            try:
                n = w.sock.recv_into(self.wbuf)
            except (BlockingIOError, ConnectionResetError):
                return
            if n == 0:  # EOF: the worker is gone, or going (run() waits for its exit)
                if w.closed_at is None:
                    w.closed_at = time.monotonic()
                return
            w.answered += 1
            _, error, unique = OUT_HEADER.unpack_from(self.wbuf)
            if unique == self.discard:
                self.discard = None
                log.info(
                    "worker %d answers, %.0f ms after the crash",
                    w.proc.pid,
                    (time.monotonic() - self.crashed_at) * 1000,
                )
                continue
            if unique == 0:  # a notification (the worker's FUSE_NOTIFY_STORE pushes)
                self._notify(bytes(view[:n]))
                continue
            opcode, node, _ = self.inflight.pop(unique, (0, 0, b""))
            if opcode == FUSE_OPEN and error == 0:
                self.handles[node] += 1
            elif opcode == FUSE_RELEASE:
                self.handles[node] -= 1
            try:
                os.write(self.fuse_fd, view[:n])
            except OSError as exc:
                # ENOENT: the request was interrupted (or aborted) and the kernel forgot it.
                if exc.errno not in (errno.ENOENT, errno.ENODEV):
                    log.warning("reply to request %d refused: %s", unique, exc)
            if opcode == FUSE_INIT:
                raise_read_ahead(self.device)  # the INIT reply resets it

    def _notify(self, msg: bytes) -> None:
        """Write a notification from another thread. The kernel may block its write
        (FUSE_NOTIFY_STORE waits for the page locks of reads in flight), and those reads
        need this loop to relay their replies: in the loop it deadlocked."""
        if self.notifier is None:
            self.notifier = threading.Thread(target=self._notify_loop, daemon=True)
            self.notifier.start()
        self.notices.put(msg)

    def _notify_loop(self) -> None:
        while True:
            msg = self.notices.get()
            try:
                os.write(self.fuse_fd, msg)
            except OSError as exc:  # only ever a hint (the pages are read when needed)
                log.warning("notification refused: %s", exc)

    def _restart(self, dead: Worker, code: int | None) -> bool:
        """Start a new worker in place of `dead` (its exit status, or None: stuck in its
        exit) and hand it what the kernel still waits for; False: giving up."""
        if code is None:
            how = f"closed its socket but did not exit within {EXIT_GRACE:.0f} s"
        else:
            how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
        failed = self.restarts if dead.answered == 0 else 0
        if failed >= GIVE_UP_AFTER:
            log.error(
                "worker %d %s; %d in a row answered nothing: giving up", dead.proc.pid, how, failed
            )
            return False
        self.crashed_at = time.monotonic()
        time.sleep(min(0.05 * 2**failed, 5.0) if failed else 0)
        self.restarts = failed + 1
        handles = [f"{node}:{n}" for node, n in self.handles.items() if n > 0]
        argv = [*self.worker_argv, "--open-handles", ",".join(handles) or "-"]
        self.worker = Worker(argv, self.lock_fd, None)
        self.queue.clear()  # what it had not taken yet is in inflight, or a FORGET
        if self.init is not None:
            unique = IN_HEADER.unpack_from(self.init)[2]
            if unique not in self.inflight:  # answered by the dead worker: replay it
                self.queue.append(self.init)
                self.discard = unique
        self.queue.extend(msg for _, _, msg in self.inflight.values())
        log.warning(
            "worker %d %s: started worker %d; re-sending %d requests; open handles %s",
            dead.proc.pid,
            how,
            self.worker.proc.pid,
            len(self.inflight),
            handles,
        )
        return True

    def _first_worker_ready(self, r: int, ready_fd: int | None) -> None:
        """Wait for the first worker's ready report on r and pass it on to ready_fd (or
        raise its error)."""
        worker = self.worker
        try:
            report = read_report(r, START_TIMEOUT)
        except TimeoutError:
            report = {"error": f"data daemon did not start within {START_TIMEOUT:.0f} s"}
        finally:
            os.close(r)
        if report is None or report.get("error") is not None:
            if worker.proc.poll() is None:
                worker.proc.kill()
            code = worker.close()
            report = report or {"error": f"data daemon exited with status {code}"}
            report.setdefault("exit_code", 1)
        if ready_fd is not None:
            os.write(ready_fd, (json.dumps(report) + "\n").encode())
            os.close(ready_fd)
        if report.get("error") is not None:
            raise SystemExit(int(report["exit_code"]) or 1)

    def _stop_worker(self) -> None:
        w = self.worker
        if w.proc.poll() is not None:
            return
        w.proc.terminate()
        try:
            w.proc.wait(5)
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()


def supervise(
    point: str,
    worker_argv: list[str],
    lock_fd: int,
    first: Worker,
    first_ready: int,
    ready_fd: int | None,
    oom_biased: bool,
) -> int:
    """The supervisor's life after its first worker started: mount, relay, unmount."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"
    )
    if not oom_biased:
        log.warning("%s", refused_message("the data daemon"))
    sup = Supervisor(point, worker_argv, lock_fd, first)
    try:
        sup.mount()
    except OSError as exc:
        first.proc.kill()
        first.close()
        os.close(first_ready)
        if ready_fd is not None:
            report = {"error": str(exc.strerror or exc), "exit_code": 1}
            os.write(ready_fd, (json.dumps(report) + "\n").encode())
        log.error("%s", exc)
        return 1
    log.info("mounted %s (%s); supervising %s", point, sup.device, " ".join(worker_argv))
    try:
        return sup.run(first_ready, ready_fd)
    except BaseException:  # the worker failed to start, or a bug here
        sup.unmount()
        raise
