"""containerd + CRI: PullImage to the end of sympy's own tests, on a fresh node (issue 21).

The sympy image of testbed/tree_images.py (the python test image + Debian's
python3-sympy and python3-pytest) is pushed with skopeo to a registry (Debian's
docker-registry). Each sample is a fresh node: a new containerd (root, state), a new
snapshotter root and an EMPTY node cache, the pod's pause image pulled (a kubelet's node
has it), then `sync; echo 3 > /proc/sys/vm/drop_caches`, then the timed part, as the
kubelet drives it through CRI:

    PullImage -> RunPodSandbox -> CreateContainer -> StartContainer -> container exited

The container runs, in /usr/lib/python3/dist-packages,

    python3 -m pytest -q -x -p no:cacheprovider sympy/core/tests/test_basic.py \
        sympy/core/tests/test_sympify.py

and must exit 0 with pytest's "67 passed" line in its CRI log. Rows, interleaved round
by round in this order:

  overlay       containerd's overlayfs snapshotter: PullImage downloads and unpacks every
                layer.
  stargz        stargz-snapshotter 0.12 (containerd-stargz-grpc, a proxy snapshotter, built
                here by shared/peers/build-stargz.sh: bench/_stargz.py) on an eStargz copy
                of the image made by `ctr-remote image convert --estargz --oci`, with no
                workload-specific optimisation; its defaults otherwise (background fetch on).
  lazyfs        `lazyfs snapshotter` (proxy plugin) over the image converted once into a
                store, LAZYFS_PREFETCH=0: no start-up trace replayed (nor recorded).
  lazyfs+trace  the same with the start-up trace on: the trace was recorded into the store
                by one untimed run on another fresh node (its own cache, run dir and
                snapshotter root) before the rounds; each timed node replays it.

Every lazyfs node has its own LAZYFS_RUN_DIR, so no two runs share a tree or a daemon.

Links (`--link`, repeatable; default both):

  local  registry on 127.0.0.1, the store a file:// directory on this disk: after the
         page cache is dropped, its pack files come from disk.
  1gbit  registry and SeaweedFS S3 inside a network namespace behind a veth pair shaped by
         tbf to 1 Gbit/s both ways (bench/netns.py), each behind a TCP delay line of 2 ms
         each way (+4 ms round trip).

Reported per row: PullImage to the tests' end, and its parts; the bytes and GETs served by
the registry (its access log) and, for lazyfs, the bytes and GETs its mount fetched from the
store (CACHE/mounts/*.json); and the physical limit: bytes read from the store or registry
divided by the disk's cold sequential read rate (measured here) or the link's rate.
Results: bench/results/cri_sympy.{md,png}.

Run (as root): .venv/bin/python bench/cri_sympy.py [--repeat N] [--link local|1gbit]...
    [--rows overlay,stargz,lazyfs,lazyfs+trace]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import LAZYFS, cold_read_bandwidth, drop_caches, run, tree_images
from _cri import PodError, log_text, pause_layout, remove_pod, run_to_exit
from _report import machine_note, mb, minmax_err, pyplot, save_markdown, save_plot, spread, table
from _stargz import PeerUnavailable, StargzDaemon, daemon_binary, esgz_layout  # noqa: E402
from containerd_pull import environ  # noqa: E402
from netns import ShapedLink, delay_proxy, leftovers, shaped_link  # noqa: E402
from run_vs_pull import STATS_WAIT, NsSeaweed, node_counters  # noqa: E402

from lazyfs.tree.node_files import mount_stats  # noqa: E402
from testbed.containerd import Containerd  # noqa: E402
from testbed.mounted_trees import clean_run_dir  # noqa: E402
from testbed.mounts import detach_mounts_below, mounts_below  # noqa: E402
from testbed.registry import Registry  # noqa: E402
from testbed.seaweed import free_port  # noqa: E402
from testbed.snapshotter import Snapshotter  # noqa: E402
from testbed.tree_images import SYMPY_DIR  # noqa: E402

NAME = "cri_sympy"
ROWS = ("overlay", "stargz", "lazyfs", "lazyfs+trace")
LINKS = ("local", "1gbit")
LABELS = {
    "overlay": "overlayfs (full pull)",
    "stargz": "stargz 0.12, eStargz, no optimise",
    "lazyfs": "lazyfs, no trace",
    "lazyfs+trace": "lazyfs, trace from another node",
}
SNAPSHOTTER = {"overlay": "overlayfs", "stargz": "stargz", "lazyfs": "lazyfs"}
REPEAT = 3
RATE, DELAY_MS = "1gbit", 2.0  # tbf rate; one-way delay each direction (+4 ms round trip)
LINK_BYTES_PER_S = 125e6
SYMPY_REPO, ESGZ_REPO, PAUSE_REPO = "bench/sympy:1", "bench/sympy:esgz", "bench/pause:1"
WORKDIR = "/" + SYMPY_DIR.rsplit("/", 1)[0]  # /usr/lib/python3/dist-packages
TESTS = [f"sympy/core/tests/{m}.py" for m in ("test_basic", "test_sympify")]
COMMAND = ["python3", "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *TESTS]
EXPECTED_PASSED = 67
# The snapshotter mounts the image as its last layer is pulled (any linger > 0 does); a
# short linger releases it soon after the pod, so the mount's final stats can be read.
LINGER = 2.0
# This machine's root lacks CAP_SYS_RESOURCE: runc cannot give the pause container CRI's
# oom_score_adj of -998 ("failed to update /proc/self/oom_score_adj: Permission denied").
CRI_SETTINGS: dict[str, str | bool] = {"restrict_oom_score_adj": True}
BLOB_GET = re.compile(r'"GET /v2/[^ ]+/blobs/sha256:[0-9a-f]+ HTTP/[\d.]+" (\d{3}) (\d+)')
PASSED = re.compile(r"\b(\d+) passed\b")


# ---------------------------------------------------------------------------------------
# Where the image is served from


@dataclass
class Site:
    """One link setting: the registry, the lazyfs store, how nodes reach them."""

    label: str
    registry: Registry
    pull_host: str  # HOST:PORT nodes pull from (the delay line's, over the link)
    store_url: str
    node_env: dict[str, str]  # for lazyfs on a node (S3 through the delay line)
    convert_env: dict[str, str]
    bandwidth: float = 0.0  # bytes/s of the store's and registry's medium
    medium: str = ""
    weed: NsSeaweed | None = None

    def image(self, row: str) -> str:
        return f"{self.pull_host}/{ESGZ_REPO if row == 'stargz' else SYMPY_REPO}"

    @property
    def pause(self) -> str:
        return f"{self.pull_host}/{PAUSE_REPO}"

    def s3_requests(self) -> int:
        return self.weed.request_count(bucket=self.weed.bucket) if self.weed else 0


def clean_env(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment without the machine's AWS_* and LAZYFS_*, plus extra."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "LAZYFS_"))}
    return {**base, **extra}


@contextlib.contextmanager
def serve_local(root: Path, _links: list[ShapedLink]) -> Iterator[Site]:
    registry = Registry(root / "registry", "none")
    try:
        registry.start()
        yield Site("local", registry, registry.host, f"file://{root / 'store'}", {}, {})
    finally:
        registry.close()


@contextlib.contextmanager
def serve_link(root: Path, links: list[ShapedLink]) -> Iterator[Site]:
    """Registry and SeaweedFS in a namespace behind the shaped link, each behind a delay
    line; convert and push go to them directly (untimed). The link goes into `links`,
    for the caller's check that nothing of it is left."""
    with shaped_link(RATE) as link:
        links.append(link)
        registry = Registry(
            root / "registry", "none", listen_host=link.ns_ip, wrap_argv=link.exec_argv
        )
        weed = NsSeaweed(root / "weed", link)
        try:
            registry.start()
            weed.start()
            reg_port, s3_port = free_port(), free_port()
            with (
                delay_proxy(link, reg_port, registry.port, DELAY_MS),
                delay_proxy(link, s3_port, weed.ports["s3.port"], DELAY_MS) as s3,
            ):
                node_env = {**weed.env, "AWS_ENDPOINT_URL": s3}
                url = f"s3://{weed.bucket}/store"
                site = Site("1gbit", registry, f"{link.ns_ip}:{reg_port}", url, node_env, weed.env)
                site.weed = weed
                yield site
        finally:
            registry.close()
            weed.stop()


