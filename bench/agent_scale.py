"""The node agent at scale (issue 12): a burst through the API, churn, a `kill -9`.

Each section starts its own `lazyfs serve` (testbed/agent.py's AgentProcess:
a private socket, run dir, sandbox dir and empty node cache under a scratch directory)
over a file:// store holding the 50 images of testbed/agent_images.py (the python test
image plus a small task layer each), and talks to it through lazyfs.client only.

  burst    SANDBOXES sandboxes of IMAGES distinct images created at once (one client
           thread each), each running `cat /task/id.txt` (a line unique to its image,
           checked), on an empty node cache. p50/p99 create latency, time to the last
           output, the agent's peak RSS (VmHWM) and the node data daemon's. Baseline, in
           the same run: GNU tar unpacks each image's layers from the local OCI layout
           (cores-many images at once) and the same tasks run in chroots (`chroot` is
           cheaper than a runtime's container, so the baseline is on the kind side).
  churn    CYCLES create/exec/delete cycles from CLIENTS threads, round-robin over the
           images: sandboxes per second, cycle latency. Then the node is checked: no
           mount, cgroup, runtime state, process, network namespace or upper directory
           of a sandbox left, with the agent still up and again after it stopped.
  restart  BOXES running sandboxes (half of them in the middle of a command) and a warm
           pool, then `kill -9` of the agent and a new one on the same run dir: what it
           adopted and cleaned up (and that this is what it should be), time until it
           answers and until an adopted sandbox runs a command, that the files survived
           and the interrupted commands are gone; nothing left afterwards.

Results: bench/results/agent_scale.{md,json,png}. With --only, the other sections come
from the previous agent_scale.json. Timings on a shared 2-core machine are noisy.

Run (as root): .venv/bin/python bench/agent_scale.py [--only SECTION]... [--scale 0.1]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from _common import (
    LAZYFS,
    cache_root,
    cached_dir,
    layout_layers,
    run,
    timed_run,
)
from _report import (
    RESULTS,
    run_sections,
    save_plot,
    section_axes,
    show_sections,
    table,
)
from agent_bench import COLD_LINE  # noqa: E402
from run_vs_pull import untar_layer  # noqa: E402

from chunker import erofs, manifest  # noqa: E402
from lazyfs.client import AgentError, Client  # noqa: E402
from testbed.agent import AgentProcess, agent_node  # noqa: E402
from testbed.agent_images import TASK_FILE, AgentImages, ensure_agent_images  # noqa: E402
from testbed.images import IMAGE_PATH_ENV  # noqa: E402
from testbed.mounts import wait_no_mounts_below  # noqa: E402
from testbed.nodecheck import leftovers  # noqa: E402
from testbed.processes import process_cpu  # noqa: E402

SECTIONS = ("burst", "churn", "restart")
TASK = ["cat", TASK_FILE]
CHROOT_ENV = {"PATH": IMAGE_PATH_ENV, "HOME": "/root", "LC_ALL": "C"}
STUCK = 600.0  # seconds after which a sandbox that has not answered counts as stuck
RSS_INTERVAL = 0.1


@dataclass
class Counts:
    images: int = 50
    sandboxes: int = 200
    cycles: int = 1000
    clients: int = 4
    boxes: int = 8  # restart: running sandboxes at the kill
    pool: int = 2  # restart: ready pooled sandboxes at the kill

    def scaled(self, factor: float) -> Counts:
        def s(n: int, least: int) -> int:
            return max(least, round(n * factor))

        return Counts(
            s(self.images, 2),
            s(self.sandboxes, 4),
            s(self.cycles, 10),
            self.clients,
            s(self.boxes, 2),
            self.pool,
        )


# ---------------------------------------------------------------------------------------
# The store, and a node with its agent


def store(images: AgentImages, layer_trees: bool = True) -> Path:
    """A file:// store with all the images converted (cached; each run copies it, since
    mounts write start-up traces into their store): with their layer trees, as `lazyfs
    convert` publishes them, or with `layer_trees` False their merged trees alone
    (--no-layer-trees; bench/layer_trees.py compares the two)."""
    name = f"agent-store-v{len(images.tags)}-m{manifest.FORMAT_VERSION}-e{erofs.FORMAT_VERSION}"
    extra = ["--layer-trees"] if layer_trees else ["--no-layer-trees"]
    name += "-layers2" if layer_trees else ""  # 2: refs carry what a lookup needs

    def build(tmp: Path) -> None:
        url = f"file://{tmp / 'store'}"
        tmp.mkdir(parents=True)
        names = {t: t for t in images.tags}

        def convert(tag: str) -> None:
            ref = f"oci:{images.layout}:{tag}"
            run([LAZYFS, "convert", ref, "--store", url, "--name", tag, *extra])

        convert(images.tags[0])  # the shared base first, once
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(convert, list(names)[1:]))

    return cached_dir(name, build) / "store"


@contextmanager
def store_copy(images: AgentImages) -> Iterator[tuple[Path, Path]]:
    """A scratch directory and a private copy of store(images) in it, removed afterwards
    (each run copies the store: mounts write start-up traces into it)."""
    cached = store(images)
    scratch = Path(tempfile.mkdtemp(prefix="lazyfs-bench-agent-"))
    try:
        shutil.copytree(cached, scratch / "store")
        yield scratch, scratch / "store"
    finally:
        # A node's data daemon exits a second after the agent's stop released its last tree
        # (LAZYFS_DAEMON_IDLE=1, agent_on): removed before that, its mount point and run
        # directory stayed behind in /tmp, empty.
        wait_no_mounts_below(scratch)
        shutil.rmtree(scratch, ignore_errors=True)


@contextmanager
def agent_on(root: Path, store_dir: Path, *args: str) -> Iterator[AgentProcess]:
    """A started agent on a fresh node under root; stopped (SIGTERM) afterwards."""
    root.mkdir(parents=True)
    agent = AgentProcess(agent_node(root, store_dir), root / "agent.sock")
    # The data daemon stays while the agent holds trees (60 s after their last sandbox);
    # once they are released at the stop it may go at once: nothing is left to check.
    agent.node.env["LAZYFS_DAEMON_IDLE"] = "1"
    agent.start(*args)
    try:
        yield agent
    finally:
        agent.stop()
        agent.node.remove_cgroup_parent()  # empty by now, or kept for the leftover check


def peak_rss(pid: int) -> int:
    """VmHWM (peak RSS) of pid, bytes; 0 if it is gone."""
    return vm_bytes(pid, "VmHWM")


def vm_bytes(pid: int, key: str) -> int:
    """A size in /proc/PID/status (VmHWM, VmRSS, ...), bytes; 0 if pid is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def node_daemons(agent: AgentProcess) -> dict[str, int]:
    """Pids of this node's data daemon and its supervisor (by their run dir)."""
    run_dir = agent.node.env["LAZYFS_RUN_DIR"].encode()
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"LAZYFS_RUN_DIR=" + run_dir not in env:
            continue
        for module, kind in (
            (b"lazyfs.tree.fuse_supervisor", "supervisor"),
            (b"lazyfs.tree.data_daemon", "data daemon"),
        ):
            if module in argv:
                found[kind] = int(pid)
    return found


