"""The node agent's latencies (issue 12, "What it must show"), side by side in one run.

Everything goes through a real `lazyfs serve` that this script starts on a private
socket, run directory, sandbox directory and node cache, with the python test image
(Debian bookworm minbase + python3, 218 MB of tar) converted into a local file:// store.
The client is lazyfs.client.Client over the unix socket: every figure includes the
HTTP round trips a training framework pays.

  warm claims   with `--pool IMAGE=POOL`: wait until the pool is full (a warm pool),
                then claim a sandbox and run `true` in it, to its exit; CLAIMS times.
                Goal: p50 <= 10 ms, p99 <= 30 ms.
  python3       the same claim with `python3 -c print` (after one unmeasured, which
                reads python3's files into the node cache), against that command run on
                the host (Debian's /usr/bin/python3, the image's version), interleaved.
                Goal: <= 1.3x.
  exec          `exec true` into one running sandbox, EXECS times. Goal: p50 <= 5 ms.
  cold create   a new agent with an empty node cache and nothing mounted (the node data
                daemon up: the agent starts it at its own start and holds it while it
                runs, image_mounts.py), then create + exec
                `python3 -c 'print("hello")'` to its first output line, COLD times; one
                unmeasured run before records the image's start-up trace in the store
                (as the first run of an image on any node would). Against it, in the
                same rounds: the image's layer blobs copied from the local OCI layout
                (sha256-checked), unpacked with GNU tar, then `chroot DIR python3 ...`
                (bench/run_vs_pull.py's (a), local). Goal: <= 0.3 s and >= 5x faster.
                The agent logs where a cold claim's time goes; the table breaks it down.
                Variants: the data daemon stopped after the agent's start (so the create
                pays for its start, as every cold create did before the agent held it),
                and no start-up trace (LAZYFS_PREFETCH=0).

Run as root: .venv/bin/python bench/agent_bench.py [--claims N] [--cold N] [--quick]
Results: bench/results/agent_bench.{md,png}.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from _common import LAZYFS, images, layout_layers, run
from _report import load_average, machine_note, minmax_err, pyplot, save_markdown, save_plot, table
from run_vs_pull import Setting, full_pull, local_fetcher  # noqa: E402

from lazyfs.client import Client  # noqa: E402
from testbed.agent import AgentProcess  # noqa: E402
from testbed.mounted_trees import data_mount, supervisors  # noqa: E402
from testbed.mounts import mount_ids  # noqa: E402
from testbed.node import Node  # noqa: E402
from testbed.nodecheck import leftovers  # noqa: E402

TAG = "python"
NAME = "bench-py"
POOL = 2
CLAIMS = 120
PY_CLAIMS = 40
EXECS = 200
COLD = 5
HELLO = ["python3", "-c", 'print("hello")']
PRINT = ["python3", "-c", "print"]
HOST_PYTHON = "/usr/bin/python3"
FILL_TIMEOUT = 60.0
GOALS = {"claim_p50": 0.010, "claim_p99": 0.030, "py_ratio": 1.3, "exec_p50": 0.005}
GOAL_COLD, GOAL_COLD_RATIO = 0.3, 5.0


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


# ---------------------------------------------------------------------------------------
# A private agent


class Bench:
    """The run's scratch directory, store and agents; what they leave is checked."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.store = root / "store"
        self.nodes: list[Node] = []  # one per agent: its own dirs and cgroup parent
        self.base_env = {
            k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "LAZYFS_"))
        }

    @contextmanager
    def agent(self, label: str, *args: str, env: dict[str, str] | None = None) -> Iterator[Client]:
        """A fresh `lazyfs serve` with its own cache, run and sandbox dirs under
        root/label: nothing mounted, nothing cached."""
        tmp = self.root / label
        tmp.mkdir()
        node_env = {
            **self.base_env,
            "LAZYFS_STORE": f"file://{self.store}",
            "LAZYFS_CACHE": str(tmp / "cache"),
            "LAZYFS_RUN_DIR": str(tmp / "run"),
            "LAZYFS_SANDBOX_DIR": str(tmp / "sandboxes"),
            "LAZYFS_DAEMON_IDLE": "0",  # the data daemon goes as soon as its agent stops
            **(env or {}),
        }
        self.current = AgentProcess(Node(tmp, node_env), tmp / "agent.sock")
        self.nodes.append(self.current.node)
        self.current.start(*args)
        try:
            with self.current.client() as c:
                yield c
        finally:
            self.current.stop()

    def agent_log(self) -> str:
        return self.current.log()

    def wait_clean(self, timeout: float = 20.0) -> dict[str, list]:
        """What the agents left (testbed/nodecheck.py: mounts, cgroups under each node's
        own cgroup parent, runtime state, upper dirs, processes, network namespaces),
        once empty (the data daemon exits a moment after its last tree), or as it is
        after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            left: dict[str, list] = {}
            for node in self.nodes:
                for kind, found in leftovers(node.tmp, node.sandboxes, node.cgroup_parent).items():
                    left.setdefault(kind, []).extend(found)
            left = {k: v for k, v in left.items() if v}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)

    def scrub(self) -> None:
        """Stop and remove what this run's nodes left (each scrubs only its own)."""
        for node in self.nodes:
            node.scrub()

    def remove_cgroup_parents(self) -> None:
        for node in self.nodes:
            node.remove_cgroup_parent()


