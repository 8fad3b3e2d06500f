"""Kernel-speed image trees (issue 10): per-file costs, a real task, a burst, other speeds.

Everything goes through the user-facing commands (`lazyfs convert`, `lazyfs mount IMAGE
DIR`, `lazyfs umount DIR`, `lazyfs run IMAGE -- CMD`), so the same script measures today's
per-image FUSE tree and the EROFS tree once `lazyfs mount` serves it. Images:
testbed/tree_images.py (`sympy`; `task-00`..`task-15`: the python image plus a
300-file task layer each), converted into a file:// store under a scratch directory.
Every lazyfs measurement is interleaved with its baseline, round by round.

Sections (`--only SECTION`, repeatable):

  metadata  Over the 300 task files of task-00: stat, open+close, open+read (whole file)
            and a negative lookup (stat of a missing name in the same directories), per
            file in microseconds, on a `lazyfs mount` (warm: node cache and page cache
            full after one pass) vs the same tree on local disk (`umoci unpack`). Also the
            task's own check (python3 imports its 208 modules and reads all 300 files) in a
            chroot of each tree. Goal: every op within 1.3x of local.
  sympy     Four of sympy's own test modules under pytest (Debian's python3-sympy and
            python3-pytest): local unpack in a chroot (warm) vs `lazyfs run` warm (node
            cache full; a new mount, and the image still mounted by a `--linger` run),
            cold (empty node cache, local store) and cold over S3 behind a 1 Gbit/s +
            4 ms link (bench/netns.py). Store requests of the cold runs from the mount's
            final stats. Each warm run is compared with the mean of the local runs just
            before and after it, each cold one with the round's three local runs.
            Goals: warm <= 1.1x local, cold <= 1.6x local.
  burst     32 `lazyfs run`s of the 16 task images at once (2 each), empty node cache,
            each printing a line the bench checks, vs GNU tar unpacking all 16 images from
            the OCI layout's blobs (as many at once as there are cores) and running the
            same 32 commands in chroots. Time to the last output; peak RSS of all lazyfs
            processes of this run (sampled every 50 ms); marginal RSS per mounted image
            (RSS with all 16 mounted minus RSS with one, over 15). Goals: >= 3x sooner
            than tar, peak RSS <= 400 MB. The same 32 sandboxes through the node agent
            (`lazyfs serve`, one create + exec each, 32 clients at once): there the
            sandboxes' own processes (tini, the exec server) count too, found by the
            agent's cgroup parent.
  other     Warm sequential read of 1 GiB and `find` over 100k files: bench/mount_perf.py's
            own functions (its images, its mounts: started as `python -m lazyfs.tree.fuse_mount`).

Results: bench/results/tree_perf.{md,png,json}. With --only, the other sections are
taken from the previous tree_perf.json, so the table and plot stay whole.

Run (as root): .venv/bin/python bench/tree_perf.py [--quick] [--repeat N] [--only SECTION]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import (
    LAZYFS,
    Timed,
    layout_layers,
    run,
    timed_run,
    tree_images,
    tree_rootfs,
)
from _report import (
    RESULTS,
    grouped_bars,
    load_average,
    machine_note,
    mb,
    median,
    pyplot,
    save_markdown,
    save_plot,
    spread,
    table,
)
from netns import delay_proxy, leftovers, shaped_link  # noqa: E402
from run_vs_pull import NsSeaweed, cleanup, final_stats, untar_layer, wait_unmounted  # noqa: E402

from chunker.errors import NotFoundError  # noqa: E402
from lazyfs.client import AgentNotRunning, Client  # noqa: E402
from lazyfs.tree.node_files import read_stats  # noqa: E402
from testbed.images import IMAGE_PATH_ENV  # noqa: E402
from testbed.mounts import mounts_below  # noqa: E402
from testbed.seaweed import free_port  # noqa: E402
from testbed.tree_images import SYMPY_DIR, TASK_CHECK, task_tag  # noqa: E402

SECTIONS = ("metadata", "sympy", "burst", "other")
SYMPY_MODULES = ("test_basic", "test_numbers", "test_sympify", "test_subs")
PYTEST = ["python3", "-B", "-m", "pytest", "-q", "-p", "no:cacheprovider"] + [
    f"/{SYMPY_DIR}/core/tests/{m}.py" for m in SYMPY_MODULES
]
CHILD_ENV = {"PATH": IMAGE_PATH_ENV, "HOME": "/root", "LC_ALL": "C"}
GOALS = {"metadata": 1.3, "sympy_warm": 1.1, "sympy_cold": 1.6, "burst": 3.0, "rss_mb": 400}
PASSES = 5  # metadata passes per op, per tree, per round
RATE, DELAY_MS = "1gbit", 2.0  # one way each direction: +4 ms round trip
LINGER = 30  # seconds a `--linger` run keeps the image mounted
RUN_TIMEOUT = 600.0
BURST_COPIES = 2
RSS_INTERVAL = 0.05


# ---------------------------------------------------------------------------------------
# The run's scratch space, store and commands


@dataclass
class Bench:
    root: Path  # scratch directory: store, caches, mounts, sandboxes
    env: dict[str, str]  # the environment of every lazyfs process
    converted: set[str] = field(default_factory=set)
    n: int = 0

    @property
    def url(self) -> str:
        return f"file://{self.root / 'store'}"

    @property
    def marker(self) -> bytes:
        """In the environment of every process this run's lazyfs commands start."""
        return f"LAZYFS_RUN_DIR={self.env['LAZYFS_RUN_DIR']}".encode()

    @property
    def cgroup_parent(self) -> str:
        """This run's own cgroup parent for its sandboxes: sampled by it, and apart from
        whatever else runs sandboxes on the machine."""
        return self.env["LAZYFS_CGROUP_PARENT"]

    def scratch(self, label: str) -> Path:
        self.n += 1
        path = self.root / f"{label}-{self.n}"
        path.mkdir()
        return path

    def image(self, tag: str) -> str:
        """The name of tree image `tag` in the store, converted on first use."""
        name = f"bench-{tag}"
        if name not in self.converted:
            layout = tree_images().layout
            cmd = [LAZYFS, "convert", f"oci:{layout}:{tag}", "--store", self.url, "--name", name]
            run(cmd, env=self.env)
            self.converted.add(name)
        return name

    @contextmanager
    def mount(self, name: str, cache: Path) -> Iterator[Path]:
        mp = self.scratch("mnt")
        run([LAZYFS, "mount", name, mp, "--store", self.url, "--cache", cache], env=self.env)
        try:
            yield mp
        finally:
            self.umount(mp, cache)

    def umount(self, mp: Path, cache: Path) -> None:
        """`lazyfs umount`, then wait (up to 10 s) for the daemon's exit: its final stats."""
        run([LAZYFS, "umount", mp], env=self.env)
        wait_unmounted(mp)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if read_stats(mp, cache).get("mounted") is False:
                    return
            except NotFoundError:
                return  # a tree without per-mount stats
            time.sleep(0.02)

    def run_argv(
        self, name: str, cache: Path, command: list[str], url: str = "", linger: float = 0
    ) -> list[str | Path]:
        argv: list[str | Path] = [LAZYFS, "run", name, "--store", url or self.url]
        argv += ["--cache", cache] + (["--linger", str(linger)] if linger else [])
        return [*argv, "--", *command]

    def unmount_lingering(self, cache: Path) -> None:
        """Unmount what `run --linger` left mounted (its reaper then finds nothing to do)."""
        run_dir = Path(self.env["LAZYFS_RUN_DIR"])
        for point in mounts_below(run_dir / "images"):  # not the node data daemon's mount
            self.umount(Path(point), cache)