class PeakWatcher:
    """Keeps the largest VmHWM seen of the agent's node daemons (they may exit by idling).
    /proc is searched for them once a second (with hundreds of sandboxes, a search reads
    thousands of files: a share of a core if done at every sample), and the VmHWM of
    those found is read every RSS_INTERVAL."""

    def __init__(self, agent: AgentProcess) -> None:
        self.agent = agent
        self.peaks: dict[str, int] = {}
        self._pids: dict[str, int] = {}
        self._searched = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> PeakWatcher:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample(search=True)

    def _sample(self, search: bool = False) -> None:
        assert self.agent.proc is not None
        if search or time.monotonic() - self._searched >= 1.0:
            self._pids = {"agent": self.agent.proc.pid, **node_daemons(self.agent)}
            self._searched = time.monotonic()
        for kind, pid in self._pids.items():
            self.peaks[kind] = max(self.peaks.get(kind, 0), peak_rss(pid))

    def _loop(self) -> None:
        while not self._stop.wait(RSS_INTERVAL):
            self._sample()


def sandbox_leftovers(agent: AgentProcess, ids: set[str]) -> dict[str, list]:
    """What of the node's sandboxes is left while the agent runs: its image trees and
    data daemon are the agent's and stay; everything of a sandbox must be gone."""
    left = leftovers(agent.node.tmp, agent.node.sandboxes, agent.node.cgroup_parent, ids)
    left["mounts"] = [m for m in left["mounts"] if m.startswith(str(agent.node.sandboxes))]
    del left["processes"]  # the agent and its data daemon mention the node's dir
    return {k: [str(x) for x in v] for k, v in left.items() if v}


