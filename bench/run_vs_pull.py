"""Time to the first output of a sandbox: full image pull vs `lazyfs run` (issue 3).

On the python test image (Debian bookworm minbase + python3: 2 gzip layers, 80.3 MB
compressed, 217.7 MB of tar), the time from "start" to the first line printed by
`python3 -c 'print("hello")'`, measured side by side in one run:

  (a)  full pull: fetch every layer blob (sha256-verified, layers in parallel), unpack
       the layers one after the other into a fresh directory with GNU tar (gzip, numeric
       owners, xattrs; whiteouts and opaque directories applied after each layer, as an
       overlay snapshotter would see them), then `chroot DIR python3 -c ...`. This is the
       fastest honest baseline we have; it runs inside this (already started) Python
       process, so it pays no interpreter start-up, unlike (b) and (c).
  (a') the same fetch, unpacked with `umoci unpack` (the reference extraction), local only.
  (b0) `lazyfs run IMAGE --cache EMPTY_DIR -- python3 -c ...` with LAZYFS_PREFETCH=0: the
       run starts the mount, which fetches each chunk when python3 first reads it.
  (b)  the same with prefetch on (the default): the image's start-up trace, recorded by
       one unmeasured run per setting before the rounds (in practice by the first run of
       the image on any node), is replayed by the mount while python3 starts.
  (c)  the same again with the node cache (b) filled (a new mount, warm chunks).
  (d)  the next sandbox of the image while a `lazyfs run --linger` before it keeps the
       image mounted (the mount is there, chunks warm): what back-to-back sandboxes of
       one image on a node pay.

Settings:
  local  file:// store for lazyfs, the local OCI layout for the full pull (both read
         from the host's page cache: nothing is dropped, other people share the machine).
  1gbit  SeaweedFS S3 in a network namespace behind a veth pair shaped by tbf to 1 Gbit/s
         both ways (bench/netns.py); lazyfs reads s3:// through it, the full pull GETs the
         layer blobs from the same bucket through it and unpacks locally.
  1gbit+4ms  as 1gbit, through a TCP delay line in the namespace adding 2 ms each way.

Every measurement is repeated REPEAT times, interleaved (a, a', b0, b, c, d per round), and the
median is reported. A breakdown of (b) follows: CLI start-up, manifest fetch, mount
start-up, python3's reads on a cold mount, the sandbox set-up.

Run (as root): .venv/bin/python bench/run_vs_pull.py [--repeat N] [--no-latency]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from _common import (
    LAZYFS,
    REPO,
    images,
    layout_layers,
    rootfs,
    run,
    timed_run,
)
from _report import (
    grouped_bars,
    load_average,
    machine_note,
    mb,
    pyplot,
    save_markdown,
    save_plot,
    spread,
    table,
)
from netns import ShapedLink, delay_proxy, leftovers, shaped_link  # noqa: E402

from lazyfs.tree.node_files import mount_stats, read_stats  # noqa: E402
from testbed.mounts import mounts_below  # noqa: E402
from testbed.seaweed import Seaweed, free_port  # noqa: E402

TAG = "python"
NAME = "bench-python"
COMMAND = ["python3", "-c", 'print("hello")']
EXPECTED = b"hello"
REPEAT = 3
RATE = "1gbit"
DELAY_MS = 2.0  # one way, each direction: +4 ms round trip
GOAL_LOCAL = 5.0  # issue 3: (b) at least 5x faster than (a) from a local store
PY = REPO / ".venv" / "bin" / "python"
CHILD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
RUN_TIMEOUT = 180.0  # seconds before a hung command is killed
STATS_WAIT = 15.0  # seconds for a mount daemon to publish its final stats


# ---------------------------------------------------------------------------------------
# Where the image comes from


@dataclass
class Setting:
    label: str
    store_url: str
    env: dict[str, str]  # environment of the lazyfs processes (AWS_* for s3://)
    fetch_blob: Callable[[dict, Path], None]  # layer descriptor -> verified file
    s3_requests: Callable[[], int] | None = None  # requests the S3 server has served


def copy_verified(read: Callable[[int], bytes], digest: str, dest: Path) -> None:
    """Write a blob from `read` to dest, checking its sha256 as a puller does."""
    h = hashlib.sha256()
    with open(dest, "wb") as out:
        while chunk := read(1 << 20):
            h.update(chunk)
            out.write(chunk)
    if "sha256:" + h.hexdigest() != digest:
        raise RuntimeError(f"blob {digest} arrived corrupt")


def local_fetcher(layout: Path) -> Callable[[dict, Path], None]:
    def fetch(layer: dict, dest: Path) -> None:
        algo, hexd = layer["digest"].split(":", 1)
        with open(layout / "blobs" / algo / hexd, "rb") as src:
            copy_verified(src.read, layer["digest"], dest)

    return fetch


def s3_fetcher(client: Any, bucket: str) -> Callable[[dict, Path], None]:
    def fetch(layer: dict, dest: Path) -> None:
        body = client.get_object(Bucket=bucket, Key=blob_key(layer))["Body"]
        try:
            copy_verified(body.read, layer["digest"], dest)
        finally:
            body.close()

    return fetch


def blob_key(layer: dict) -> str:
    return "blobs/" + layer["digest"].replace(":", "/")


# ---------------------------------------------------------------------------------------
# (a) full pull


def apply_whiteouts(root: Path, names: list[str]) -> None:
    """Turn one extracted layer's whiteout files into deletions (OCI image spec)."""
    members = {os.path.normpath(n) for n in names if n.strip()}
    prefixes = {str(a) for m in members for a in Path(m).parents}
    for name in sorted(members):
        base = os.path.basename(name)
        parent = os.path.dirname(name)
        if base == ".wh..wh..opq":
            # Opaque directory: nothing below it from lower layers survives.
            for dirpath, dirnames, filenames in os.walk(root / parent, topdown=False):
                for entry in dirnames + filenames:
                    full = Path(dirpath) / entry
                    rel = str(full.relative_to(root))
                    if rel not in members and rel not in prefixes:
                        remove(full)
            remove(root / name)
        elif base.startswith(".wh."):
            remove(root / parent / base[len(".wh.") :])
            remove(root / name)


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def untar_layer(blob: Path, root: Path) -> None:
    proc = run(
        [
            "tar",
            "--numeric-owner",
            "--xattrs",
            "--xattrs-include=*",
            "--quoting-style=literal",
            "-xzvf",  # -v: the member names, for the whiteout pass
            blob,
            "-C",
            root,
        ]
    )
    apply_whiteouts(root, proc.stdout.splitlines())