def chroot(root: Path, command: list[str], start: float | None = None) -> Timed:
    return timed_run(["chroot", root, *command], CHILD_ENV, start, RUN_TIMEOUT)


# ---------------------------------------------------------------------------------------
# metadata


def op_stat(files: list[str], _missing: list[str]) -> None:
    for f in files:
        os.stat(f)


def op_open_close(files: list[str], _missing: list[str]) -> None:
    for f in files:
        os.close(os.open(f, os.O_RDONLY))


def op_open_read(files: list[str], _missing: list[str]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            while os.read(fd, 1 << 16):
                pass
        finally:
            os.close(fd)


def op_negative(_files: list[str], missing: list[str]) -> None:
    for f in missing:
        try:
            os.stat(f)
        except FileNotFoundError:
            continue
        raise RuntimeError(f"{f} exists")


OPS: dict[str, Callable[[list[str], list[str]], None]] = {
    "stat": op_stat,
    "open+close": op_open_close,
    "open+read": op_open_read,
    "negative lookup": op_negative,
}


def per_file_us(op: str, files: list[str], missing: list[str]) -> float:
    t0 = time.perf_counter()
    OPS[op](files, missing)
    return (time.perf_counter() - t0) / len(files) * 1e6


def bench_metadata(b: Bench, repeat: int) -> dict[str, Any]:
    imgs, tag = tree_images(), task_tag(0)
    name, local = b.image(tag), tree_rootfs(tag)
    res: dict[str, Any] = {
        t: {op: [] for op in [*OPS, "task check s"]} for t in ("local", "lazyfs")
    }
    with b.mount(name, b.scratch("cache-meta")) as mp:
        trees = {"local": local, "lazyfs": mp}
        for rnd in range(repeat + 1):  # round 0 fills the caches and is not kept
            for t, root in trees.items():
                files = [str(root / f) for f in imgs.task_files]
                missing = [f"{os.path.dirname(f)}/no-such-{i}.py" for i, f in enumerate(files)]
                for op in OPS:
                    samples = [per_file_us(op, files, missing) for _ in range(PASSES)]
                    if rnd:
                        res[t][op] += samples
                check = chroot(root, TASK_CHECK)
                if check.out.strip() != imgs.expected[tag]:
                    raise RuntimeError(f"task check on {t} printed {check.out!r}")
                if rnd:
                    res[t]["task check s"].append(check.exit)
            if rnd:
                line = ", ".join(f"{op} {median(res['lazyfs'][op][-PASSES:]):.0f}" for op in OPS)
                print(f"  metadata round {rnd}/{repeat}: lazyfs us/file {line}", flush=True)
    return res


# ---------------------------------------------------------------------------------------
# sympy


def pytest_passed(t: Timed) -> Timed:
    if " passed" not in t.out or " failed" in t.out:
        raise RuntimeError(f"pytest did not pass: {t.out[-1000:]}")
    return t


def cold_run(b: Bench, argv_for: Callable[[Path], list[str | Path]], env: dict[str, str]) -> dict:
    """One lazyfs run on an empty node cache; its wall time and its mount's final stats."""
    cache = b.scratch("cache-cold")
    try:
        t = pytest_passed(timed_run(argv_for(cache), env))
        try:
            stats = final_stats(cache, set())
        except RuntimeError:  # a tree that publishes no per-mount stats
            stats = {}
        return {"s": t.exit, **{k: stats.get(k) for k in ("store_requests", "bytes_fetched")}}
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def bench_sympy(b: Bench, repeat: int, network: bool) -> dict[str, Any]:
    name, local = b.image("sympy"), tree_rootfs("sympy")
    warm = b.scratch("cache-warm")
    pytest_passed(chroot(local, PYTEST))  # the local tree into the page cache
    # The first run of the image fills the warm cache and records its start-up trace.
    print(f"  sympy first run: {timed_run(b.run_argv(name, warm, PYTEST), b.env).exit:.2f} s")
    variants = ("local", "warm new mount", "warm mounted", "cold", "cold, no trace")
    res: dict[str, Any] = {k: [] for k in variants}
    # Each variant's own baseline per round: the mean of the local runs right before and
    # after it (warm variants), or of the round's three (cold ones). One local run per
    # round against runs up to 40 s later let the VM's drift decide the warm rows: their
    # ratios moved by +-10 % between runs minutes apart.
    res["baseline"] = {k: [] for k in variants[1:]}
    no_trace = {**b.env, "LAZYFS_PREFETCH": "0"}

    def local_run() -> float:
        return pytest_passed(chroot(local, PYTEST)).exit

    for i in range(repeat):
        before = local_run()
        res["local"].append(before)
        res["warm new mount"].append(
            pytest_passed(timed_run(b.run_argv(name, warm, PYTEST), b.env)).exit
        )
        between = local_run()
        timed_run(b.run_argv(name, warm, PYTEST, linger=LINGER), b.env)  # mounts it, fills pages
        lingered = timed_run(b.run_argv(name, warm, PYTEST, linger=LINGER), b.env)
        res["warm mounted"].append(pytest_passed(lingered).exit)
        b.unmount_lingering(warm)
        after = local_run()
        res["cold"].append(cold_run(b, lambda c: b.run_argv(name, c, PYTEST), b.env))
        res["cold, no trace"].append(cold_run(b, lambda c: b.run_argv(name, c, PYTEST), no_trace))
        res["baseline"]["warm new mount"].append((before + between) / 2)
        res["baseline"]["warm mounted"].append((between + after) / 2)
        for variant in ("cold", "cold, no trace"):
            res["baseline"][variant].append((before + between + after) / 3)
        row = {k: _secs(res[k][-1]) for k in variants}
        print(
            f"  sympy round {i + 1}/{repeat}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items())
        )
    if network:
        res.update(sympy_over_link(b, name, local, repeat))
    return res


@contextmanager
def scratch_node(prefix: str, **env: str) -> Iterator[Bench]:
    """A Bench on a node of its own: a directory under /var/tmp (on this disk, not a
    tmpfs, so that a store's packs come from disk once the page cache is dropped) for its
    store, caches, run dir and sandboxes, its own cgroup parent, and `env` on top. All it
    left mounted or running is cleaned up afterwards, and the directory removed."""
    root = Path(tempfile.mkdtemp(prefix=prefix, dir="/var/tmp"))
    node = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "LAZYFS_"))}
    node.update(LAZYFS_RUN_DIR=str(root / "run"), LAZYFS_SANDBOX_DIR=str(root / "sandboxes"))
    node.update(LAZYFS_CGROUP_PARENT=f"{prefix}{os.getpid()}", **env)
    try:
        yield Bench(root, node)
    finally:
        if problems := cleanup(root):
            print(f"clean-up had to remove: {problems}", file=sys.stderr)
        shutil.rmtree(root, ignore_errors=True)
        for hierarchy in Path("/sys/fs/cgroup").iterdir():
            with suppress(OSError):
                (hierarchy / node["LAZYFS_CGROUP_PARENT"]).rmdir()