def wait_pool_full(c: Client, target: int) -> None:
    deadline = time.monotonic() + FILL_TIMEOUT
    while sum(p["ready"] for p in c.pools()) < target:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the pool did not fill: {c.pools()}")
        time.sleep(0.01)


# ---------------------------------------------------------------------------------------
# Measurements


def warm_claims(bench: Bench, c: Client, argv: list[str], n: int) -> tuple[list[float], int]:
    """Seconds of claim + exec argv to its exit, each from a full pool; how many were
    served by the pool."""
    samples, pooled = [], 0
    for _ in range(n):
        wait_pool_full(c, POOL)
        t0 = time.perf_counter()
        sb = c.create(NAME)
        r = sb.exec(argv)
        samples.append(time.perf_counter() - t0)
        if r.exit_code != 0:
            raise RuntimeError(f"{argv} exited {r.exit_code}: {r.stderr!r}")
        pooled += bool(sb.info["from_pool"])
        sb.delete()
    return samples, pooled


def agent_sums(c: Client) -> dict[str, float]:
    """The agent's own claim (from a pool) and exec histograms' sums and counts."""
    want = {
        'lazyfs_claim_seconds_sum{source="pool"}': "claim_sum",
        'lazyfs_claim_seconds_count{source="pool"}': "claim_n",
        "lazyfs_exec_seconds_sum": "exec_sum",
        "lazyfs_exec_seconds_count": "exec_n",
    }
    out = {}
    for line in c.metrics().splitlines():
        name, _, value = line.rpartition(" ")
        if name in want:
            out[want[name]] = float(value)
    return out


def agent_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    d = {k: after[k] - before[k] for k in after}
    return {"claim": d["claim_sum"] / d["claim_n"], "exec": d["exec_sum"] / d["exec_n"]}


def host_runs(argv: list[str], n: int) -> list[float]:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(argv, check=True, stdin=subprocess.DEVNULL)
        samples.append(time.perf_counter() - t0)
    return samples


def execs(c: Client, n: int) -> list[float]:
    with c.create(NAME) as sb:
        sb.exec(["true"])  # the exec server is up from here on
        samples = []
        for _ in range(n):
            t0 = time.perf_counter()
            if sb.exec(["true"]).exit_code != 0:
                raise RuntimeError("exec true failed")
            samples.append(time.perf_counter() - t0)
    return samples


def _stop_data_daemon(bench: Bench) -> None:
    """Stop the agent's node data daemon (SIGTERM to its supervisor, which unmounts), so
    that the next create starts it again and the agent holds that one."""
    run_dir = bench.current.node.tmp / "run"
    (pid,) = supervisors(run_dir)
    point = data_mount(run_dir)
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while supervisors(run_dir) or point in mount_ids():
        if time.monotonic() > deadline:
            raise RuntimeError("the data daemon did not stop")
        time.sleep(0.02)


COLD_LINE = re.compile(r"sandbox (\S+): made cold in ([0-9.]+) s \((.*)\)")