def prepare(site: Site, root: Path, rows: list[str]) -> None:
    """Push the images, convert sympy into the store, measure the medium. The eStargz
    image only for a stargz row: building it needs the stargz peer's ctr-remote."""
    trees = tree_images()
    site.registry.push(f"oci:{pause_layout()}:pause", PAUSE_REPO)
    site.registry.push(f"oci:{trees.layout}:sympy", SYMPY_REPO)
    if "stargz" in rows:
        site.registry.push(f"oci:{esgz_layout(trees.layout, 'sympy')}:sympy-esgz", ESGZ_REPO)
    argv = [LAZYFS, "convert", site.registry.ref(SYMPY_REPO), "--tls-verify=false"]
    run([*argv, "--store", site.store_url], env=clean_env(site.convert_env))
    if site.weed is None:
        blob = max(site.registry.storage.rglob("data"), key=lambda p: p.stat().st_size)
        site.bandwidth = cold_read_bandwidth(blob)
        site.medium = f"disk, {mb(site.bandwidth)} MB/s cold sequential read (measured)"
    else:
        site.bandwidth = LINK_BYTES_PER_S
        site.medium = f"link, {RATE} = {mb(LINK_BYTES_PER_S)} MB/s"


def record_trace(site: Site, root: Path) -> None:
    """One untimed run on another fresh node, which records the start-up trace in the store."""
    rec = measure(site, "lazyfs+trace", root / f"{site.label}-trace-recorder", record=True)
    print(f"  {site.label}: trace recorded on another node ({rec['total']:.2f} s)", flush=True)