@contextmanager
def s3_over_link(b: Bench, name: str) -> Iterator[tuple[str, dict[str, str], NsSeaweed]]:
    """The image `name` pushed to SeaweedFS S3 in a network namespace behind the shaped
    link (RATE) and a delay line (DELAY_MS each way): its store URL, the environment of
    a lazyfs process that reads it, and the server (its request counts)."""
    links = []
    with shaped_link(RATE) as link:
        links.append(link)
        weed = NsSeaweed(b.root / "weed", link)
        try:
            weed.start()
            url = f"s3://{weed.bucket}/store"
            run([LAZYFS, "push", name, "--to", url, "--store", b.url], env={**b.env, **weed.env})
            with delay_proxy(link, free_port(), weed.ports["s3.port"], DELAY_MS) as endpoint:
                yield url, {**b.env, **weed.env, "AWS_ENDPOINT_URL": endpoint}, weed
        finally:
            weed.stop()
    if left := [x for link in links for x in leftovers(link)]:
        print(f"link left behind: {left}", file=sys.stderr)


def sympy_over_link(b: Bench, name: str, local: Path, repeat: int) -> dict[str, list]:
    """Cold runs from SeaweedFS S3 behind the shaped link, interleaved with local runs."""
    out: dict[str, list] = {k: [] for k in ("local (link phase)", "cold, S3", "cold, no trace, S3")}
    with s3_over_link(b, name) as (url, env, weed):
        envs = {"cold, S3": env, "cold, no trace, S3": {**env, "LAZYFS_PREFETCH": "0"}}

        def s3_cold(variant: str) -> dict:
            before = weed.request_count(bucket=weed.bucket)
            r = cold_run(b, lambda c: b.run_argv(name, c, PYTEST, url=url), envs[variant])
            return {**r, "s3_requests": weed.request_count(bucket=weed.bucket) - before}

        s3_cold("cold, S3")  # records the start-up trace in this store
        for i in range(repeat):
            out["local (link phase)"].append(pytest_passed(chroot(local, PYTEST)).exit)
            for variant in envs:
                out[variant].append(s3_cold(variant))
            line = ", ".join(f"{v} {out[v][-1]['s']:.2f} s" for v in envs)
            print(f"  sympy over the link {i + 1}/{repeat}: {line}", flush=True)
    return out