def cold_create(
    bench: Bench, label: str, env: dict[str, str] | None = None, daemon_down: bool = False
) -> dict[str, float]:
    """A fresh agent (empty cache, nothing mounted; the data daemon it holds up); create
    + python3 hello to its first output line, and the agent's account of the create.
    `daemon_down`: the data daemon stopped first, so the create starts it."""
    with bench.agent(label, env=env) as c:
        if daemon_down:
            _stop_data_daemon(bench)
        t0 = time.perf_counter()
        sb = c.create(NAME)
        t_created = time.perf_counter() - t0
        first = None
        out = b""
        for kind, data in sb.exec_stream(HELLO):
            if kind == "stdout" and first is None:
                first = time.perf_counter() - t0
            if kind == "stdout":
                out += data  # type: ignore[operator]
        if first is None or out != b"hello\n":
            raise RuntimeError(f"python3 hello printed {out!r}")
        t1 = time.perf_counter()
        sb.exec(HELLO)
        warm = time.perf_counter() - t1
        sb.delete()
        found = COLD_LINE.search(bench.agent_log())
        parts = {}
        if found:
            for item in found.group(3).split(", "):
                key, value = item.split()
                parts[key] = float(value)
        return {"first": first, "created": t_created, "hello_warm": warm, **parts}


# ---------------------------------------------------------------------------------------
# Output


VARIANTS = [
    ("cold_daemon_down", "the node data daemon not running (its start paid)"),
    ("cold_noprefetch", "no start-up trace (LAZYFS_PREFETCH=0)"),
]


def report(res: dict, args: argparse.Namespace, loads: tuple[str, str]) -> str:
    claims, py, host, ex = res["claims"], res["py"], res["host"], res["execs"]
    cold, tar = res["cold"], res["tar"]
    cold_first = statistics.median(r["first"] for r in cold)
    tar_first = statistics.median(r["first"] for r in tar)
    py_ratio = pct(py, 0.5) / pct(host, 0.5)
    rows = [
        [
            f"warm claim + exec `true` (n={len(claims)}, {res['pooled']} from the pool)",
            ms(pct(claims, 0.5)),
            ms(pct(claims, 0.99)),
            f"{pct(claims, 0.5) / 0.092:.2f}x agent-sandbox's p50 92 ms",
            "p50 <= 10 ms, p99 <= 30 ms",
            _ok(pct(claims, 0.5) <= GOALS["claim_p50"] and pct(claims, 0.99) <= GOALS["claim_p99"]),
        ],
        [
            f"warm claim + exec `python3 -c print` (n={len(py)})",
            ms(pct(py, 0.5)),
            ms(pct(py, 0.99)),
            f"**{py_ratio:.2f}x** the host's {ms(pct(host, 0.5))} (p99 {ms(pct(host, 0.99))})",
            "<= 1.3x",
            _ok(py_ratio <= GOALS["py_ratio"]),
        ],
        [
            f"exec `true` into a running sandbox (n={len(ex)})",
            ms(pct(ex, 0.5)),
            ms(pct(ex, 0.99)),
            "",
            "p50 <= 5 ms",
            _ok(pct(ex, 0.5) <= GOALS["exec_p50"]),
        ],
        [
            f"cold create to python3 hello's first output (n={len(cold)})",
            f"{cold_first:.3f} s",
            f"{max(r['first'] for r in cold):.3f} s (max)",
            f"**{tar_first / cold_first:.1f}x** sooner than GNU tar + chroot ({tar_first:.2f} s)",
            "<= 0.3 s, >= 5x",
            _ok(cold_first <= GOAL_COLD and tar_first / cold_first >= GOAL_COLD_RATIO),
        ],
    ]
    for key, what in VARIANTS:
        if res.get(key):
            first = statistics.median(r["first"] for r in res[key])
            ok = first <= GOAL_COLD and tar_first / first >= GOAL_COLD_RATIO
            rows.append(
                [
                    f"cold create, {what} (n={len(res[key])})",
                    f"{first:.3f} s",
                    f"{max(r['first'] for r in res[key]):.3f} s (max)",
                    f"**{tar_first / first:.1f}x** sooner than tar",
                    "<= 0.3 s, >= 5x",
                    _ok(ok),
                ]
            )
    main = table(["measure", "p50 / median", "p99", "ratio", "goal", "met"], rows)
    agent = res["agent"]
    mean = statistics.mean(claims)
    rest = mean - agent["claim"] - agent["exec"]
    warm = table(
        ["warm claim + exec `true`, mean of each part", "ms"],
        [
            ["the agent's claim (request in, sandbox handed out)", f"{agent['claim'] * 1e3:.2f}"],
            ["the agent's exec of `true` (to its exit status)", f"{agent['exec'] * 1e3:.2f}"],
            ["HTTP, JSON and the client (the rest)", f"{rest * 1e3:.2f}"],
            ["client side, in all", f"{mean * 1e3:.2f}"],
        ],
    )
    columns = [("cold", "agent running, image not mounted")] + [
        (k, w) for k, w in VARIANTS if res.get(k)
    ]

    def cell(key: str, part: Callable[[dict], float]) -> str:
        return f"{statistics.median(part(r) for r in res[key]):.3f} s"

    parts: list[tuple[str, Callable[[dict], float]]] = [
        ("resolve the image, fetch its manifest (agent)", lambda r: r.get("image", 0.0)),
        ("mount its tree (EROFS; the data daemon's start if not up)", lambda r: r.get("tree", 0)),
        ("prepare the bundle (overlay, config.json)", lambda r: r.get("prepare", 0.0)),
        (
            "`runc run --detach` (create and start; before 2026-12-01 evening, the two)",
            lambda r: r.get("runtime", r.get("create", 0.0) + r.get("start", 0.0)),
        ),
        ("create request, client side (all of the above + HTTP)", lambda r: r["created"]),
        (
            "first exec to its first output (python3 hello, its files read cold)",
            lambda r: r["first"] - r["created"],
        ),
        ("for comparison: python3 hello again in that sandbox (warm)", lambda r: r["hello_warm"]),
    ]
    bd = [[what] + [cell(key, part) for key, _ in columns] for what, part in parts]
    tar_parts = " / ".join(
        f"{statistics.median(r[k] for r in tar):.2f} s" for k in ("fetch", "unpack", "run")
    )
    bd.append(
        ["GNU tar baseline: copy blobs / unpack / chroot python3", tar_parts]
        + [""] * (len(columns) - 1)
    )
    breakdown = table(["cold create, median of each part"] + [w for _, w in columns], bd)
    notes = [
        f"Command: `.venv/bin/python bench/agent_bench.py {' '.join(sys.argv[1:])}`".rstrip(),
        f"Machine: {machine_note()}; load average before {loads[0]}, after {loads[1]}"
        " (a shared machine: other jobs' load makes the tails noisy).",
        f"Warm pool of {POOL}; each claim waits for the pool to be full first. Host python3:"
        f" {HOST_PYTHON}.",
    ]
    text = main + "\n\n" + warm + "\n\n" + breakdown + "\n\n" + "\n".join(f"- {n}" for n in notes)
    save_markdown(
        "agent_bench",
        "Node agent: warm claims, exec, cold create",
        [
            ("Results", main),
            ("Where a warm claim's time goes", warm),
            ("Where a cold create's time goes", breakdown),
            ("Notes", "\n".join(f"- {n}" for n in notes)),
        ],
    )
    return text