# ---------------------------------------------------------------------------------------
# One fresh node


class Node:
    """containerd and its snapshotter for one sample; `stop()` leaves nothing behind."""

    def __init__(self, site: Site, row: str, base: Path, trace: bool) -> None:
        self.site, self.row, self.base = site, row, base
        self.kind = "lazyfs" if row.startswith("lazyfs") else row
        self.trace = trace
        self.sn: Snapshotter | None = None
        self.sg: StargzDaemon | None = None
        self.ctd: Containerd | None = None
        self.pod_id = ""
        self.left: list[str] = []

    @property
    def cache(self) -> Path:
        assert self.sn is not None
        return self.sn.cache

    def start(self) -> Containerd:
        socket, proxy = None, "lazyfs"
        if self.kind == "lazyfs":
            env = {
                **self.site.node_env,
                "LAZYFS_RUN_DIR": str(self.base / "run"),
                "LAZYFS_PREFETCH": "1" if self.trace else "0",
            }
            with environ(env):  # the snapshotter, its mounts and daemon inherit it
                self.sn = Snapshotter(self.base / "sn", self.site.store_url, linger=LINGER)
                self.sn.base.mkdir()
                self.sn.start()
            socket = self.sn.socket
        elif self.kind == "stargz":
            self.sg = StargzDaemon(self.base / "sg", [self.site.pull_host])
            self.sg.start()
            socket, proxy = self.sg.socket, "stargz"
        settings = {**CRI_SETTINGS, "sandbox_image": self.site.pause}
        self.ctd = Containerd(
            self.base / "ctd",
            socket,
            cri_snapshotter=SNAPSHOTTER[self.kind],
            proxy_name=proxy,
            cri_settings=settings,
        )
        self.ctd.add_registry(self.site.pull_host)
        self.ctd.start()
        self.ctd.pull(self.site.pause)
        return self.ctd

    def remove_pod(self) -> None:
        if self.pod_id and self.ctd is not None:
            remove_pod(self.ctd.address, self.pod_id)
            self.pod_id = ""

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.remove_pod()
        if self.ctd is not None:
            self.ctd.stop()
        if self.sn is not None:
            self.sn.stop()
            self.left += detach_mounts_below(self.sn.base)
            clean_run_dir(self.sn.run_dir)  # its trees, their reapers, the data daemon
        if self.sg is not None:
            self.sg.stop()  # its FUSE layers stay mounted after it: detached, expected