def node_leftovers(agent: AgentProcess, ids: set[str] | None) -> dict[str, list]:
    """After the agent stopped: nothing at all (waiting for the data daemon's idle exit)."""
    deadline = time.monotonic() + 20
    while True:
        node = agent.node
        found = leftovers(node.tmp, node.sandboxes, node.cgroup_parent, ids)
        left = {k: v for k, v in found.items() if v}
        if not left or time.monotonic() > deadline:
            return {k: [str(x) for x in v] for k, v in left.items()}
        time.sleep(0.2)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


# ---------------------------------------------------------------------------------------
# burst


def jobs_for(images: AgentImages, counts: Counts) -> list[str]:
    tags = images.tags[: counts.images]
    return [tags[i % len(tags)] for i in range(counts.sandboxes)]


def lazyfs_burst(
    root: Path,
    store_dir: Path,
    images: AgentImages,
    counts: Counts,
    warm: int = 0,
    again: bool = False,
) -> dict:
    """The burst on a new agent; with `warm`, `--warm warm` and the generic pool full
    before it starts (bench/generic_claims.py). With `again`, once its sandboxes are
    deleted and the pool is full again, the same burst once more on the same agent
    (res["again"]): its image trees mounted, its manifests in the node cache, which
    splits what a new image costs a claim from what every claim costs."""
    jobs = jobs_for(images, counts)
    args = ["--max-sandboxes", str(len(jobs) + warm + 10)]
    with agent_on(root, store_dir, *args, *(["--warm", str(warm)] if warm else [])) as agent:
        fill = 0.0
        if warm:
            with agent.client() as c:
                fill = wait_pool_full(c, warm)
        with PeakWatcher(agent) as rss:
            first = _burst_on(agent, images, jobs, warm)
        boxes = first.pop("boxes")
        left_running = sandbox_leftovers(agent, set(boxes))
        log = agent.log()
        repeat = None
        if again:
            if warm:
                with agent.client() as c:
                    c.set_warm(warm)
                    wait_pool_full(c, warm)
            repeat = _burst_on(agent, images, jobs, warm)
            again_boxes = repeat.pop("boxes")
            repeat["left_after_delete"] = sandbox_leftovers(agent, set(again_boxes))
            boxes += again_boxes
            repeat.pop("listed_running")
            repeat["logged_p50"] = logged_p50(agent.log()[len(log) :])
    left = node_leftovers(agent, set(boxes))
    logged = logged_p50(log)
    return {
        "sandboxes": len(jobs),
        "images": counts.images,
        "warm": warm,
        "warm_fill": fill,
        **first,
        "logged_p50": logged,  # source -> part -> the median seconds the agent logged
        "peak_rss_mb": {k: v / 1e6 for k, v in rss.peaks.items()},
        "left_after_delete": left_running,
        "left_after_stop": left,
        **({"again": repeat} if repeat is not None else {}),
    }


def _cpu(pid: int) -> float:
    """process_cpu, or 0.0 for a process that is gone."""
    try:
        return process_cpu(pid)
    except OSError:
        return 0.0


def logged_p50(log: str) -> dict[str, dict[str, float]]:
    """Source -> part -> the median seconds the agent logged (logged_claims)."""
    return {
        source: {k: pct([p[k] for p in parts], 0.5) for k in parts[0]}
        for source, parts in logged_claims(log).items()
    }


