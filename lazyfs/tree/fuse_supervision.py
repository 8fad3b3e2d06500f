"""The FUSE supervisor's life after its first worker started: it mounts the data daemon's
FUSE connection, hands each worker the kernel's FUSE_INIT, counts the handles the kernel
holds open per node (the workers report them), and starts a new worker when one dies.
lazyfs/tree/fuse_supervisor.py, the process's entry, says why and how; it imports this
module only after it has started the first worker.

The worker serves /dev/fuse itself. Each new worker gets two descriptors: a socket to us,
where libfuse reads the FUSE_INIT we kept and answers it (libfuse answers EIO to anything
before INIT), and /dev/fuse, which it then reads and answers directly
(lazyfs/tree/data_daemon.py, take_device). Until session 30 this process relayed every
request and reply through that socket instead, ~95 us and two copies per request
(docs/design-changes.md says what the relay cost and why it could go).

What a dead worker leaves behind, and who picks it up:
- requests it read and did not answer: the kernel keeps them; the next worker asks for
  them again with FUSE_NOTIFY_RESEND (Linux 6.9, protocol 7.40; the kernel's INIT says
  whether it can). On a kernel without it we cannot recover them, so a worker's death
  then ends the mount, as our own death does.
- the handles open per node: each worker reports every open and release to us on its
  socket (a message "+INO" or "-INO", below), and a new worker is told the counts
  (--open-handles), so that its idle exit stays right. A worker that dies between
  answering an open and reporting it would lose that handle, and its successor could
  then exit idle under a mounted tree, so an open is reported before its reply and a
  release after: at worst a handle is counted twice and the daemon stays up.
"""

from __future__ import annotations

import collections
import ctypes
import json
import logging
import os
import select
import signal
import struct
import subprocess
import time

from lazyfs.libc import MNT_DETACH, libc
from lazyfs.mount_table import mount_device
from lazyfs.oom import refused_message
from lazyfs.tree.daemon_start import read_report
from lazyfs.tree.fuse_worker import Worker
from lazyfs.tree.mount_watch import raise_read_ahead, start_watchdog

log = logging.getLogger("lazyfs.tree.fuse_supervisor")

FSTYPE = "fuse.lazyfs-data"
SOURCE = "lazyfs-data"
MS_RDONLY, MS_NOSUID, MS_NODEV = 1, 2, 4
START_TIMEOUT = 600.0

# linux/fuse.h: the in-header's first 32 bytes (len, opcode, unique, nodeid) and the
# out-header; FUSE_INIT's body after the 40-byte in-header: major, minor, max_readahead,
# flags, then (minor >= 36) flags2, the flags' upper 32 bits.
FUSE_INIT = 26
IN_HEADER = struct.Struct("<IIQQ")
OUT_HEADER = struct.Struct("<IiQ")
INIT_IN = struct.Struct("<IIIII")
INIT_IN_AT = 40
FUSE_HAS_RESEND = 1 << (39 - 32)  # in flags2: the kernel takes FUSE_NOTIFY_RESEND
INIT_BUF = 64 << 10  # the kernel wants a read buffer of at least 8 KiB for INIT
# A worker's reports after its INIT reply: one SEQPACKET message per open or release.
OPENED, RELEASED = ord("+"), ord("-")
GIVE_UP_AFTER = 10  # workers in a row that died without answering anything
# Seconds from a worker's socket closing to its exit before it counts as stuck in that exit
# (see Supervisor.run): a normal exit takes milliseconds between the two.
EXIT_GRACE = 1.0