def _ok(met: bool) -> str:
    return "yes" if met else "**no**"


def plot(res: dict) -> None:
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(13, 4.8))
    series = [
        ("warm claim + exec true", res["claims"], "#48c"),
        ("warm claim + exec python3 -c print", res["py"], "#4a6"),
        ("python3 -c print on the host", res["host"], "#b44"),
        ("exec true (running sandbox)", res["execs"], "#7c5"),
    ]
    for label, samples, color in series:
        xs = sorted(s * 1000 for s in samples)
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        left.step(xs, ys, where="post", label=label, color=color)
    left.axvline(10, color="#888", ls="--", lw=0.8)
    left.annotate("10 ms goal", (10, 0.05), fontsize=8, color="#666")
    left.set_xscale("log")
    left.set_xlabel("milliseconds (client side, through the HTTP API)")
    left.set_ylabel("fraction of samples")
    left.set_title("warm claims and execs (CDF)")
    left.legend(fontsize=8, loc="lower right")
    bars = [("GNU tar + chroot", res["tar"], "#b44"), ("agent, cold create", res["cold"], "#48c")]
    if res.get("cold_noprefetch"):
        bars.insert(1, ("agent, cold, no trace", res["cold_noprefetch"], "#9bd"))
    if res.get("cold_daemon_down"):
        bars.append(("agent, cold, data daemon down", res["cold_daemon_down"], "#c84"))
    for i, (_label, runs, color) in enumerate(bars):
        vals = [r["first"] for r in runs]
        med = statistics.median(vals)
        right.bar(i, med, 0.6, color=color, yerr=minmax_err(vals))
        right.annotate(f"{med:.2f} s", (i, med), ha="center", va="bottom", fontsize=8)
    right.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
    right.set_yscale("log")
    right.set_ylabel("seconds to python3 hello's first output (median, min-max)")
    right.set_title("cold: empty node cache, image not mounted")
    fig.tight_layout()
    save_plot(fig, "agent_bench")