def first_line(
    argv: list[str | Path], env: dict[str, str] | None = None, start: float | None = None
) -> tuple[float, float]:
    """Run argv; (seconds until its first stdout line, seconds until it exited)."""
    t = timed_run(argv, env, start, RUN_TIMEOUT)
    line = t.out.split("\n", 1)[0]
    if line.strip() != EXPECTED.decode():
        raise RuntimeError(f"{' '.join(map(str, argv))} printed {line!r}, not {EXPECTED!r}")
    return t.first, t.exit


def full_pull(
    setting: Setting, layers: list[dict], work: Path, layout: Path, umoci: bool = False
) -> dict[str, float]:
    """(a) / (a'): fetch, unpack, chroot; seconds of each phase and to the first output."""
    blobs = work / "blobs"
    blobs.mkdir(parents=True)
    t0 = time.perf_counter()
    paths = [blobs / layer["digest"].split(":", 1)[1] for layer in layers]
    with ThreadPoolExecutor(len(layers)) as pool:
        list(pool.map(setting.fetch_blob, layers, paths))
    t_fetch = time.perf_counter() - t0
    if umoci:
        # umoci reads an OCI layout: the index, manifest and config come from the local
        # layout (small), the layer blobs we just fetched are linked in next to them.
        tmp_layout = work / "layout"
        shutil.copytree(layout, tmp_layout, ignore=shutil.ignore_patterns("blobs"))
        fetched = {p.name for p in paths}
        shutil.copytree(
            layout / "blobs", tmp_layout / "blobs", ignore=lambda _dir, names: fetched & set(names)
        )
        for p in paths:
            os.link(p, tmp_layout / "blobs" / "sha256" / p.name)
        run(["umoci", "unpack", "--image", f"{tmp_layout}:{TAG}", work / "bundle"])
        root = work / "bundle" / "rootfs"
    else:
        root = work / "rootfs"
        root.mkdir()
        for p in paths:
            untar_layer(p, root)
    t_unpack = time.perf_counter() - t0 - t_fetch
    t_first, t_exit = first_line(["chroot", root, *COMMAND], env={"PATH": CHILD_PATH}, start=t0)
    return {
        "first": t_first,
        "exit": t_exit,
        "fetch": t_fetch,
        "unpack": t_unpack,
        "run": t_first - t_fetch - t_unpack,
    }


# ---------------------------------------------------------------------------------------
# (b), (c) lazyfs run


COUNTERS = ("store_requests", "bytes_fetched")


def final_stats(cache: Path, after_pids: set[int]) -> dict:
    """The final stats of the mounts that just ended (not of the daemons `after_pids`),
    once every tree of theirs has ended, with node_counters() for COUNTERS."""
    deadline = time.monotonic() + STATS_WAIT
    while True:
        mine = [s for s in mount_stats(cache) if s.get("pid") not in after_pids]
        if mine and all(s.get("mounted") is False for s in mine):
            return {**mine[0], **node_counters(mine)}
        if time.monotonic() > deadline:
            raise RuntimeError(f"no final mount stats in {cache}/mounts")
        time.sleep(0.02)