def registry_blobs(registry: Registry, since: int, until: int) -> tuple[int, int]:
    """(GETs, bytes) of blob requests in the registry's access log between two offsets."""
    with open(registry.log_path, "rb") as f:
        f.seek(since)
        text = f.read(until - since).decode(errors="replace")
    hits = [int(m[2]) for m in BLOB_GET.finditer(text) if m[1] in ("200", "206")]
    return len(hits), sum(hits)


def check_output(log: Path, exit_code: int) -> int:
    """pytest's passed count; raises unless it exited 0 with EXPECTED_PASSED passed."""
    text = log_text(log)
    found = PASSED.findall(text)
    if exit_code != 0 or not found or int(found[-1]) != EXPECTED_PASSED:
        raise RuntimeError(
            f"the tests exited {exit_code} with {found[-1] if found else 'no'} passed "
            f"(expected {EXPECTED_PASSED}):\n{text[-1500:]}"
        )
    return int(found[-1])


def metadata_bytes(cache: Path) -> int:
    """The image's manifest and EROFS metadata, as fetched from the store (stored as is)."""
    files = [*(cache / "manifests").glob("*.db"), *(cache / "erofs").glob("*")]
    return sum(p.stat().st_size for p in files if p.is_file())


def measure(site: Site, row: str, base: Path, record: bool = False) -> dict[str, Any]:
    """One sample on a fresh node; `record`: the untimed run that records the trace."""
    base.mkdir(parents=True)
    node = Node(site, row, base, trace=row == "lazyfs+trace")
    try:
        ctd = node.start()
        s3_before = site.s3_requests()
        drop_caches()
        since = site.registry.log_size()
        t0 = time.perf_counter()
        ref = ctd.pull(site.image(row))
        pulled = time.perf_counter()
        try:
            pod = run_to_exit(ctd.address, ref, COMMAND, WORKDIR, base / "logs")
        except PodError as exc:
            node.pod_id = exc.pod_id
            raise
        end = time.perf_counter()
        until = site.registry.log_size()
        node.pod_id = pod.pod_id
        out: dict[str, Any] = {
            "total": end - t0,
            "pull": pulled - t0,
            "sandbox": pod.sandbox,
            "create": pod.create + pod.start,
            "run": pod.exit,
            "passed": check_output(pod.log_path, pod.exit_code),
        }
        out["registry_gets"], out["registry_bytes"] = registry_blobs(site.registry, since, until)
        node.remove_pod()
        if node.kind == "lazyfs":
            out.update(lazy_stats(node, site, s3_before, record))
        return out
    finally:
        node.stop()
        if node.left:
            print(f"  detached leftover mounts: {node.left}", file=sys.stderr)
        shutil.rmtree(base, ignore_errors=True)


TRACE_MOVING = ("starting", "replaying", "recording")  # node_cache/prefetch.py's states


def settled_stats(cache: Path, trace: str) -> dict[str, Any]:
    """The image's stats once every tree of it is released ("mounted": false) and no
    tree's trace is on its way (a recording is "recording" until its PUT is done), with
    some tree's trace in state `trace`: the image stands on its layer trees, and one
    that was not read records or replays nothing. Not the first "mounted": false alone:
    the data daemon marks a device unmounted before it writes a recorded trace, and its
    periodic publish can show that moment. Counters from node_counters (each data daemon
    once)."""
    deadline = time.monotonic() + STATS_WAIT
    while True:
        found = mount_stats(cache)
        states = {s.get("trace") for s in found}
        if (
            found
            and all(s.get("mounted") is False for s in found)
            and trace in states
            and not states & set(TRACE_MOVING)
        ):
            return {**found[0], **node_counters(found), "traces": sorted(map(str, states))}
        if time.monotonic() > deadline:
            logs = "".join(p.read_text()[-2000:] for p in (cache / "mounts").glob("*.log"))
            raise RuntimeError(f"no final stats with trace {trace!r} in {cache}: {found}\n{logs}")
        time.sleep(0.05)