def _burst_on(agent: AgentProcess, images: AgentImages, jobs: list[str], warm: int) -> dict:
    """One burst on a running agent: every job's create and task at once, then its
    sandboxes deleted (their ids under "boxes"). "cpu_s": the seconds of CPU the agent and
    the node's data daemon (supervisor and worker) used from the start of the burst to
    its last answer (a daemon started by the burst: since its start)."""
    boxes: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(len(jobs) + 1)
    t0 = 0.0

    def one(tag: str) -> dict:
        with agent.client() as c:
            start.wait()
            t = time.perf_counter()
            sb = c.create(tag, ttl=3600)
            created = time.perf_counter() - t
            with lock:
                boxes.append(sb.id)
            r = sb.exec(TASK, timeout=300)
            return {
                "create": created,
                "output_at": time.perf_counter() - t0,
                "ok": r.exit_code == 0 and r.stdout.decode() == images.expected[tag],
            }

    assert agent.proc is not None
    before = {"agent": agent.proc.pid, **node_daemons(agent)}
    with agent.client() as c:
        claimed = {k: v["count"] for k, v in claim_metrics(c).items()}
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(one, tag) for tag in jobs]
        used = {kind: _cpu(pid) for kind, pid in before.items()}
        t0 = time.perf_counter()
        start.wait()
        done, stuck = wait(futures, timeout=STUCK)
        wall = time.perf_counter() - t0
        cpu = {
            kind: _cpu(pid) - (used[kind] if before.get(kind) == pid else 0.0)
            for kind, pid in {"agent": agent.proc.pid, **node_daemons(agent)}.items()
        }
        results, errors = [], []
        for f in done:
            try:
                results.append(f.result())
            except AgentError as exc:
                errors.append(f"{exc.status} {exc}")
        with agent.client() as c:
            listed = [b for b in c.list() if b["state"] == "running"]
            claims = {k: v["count"] - claimed.get(k, 0.0) for k, v in claim_metrics(c).items()}
            if warm:  # its ready sandboxes go too: nothing of a sandbox is to be left
                no_generic(c)
    with agent.client() as c, ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: c.sandbox(i).delete(missing_ok=True), boxes))
    creates = [r["create"] for r in results]
    return {
        "boxes": boxes,
        "claims": claims,
        "right": sum(r["ok"] for r in results),
        "wrong": sum(not r["ok"] for r in results),
        "errors": errors,
        "stuck": len(stuck),
        "listed_running": len(listed),
        "create_p50": pct(creates, 0.5) if creates else None,
        "create_p99": pct(creates, 0.99) if creates else None,
        "create_max": max(creates) if creates else None,
        "last_output": max(r["output_at"] for r in results) if results else wall,
        "cpu_s": cpu,
    }


def tar_burst(root: Path, images: AgentImages, counts: Counts) -> dict:
    """Full pull: each image's layers unpacked with GNU tar from the local layout (cores-
    many images at once), then its tasks in chroots; time to the last right output."""
    jobs = jobs_for(images, counts)
    per_image: dict[str, int] = {}
    for tag in jobs:
        per_image[tag] = per_image.get(tag, 0) + 1
    root.mkdir(parents=True)

    def one(tag: str) -> list[float]:
        rootfs = root / tag
        rootfs.mkdir()
        for layer in layout_layers(images.layout, tag):
            untar_layer(images.layout / "blobs" / layer["digest"].replace(":", "/"), rootfs)
        with ThreadPoolExecutor(per_image[tag]) as pool:
            runs = [
                pool.submit(timed_run, ["chroot", rootfs, *TASK], CHROOT_ENV, t0)
                for _ in range(per_image[tag])
            ]
            outs = [r.result() for r in runs]
        if any(o.out != images.expected[tag] for o in outs):
            raise RuntimeError(f"{tag}: a chroot printed {outs[0].out!r}")
        return [o.exit for o in outs]

    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
            ends = [x for lst in pool.map(one, list(per_image)) for x in lst]
        return {"last_output": max(ends), "disk_mb": len(per_image) * _rootfs_mb(root)}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _rootfs_mb(root: Path) -> float:
    first = next(root.iterdir())
    total = 0
    for dirpath, _, names in os.walk(first):
        for n in names:
            with suppress(OSError):
                total += os.lstat(os.path.join(dirpath, n)).st_size
    return total / 1e6