def node_counters(stats: list[dict]) -> dict[str, int]:
    """COUNTERS of a node's mounts, from mount_stats(): a data daemon has one stats file
    per tree (an image on layer trees has several), each given that daemon's newest
    node-wide figures by mount_stats, so each daemon counts once, not once per tree; the
    daemons (per-image FUSE trees have one each) add up."""
    per_daemon = {s.get("pid"): s for s in stats}
    return {k: sum(int(s.get(k) or 0) for s in per_daemon.values()) for k in COUNTERS}


def lazy_run(setting: Setting, cache: Path, env: dict[str, str]) -> dict[str, Any]:
    old = {s.get("pid") for s in mount_stats(cache)}
    before = setting.s3_requests() if setting.s3_requests else 0
    wall0, t0 = time.time(), time.perf_counter()
    t_first, t_exit = first_line(
        [LAZYFS, "run", NAME, "--store", setting.store_url, "--cache", cache, "--", *COMMAND],
        env=env,
        start=t0,
    )
    stats = final_stats(cache, old)
    s3 = setting.s3_requests() - before if setting.s3_requests else None
    mounted = mounted_at(cache, wall0) - wall0
    return {
        "first": t_first,
        "exit": t_exit,
        "mounted": mounted,
        "after_mount": t_first - mounted,
        "stats": stats,
        "s3_requests": s3,
    }


LINGER = 20  # seconds: ample for the next run to start, short for the reaper left behind


def lingered_run(setting: Setting, cache: Path, env: dict[str, str]) -> dict[str, Any]:
    """(d): an unmeasured `run --linger` leaves the image mounted; the measured run finds
    the mount and, as its last user without --linger, unmounts it."""
    argv = [LAZYFS, "run", NAME, "--store", setting.store_url, "--cache", cache]
    first_line([*argv, "--linger", str(LINGER), "--", *COMMAND], env=env)
    mountpoints = [p for p in mounts_below(Path(env["LAZYFS_RUN_DIR"])) if "/images/" in p]
    if len(mountpoints) != 1:
        raise RuntimeError(f"--linger left {mountpoints} mounted, expected one image")
    t_first, t_exit = first_line([*argv, "--", *COMMAND], env=env)
    wait_unmounted(Path(mountpoints[0]))
    return {"first": t_first, "exit": t_exit}