def lazy_stats(node: Node, site: Site, s3_before: int, record: bool) -> dict[str, Any]:
    """The mount's final stats (once the pod's tree is released) and what they must say."""
    stats = settled_stats(
        node.cache, "recorded" if record else ("replayed" if node.trace else "off")
    )
    if node.sn is not None and "is lazy" not in node.sn.log():
        raise RuntimeError(f"the snapshotter mounted nothing lazily:\n{node.sn.log()}")
    return {
        "fetched": stats["bytes_fetched"],
        "gets": stats["store_requests"],
        "meta": metadata_bytes(node.cache),
        "s3_requests": site.s3_requests() - s3_before if site.weed else None,
    }


# ---------------------------------------------------------------------------------------
# Rounds


@dataclass
class Result:
    site: Site
    rows: list[str]
    runs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def vals(self, row: str, key: str) -> list[float]:
        return [r[key] for r in self.runs[row]]

    def median(self, row: str, key: str) -> float:
        return statistics.median(self.vals(row, key))

    def span(self, row: str, key: str) -> str:
        return spread(self.vals(row, key))

    def read_bytes(self, row: str) -> float:
        """Median bytes the row read from the store or registry during the timed part."""
        if row.startswith("lazyfs"):
            return statistics.median(r["fetched"] + r["meta"] for r in self.runs[row])
        return self.median(row, "registry_bytes")


def measure_site(site: Site, root: Path, rows: list[str], repeat: int) -> Result:
    res = Result(site, rows, {row: [] for row in rows})
    for i in range(repeat):
        for row in rows:
            r = measure(site, row, root / f"{site.label}-{row}-{i}")
            res.runs[row].append(r)
            lazy = (
                f"; mount fetched {mb(r['fetched'])} MB in {r['gets']} GETs"
                f" (+{mb(r['meta'])} MB metadata)"
                if "fetched" in r
                else ""
            )
            print(
                f"  {site.label} {row} #{i + 1}: {r['total']:.2f} s (pull {r['pull']:.2f}, "
                f"pod {r['sandbox']:.2f}, create+start {r['create']:.2f}, run {r['run']:.2f}); "
                f"{r['passed']} passed; registry {r['registry_gets']} blob GETs, "
                f"{mb(r['registry_bytes'])} MB{lazy}",
                flush=True,
            )
    return res


# ---------------------------------------------------------------------------------------
# Output


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def ratio(res: Result, num: str, den: str) -> str:
    if num not in res.runs or den not in res.runs:
        return "-"
    return f"{res.median(num, 'total') / res.median(den, 'total'):.2f}x"


def main_table(results: list[Result]) -> str:
    rows = []
    for res in results:
        for row in res.rows:
            limit = res.read_bytes(row) / res.site.bandwidth
            rows.append([
                res.site.label, LABELS[row], res.span(row, "total"), res.span(row, "pull"),
                res.span(row, "sandbox"), res.span(row, "create"), res.span(row, "run"),
                mb(res.read_bytes(row)), f"{limit:.2f}",
                ratio(res, "overlay", row), ratio(res, "stargz", row),
            ])  # fmt: skip
    return table(
        [
            "link", "node", "PullImage -> tests end, s", "PullImage, s", "RunPodSandbox, s",
            "Create + StartContainer, s", "StartContainer -> exit, s",
            "MB read from store/registry", "physical limit, s", "overlay / this", "stargz / this",
        ],
        rows,
    )  # fmt: skip


def fetch_table(results: list[Result]) -> str:
    rows = []
    for res in results:
        for row in res.rows:
            lazy = row.startswith("lazyfs")
            med = res.median
            rows.append([
                res.site.label, LABELS[row],
                f"{med(row, 'registry_gets'):.0f}", mb(med(row, "registry_bytes")),
                mb(med(row, "fetched")) if lazy else "-",
                f"{med(row, 'gets'):.0f}" if lazy else "-",
                mb(med(row, "meta")) if lazy else "-",
                f"{med(row, 's3_requests'):.0f}" if lazy and res.site.weed else "-",
            ])  # fmt: skip
    return table(
        [
            "link", "node", "registry blob GETs", "MB from the registry",
            "MB the lazyfs mount fetched", "its GETs",
            "MB manifest + EROFS metadata", "S3 requests (all)",
        ],
        rows,
    )  # fmt: skip