class Supervisor:
    def __init__(
        self,
        mountpoint: str,
        worker_argv: list[str],
        lock_fd: int | None,
        device_fd: int,
        first: Worker,
    ) -> None:
        """`device_fd`: /dev/fuse, opened before the first worker, which has a copy;
        `first`: that worker, started already (fuse_supervisor.py says why)."""
        self.mountpoint = mountpoint
        self.worker_argv = worker_argv
        self.lock_fd = lock_fd
        self.fuse_fd = device_fd
        self.device = ""  # major:minor of our mount
        self.handles: collections.Counter[int] = collections.Counter()  # node id -> opens
        self.init: bytes | None = None  # the kernel's FUSE_INIT, as it came
        self.init_answered = False  # the kernel has had its INIT reply
        self.resend = False  # the kernel takes FUSE_NOTIFY_RESEND
        self.worker = first
        self.stuck: list[Worker] = []  # replaced while stuck in their exit; reaped later
        self.restarts = 0  # workers in a row that answered nothing
        self.crashed_at = 0.0

    # ------------------------------------------------------------------ mount

    def mount(self) -> None:
        data = f"fd={self.fuse_fd},rootmode=40000,user_id=0,group_id=0,allow_other"
        flags = MS_NOSUID | MS_NODEV | MS_RDONLY
        if libc.mount(
            SOURCE.encode(), os.fsencode(self.mountpoint), FSTYPE.encode(), flags, data.encode()
        ):
            err = ctypes.get_errno()
            raise OSError(err, f"cannot mount {self.mountpoint}: {os.strerror(err)}")
        self.device = mount_device(self.mountpoint)
        # Our death ends the mount (the worker leaves when its socket to us closes, and
        # the connection aborts with the last /dev/fuse descriptor): the watchdog
        # detaches the dead mount then.
        start_watchdog(self.mountpoint, self.device, ["umount", "-l", "--", self.mountpoint])

    def unmount(self) -> None:
        if self.fuse_fd < 0:
            return
        point = os.fsencode(self.mountpoint)
        # Only our own mount (nobody unmounted it); detach it if a tree still holds it.
        ours = self.device and mount_device(self.mountpoint) == self.device
        if ours and libc.umount2(point, 0) != 0:
            libc.umount2(point, MNT_DETACH)
        os.close(self.fuse_fd)  # aborts whatever the kernel still had queued
        self.fuse_fd = -1

    def take_init(self) -> None:
        """Read the kernel's FUSE_INIT, which the mount queued, and give it to the first
        worker. Nothing else is read from /dev/fuse here: the workers read the rest."""
        if not select.select([self.fuse_fd], [], [], START_TIMEOUT)[0]:
            raise OSError(f"no FUSE_INIT from the kernel on {self.mountpoint}")
        msg = os.read(self.fuse_fd, INIT_BUF)
        _, opcode, _, _ = IN_HEADER.unpack_from(msg)
        if opcode != FUSE_INIT:
            raise OSError(f"the kernel's first FUSE request is {opcode}, not INIT")
        body = msg.ljust(INIT_IN_AT + INIT_IN.size, b"\0")  # flags2 is newer than 7.36
        _, minor, _, _, flags2 = INIT_IN.unpack_from(body, INIT_IN_AT)
        self.resend = minor >= 36 and bool(flags2 & FUSE_HAS_RESEND)
        if not self.resend:
            log.warning(
                "this kernel cannot re-send a dead worker's requests (FUSE_NOTIFY_RESEND,"
                " Linux 6.9): a worker's crash will end the mount"
            )
        self.init = msg
        self._give_init(self.worker)

    def _give_init(self, w: Worker) -> None:
        if self.init is None:
            return
        try:
            w.sock.send(self.init)
        except OSError as exc:  # it died already: its pidfd says so next
            log.info("worker %d did not take the INIT: %s", w.proc.pid, exc)

    # ------------------------------------------------------------------ the workers

    def run(self, first_ready: int, ready_fd: int | None, starter_lock: int | None) -> int:
        """Watch the worker until the mount or the worker ends; first_ready: the read end
        of the first worker's ready pipe, whose report goes on to ready_fd (our
        starter's)."""
        self._first_worker_ready(first_ready, ready_fd, starter_lock)
        rfd, wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wfd)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)  # the wakeup fd carries it
        while True:
            w = self.worker
            poll = select.poll()  # afresh: the worker's fds change on a restart
            if w.closed_at is None:  # once at EOF, it would report POLLHUP on every poll
                poll.register(w.sock, select.POLLIN)
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
            self._reap_stuck(ready)
            if w.pidfd in ready:
                self._from_worker()  # what it sent before it died
                code = w.close()
                if code == 0:  # idle, stopped, or the mount is gone (unmounted)
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

    def _from_worker(self) -> None:
        """A worker's first message is its INIT reply; the rest are its handle reports."""
        w = self.worker
        while True:
            try:
                msg = w.sock.recv(INIT_BUF)
            except (BlockingIOError, ConnectionResetError):
                return
            if not msg:  # EOF: the worker is gone, or going (run() waits for its exit)
                if w.closed_at is None:
                    w.closed_at = time.monotonic()
                return
            w.answered += 1
            if w.answered == 1:
                self._init_reply(w, msg)
            elif msg[0] in (OPENED, RELEASED):
                self.handles[int(msg[1:])] += 1 if msg[0] == OPENED else -1
            else:
                log.warning("worker %d sent %r: ignored", w.proc.pid, msg[:32])

    def _init_reply(self, w: Worker, msg: bytes) -> None:
        if self.init_answered:  # a restarted worker's: the kernel had one long ago
            log.info(
                "worker %d answers, %.0f ms after the crash",
                w.proc.pid,
                (time.monotonic() - self.crashed_at) * 1000,
            )
            return
        _, error, _ = OUT_HEADER.unpack_from(msg)
        try:
            os.write(self.fuse_fd, msg)
        except OSError as exc:
            log.warning("INIT reply refused: %s", exc)
        self.init_answered = True
        if error == 0:
            raise_read_ahead(self.device)  # the INIT reply resets it

    def _restart(self, dead: Worker, code: int | None) -> bool:
        """Start a new worker in place of `dead` (its exit status, or None: stuck in its
        exit) and give it the INIT; False: giving up."""
        if code is None:
            how = f"closed its socket but did not exit within {EXIT_GRACE:.0f} s"
        else:
            how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
        if not self.resend:
            log.error(
                "worker %d %s; the kernel cannot re-send its requests: giving up",
                dead.proc.pid,
                how,
            )
            return False
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
        # Only after the kernel had its INIT reply: until then it sends no other request,
        # and a re-sent INIT would make the reply we still pass on unknown to it.
        if self.init_answered:
            argv.append("--resend")
        self.worker = Worker(argv, self.lock_fd, self.fuse_fd, None)
        self._give_init(self.worker)
        log.warning(
            "worker %d %s: started worker %d; open handles %s",
            dead.proc.pid,
            how,
            self.worker.proc.pid,
            handles,
        )
        return True

    def _first_worker_ready(self, r: int, ready_fd: int | None, starter_lock: int | None) -> None:
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
        tell_starter(ready_fd, report, starter_lock)
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