def mounted_at(cache: Path, since: float) -> float:
    """When the image's tree came up after `since`: its FUSE daemon logged "mounted
    image", or the node data daemon "serving image" (the EROFS tree's device opened)."""
    found = None
    for log in (cache / "mounts").glob("*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if " mounted image " in line or " serving image " in line:
                stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                if stamp >= since - 0.001:
                    found = stamp if found is None else max(found, stamp)
    if found is None:
        raise RuntimeError(f"no 'mounted image' or 'serving image' line in {cache}/mounts")
    return found


# ---------------------------------------------------------------------------------------
# One setting, all methods


@dataclass
class Result:
    setting: str
    runs: dict[str, list[dict]] = field(default_factory=dict)
    breakdown: list[dict[str, Any]] = field(default_factory=list)

    def median(self, method: str, key: str = "first") -> float:
        return statistics.median(r[key] for r in self.runs[method])


def measure(
    setting: Setting,
    layers: list[dict],
    layout: Path,
    scratch: Path,
    repeat: int,
    env: dict[str, str],
    umoci: bool,
) -> Result:
    res = Result(setting.label)
    methods = ["a", "a'", "b0", "b", "c", "d"] if umoci else ["a", "b0", "b", "c", "d"]
    for m in methods:
        res.runs[m] = []
    # One unmeasured run records the image's start-up trace in the store (if none yet).
    cache = scratch / f"cache-{setting.label}-record"
    cache.mkdir()
    try:
        rec = lazy_run(setting, cache, env)
        print(f"  [{setting.label}] trace: {rec['stats'].get('trace')}", flush=True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    no_prefetch = {**env, "LAZYFS_PREFETCH": "0"}
    for i in range(repeat):
        for m in ("a", "a'") if umoci else ("a",):
            work = Path(tempfile.mkdtemp(prefix=f"pull-{i}-", dir=scratch))
            try:
                res.runs[m].append(full_pull(setting, layers, work, layout, umoci=m == "a'"))
            finally:
                shutil.rmtree(work, ignore_errors=True)
        cache = scratch / f"cache-{setting.label}-{i}-b0"
        cache.mkdir()
        try:
            res.runs["b0"].append(lazy_run(setting, cache, no_prefetch))
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        cache = scratch / f"cache-{setting.label}-{i}"
        cache.mkdir()
        try:
            res.runs["b"].append(lazy_run(setting, cache, env))
            res.runs["c"].append(lazy_run(setting, cache, env))
            res.runs["d"].append(lingered_run(setting, cache, env))
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        line = ", ".join(f"{m} {res.runs[m][-1]['first']:.2f}s" for m in methods)
        print(f"  [{setting.label}] round {i + 1}/{repeat}: {line}", flush=True)
    return res


# ---------------------------------------------------------------------------------------
# Where the time of (b) goes


MANIFEST_PROBE = r"""
import json, sys, time
t0 = time.perf_counter()
from chunker.store.backends import open_store
from chunker.images import fetch_manifest
from chunker.refs import resolve_image
t1 = time.perf_counter()
store = open_store(sys.argv[1])
t2 = time.perf_counter()
image_id = resolve_image(store, sys.argv[2])
t3 = time.perf_counter()
fetch_manifest(store, image_id, __import__("pathlib").Path(sys.argv[3]))
t4 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "open_store": t2 - t1, "resolve": t3 - t2,
                  "fetch_manifest": t4 - t3}))
"""


RUNTIME_PROBE = r"""
import json, sys, time
from pathlib import Path
from lazyfs.sandbox.runtime import Sandbox, SandboxHost, SandboxRequest
from lazyfs.settings import Settings
host = SandboxHost.of(Settings.from_env())
box = Sandbox.prepare(Path(sys.argv[1]), SandboxRequest({}, ["/bin/true"]), host)
try:
    status = box.run_foreground()
    t0 = time.perf_counter()
finally:
    box.delete()
box.timings["delete"] = time.perf_counter() - t0
print(json.dumps(box.timings))
"""


def timed(argv: list[str | Path], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    run(argv, env=env)
    return time.perf_counter() - t0


def breakdown(setting: Setting, scratch: Path, env: dict[str, str]) -> dict[str, Any]:
    """Each piece of (b) on its own, on a fresh cache (one sample of each)."""
    out: dict[str, Any] = {}
    out["interpreter"] = timed([PY, "-c", "pass"], env)
    out["cli_imports"] = timed([PY, "-c", "import lazyfs.cli, lazyfs.sandbox.run"], env)
    out["daemon_imports"] = timed(
        [
            PY,
            "-c",
            "import lazyfs.tree.fuse_mount, lazyfs.tree.fuse_ops, node_cache.cache, pyfuse3, trio",
        ],
        env,
    )
    probe = run(
        [PY, "-c", MANIFEST_PROBE, setting.store_url, NAME, scratch / "probe.db"], env=env, cwd=REPO
    )
    out.update(json.loads(probe.stdout))
    (scratch / "probe.db").unlink(missing_ok=True)

    cache = scratch / f"bd-cache-{setting.label}"
    mp = scratch / f"bd-mnt-{setting.label}"
    cache.mkdir()
    mp.mkdir(exist_ok=True)
    mounted = False
    try:
        before = setting.s3_requests() if setting.s3_requests else 0
        out["mount"] = timed(
            [LAZYFS, "mount", NAME, mp, "--store", setting.store_url, "--cache", cache], env
        )
        mounted = True
        out["mount_s3_requests"] = (setting.s3_requests() - before) if setting.s3_requests else 0
        out["python_cold"] = first_line(["chroot", mp, *COMMAND], env={"PATH": CHILD_PATH})[0]
        time.sleep(1.2)  # the daemon publishes its stats once a second
        stats = read_stats(mp, cache)
        for key in ("reads", "bytes_fetched", "store_requests"):
            out[f"cold_{key}"] = stats[key]
        out["python_hot"] = first_line(["chroot", mp, *COMMAND], env={"PATH": CHILD_PATH})[0]
    finally:
        if mounted:
            subprocess.run([LAZYFS, "umount", mp], env=env, capture_output=True)
            wait_unmounted(mp)
        shutil.rmtree(cache, ignore_errors=True)
    # The sandbox alone on the OCI runtime, over a local unpacked copy of the image:
    # prepare (overlay + config.json), `runc create`, `runc start`, the command (/bin/true)
    # to its exit, delete. The runtime's share of a start is create + start.
    probe = run(
        [PY, "-c", RUNTIME_PROBE, rootfs(TAG)],
        env={**env, "LAZYFS_SANDBOX_DIR": str(scratch / "bd-boxes"),
             "LAZYFS_RUN_DIR": str(scratch / "bd-run")},
        cwd=REPO,
    )  # fmt: skip
    for key, value in json.loads(probe.stdout).items():
        out[f"sandbox_{key}"] = value
    return out


def wait_unmounted(mp: Path, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while str(mp) in mounts_below(mp) and time.monotonic() < deadline:
        time.sleep(0.05)


# ---------------------------------------------------------------------------------------
# S3 inside the namespace


class NsSeaweed(Seaweed):
    """testbed.seaweed.Seaweed, run inside the link's namespace on its address."""

    def __init__(self, base: Path, link: ShapedLink, endpoint_port: int | None = None) -> None:
        super().__init__(base, ip=link.ns_ip, wrap=link.exec_argv)
        self.link = link


# ---------------------------------------------------------------------------------------
# Clean-up checks


def cleanup(root: Path) -> list[str]:
    """Unmount and stop whatever this run left under root; returns what was found."""
    problems = []
    for point in sorted(mounts_below(root), key=len, reverse=True):
        problems.append(f"mount {point}")
        subprocess.run(["fusermount3", "-u", "-z", point], capture_output=True)
        subprocess.run(["umount", "-l", point], capture_output=True)
    for stats_dir in root.glob("*/mounts"):
        for stats in mount_stats(stats_dir.parent):
            pid = stats.get("pid")
            if isinstance(pid, int) and _is_our_daemon(pid, root):
                problems.append(f"mount daemon {pid}")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
    return problems


def _is_our_daemon(pid: int, root: Path) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return False
    return b"lazyfs.tree.fuse_mount" in cmdline and str(root).encode() in cmdline


# ---------------------------------------------------------------------------------------
# Output


def fmt(res: Result, m: str, key: str = "first") -> str:
    return spread([r[key] for r in res.runs[m]])


LABELS = {
    "a": "(a) full pull: fetch + tar + chroot",
    "a'": "(a') full pull: fetch + umoci unpack + chroot",
    "b0": "(b0) lazyfs run, empty node cache, prefetch off",
    "b": "(b) lazyfs run, empty node cache, start-up trace",
    "c": "(c) lazyfs run, warm node cache",
    "d": "(d) lazyfs run, image still mounted by a --linger run",
}


def report(
    results: list[Result], info: dict, load: tuple[str, str], cmdline: str, notes: list[str]
) -> str:
    rows = []
    for res in results:
        base = res.median("a")
        for m in res.runs:
            med = res.median(m)
            ratio = base / med
            rows.append(
                [
                    res.setting,
                    LABELS[m],
                    fmt(res, m),
                    fmt(res, m, "exit"),
                    f"{med / base:.3f}",
                    f"{ratio:.1f}x",
                ]
            )
    main_table = table(
        [
            "setting",
            "method",
            "first output s, median (min-max)",
            "exit s",
            "time / (a)",
            "speed-up vs (a)",
        ],
        rows,
    )

    phase_rows = []
    for res in results:
        for m in ("a", "a'"):
            if m in res.runs:
                phase_rows.append(
                    [
                        res.setting,
                        m,
                        f"{res.median(m, 'fetch'):.2f}",
                        f"{res.median(m, 'unpack'):.2f}",
                        f"{res.median(m, 'run'):.3f}",
                    ]
                )
    phase_table = table(["setting", "method", "fetch s", "unpack s", "python3 s"], phase_rows)

    fetch_rows = []
    for res in results:
        for m in ("b0", "b", "c"):
            st = [r["stats"] for r in res.runs[m]]
            fetched = statistics.median(s["bytes_fetched"] for s in st)
            chunks = statistics.median(s["chunks_fetched"] for s in st)
            s3 = [r["s3_requests"] for r in res.runs[m]]
            fetch_rows.append(
                [
                    res.setting,
                    m,
                    mb(fetched),
                    f"{100 * fetched / info['stored_bytes']:.1f} %",
                    f"{100 * fetched / info['layer_bytes']:.1f} %",
                    f"{chunks:.0f} / {info['chunks']}",
                    f"{statistics.median(s['store_requests'] for s in st):.0f}",
                    f"{statistics.median(s.get('prefetch_chunks', 0) for s in st):.0f}",
                    "-" if s3[0] is None else f"{statistics.median(s3):.0f}",
                    mb(statistics.median(s["bytes_read"] for s in st)),
                    f"{statistics.median(s['reads'] for s in st):.0f}",
                ]
            )
    fetch_table = table(
        [
            "setting",
            "run",
            "MB fetched",
            "of stored chunks",
            "of layer blobs",
            "chunks fetched",
            "chunk GETs",
            "chunks prefetched",
            "S3 requests (all)",
            "MB read via FUSE",
            "FUSE reads",
        ],
        fetch_rows,
    )

    bd_table = breakdown_table([r for r in results if r.breakdown])

    goals = []
    local = next((r for r in results if r.setting == "local"), None)
    if local:
        sp = local.median("a") / local.median("b")
        goals.append(
            f"- local store: (b) is {sp:.1f}x faster than (a) "
            f"(goal >= {GOAL_LOCAL:.0f}x: {'met' if sp >= GOAL_LOCAL else 'NOT met'})."
        )
    for res in results:
        if res.setting != "local" and local:
            sp = res.median("a") / res.median("b")
            lsp = local.median("a") / local.median("b")
            goals.append(
                f"- {res.setting}: (b) is {sp:.1f}x faster than (a) (local: "
                f"{lsp:.1f}x; goal: further ahead: {'met' if sp > lsp else 'NOT met'})."
            )
    sections = [
        (
            "Conditions",
            "\n".join(
                [
                    f"- {machine_note()}; load average before: {load[0]}; after: {load[1]} "
                    "(a shared machine: preliminary numbers).",
                    f"- Image: python test image, {len(info['layers'])} gzip layers, "
                    f"{mb(info['layer_bytes'])} MB compressed, {mb(info['tar_bytes'])} MB of tar; "
                    f"converted: {info['chunks']} chunks, {mb(info['stored_bytes'])} MB stored, "
                    f"manifest {mb(info['manifest_bytes'])} MB.",
                    f"- {REPEAT_NOTE.format(n=len(next(iter(results)).runs['a']))}",
                    f"- Command: `{cmdline}`",
                ]
            ),
        ),
        ("Time to first output", main_table + "\n\n" + "\n".join(goals)),
        ("Full pull phases (median s)", phase_table),
        ("What (b) and (c) fetched (median per run)", fetch_table),
        ("Where the time of (b) goes", bd_table),
        ("Notes", "\n".join(f"- {n}" for n in notes)),
    ]
    path = save_markdown("run_vs_pull", "Sandbox start: full pull vs lazyfs run", sections)
    return path.read_text()


BREAKDOWN_ROWS = (
    ("interpreter", "python interpreter start (`python -c pass`)"),
    ("cli_imports", "lazyfs CLI: interpreter + imports"),
    ("daemon_imports", "mount daemon: interpreter + imports (pyfuse3, trio, ...)"),
    ("import", "chunker imports (warm process)"),
    ("open_store", "open the store (s3://: SigV4 reader; boto3 only to write)"),
    ("resolve", "resolve the name (first request)"),
    ("fetch_manifest", "fetch + verify the manifest"),
    ("mount", "`lazyfs mount`, empty cache, until it answers"),
    ("mount_s3_requests", "  S3 requests made by that mount start (count)"),
    ("python_cold", "python3 on that cold mount (chroot, no sandbox)"),
    ("cold_reads", "  FUSE reads by it (count)"),
    ("cold_bytes_fetched", "  MB it fetched"),
    ("cold_store_requests", "  chunk GETs it made (count)"),
    ("python_hot", "python3 on the same mount again (page cache hot)"),
    ("sandbox_prepare", "sandbox alone: overlay + user/command lookup + config.json"),
    ("sandbox_create", "  `runc create` (namespaces, cgroups, mounts, seccomp)"),
    ("sandbox_start", "  `runc start`"),
    ("sandbox_run", "  /bin/true under tini, start to exit"),
    ("sandbox_delete", "  delete (runc delete, cgroups, overlay, dirs)"),
)


def breakdown_table(results: list[Result]) -> str:
    def cell(res: Result, key: str) -> str:
        val = statistics.median(b[key] for b in res.breakdown)
        if key.endswith("bytes_fetched"):
            return mb(val)
        if key.startswith("cold_") or key.endswith("requests"):
            return f"{val:.0f}"
        return f"{val:.3f}"

    rows = [[label, *(cell(r, key) for r in results)] for key, label in BREAKDOWN_ROWS]
    rows.append(
        [
            "(b) in the main runs: mount answering, s after start",
            *(f"{r.median('b', 'mounted'):.3f}" for r in results),
        ]
    )
    rows.append(
        [
            "(b) in the main runs: first output, s after the mount answered",
            *(f"{r.median('b', 'after_mount'):.3f}" for r in results),
        ]
    )
    rows.append(
        [
            "(b) in the main runs: first output, s after start",
            *(f"{r.median('b'):.3f}" for r in results),
        ]
    )
    rows.append(
        [
            "(c) in the main runs: mount answering / first output, s",
            *(f"{r.median('c', 'mounted'):.3f} / {r.median('c'):.3f}" for r in results),
        ]
    )
    return table(["piece (median s unless a count)", *(r.setting for r in results)], rows)


REPEAT_NOTE = (
    "Each cell: median of {n} runs, interleaved (a, a', b0, b, c, d per round); "
    '"first output" = from start until python3\'s `hello` line is read, '
    '"exit" = until the command (and, for lazyfs run, its unmount) returned.'
)


def plot(results: list[Result]) -> None:
    methods = ["a", "a'", "b0", "b", "c", "d"]
    colors = {"a": "#b44", "a'": "#d88", "b0": "#9bd", "b": "#48c", "c": "#4a6", "d": "#7c5"}
    fig, ax = pyplot().subplots(figsize=(13, 4.8))
    firsts = {
        LABELS[m]: [[r["first"] for r in res.runs[m]] if m in res.runs else None for res in results]
        for m in methods
    }
    by_label = {LABELS[m]: c for m, c in colors.items()}
    for bars in grouped_bars(ax, firsts, width=0.14, colors=by_label, samples=True):
        for bar in bars or []:
            y = bar.get_height()
            ax.annotate(
                f"{y:.2f}",
                (bar.get_x() + bar.get_width() / 2, y),
                ha="center",
                va="bottom",
                fontsize=8,
            )
    ax.set_xticks(range(len(results)), [r.setting for r in results])
    ax.set_ylabel("seconds to first output (median, min-max)")
    ax.set_yscale("log")
    ax.set_title("python3 -c 'print(\"hello\")' on the python image (218 MB)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # clear of the bars
    fig.tight_layout()
    save_plot(fig, "run_vs_pull")


# ---------------------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=REPEAT)
    p.add_argument("--no-latency", action="store_true", help="skip the 1gbit+4ms setting")
    p.add_argument("--local-only", action="store_true", help="skip the network settings")
    args = p.parse_args()
    # SIGTERM -> SystemExit, so the finally blocks below still clean up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if os.geteuid() != 0:
        print("run_vs_pull needs root (namespaces, FUSE, chroot)", file=sys.stderr)
        return 2
    load_before = load_average()
    print(f"load average: {load_before}", flush=True)
    imgs = images()
    layout = imgs.layout
    layers = layout_layers(layout, TAG)
    root = Path(tempfile.mkdtemp(prefix="lazyfs-bench-rvp-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "LAZYFS_"))}
    env.update(LAZYFS_RUN_DIR=str(root / "run"), LAZYFS_SANDBOX_DIR=str(root / "sandboxes"))
    # The node data daemon exits as soon as its last tree is gone: every measured start
    # but (d) pays for starting it, as on a node where nothing of lazyfs is running.
    env.update(LAZYFS_DAEMON_IDLE="0")
    results: list[Result] = []
    notes: list[str] = []
    links: list[ShapedLink] = []
    try:
        store = root / "store"
        run(
            [
                LAZYFS,
                "convert",
                f"oci:{layout}:{TAG}",
                "--store",
                f"file://{store}",
                "--name",
                NAME,
            ],
            env=env,
        )
        inspect = json.loads(
            run(
                [
                    LAZYFS,
                    "inspect",
                    NAME,
                    "--store",
                    f"file://{store}",
                    "--cache",
                    root / "inspect-cache",
                    "--json",
                ],
                env=env,
            ).stdout
        )
        info = {
            "layers": layers,
            "layer_bytes": sum(int(x["size"]) for x in layers),
            "tar_bytes": sum(x.uncompressed_size for x in imgs_layers(imgs)),
            "stored_bytes": inspect["stored_bytes"],
            "chunks": inspect["chunks"],
            "manifest_bytes": inspect["manifest_bytes"],
        }

        print("local store ...", flush=True)
        local = Setting("local", f"file://{store}", env, local_fetcher(layout))
        res = measure(local, layers, layout, root, args.repeat, env, umoci=True)
        res.breakdown = [breakdown(local, root, env) for _ in range(args.repeat)]
        results.append(res)

        if not args.local_only:
            results += network_settings(args, root, store, layers, layout, env, links, notes)
        load_after = load_average()
        notes += standard_notes(args)
    finally:
        problems = cleanup(root)
        shutil.rmtree(root, ignore_errors=True)
        for link in links:
            problems += leftovers(link)
        if problems:
            print(f"clean-up had to remove: {problems}", file=sys.stderr)
    text = report(
        results,
        info,
        (load_before, load_after),
        " ".join([".venv/bin/python", "bench/run_vs_pull.py", *sys.argv[1:]]),
        notes,
    )
    plot(results)
    print(text)
    return 0


def imgs_layers(imgs: Any) -> list[Any]:
    data = json.loads((imgs.root / "info.json").read_text())
    from testbed.images import LayerInfo

    return [LayerInfo(**x) for x in data["layers"][TAG]]


def network_settings(
    args: argparse.Namespace,
    root: Path,
    store: Path,
    layers: list[dict],
    layout: Path,
    env: dict[str, str],
    links: list[ShapedLink],
    notes: list[str],
) -> list[Result]:
    out = []
    with shaped_link(RATE) as link:
        links.append(link)
        weed = NsSeaweed(root / "weed", link)
        try:
            weed.start()
            print(f"weed up in {weed.start_seconds:.1f} s at {weed.endpoint}", flush=True)
            s3env = {**env, **weed.env}
            url = f"s3://{weed.bucket}/store"
            run([LAZYFS, "push", NAME, "--to", url, "--store", f"file://{store}"], env=s3env)
            client = weed.client()
            for layer in layers:
                algo, hexd = layer["digest"].split(":", 1)
                client.upload_file(
                    str(layout / "blobs" / algo / hexd), weed.bucket, blob_key(layer)
                )
            client.close()
            with probe_throughput(weed, layers[0]) as mbps:
                notes.append(
                    f"1 Gbit link check: one GET of the {mb(int(layers[0]['size']))}"
                    f" MB base layer ran at {mbps:.0f} MB/s (1 Gbit/s = 125 MB/s)."
                )
            dl_client = weed.client()
            direct_ms = small_get_ms(dl_client, weed.bucket, blob_key(layers[-1]))
            notes.append(f"HEAD request to S3 over the 1 Gbit link: {direct_ms:.1f} ms (median).")
            s3 = Setting(
                f"{RATE}",
                url,
                s3env,
                s3_fetcher(dl_client, weed.bucket),
                s3_requests=lambda: weed.request_count(bucket=weed.bucket),
            )
            print(f"{s3.label} link ...", flush=True)
            res = measure(s3, layers, layout, root, args.repeat, s3env, umoci=False)
            res.breakdown = [breakdown(s3, root, s3env) for _ in range(args.repeat)]
            out.append(res)
            if not args.no_latency:
                port = free_port()
                with delay_proxy(link, port, weed.ports["s3.port"], DELAY_MS) as endpoint:
                    penv = {**s3env, "AWS_ENDPOINT_URL": endpoint}
                    pclient = proxy_client(weed, endpoint)
                    proxied_ms = small_get_ms(pclient, weed.bucket, blob_key(layers[-1]))
                    notes.append(
                        f"HEAD request through the delay proxy: {proxied_ms:.1f} ms (median; "
                        f"{proxied_ms - direct_ms:+.1f} ms vs direct)."
                    )
                    label = f"{RATE}+{2 * DELAY_MS:g}ms"
                    lat = Setting(
                        label,
                        url,
                        penv,
                        s3_fetcher(pclient, weed.bucket),
                        s3_requests=lambda: weed.request_count(bucket=weed.bucket),
                    )
                    print(f"{label} link ...", flush=True)
                    res = measure(lat, layers, layout, root, args.repeat, penv, umoci=False)
                    res.breakdown = [breakdown(lat, root, penv) for _ in range(args.repeat)]
                    out.append(res)
                    pclient.close()
            dl_client.close()
        finally:
            weed.stop()
    return out


def small_get_ms(client: Any, bucket: str, key: str, n: int = 20) -> float:
    """Median ms of a HEAD request: what a round trip to the store costs a client."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        client.head_object(Bucket=bucket, Key=key)
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def proxy_client(weed: Seaweed, endpoint: str) -> Any:
    saved = weed.endpoint
    weed.endpoint = endpoint
    try:
        return weed.client()
    finally:
        weed.endpoint = saved


@contextlib.contextmanager
def probe_throughput(weed: Seaweed, layer: dict) -> Iterator[float]:
    client = weed.client()
    try:
        t0 = time.perf_counter()
        body = client.get_object(Bucket=weed.bucket, Key=blob_key(layer))["Body"]
        n = 0
        while chunk := body.read(1 << 20):
            n += len(chunk)
        yield n / (time.perf_counter() - t0) / 1e6
    finally:
        client.close()


def standard_notes(args: argparse.Namespace) -> list[str]:
    return [
        "(a) runs inside the benchmark's Python process (boto3 client already made, no "
        "interpreter start), while (b)/(c) start the `lazyfs` CLI and a mount daemon: "
        "the comparison favours the full pull.",
        "(a) fetches the layers in parallel, verifies their sha256, then unpacks them one "
        "after another with GNU tar + gzip (no pigz here), like an overlay snapshotter; "
        "(a') uses umoci unpack, which also writes an mtree manifest (slower).",
        "Nothing is dropped from the page cache (shared machine): the local store and the "
        "layout are read from memory in both (a) and (b).",
        "(c) starts a new mount (the previous run unmounted it as its last user); only the "
        "node cache is warm.",
        '"chunk GETs" are the node cache\'s ranged GETs; "S3 requests (all)" also counts '
        "ref and manifest GETs, from the server's metrics.",
    ] + (
        []
        if args.no_latency
        else [
            f"1gbit+{2 * DELAY_MS:g}ms: a TCP delay line (bench/netns.py) inside the namespace "
            f"in front of S3 adds {DELAY_MS:g} ms each way, on top of the 1 Gbit/s tbf link.",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