# ---------------------------------------------------------------------------------------
# burst


def _pss(pid: int) -> int:
    """Proportional set size in bytes (/proc/PID/smaps_rollup)."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


class RssSampler:
    """Samples the summed RSS of this run's lazyfs processes every RSS_INTERVAL seconds.

    A process counts if its command line contains "lazyfs" (the CLI, the mount daemons,
    the sandboxes' PID 1, a linger reaper) and its environment holds the run's marker, so
    the other users of this machine and their lazyfs processes are left out.
    """

    def __init__(self, marker: bytes, cgroup_parent: str | None = None) -> None:
        self.marker = marker
        # Sandboxes' processes (tini, an exec server) carry the image's environment, not
        # the marker: they are found by their cgroup, under the agent's cgroup parent.
        self.cgroup = f":/{cgroup_parent}/".encode() if cgroup_parent else None
        self.ours: dict[tuple[int, bytes], bool] = {}
        self.in_sandbox: dict[tuple[int, bytes], bool] = {}
        self.peak = 0
        self.peak_by_kind: dict[str, int] = {}
        self.peak_procs = 0
        # PSS too: RSS counts the pages processes share (the interpreter, libraries) once
        # per process, so a sum of RSS overstates what 32 Python CLIs take from the node.
        self.peak_pss = 0
        self._pss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            by_kind = self.sample()
            total = sum(by_kind.values())
            if total > self.peak:
                self.peak, self.peak_by_kind = total, by_kind
            self.peak_pss = max(self.peak_pss, self._pss)
            self._stop.wait(RSS_INTERVAL)

    def sample(self) -> dict[str, int]:
        """RSS bytes of our lazyfs processes now, by kind."""
        by_kind: dict[str, int] = {}
        page = os.sysconf("SC_PAGE_SIZE")
        pss_total = 0
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                in_sandbox = self._in_sandbox(int(pid), cmdline)
                if not in_sandbox and (
                    b"lazyfs" not in cmdline or not self._is_ours(int(pid), cmdline)
                ):
                    continue
                rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
                pss_total += _pss(int(pid))
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
            kind = "in the sandboxes: tini, exec server" if in_sandbox else _kind(cmdline)
            by_kind[kind] = by_kind.get(kind, 0) + rss
        self._pss = pss_total
        return by_kind

    def _in_sandbox(self, pid: int, cmdline: bytes) -> bool:
        """A lazyfs process in a sandbox (tini and the exec server; not the task)."""
        if self.cgroup is None or b"lazyfs" not in cmdline:
            return False
        key = (pid, cmdline)
        if key not in self.in_sandbox:
            self.in_sandbox[key] = self.cgroup in Path(f"/proc/{pid}/cgroup").read_bytes()
        return self.in_sandbox[key]

    def _is_ours(self, pid: int, cmdline: bytes) -> bool:
        key = (pid, cmdline)
        if key not in self.ours:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            self.ours[key] = self.marker in environ
        return self.ours[key]


_KINDS = [  # (what the command line holds, the kind it is reported as), first match wins
    (b"lazyfs.tree.fuse_supervisor", "data daemon supervisor"),
    (b"lazyfs.tree.data_daemon", "data daemon"),
    (b"lazyfs.tree.fuse_mount", "FUSE tree daemons"),
    (b"lazyfs.tree.image_mounts\0reap", "linger reapers"),
    (b"bin/lazyfs\0serve", "node agent"),
    # before the CLIs: the gate's and the waiter's command lines hold what they exec next
    (b"lazyfs-run-wait\0gate", "lazyfs run CLIs waiting for a slot (C)"),
    (b"lazyfs-run-wait\0wait", "lazyfs run waiters (C)"),
    (b"lazyfs.sandbox.run_finish", "lazyfs run finishers"),
    (b"bin/lazyfs\0run", "lazyfs run CLIs"),
    (b"runc\0", "runc"),
    (b"fusermount", "fusermount3"),
]


def _kind(cmdline: bytes) -> str:
    return next((kind for key, kind in _KINDS if key in cmdline), "other lazyfs")


def check_outputs(outputs: list[tuple[str, Timed]]) -> float:
    """Time to the last output, after checking every output is its image's line."""
    expected = tree_images().expected
    for tag, t in outputs:
        if t.out.strip() != expected[tag]:
            raise RuntimeError(f"{tag} printed {t.out!r}, expected {expected[tag]!r}")
    return max(t.first for _, t in outputs)


def tar_burst(b: Bench) -> float:
    """Unpack each task image with GNU tar (cores-many at once), run its 2 checks."""
    imgs = tree_images()
    work = b.scratch("tar-burst")

    def one(tag: str) -> list[tuple[str, Timed]]:
        root = work / tag
        root.mkdir()
        for layer in layout_layers(imgs.layout, tag):
            untar_layer(imgs.layout / "blobs" / layer["digest"].replace(":", "/"), root)
        with ThreadPoolExecutor(BURST_COPIES) as pool:
            runs = [pool.submit(chroot, root, TASK_CHECK, t0) for _ in range(BURST_COPIES)]
            return [(tag, r.result()) for r in runs]

    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
            outputs = [x for lst in pool.map(one, imgs.task_tags) for x in lst]
        return check_outputs(outputs)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def lazyfs_burst(b: Bench, names: dict[str, str]) -> tuple[float, RssSampler]:
    """All 32 `lazyfs run`s at once on an empty node cache."""
    cache = b.scratch("cache-burst")
    jobs = [tag for tag in names for _ in range(BURST_COPIES)]
    with RssSampler(b.marker, b.cgroup_parent) as rss, ThreadPoolExecutor(len(jobs)) as pool:
        t0 = time.perf_counter()
        futures = [
            pool.submit(timed_run, b.run_argv(names[tag], cache, TASK_CHECK), b.env, t0)
            for tag in jobs
        ]
        outputs = [(tag, f.result()) for tag, f in zip(jobs, futures, strict=True)]
    shutil.rmtree(cache, ignore_errors=True)
    return check_outputs(outputs), rss


@contextmanager
def node_agent(
    b: Bench, cache: Path, env: dict[str, str] | None = None, url: str = "", warm: int = 0
) -> Iterator[Client]:
    """`lazyfs serve` on a socket of its own (in `env`, default the run's; on the store
    `url`, default the run's); stopped (SIGTERM: it deletes its sandboxes) afterwards.
    `warm`: with `--warm warm` (a generic pool of that many, filling as it starts)."""
    sock = b.scratch("agent") / "agent.sock"
    argv = [LAZYFS, "serve", "--socket", sock, "--store", url or b.url, "--cache", cache]
    argv += ["--max-sandboxes", "64", *(["--warm", str(warm)] if warm else [])]
    proc = subprocess.Popen([str(a) for a in argv], env=env or b.env, stdout=subprocess.DEVNULL)
    client = Client(socket=str(sock))
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                client.health()
                break
            except AgentNotRunning:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("lazyfs serve did not come up") from None
                time.sleep(0.05)
        yield client
    finally:
        client.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def agent_burst(b: Bench, names: dict[str, str]) -> tuple[float, RssSampler]:
    """The 32 sandboxes through one node agent: 32 clients at once, each creating a
    sandbox (cold: no pool) and running the task in it; empty node cache."""
    cache = b.scratch("cache-agent-burst")
    jobs = [tag for tag in names for _ in range(BURST_COPIES)]
    with node_agent(b, cache) as client, RssSampler(b.marker, b.cgroup_parent) as rss:

        def one(tag: str) -> Timed:
            with client.create(names[tag]) as sb:
                r = sb.exec(TASK_CHECK, timeout=RUN_TIMEOUT)
                done = time.perf_counter() - t0
                if r.exit_code != 0:
                    raise RuntimeError(f"{tag}: exit {r.exit_code}: {r.stderr!r}")
                return Timed(done, done, r.stdout.decode())

        with ThreadPoolExecutor(len(jobs)) as pool:
            t0 = time.perf_counter()
            outputs = list(zip(jobs, pool.map(one, jobs), strict=True))
    shutil.rmtree(cache, ignore_errors=True)
    return check_outputs(outputs), rss


def wait_for_no_data_daemon(b: Bench, timeout: float = 60) -> None:
    sampler = RssSampler(b.marker)
    deadline = time.monotonic() + timeout
    while "data daemon supervisor" in sampler.sample():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the data daemon still runs {timeout:.0f} s after a burst")
        time.sleep(0.1)


def marginal_rss(b: Bench, names: dict[str, str]) -> dict[str, float]:
    """RSS of our lazyfs processes with 1 and with all images mounted (each tree read once)."""
    cache = b.scratch("cache-rss")
    sampler = RssSampler(b.marker)
    rss: list[int] = []
    mps: list[Path] = []
    try:
        for name in names.values():
            mps.append(b.scratch("mnt"))
            run([LAZYFS, "mount", name, mps[-1], "--store", b.url, "--cache", cache], env=b.env)
            chroot(mps[-1], TASK_CHECK)
            rss.append(sum(sampler.sample().values()))
    finally:
        for mp in mps:
            if os.path.ismount(mp):
                b.umount(mp, cache)
        shutil.rmtree(cache, ignore_errors=True)
    return {
        "one_mb": rss[0] / 1e6,
        "all_mb": rss[-1] / 1e6,
        "n": len(rss),
        "per_image_mb": (rss[-1] - rss[0]) / (len(rss) - 1) / 1e6,
    }


def bench_burst(b: Bench, repeat: int) -> dict[str, Any]:
    names = {tag: b.image(tag) for tag in tree_images().task_tags}
    # Each variant has a node cache of its own, so a data daemon of its own: the one
    # before must be gone before the next is sampled (1 s after its last image).
    b.env["LAZYFS_DAEMON_IDLE"] = "1"
    # The sections before leave data daemons that exit 60 s after their last tree; the
    # first round's peak RSS counted three of them (451 MB at 23:24) until this waited.
    wait_for_no_data_daemon(b, timeout=120)
    try:
        return _bench_burst(b, names, repeat)
    finally:
        del b.env["LAZYFS_DAEMON_IDLE"]


def _bench_burst(b: Bench, names: dict[str, str], repeat: int) -> dict[str, Any]:
    res: dict[str, Any] = {
        "tar": [],
        "lazyfs": [],
        "peak_rss_mb": [],
        "peak_pss_mb": [],
        "peak_by_kind_mb": [],
        "agent": [],
        "agent_peak_rss_mb": [],
        "agent_peak_pss_mb": [],
        "agent_peak_by_kind_mb": [],
    }
    for i in range(repeat):
        res["tar"].append(tar_burst(b))
        line = f"  burst round {i + 1}/{repeat}: tar {res['tar'][-1]:.2f} s"
        for key, burst in (("", lazyfs_burst), ("agent_", agent_burst)):
            t, rss = burst(b, names)
            wait_for_no_data_daemon(b)
            res[key + "peak_rss_mb"].append(rss.peak / 1e6)
            res[key + "peak_pss_mb"].append(rss.peak_pss / 1e6)
            res[key + "peak_by_kind_mb"].append({k: v / 1e6 for k, v in rss.peak_by_kind.items()})
            res[key.rstrip("_") or "lazyfs"].append(t)
            label = "agent" if key else "lazyfs run"
            line += f", {label} {t:.2f} s (peak RSS {rss.peak / 1e6:.0f} MB)"
        print(line, flush=True)
    res["marginal"] = marginal_rss(b, names)
    return res


# ---------------------------------------------------------------------------------------
# other speeds: bench/mount_perf.py's own measurements


def bench_other(b: Bench, repeat: int) -> dict[str, Any]:
    import mount_perf

    ids = mount_perf.ensure_images()
    local_big, local_tree = mount_perf.local_copies()
    m = mount_perf.Mounts(b.scratch("mount-perf"), ids, "erofs")
    reads, _ = mount_perf.bench_reads(m, repeat, local_big)
    tree = mount_perf.bench_tree(m, repeat, local_tree)
    return {"reads": reads, "tree": tree}


# ---------------------------------------------------------------------------------------
# Output


def met(ok: bool) -> str:
    return "yes" if ok else "**no**"


def metadata_table(res: dict) -> str:
    rows = []
    for op in [*OPS, "task check s"]:
        loc, lazy = res["local"][op], res["lazyfs"][op]
        ratio = median(lazy) / median(loc)
        unit_digits = 3 if op.endswith(" s") else 1
        goal = GOALS["metadata"]
        rows.append(
            [
                op if op.endswith(" s") else f"{op}, us per file",
                spread(loc, unit_digits),
                spread(lazy, unit_digits),
                f"**{ratio:.1f}x**",
                f"<= {goal}x" if not op.endswith(" s") else "",
                met(ratio <= goal) if not op.endswith(" s") else "",
            ]
        )
    return table(
        ["300 task files, warm", "local disk", "lazyfs mount", "ratio", "goal", "met"], rows
    )


def _secs(v: float | dict) -> float:
    return v["s"] if isinstance(v, dict) else v


def sympy_goal(variant: str) -> float:
    """The issue's bound on run time / local warm (0: a baseline, no goal)."""
    if variant.startswith("warm"):
        return GOALS["sympy_warm"]
    return GOALS["sympy_cold"] if variant.startswith("cold") else 0


def paired(runs: list[float], baselines: list[float]) -> list[float]:
    """Each round's run over the same round's baseline (the machine drifts between rounds)."""
    return [r / b for r, b in zip(runs, baselines, strict=True)]


def sympy_table(res: dict) -> str:
    rows = []
    baselines = res.get("baseline", {})  # absent from runs before 2026-12-01 23:40
    for variant, runs in res.items():
        if variant == "baseline":
            continue
        secs = [_secs(r) for r in runs]
        base = res["local (link phase)" if variant.endswith("S3") else "local"]
        ratios = paired(secs, baselines.get(variant, base))
        goal = sympy_goal(variant)
        rows.append(
            [
                LABELS.get(variant, variant),
                spread(secs),
                spread(ratios, unit="x", bold=True),
                f"<= {goal}x" if goal else "",
                met(median(ratios) <= goal) if goal else "",
                *fetch_cells([r for r in runs if isinstance(r, dict)]),
            ]
        )
    headers = ["run", "wall s", "/ local warm, next to it", "goal", "met"]
    return table([*headers, "chunk GETs", "MB fetched", "S3 requests"], rows)


def fetch_cells(runs: list[dict]) -> list[str]:
    """Medians of the cold runs' chunk GETs, MB fetched and S3 requests ("-": none)."""
    cells = []
    for key in ("store_requests", "bytes_fetched", "s3_requests"):
        vals = [r[key] for r in runs if r.get(key) is not None]
        if not vals:
            cells.append("-")
        else:
            cells.append(mb(median(vals)) if key == "bytes_fetched" else f"{median(vals):.0f}")
    return cells


LABELS = {
    "local": "local unpack, chroot (warm)",
    "local (link phase)": "local unpack, chroot (warm), during the link runs",
    "warm new mount": "lazyfs run, warm node cache, new mount",
    "warm mounted": "lazyfs run, warm, image still mounted (--linger)",
    "cold": "lazyfs run, empty node cache, local store (start-up trace replayed)",
    "cold, no trace": "lazyfs run, empty node cache, local store, LAZYFS_PREFETCH=0",
    "cold, S3": f"same, S3 over {RATE} + {2 * DELAY_MS:g} ms round trip (trace replayed)",
    "cold, no trace, S3": f"same, S3 over {RATE} + {2 * DELAY_MS:g} ms, LAZYFS_PREFETCH=0",
}


def _variant_rows(res: dict, key: str, labels: tuple[str, str, str, str]) -> list[list[str]]:
    """A burst variant's rows: its time against tar, its peak RSS by kind, its peak PSS.
    `key`: "" for `lazyfs run`, "agent_" for the node agent (the keys bench_burst saves)."""
    times = res[key.rstrip("_") or "lazyfs"]
    run, rss, pss, pss_note = labels
    speedups = paired(res["tar"], times)
    speedup = median(speedups)
    peak = max(res[key + "peak_rss_mb"])
    kinds = res[key + "peak_by_kind_mb"][res[key + "peak_rss_mb"].index(peak)]
    return [
        [
            run,
            spread(times),
            f"{spread(speedups, unit='x', bold=True)} sooner than tar,"
            f" same round (goal >= {GOALS['burst']}x)",
            met(speedup >= GOALS["burst"]),
        ],
        [
            rss,
            f"{peak:.0f} MB",
            "; ".join(f"{k} {v:.0f}" for k, v in sorted(kinds.items())),
            met(peak <= GOALS["rss_mb"]),
        ],
        [pss, f"{max(res.get(key + 'peak_pss_mb') or [0]):.0f} MB", pss_note, ""],
    ]


def burst_table(res: dict) -> str:
    m = res["marginal"]
    rows = [
        ["GNU tar unpack of 16 images + 32 chroot runs", spread(res["tar"]), "", ""],
        *_variant_rows(
            res,
            "",
            (
                "32 `lazyfs run`, empty node cache",
                "peak RSS of all lazyfs processes (max over rounds)",
                "peak PSS of the same (shared pages split among their users)",
                "what the node's memory pays",
            ),
        ),
        *(
            _variant_rows(
                res,
                "agent_",
                (
                    "the same 32 through the node agent (create + exec), empty node cache",
                    "peak RSS: the agent, the data daemon and the sandboxes' own processes",
                    "peak PSS of the same",
                    "",
                ),
            )
            if res.get("agent")  # results from before the agent variant have none
            else []
        ),
        [
            "marginal RSS per mounted image (`lazyfs mount`, tree read once)",
            f"{m['per_image_mb']:.1f} MB",
            f"1 image {m['one_mb']:.0f} MB, {m['n']} images {m['all_mb']:.0f} MB",
            "",
        ],
    ]
    return table(["burst: 16 task images x 2", "time to last output s", "", "met"], rows)


def other_table(res: dict) -> str:
    r, t = res["reads"], res["tree"]
    warm, local = r["warm_gbps"]["median"], r["local_gbps"]["median"]
    find, lfind = t["find_eps"]["median"], t["local_find_eps"]["median"]
    rows = [
        [
            "1 GiB sequential read, warm node cache, GB/s",
            f"{warm:.2f}",
            f"{local:.2f}",
            f"{warm / local:.2f}",
            ">= 1 GB/s",
            met(warm >= 1.0),
        ],
        [
            "`find` over 100k files, fresh mount, k entries/s",
            f"{find / 1e3:.0f}",
            f"{lfind / 1e3:.0f}",
            f"{find / lfind:.2f}",
            ">= 300k/s",
            met(find >= 300e3),
        ],
    ]
    note = (
        "\n\nFrom bench/mount_perf.py's functions (medians), on EROFS trees; both trees side "
        "by side: bench/results/mount_perf.md."
    )
    return table(["other speeds", "lazyfs", "local", "ratio", "goal", "met"], rows) + note


TABLES = {
    "metadata": ("Metadata, warm (per-file cost)", metadata_table),
    "sympy": ("Import-heavy task: sympy's tests under pytest", sympy_table),
    "burst": ("Burst: 32 sandboxes from 16 distinct images", burst_table),
    "other": ("Other speeds", other_table),
}


def report(res: dict) -> str:
    present = [s for s in SECTIONS if s in res]
    conditions = [
        f"- {machine_note()}; a shared machine: read the ranges, not the digits.",
        "- Baseline and lazyfs interleaved round by round; cells are median (min-max).",
        f"- sympy: {', '.join(SYMPY_MODULES)} from sympy/core/tests, `{' '.join(PYTEST[:7])}`.",
        *(f"- {', '.join(secs)}: {ran}" for ran, secs in _by_run(res, present).items()),
    ]
    sections = [("Conditions", "\n".join(conditions))]
    sections += [(TABLES[s][0], TABLES[s][1](res[s])) for s in present]
    path = save_markdown("tree_perf", "Kernel-speed image trees (issue 10)", sections)
    return path.read_text()


def _by_run(res: dict, sections: list[str]) -> dict[str, list[str]]:
    """The sections measured by each run (--only runs leave the others as they were)."""
    runs: dict[str, list[str]] = {}
    for section in sections:
        runs.setdefault(res.get("ran", {}).get(section, "an earlier run"), []).append(section)
    return runs


def plot(res: dict) -> None:
    present = [s for s in SECTIONS if s in res]
    fig, axes = pyplot().subplots(1, len(present), figsize=(5 * len(present), 4.6), squeeze=False)
    for ax, section in zip(axes[0], present, strict=True):
        PLOTS[section](ax, res[section])
    fig.tight_layout()
    save_plot(fig, "tree_perf")


def _bars(ax: Any, labels: list[str], groups: dict[str, list[float]], unit: str) -> None:
    for bars in grouped_bars(ax, groups):
        ax.bar_label(bars, fmt="%.3g", fontsize=7)
    ax.set_xticks(range(len(labels)), labels, rotation=15, fontsize=8)
    ax.set_ylabel(unit)
    ax.legend(fontsize=8)


def plot_metadata(ax: Any, res: dict) -> None:
    ops = list(OPS)
    _bars(
        ax, ops, {t: [median(res[t][op]) for op in ops] for t in ("local", "lazyfs")}, "us per file"
    )
    ax.set_yscale("log")
    ax.set_title("300 task files, warm (median)")


def plot_sympy(ax: Any, res: dict) -> None:
    names = [n for n in res if n != "baseline"]
    _bars(
        ax,
        [n.replace(" ", "\n", 1) for n in names],
        {"wall s": [median([_secs(r) for r in res[n]]) for n in names]},
        "seconds",
    )
    ax.set_title("sympy tests under pytest (median)")


def plot_burst(ax: Any, res: dict) -> None:
    labels, values = ["GNU tar + chroot", "lazyfs run"], [median(res["tar"]), median(res["lazyfs"])]
    title = f"32 sandboxes, 16 images; peak RSS: lazyfs run {max(res['peak_rss_mb']):.0f} MB"
    if res.get("agent"):
        labels.append("node agent")
        values.append(median(res["agent"]))
        title += f", agent {max(res['agent_peak_rss_mb']):.0f} MB"
    _bars(ax, labels, {"s to last output": values}, "seconds")
    ax.set_title(title)


def plot_other(ax: Any, res: dict) -> None:
    r, t = res["reads"], res["tree"]
    _bars(
        ax,
        ["warm read, GB/s", "find, 100k entries/s"],
        {
            "local": [r["local_gbps"]["median"], t["local_find_eps"]["median"] / 1e5],
            "lazyfs": [r["warm_gbps"]["median"], t["find_eps"]["median"] / 1e5],
        },
        "",
    )
    ax.set_yscale("log")
    ax.set_title("mount_perf: other speeds (median)")


PLOTS: dict[str, Callable[[Any, dict], None]] = {
    "metadata": plot_metadata,
    "sympy": plot_sympy,
    "burst": plot_burst,
    "other": plot_other,
}


# ---------------------------------------------------------------------------------------


def measure(b: Bench, only: list[str], repeat: int, network: bool) -> dict[str, Any]:
    steps: dict[str, Callable[[], dict]] = {
        "metadata": lambda: bench_metadata(b, repeat),
        "sympy": lambda: bench_sympy(b, repeat, network),
        "burst": lambda: bench_burst(b, repeat),
        "other": lambda: bench_other(b, max(1, repeat // 2)),
    }
    res = {}
    for section in only:
        print(f"{section} ...", flush=True)
        t0 = time.perf_counter()
        res[section] = steps[section]()
        print(f"{section} took {time.perf_counter() - t0:.0f} s", flush=True)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1 round, no link, no `other`")
    p.add_argument("--repeat", type=int, default=None, help="rounds per section (default 3)")
    p.add_argument("--only", choices=SECTIONS, action="append", help="run only this section")
    p.add_argument("--no-link", action="store_true", help="skip the sympy runs over the link")
    p.add_argument("--report", action="store_true", help="redo table + plot from tree_perf.json")
    args = p.parse_args()
    saved = RESULTS / "tree_perf.json"
    if args.report:
        return show(json.loads(saved.read_text()))
    if os.geteuid() != 0:
        print("tree_perf needs root (FUSE, chroot, namespaces)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the clean-up still runs
    repeat = args.repeat or (1 if args.quick else 3)
    only = args.only or [s for s in SECTIONS if not (args.quick and s == "other")]
    network = not (args.quick or args.no_link)
    started, load_before = time.perf_counter(), load_average()
    tree_images()  # build before the clock of any section starts
    with scratch_node("lazyfs-bench-trees-") as b:
        res = measure(b, only, repeat, network)
    merged = json.loads(saved.read_text()) if saved.exists() and args.only else {}
    cmd = " ".join([".venv/bin/python", "bench/tree_perf.py", *sys.argv[1:]])
    ran = (
        f"{time.strftime('%Y-%m-%d %H:%M')}, `{cmd}`: {repeat} round(s), load average "
        f"{load_before} before, {load_average()} after,"
        f" {time.perf_counter() - started:.0f} s in all"
    )
    merged.setdefault("ran", {}).update({s: ran for s in res})
    merged.update(res)
    RESULTS.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(merged, indent=1))
    return show(merged)


def show(res: dict) -> int:
    print(report(res))
    plot(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