def tell_starter(ready_fd: int | None, report: dict, starter_lock: int | None) -> None:
    """Give our starter the first worker's report, then let go of its start lock.

    The starter may be gone (`lazyfs run` on bad input exits while the daemon it started
    early comes up): a write to its pipe then fails, and we serve on. That failure used to
    end this process, and its watchdog then detached the next starter's new mount at the
    same place (a FUSE mount's device number is reused), which answered ENODEV.
    starter_lock: our copy of the starter's exclusive lock on MOUNTPOINT.lock. Until the
    report, no second starter can start a second daemon here, even if ours left."""
    if ready_fd is not None:
        try:
            os.write(ready_fd, (json.dumps(report) + "\n").encode())
        except OSError as exc:
            log.info("our starter did not take the ready report: %s", exc)
        os.close(ready_fd)
    if starter_lock is not None:
        os.close(starter_lock)


def supervise(
    point: str,
    worker_argv: list[str],
    lock_fd: int,
    device_fd: int,
    first: Worker,
    first_ready: int,
    ready_fd: int | None,
    starter_lock: int | None,
    oom_biased: bool,
) -> int:
    """The supervisor's life after its first worker started: mount, watch, unmount."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"
    )
    if not oom_biased:
        log.warning("%s", refused_message("the data daemon"))
    sup = Supervisor(point, worker_argv, lock_fd, device_fd, first)
    try:
        sup.mount()
        sup.take_init()
    except OSError as exc:
        first.proc.kill()
        first.close()
        os.close(first_ready)
        sup.unmount()
        tell_starter(ready_fd, {"error": str(exc.strerror or exc), "exit_code": 1}, starter_lock)
        log.error("%s", exc)
        return 1
    log.info("mounted %s (%s); supervising %s", point, sup.device, " ".join(worker_argv))
    try:
        return sup.run(first_ready, ready_fd, starter_lock)
    except BaseException:  # the worker failed to start, or a bug here
        sup.unmount()
        raise