def interleaved(n: int, *steps: Callable[[int], None]) -> None:
    for i in range(n):
        for step in steps:
            step(i)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--claims", type=int, default=CLAIMS)
    p.add_argument("--execs", type=int, default=EXECS)
    p.add_argument("--cold", type=int, default=COLD)
    p.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
    args = p.parse_args()
    if args.quick:
        args.claims, args.execs, args.cold = 20, 30, 1
    if os.geteuid() != 0:
        print("agent_bench needs root (mounts, runc)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally cleans up
    loads = [load_average()]
    imgs = images()
    layers = layout_layers(imgs.layout, TAG)
    root = Path(tempfile.mkdtemp(prefix="lazyfs-bench-agent-"))
    bench = Bench(root)
    res: dict = {"cold": [], "cold_daemon_down": [], "cold_noprefetch": [], "tar": []}
    try:
        run([LAZYFS, "convert", f"oci:{imgs.layout}:{TAG}", "--name", NAME]
            + ["--store", f"file://{bench.store}"])  # fmt: skip
        print(f"load average {loads[0]}; warm pool of {POOL} ...", flush=True)
        with bench.agent("warm", "--pool", f"{NAME}={POOL}") as c:
            wait_pool_full(c, POOL)
            before = agent_sums(c)
            res["claims"], res["pooled"] = warm_claims(bench, c, ["true"], args.claims)
            res["agent"] = agent_means(before, agent_sums(c))
            print(f"  claim + true: p50 {ms(pct(res['claims'], 0.5))}", flush=True)
            res["py"], res["host"] = [], []
            # One unmeasured first: the claims above ran only `true`, so python3's files
            # were never read from this tree (node cache and page cache cold): that one
            # run was the p99 of every run before (0.35-0.8 s).
            warm_claims(bench, c, PRINT, 1)
            for _ in range(max(1, args.claims // 3 if not args.quick else 10)):
                res["py"] += warm_claims(bench, c, PRINT, 1)[0]
                res["host"] += host_runs([HOST_PYTHON, *PRINT[1:]], 1)
            res["execs"] = execs(c, args.execs)
        print("cold creates and the GNU tar baseline ...", flush=True)
        setting = Setting(
            "local", f"file://{bench.store}", bench.base_env, local_fetcher(imgs.layout)
        )
        cold_create(bench, "cold-record")  # records the start-up trace in the store

        def one_cold(i: int) -> None:
            res["cold"].append(cold_create(bench, f"cold-{i}"))

        def one_daemon_down(i: int) -> None:
            res["cold_daemon_down"].append(cold_create(bench, f"cold-dd-{i}", daemon_down=True))

        def one_noprefetch(i: int) -> None:
            res["cold_noprefetch"].append(
                cold_create(bench, f"cold-np-{i}", env={"LAZYFS_PREFETCH": "0"})
            )

        def one_tar(i: int) -> None:
            work = root / f"tar-{i}"
            try:
                res["tar"].append(full_pull(setting, layers, work, imgs.layout))
            finally:
                shutil.rmtree(work, ignore_errors=True)
                # The unpack's 218 MB of dirty pages (and the removal's journal) are
                # written back now, not during the cold create measured next.
                os.sync()

        interleaved(args.cold, one_tar, one_cold, one_daemon_down, one_noprefetch)
        loads.append(load_average())
    finally:
        left = bench.wait_clean()
        if left:
            print(f"left behind: {left}", file=sys.stderr)
            bench.scrub()
        bench.remove_cgroup_parents()
        shutil.rmtree(root, ignore_errors=True)
    text = report(res, args, (loads[0], loads[-1]))
    plot(res)
    print(text)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