def summary(results: list[Result]) -> list[str]:
    out = []
    for res in results:
        for row in ("lazyfs", "lazyfs+trace"):
            others = [o for o in ("stargz", "overlay") if o in res.runs]
            if row not in res.runs or not others:
                continue
            vs = " and ".join(f"{ratio(res, o, row)} faster than {o}" for o in others)
            out.append(f"- {res.site.label}: {LABELS[row]}: {vs}.")
    return out + ["- Issue 21's goals, without a trace: 2x faster than stargz, 3x than overlayfs."]


def report(results: list[Result], loads: tuple[str, str], repeat: int, cmdline: str) -> str:
    conditions = [
        f"- {machine_note()}; `uptime` before: {loads[0]}; after: {loads[1]}.",
        "- Image: the `sympy` tree image (python test image + Debian python3-sympy, "
        "python3-pytest: 3 gzip layers), pushed with skopeo to Debian's docker-registry; "
        "the eStargz copy by `ctr-remote image convert --estargz --oci` (no optimise); the "
        "lazyfs store by `lazyfs convert docker://...` once per link.",
        "- containerd 1.6 (Debian) + runc; CRI with `disable_snapshot_annotations = false`; "
        "the pod in the node's network namespace (no CNI), its pause image (a static "
        "`pause` binary) pulled before the timed part.",
        f"- Timed: CRI PullImage, RunPodSandbox, CreateContainer, StartContainer, then "
        f"ContainerStatus every 10 ms until exited. Command, in {WORKDIR}: "
        f"`{' '.join(COMMAND)}`; exit 0 and `{EXPECTED_PASSED} passed` checked in the CRI log.",
        f"- Each cell: median (min-max) of {repeat} samples, interleaved (overlay, stargz, "
        "lazyfs, lazyfs+trace per round), each on a fresh node: new containerd root/state, "
        "new snapshotter root (stargz: new daemon root), an empty node cache and its own "
        "LAZYFS_RUN_DIR; `sync; echo 3 > /proc/sys/vm/drop_caches` right before PullImage.",
        "- lazyfs: `lazyfs snapshotter --linger 2`, LAZYFS_PREFETCH=0 for the no-trace row. "
        "lazyfs+trace: the trace was recorded by one untimed run on another fresh node.",
        "- stargz: containerd-stargz-grpc 0.12.0 built from its source by "
        "shared/peers/build-stargz.sh, default config (background fetch on) plus plain HTTP.",
        *[f"- {res.site.label}: {res.site.medium}." for res in results],
        f"- 1gbit: registry and SeaweedFS S3 in a network namespace behind a veth pair "
        f"shaped by tbf ({RATE}, burst 256kb, latency 50ms) both ways, each behind a delay "
        f"line of {DELAY_MS:g} ms each way; local: registry on 127.0.0.1, file:// store.",
        f"- Command: `{cmdline}`",
    ]
    notes = [
        "Physical limit = MB read from the store or registry during the timed part ÷ the "
        "medium's rate (local: the disk's cold sequential read, measured on a registry blob "
        "after dropping the page cache; 1gbit: the link's rate). It leaves out "
        "decompression, the writes of an unpack, round trips and the image's own reads of "
        "the local disk.",
        "MB read: overlay and stargz, the blob bytes the registry's access log shows sent "
        "(the layers; for stargz, its ranged GETs, background fetch included, until the "
        "tests ended); lazyfs, `bytes_fetched` of the mount's final stats (compressed "
        "chunks, gaps in coalesced ranges included) plus the image's manifest and EROFS "
        "metadata. GETs: `store_requests` (prefetch included).",
        "RunPodSandbox starts the pause container; StartContainer -> exit is the tests' "
        "run with its cold reads (for the lazy rows nearly all of the lazy loading).",
    ]
    timing = main_table(results) + "\n\n" + "\n".join(summary(results))
    sections = [
        ("Conditions", "\n".join(conditions)),
        ("PullImage to the end of the tests", timing),
        ("What was fetched (median per sample)", fetch_table(results)),
        ("Notes", "\n".join(f"- {n}" for n in notes)),
    ]
    title = "containerd + CRI: PullImage to the end of sympy's tests, on a fresh node"
    return save_markdown(NAME, title, sections).read_text()