def bench_burst(scratch: Path, store_dir: Path, images: AgentImages, counts: Counts) -> dict:
    res = lazyfs_burst(scratch / "burst", store_dir, images, counts)
    print(
        f"  lazyfs: {res['right']}/{res['sandboxes']} right,"
        f" last output {res['last_output']:.1f} s",
        flush=True,
    )
    res["tar"] = tar_burst(scratch / "tar", images, counts)
    print(f"  GNU tar + chroot: last output {res['tar']['last_output']:.1f} s", flush=True)
    return res


# ---------------------------------------------------------------------------------------
# churn


def bench_churn(scratch: Path, store_dir: Path, images: AgentImages, counts: Counts) -> dict:
    tags = images.tags[: counts.images]
    with agent_on(scratch / "churn", store_dir) as agent:
        ids: set[str] = set()
        lock = threading.Lock()
        next_cycle = iter(range(counts.cycles))

        def client_loop() -> tuple[list[float], list[str]]:
            times, errors = [], []
            with agent.client() as c:
                while True:
                    with lock:
                        i = next(next_cycle, None)
                    if i is None:
                        return times, errors
                    tag = tags[i % len(tags)]
                    t = time.perf_counter()
                    try:
                        sb = c.create(tag)
                        with lock:
                            ids.add(sb.id)
                        r = sb.exec(TASK, timeout=120)
                        sb.delete()
                    except AgentError as exc:
                        errors.append(f"{exc.status} {exc}")
                        continue
                    if r.exit_code != 0 or r.stdout.decode() != images.expected[tag]:
                        errors.append(
                            f"{tag}: exit {r.exit_code}, {r.seconds:.3f} s, stdout {r.stdout!r},"
                            f" stderr {r.stderr[-300:]!r}"
                        )
                        continue
                    times.append(time.perf_counter() - t)

        # Warm-up: one cycle per image (mounts, first reads) outside the clock.
        with agent.client() as c:
            for tag in tags:
                with c.create(tag) as sb:
                    ids.add(sb.id)
                    sb.exec(TASK)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(counts.clients) as pool:
            outcomes = list(pool.map(lambda _: client_loop(), range(counts.clients)))
        wall = time.perf_counter() - t0
        times = [t for ts, _ in outcomes for t in ts]
        errors = [e for _, es in outcomes for e in es]
        with agent.client() as c:
            listed = c.list()
        left_running = sandbox_leftovers(agent, ids)
    left = node_leftovers(agent, ids)
    return {
        "cycles": counts.cycles,
        "clients": counts.clients,
        "images": len(tags),
        "ok": len(times),
        "errors": errors[:10],
        "error_count": len(errors),
        "wall": wall,
        "per_second": len(times) / wall,
        "cycle_p50": pct(times, 0.5) if times else None,
        "cycle_p99": pct(times, 0.99) if times else None,
        "listed_after": len(listed),
        "left_agent_up": {k: [str(x) for x in v] for k, v in left_running.items()},
        "left_after_stop": left,
    }


# ---------------------------------------------------------------------------------------
# restart