def plot(results: list[Result]) -> None:
    colors = {"overlay": "#b44", "stargz": "#c90", "lazyfs": "#48c", "lazyfs+trace": "#2a6"}
    fig, axes = pyplot().subplots(
        1, len(results), figsize=(5 * len(results) + 1, 4.8), squeeze=False
    )
    for ax, res in zip(axes[0], results, strict=True):
        for x, row in enumerate(res.rows):
            pull, rest = res.median(row, "pull"), res.median(row, "total") - res.median(row, "pull")
            tot = res.vals(row, "total")
            med = statistics.median(tot)
            ax.bar(x, pull, 0.6, color=colors[row], alpha=0.55)
            ax.bar(x, rest, 0.6, bottom=pull, color=colors[row],
                   yerr=minmax_err(tot), capsize=3)  # fmt: skip
            limit = res.read_bytes(row) / res.site.bandwidth
            ax.hlines(limit, x - 0.3, x + 0.3, colors="k", linestyles="dotted")
            ax.annotate(f"{med:.2f}", (x + 0.3, med), ha="left", va="center", fontsize=8,
                        xytext=(2, 0), textcoords="offset points")  # fmt: skip
        ax.set_xticks(range(len(res.rows)), [LABELS[r].replace(", ", ",\n") for r in res.rows],
                      fontsize=7)  # fmt: skip
        ax.set_title(f"{res.site.label}: PullImage -> sympy tests end")
        ax.set_ylabel("seconds (light: PullImage; dotted: physical limit)")
    fig.suptitle("containerd + CRI on a fresh node, page cache dropped (median, min-max)")
    fig.tight_layout()
    save_plot(fig, NAME)


# ---------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=REPEAT, help="samples per row (default 3)")
    p.add_argument("--link", action="append", choices=LINKS, help="local, 1gbit (default both)")
    p.add_argument("--rows", default=",".join(ROWS), help="a comma-separated subset of the rows")
    args = p.parse_args()
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    if not args.rows or any(r not in ROWS for r in args.rows):
        p.error(f"--rows takes a comma-separated subset of {', '.join(ROWS)}")
    args.rows = [r for r in ROWS if r in args.rows]
    args.link = [k for k in LINKS if k in (args.link or LINKS)]
    return args


def main() -> int:
    args = parse_args()
    if os.geteuid() != 0:
        print("cri_sympy needs root (containerd, namespaces, FUSE, drop_caches)", file=sys.stderr)
        return 2
    # SIGTERM -> SystemExit, so the finally blocks below still clean up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if "stargz" in args.rows:
        try:
            daemon_binary()
        except PeerUnavailable as exc:
            print(f"cri_sympy: stargz peer unavailable: {exc} (run with --rows "
                  "overlay,lazyfs,lazyfs+trace to leave it out)", file=sys.stderr)  # fmt: skip
            return 2
    load_before = uptime()
    print(load_before, flush=True)
    root = Path(tempfile.mkdtemp(prefix="lazyfs-bench-cri-"))
    serve = {"local": serve_local, "1gbit": serve_link}
    results: list[Result] = []
    problems: list[str] = []
    links: list[ShapedLink] = []
    try:
        for label in args.link:
            with serve[label](root / f"servers-{label}", links) as site:
                prepare(site, root, args.rows)
                if "lazyfs+trace" in args.rows:
                    record_trace(site, root)
                print(f"{label}: registry {site.pull_host}, store {site.store_url}", flush=True)
                results.append(measure_site(site, root, args.rows, args.repeat))
        load_after = uptime()
    finally:
        for link in links:
            problems += leftovers(link)
        problems += [f"mount {m}" for m in mounts_below(root)]
        if problems:
            print(f"clean-up left: {problems} (kept {root})", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    cmdline = " ".join([".venv/bin/python", "bench/cri_sympy.py", *sys.argv[1:]])
    text = report(results, (load_before, load_after), args.repeat, cmdline)
    plot(results)
    print(text)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