def bench_restart(scratch: Path, store_dir: Path, images: AgentImages, counts: Counts) -> dict:
    tags = images.tags[: counts.images]
    pool_image = tags[0]
    with agent_on(scratch / "restart", store_dir, "--pool", f"{pool_image}={counts.pool}") as agent:
        with agent.client() as c:
            wait_pool_full(c, counts.pool)
            boxes = [c.create(tags[i % len(tags)]) for i in range(counts.boxes)]
            for sb in boxes:
                sb.write_file("/tmp/mark", sb.id.encode())
        busy = boxes[: len(boxes) // 2]  # these are mid-command at the kill
        outcomes: dict[str, str] = {}

        def mid_exec(box_id: str) -> None:
            try:
                with agent.client() as c:
                    c.sandbox(box_id).exec(["sh", "-c", "echo started; exec sleep 35"])
                outcomes[box_id] = "finished (it should have been cut off)"
            except AgentError as exc:  # the connection dies with the agent
                outcomes[box_id] = f"{type(exc).__name__}: {exc}".replace(
                    str(agent.socket), "SOCKET"
                )

        threads = [threading.Thread(target=mid_exec, args=(sb.id,)) for sb in busy]
        for t in threads:
            t.start()
        with agent.client() as c:
            deadline = time.monotonic() + 30
            while not all(_sleeping(c, sb.id) for sb in busy):
                assert time.monotonic() < deadline, "the commands did not start"
                time.sleep(0.1)
            wait_pool_full(c, counts.pool)  # refilled after the claims the creates made
            pooled = [b["id"] for b in c.list() if b["state"] == "ready"]
        agent.kill9()
        for t in threads:
            t.join(30)
        t0 = time.perf_counter()
        agent.start()
        answered = time.perf_counter() - t0
        with agent.client() as c:
            health = c.health()
            adopted = set(health["adopted_on_start"])
            first = c.sandbox(boxes[0].id).exec(["cat", "/tmp/mark"])
            served = time.perf_counter() - t0
            marks_ok = all(
                c.sandbox(sb.id).read_file("/tmp/mark") == sb.id.encode() for sb in boxes
            )
            cut_off = all(not _sleeping(c, sb.id) for sb in busy)
            gone: dict[str, int] = {}
            for box_id in pooled:
                try:
                    c.sandbox(box_id)
                    gone[box_id] = 200
                except AgentError as exc:
                    gone[box_id] = exc.status
            works = all(c.sandbox(sb.id).exec(["true"]).exit_code == 0 for sb in boxes)
            for sb in boxes:
                c.sandbox(sb.id).delete()
        ids = {sb.id for sb in boxes} | set(pooled)
        ids |= {b for b in health["cleaned_on_start"]}
    left = node_leftovers(agent, ids)
    expected_adopted = {sb.id for sb in boxes}
    return {
        "running": len(boxes),
        "mid_exec": len(busy),
        "pooled": len(pooled),
        "adopted": len(adopted),
        "adopted_right": adopted == expected_adopted,
        "cleaned": sorted(health["cleaned_on_start"]),
        "pooled_cleaned": all(p in health["cleaned_on_start"] for p in pooled),
        "pooled_status": sorted(set(gone.values())),
        "answer_s": answered,
        "first_exec_s": served,
        "first_exec_ok": first.stdout == boxes[0].id.encode(),
        "files_kept": marks_ok,
        "interrupted_gone": cut_off,
        "all_serve": works,
        "client_saw": sorted(set(outcomes.values())),
        "left_after_stop": left,
    }


def wait_pool_full(c: Client, size: int, timeout: float = 120, poll: float = 0.1) -> float:
    """Wait until the agent's pools hold `size` ready sandboxes; the seconds it took."""
    t0 = time.monotonic()
    while sum(p["ready"] for p in c.pools()) < size:
        assert time.monotonic() < t0 + timeout, f"the pool did not fill: {c.pools()}"
        time.sleep(poll)
    return time.monotonic() - t0


def no_generic(c: Client, timeout: float = 120) -> None:
    """The generic pool's target 0, and none of its sandboxes left, ready or being made."""
    c.set_warm(0)
    deadline = time.monotonic() + timeout
    while any(p["ready"] or p["creating"] for p in c.pools() if p["generic"]):
        assert time.monotonic() < deadline, f"the generic pool did not empty: {c.pools()}"
        time.sleep(0.05)


# The agent's log line for a generic claim (lazyfs/agent/node.py, _claim_generic); a cold
# create's is agent_bench.COLD_LINE.
GIVEN_LINE = re.compile(r"sandbox (\S+): given image \S+'s root in ([0-9.]+) s \((.*)\)")


def logged_claims(log: str) -> dict[str, list[dict[str, float]]]:
    """Where claims' time went in the agent, by source, from the lines it logs: a cold
    create's whole ("logged", from the image lookup) and parts (image, tree, prepare,
    runtime), a generic claim's ("logged", from the image lookup; image, tree, user,
    root); seconds. "image" holds a new image's tree mount (lazyfs/agent/arrivals.py)."""
    found: dict[str, list[dict[str, float]]] = {}
    for source, line in (("cold", COLD_LINE), ("generic", GIVEN_LINE)):
        for m in line.finditer(log):
            parts = {"logged": float(m[2])}
            for item in m[3].split(", "):
                key, value = item.split()
                parts[key] = float(value)
            found.setdefault(source, []).append(parts)
    return found


def claim_metrics(c: Client) -> dict[str, dict[str, float]]:
    """The agent's claims so far by source ("pool", "generic", "cold"): how many
    (lazyfs_claims_total) and their seconds in all (lazyfs_claim_seconds_sum)."""
    found: dict[str, dict[str, float]] = {}
    for line in c.metrics().splitlines():
        m = re.fullmatch(r'lazyfs_claim(s_total|_seconds_sum)\{source="(\w+)"\} (\S+)', line)
        if m:
            key = "count" if m[1] == "s_total" else "seconds"
            found.setdefault(m[2], {"count": 0.0, "seconds": 0.0})[key] = float(m[3])
    return found


def _sleeping(c: Client, box_id: str) -> bool:
    count = "for p in /proc/[0-9]*; do tr '\\0' ' ' <$p/cmdline; echo; done | grep -c '^sleep 35'"
    return c.sandbox(box_id).exec(["sh", "-c", count]).stdout.strip() != b"0"


# ---------------------------------------------------------------------------------------
# Output


def _s(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def left_text(d: dict) -> str:
    """What leftovers() found, in a few words."""
    return "nothing" if not d else "; ".join(f"{k}: {len(v)}" for k, v in d.items())


def burst_table(r: dict) -> str:
    tar = r["tar"]["last_output"]
    rss = r["peak_rss_mb"]
    rows = [
        ["sandboxes (distinct images)", f"{r['sandboxes']} ({r['images']})"],
        [
            "outputs right / wrong / errors / stuck",
            f"{r['right']} / {r['wrong']} / {len(r['errors'])} / {r['stuck']}",
        ],
        ["running when all had answered", r["listed_running"]],
        [
            "create latency p50 / p99 / max",
            f"{_s(r['create_p50'])} / {_s(r['create_p99'])} / {_s(r['create_max'])} s",
        ],
        ["lazyfs: to the last output", f"{_s(r['last_output'])} s"],
        ["GNU tar + chroot (full pull): to the last output", f"{_s(tar)} s"],
        ["full pull / lazyfs", f"**{tar / r['last_output']:.2f}x**"],
        ["agent peak RSS", f"{rss.get('agent', 0):.0f} MB"],
        [
            "node data daemon + supervisor peak RSS",
            f"{rss.get('data daemon', 0):.0f} + {rss.get('supervisor', 0):.0f} MB",
        ],
        ["unpacked trees the full pull wrote", f"{r['tar']['disk_mb']:,.0f} MB"],
        [
            "left after the deletes (agent up) / after stop",
            f"{left_text(r['left_after_delete'])} / {left_text(r['left_after_stop'])}",
        ],
    ]
    return table(["burst", "value"], rows)


def churn_table(r: dict) -> str:
    rows = [
        ["cycles (clients, images)", f"{r['cycles']} ({r['clients']}, {r['images']})"],
        ["cycles right / failed", f"{r['ok']} / {r['error_count']}"],
        ["sandboxes per second", f"**{r['per_second']:.1f}**"],
        ["cycle latency p50 / p99", f"{_s(r['cycle_p50'], 3)} / {_s(r['cycle_p99'], 3)} s"],
        ["wall", f"{r['wall']:.1f} s"],
        ["sandboxes listed afterwards", r["listed_after"]],
        ["left with the agent up", left_text(r["left_agent_up"])],
        ["left after it stopped", left_text(r["left_after_stop"])],
    ]
    return table(["churn", "value"], rows)


def restart_table(r: dict) -> str:
    def yes(b: bool) -> str:
        return "yes" if b else "**no**"

    rows = [
        [
            "at the kill: running (mid-command) / pooled",
            f"{r['running']} ({r['mid_exec']}) / {r['pooled']}",
        ],
        ["adopted (= the running ones)", f"{r['adopted']} ({yes(r['adopted_right'])})"],
        [
            "cleaned up (the pooled ones among them)",
            f"{len(r['cleaned'])} ({yes(r['pooled_cleaned'])}; they answer {r['pooled_status']})",
        ],
        ["new agent answers after", f"{r['answer_s']:.2f} s"],
        ["first command in an adopted sandbox done after", f"{r['first_exec_s']:.2f} s"],
        [
            "files kept / interrupted commands gone / all serve",
            f"{yes(r['files_kept'])} / {yes(r['interrupted_gone'])} / {yes(r['all_serve'])}",
        ],
        ["what the interrupted clients saw", "; ".join(r["client_saw"])],
        ["left after stop", left_text(r["left_after_stop"])],
    ]
    return table(["restart", "value"], rows)


TABLES: dict[str, Callable[[dict], str]] = {
    "burst": burst_table,
    "churn": churn_table,
    "restart": restart_table,
}


def plot(res: dict) -> None:
    fig, plots = section_axes(res, SECTIONS, (5, 4.4))
    for ax, section, r in plots:
        if section == "burst":
            bars = ax.bar(
                ["GNU tar + chroot", "lazyfs agent"], [r["tar"]["last_output"], r["last_output"]]
            )
            ax.set_ylabel("seconds to the last output")
            ax.set_title(f"{r['sandboxes']} sandboxes of {r['images']} images at once")
        elif section == "churn":
            bars = ax.bar(["p50", "p99"], [r["cycle_p50"] or 0, r["cycle_p99"] or 0])
            ax.set_ylabel("seconds per create/exec/delete")
            ax.set_title(f"churn: {r['per_second']:.1f} sandboxes/s, {r['clients']} clients")
        else:
            bars = ax.bar(["agent answers", "first exec"], [r["answer_s"], r["first_exec_s"]])
            ax.set_ylabel("seconds after the restart")
            ax.set_title(f"kill -9: {r['adopted']} adopted, {len(r['cleaned'])} cleaned")
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
    fig.tight_layout()
    save_plot(fig, "agent_scale")


def show(res: dict) -> int:
    title = "The node agent at scale (bench/agent_scale.py)"
    return show_sections("agent_scale", title, res, TABLES, plot)


# ---------------------------------------------------------------------------------------


def section_parser(doc: str, sections: tuple[str, ...], name: str) -> argparse.ArgumentParser:
    """The options of an agent bench of sections: --only, --scale, --report."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--only", choices=sections, action="append", help="run only this section")
    p.add_argument("--scale", type=float, default=1.0, help="multiply the counts (e.g. 0.1)")
    p.add_argument("--report", action="store_true", help=f"redo table + plot from {name}.json")
    return p


def can_run(name: str) -> bool:
    """As root (mounts, runc), with SIGTERM ending through the clean-up; else says so."""
    if os.geteuid() != 0:
        print(f"{name} needs root (mounts, runc)", file=sys.stderr)
        return False
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return True


def main() -> int:
    args = section_parser(__doc__, SECTIONS, "agent_scale").parse_args()
    if args.report:
        return show(json.loads((RESULTS / "agent_scale.json").read_text()))
    if not can_run("agent_scale"):
        return 2
    steps = {"burst": bench_burst, "churn": bench_churn, "restart": bench_restart}
    return show(run_on_store("agent_scale", steps, args.only, Counts().scaled(args.scale)))


def run_on_store(
    name: str, steps: dict[str, Callable], only: list[str] | None, counts: Any
) -> dict:
    """Run the sections `only` (None: all of `steps`, section -> step(scratch, store_dir,
    images, counts)) on a private copy of the store of the agent images (run_sections)."""
    images = ensure_agent_images(cache_root())
    with store_copy(images) as (scratch, store_dir):
        chosen = {s: partial(steps[s], scratch, store_dir, images, counts) for s in only or steps}
        return run_sections(name, chosen, merge=bool(only))


if __name__ == "__main__":
    sys.exit(main())
