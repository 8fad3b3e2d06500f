"""Cold starts as a fresh node sees them (issue 21), each beside its baseline, interleaved.

"Cold" here means what a new node has: `sync; echo 3 > /proc/sys/vm/drop_caches` right
before the timed part, an empty node cache, no data daemon of this run's (each cold
sample's own cache is new, so its data daemon is new too), and the store a `file://`
directory on this disk, so its pack files are read from disk as well. "Warm local" is
the same command in the image unpacked on local disk (chroot), run once before so its
pages are cached: the speed a node with the image already unpacked would have.

Sections (`--only SECTION`, repeatable):

  agent   sympy's own tests (SYMPY_TESTS under pytest, -B) in a new sandbox of
          `lazyfs serve --warm 2`, through the Python client: create (a claim from the
          generic pool), exec, delete. Cold: an agent started on an empty node cache
          (not timed), its pool full, then the page cache dropped;
          warm: the next sandbox of the same agent. Each against the warm local run just
          before and after it. Goals: cold <= 1.4x, warm <= 1.1x.
  run     the same tests through `lazyfs run`: cold, and warm with the image lingering
          from the run before (`--linger`). Goals: cold <= 1.6x, warm <= 1.1x.
  s3      the cold rows of both over S3: SeaweedFS in a network namespace behind a veth
          pair shaped by tbf to 1 Gbit/s and a +4 ms delay line (bench/netns.py), its
          volumes on this disk (dropped from the page cache too).
  hello   `python3 -c print('hello')` through `lazyfs run`, cold, against GNU tar of every
          layer of the python image into an empty directory plus the same command in a
          chroot of it, page cache dropped before each. Goal: >= 4x sooner.
  burst   32 `lazyfs run`s of the 16 task images at once (bench/tree_perf.py's burst),
          cold, against GNU tar unpacking the 16 images and running the same 32 commands,
          page cache dropped before each. Goals: >= 3x sooner, peak RSS <= 400 MB.

Beside each cold lazyfs figure, the physical limit of its bytes: what it fetched from the
store (compressed) over this disk's sequential read rate, plus the time to inflate it
(zstd, at the rate measured here on the image's own files), both measured by this script.

Run (as root): .venv/bin/python bench/cold_start.py [--repeat N] [--only SECTION]
Results: bench/results/cold_start.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from _common import (
    cold_read_bandwidth,
    drop_caches,
    layout_layers,
    timed_run,
    tree_images,
    tree_rootfs,
)
from _report import (
    RESULTS,
    grouped_bars,
    load_average,
    machine_note,
    median,
    pyplot,
    save_plot,
    spread,
    table,
    write,
)
from agent_scale import claim_metrics, wait_pool_full  # noqa: E402
from run_vs_pull import final_stats, node_counters, untar_layer  # noqa: E402
from tree_perf import (  # noqa: E402
    CHILD_ENV,
    LINGER,
    RUN_TIMEOUT,
    Bench,
    chroot,
    lazyfs_burst,
    node_agent,
    pytest_passed,
    s3_over_link,
    scratch_node,
    tar_burst,
    wait_for_no_data_daemon,
)

from lazyfs.client import Client  # noqa: E402
from lazyfs.tree.node_files import mount_stats  # noqa: E402
from testbed.tree_images import SYMPY_DIR  # noqa: E402

SECTIONS = ("agent", "run", "s3", "hello", "burst")
SYMPY_TESTS = [f"/{SYMPY_DIR}/core/tests/{m}.py" for m in ("test_basic", "test_sympify")]
# -B: nothing written into the tree, so every run starts from the same bytes (pytest's
# rewritten test modules are not cached between runs in either place).
PYTEST = ["python3", "-B", "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *SYMPY_TESTS]
HELLO = ["python3", "-c", "print('hello')"]
GOALS = {"agent cold": 1.4, "agent warm": 1.1, "run cold": 1.6, "run warm": 1.1}
# The agent keeps this many generic sandboxes ready (`lazyfs serve --warm`), as an RL node
# runs it: every agent sample claims one and gives it the image's root (issue 23); the pool
# refills in the background, at low priority, while the sample runs.
AGENT_WARM = 2
HELLO_GOAL, BURST_GOAL, RSS_GOAL_MB = 4.0, 3.0, 400
LINK_BYTES_PER_S = 125e6  # RATE, 1 Gbit/s: the s3 rows' physical limit


# ---------------------------------------------------------------------------------------
# The physical limit


def inflate_rate(root: Path) -> tuple[float, float]:
    """(compressed bytes inflated per second, compressed/plain ratio): zstd at the
    converter's level over up to 64 MB of the image's own files, in 64 KiB pieces."""
    import zstandard

    from chunker.packs import ZSTD_LEVEL

    plain: list[bytes] = []
    size = 0
    for path in sorted((root / "usr/lib/python3.11").rglob("*")):
        if size > 64 << 20:
            break
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            plain += [data[i : i + (64 << 10)] for i in range(0, len(data), 64 << 10)]
            size += len(data)
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)
    packed = [cctx.compress(p) for p in plain if p]
    dctx = zstandard.ZstdDecompressor()
    t0 = time.perf_counter()
    for p in packed:
        dctx.decompress(p)
    seconds = time.perf_counter() - t0
    compressed = sum(map(len, packed))
    return compressed / seconds, compressed / size


def limit_s(fetched: int | None, rates: dict[str, float]) -> float | None:
    """Seconds the fetched bytes need at least: read from disk, then inflated."""
    if not fetched:
        return None
    return fetched / rates["disk"] + fetched / rates["inflate"]


# ---------------------------------------------------------------------------------------
# The runs


def fresh_cache(b: Bench) -> Path:
    """An empty node cache, after every data daemon of this run has exited (each cache has
    its own; LAZYFS_DAEMON_IDLE=1 makes them go a second after their last tree)."""
    wait_for_no_data_daemon(b, timeout=120)
    return b.scratch("cache")


def fetched(cache: Path) -> dict[str, Any]:
    """Store requests and bytes of the mounts that served from this cache (their stats:
    run_vs_pull.node_counters)."""
    return node_counters(mount_stats(cache))


def local_run(root: Path, command: list[str]) -> float:
    """The warm local baseline: run once untimed, then timed. Every cold sample drops the
    page cache, the local tree's pages too: a local run right after one read part of
    its tree from disk (0.84-0.89 s against 0.69-0.72 s, 2026-12-02 08:33), which made
    the cold rows look better than they are."""
    chroot(root, command)
    t = chroot(root, command)
    if command is PYTEST:
        pytest_passed(t)
    return t.exit


def run_cold(
    b: Bench, name: str, command: list[str], env: dict[str, str], url: str = ""
) -> dict[str, Any]:
    cache = fresh_cache(b)
    drop_caches()
    t = timed_run(b.run_argv(name, cache, command, url=url), env, timeout=RUN_TIMEOUT)
    if command is PYTEST:
        pytest_passed(t)
    stats = final_stats(cache, set())
    return {"s": t.exit, **{k: stats.get(k) for k in ("store_requests", "bytes_fetched")}}


def record_trace(
    b: Bench, name: str, command: list[str], env: dict[str, str] | None = None, url: str = ""
) -> None:
    """One untimed run on a node cache of its own ("another node"): it records the
    image's start-up trace into the store, for the cold runs that replay it."""
    cache = fresh_cache(b)
    timed_run(b.run_argv(name, cache, command, url=url), env or b.env, timeout=RUN_TIMEOUT)
    wait_for_no_data_daemon(b, timeout=120)  # it writes the trace as its tree goes
    shutil.rmtree(cache, ignore_errors=True)


def no_trace(b: Bench) -> dict[str, str]:
    return {**b.env, "LAZYFS_PREFETCH": "0"}  # neither replays nor records one


VARIANTS = ("cold", "cold, no trace", "warm")


def new_result() -> dict[str, Any]:
    return {"local": [], **{v: [] for v in VARIANTS}, **{f"base {v}": [] for v in VARIANTS}}


def section_run(b: Bench, repeat: int) -> dict[str, Any]:
    name, local = b.image("sympy"), tree_rootfs("sympy")
    record_trace(b, name, PYTEST)
    local_run(local, PYTEST)  # its pages in
    res = new_result()
    for i in range(repeat):
        before = local_run(local, PYTEST)
        res["cold"].append(run_cold(b, name, PYTEST, b.env))
        res["cold, no trace"].append(run_cold(b, name, PYTEST, no_trace(b)))
        between = local_run(local, PYTEST)
        cache = fresh_cache(b)
        timed_run(b.run_argv(name, cache, PYTEST, linger=LINGER), b.env)  # fills, lingers
        warm = pytest_passed(timed_run(b.run_argv(name, cache, PYTEST, linger=LINGER), b.env))
        res["warm"].append({"s": warm.exit})
        b.unmount_lingering(cache)
        after = local_run(local, PYTEST)
        res["local"] += [before, between, after]
        res["base cold"].append((before + between) / 2)
        res["base cold, no trace"].append((before + between) / 2)
        res["base warm"].append((between + after) / 2)
        print(f"  run {i + 1}/{repeat}: {round_line(res, before, between, after)}", flush=True)
    return res


def round_line(res: dict[str, Any], *local: float) -> str:
    lazy = ", ".join(f"{v} {res[v][-1]['s']:.2f} s" for v in VARIANTS)
    return "local " + "/".join(f"{x:.2f}" for x in local) + f" s; {lazy}"


def section_agent(b: Bench, repeat: int) -> dict[str, Any]:
    name, local = b.image("sympy"), tree_rootfs("sympy")
    record_trace(b, name, PYTEST)
    local_run(local, PYTEST)
    res = new_result()
    for i in range(repeat):
        before = local_run(local, PYTEST)
        res["cold, no trace"].append(agent_cold(b, name, no_trace(b)))
        with cold_agent(b, name, b.env) as (client, cold):
            res["cold"].append(cold)
            between = local_run(local, PYTEST)
            res["warm"].append({"s": sandbox_run(client, name)})
        after = local_run(local, PYTEST)
        res["local"] += [before, between, after]
        res["base cold"].append((before + between) / 2)
        res["base cold, no trace"].append(before)
        res["base warm"].append((between + after) / 2)
        print(f"  agent {i + 1}/{repeat}: {round_line(res, before, between, after)}", flush=True)
    return res


@contextmanager
def cold_agent(
    b: Bench, name: str, env: dict[str, str], url: str = ""
) -> Iterator[tuple[Client, dict[str, Any]]]:
    """A new agent (its start not timed) on an empty node cache, and its first sandbox's
    cold sample; the agent stays up for the with (a warm sample after it)."""
    cache = fresh_cache(b)
    with node_agent(b, cache, env, url, warm=AGENT_WARM) as client:
        wait_pool_full(client, AGENT_WARM)  # its only pool: made before the cache drop
        drop_caches()
        seconds = sandbox_run(client, name)
        time.sleep(1.5)  # the data daemon's stats, rewritten every second
        yield client, {"s": seconds, **fetched(cache)}


def agent_cold(b: Bench, name: str, env: dict[str, str], url: str = "") -> dict[str, Any]:
    with cold_agent(b, name, env, url) as (_, cold):
        return cold


S3_VARIANTS = ("run cold", "run cold, no trace", "agent cold", "agent cold, no trace")


def section_s3(b: Bench, repeat: int) -> dict[str, Any]:
    """The cold rows over S3: SeaweedFS in a network namespace behind tbf (RATE) and a
    delay line (+2 DELAY_MS round trip), the image pushed there, its trace recorded there
    by one untimed run on another node cache first."""
    name, local = b.image("sympy"), tree_rootfs("sympy")
    res: dict[str, Any] = {"local": [], **{v: [] for v in S3_VARIANTS}, "base": []}
    with s3_over_link(b, name) as (url, env, _):
        quiet = {**env, "LAZYFS_PREFETCH": "0"}
        record_trace(b, name, PYTEST, env, url)
        local_run(local, PYTEST)
        for i in range(repeat):
            before = local_run(local, PYTEST)
            res["run cold"].append(run_cold(b, name, PYTEST, env, url))
            res["run cold, no trace"].append(run_cold(b, name, PYTEST, quiet, url))
            res["agent cold"].append(agent_cold(b, name, env, url))
            res["agent cold, no trace"].append(agent_cold(b, name, quiet, url))
            after = local_run(local, PYTEST)
            res["local"] += [before, after]
            res["base"].append((before + after) / 2)
            line = ", ".join(f"{v} {res[v][-1]['s']:.2f} s" for v in S3_VARIANTS)
            print(f"  s3 {i + 1}/{repeat}: local {before:.2f}/{after:.2f} s; {line}")
    return res


def sandbox_run(client: Any, name: str) -> float:
    """create + exec PYTEST + delete through the client, timed as the user sees it; the
    sandbox claimed from the agent's full generic pool (RuntimeError if it was not)."""
    wait_pool_full(client, AGENT_WARM)  # the last claim's refill is not in this sample
    generic = claim_metrics(client).get("generic", {}).get("count", 0.0)
    t0 = time.perf_counter()
    with client.create(name) as sb:
        r = sb.exec(PYTEST, timeout=RUN_TIMEOUT)
    seconds = time.perf_counter() - t0
    out = r.stdout.decode(errors="replace")
    if r.exit_code != 0 or " passed" not in out:
        raise RuntimeError(f"pytest in the sandbox: exit {r.exit_code}: {out[-1000:]}")
    if claim_metrics(client).get("generic", {}).get("count", 0.0) != generic + 1:
        raise RuntimeError(f"the sandbox was not claimed from the generic pool: {client.pools()}")
    return seconds


def tar_hello(b: Bench) -> float:
    """GNU tar of every layer of the python image into an empty directory, then HELLO in
    a chroot of it; page cache dropped first."""
    imgs = tree_images()
    root = b.scratch("tar-hello")
    try:
        drop_caches()
        t0 = time.perf_counter()
        for layer in layout_layers(imgs.layout, "python"):
            untar_layer(imgs.layout / "blobs" / layer["digest"].replace(":", "/"), root)
        t = timed_run(["chroot", root, *HELLO], CHILD_ENV, t0)
        if t.out.strip() != "hello":
            raise RuntimeError(f"the chroot printed {t.out!r}")
        return t.exit
    finally:
        shutil.rmtree(root, ignore_errors=True)


def section_hello(b: Bench, repeat: int) -> dict[str, Any]:
    name = b.image("python")
    record_trace(b, name, HELLO)
    res: dict[str, Any] = {"tar": [], "cold": [], "cold, no trace": []}
    for i in range(repeat):
        res["tar"].append(tar_hello(b))
        res["cold"].append(run_cold(b, name, HELLO, b.env))
        res["cold, no trace"].append(run_cold(b, name, HELLO, no_trace(b)))
        print(
            f"  hello {i + 1}/{repeat}: tar+chroot {res['tar'][-1]:.2f} s, lazyfs run cold"
            f" {res['cold'][-1]['s']:.2f} s, no trace {res['cold, no trace'][-1]['s']:.2f} s",
            flush=True,
        )
    return res


def section_burst(b: Bench, repeat: int) -> dict[str, Any]:
    names = {tag: b.image(tag) for tag in tree_images().task_tags}
    res: dict[str, Any] = {"tar": [], "lazyfs": [], "peak_rss_mb": []}
    for i in range(repeat):
        drop_caches()
        res["tar"].append(tar_burst(b))
        drop_caches()
        t, rss = lazyfs_burst(b, names)  # its own new node cache
        # Its data daemon exits LAZYFS_DAEMON_IDLE after the last run: gone before the
        # next round's tar, and before the clean-up after the last round (which otherwise
        # found its mount and removed it).
        wait_for_no_data_daemon(b, timeout=120)
        res["lazyfs"].append(t)
        res["peak_rss_mb"].append(rss.peak / 1e6)
        print(
            f"  burst {i + 1}/{repeat}: tar {res['tar'][-1]:.2f} s, lazyfs run {t:.2f} s"
            f" (peak RSS {rss.peak / 1e6:.0f} MB)",
            flush=True,
        )
    return res


# ---------------------------------------------------------------------------------------
# Output


def met(ok: bool) -> str:
    return "**met**" if ok else "not met"


def ratio_row(
    label: str, goal: float, runs: list[dict], bases: list[float], rates: dict[str, float]
) -> list[str]:
    secs = [r["s"] for r in runs]
    ratios = [s / base for s, base in zip(secs, bases, strict=True)]
    limits = [limit_s(r.get("bytes_fetched"), rates) for r in runs]
    fetched_mb = [r["bytes_fetched"] / 1e6 for r in runs if r.get("bytes_fetched")]
    gets = [r["store_requests"] for r in runs if r.get("store_requests")]
    return [
        label,
        spread(bases),
        spread(secs),
        spread(ratios, unit="x"),
        f"<= {goal}x",
        met(max(ratios) <= goal) if len(ratios) > 1 else met(median(ratios) <= goal),
        f"{median(fetched_mb):.1f} MB, {median(gets):.0f} GETs" if fetched_mb else "-",
        f"{median([x for x in limits if x]):.3f} s" if any(limits) else "-",
    ]


def report(res: dict[str, Any], args: argparse.Namespace, load: tuple[str, str]) -> str:
    rates = res["rates"]
    cond = "\n".join(
        [
            f"- {machine_note()}; load average before: {load[0]}, after: {load[1]}.",
            f"- Command: `.venv/bin/python bench/cold_start.py --repeat {args.repeat}"
            + "".join(f" --only {s}" for s in args.only or [])
            + "`.",
            "- Cold: `sync; echo 3 > /proc/sys/vm/drop_caches` right before the timed part,"
            " an empty node cache (and so a new data daemon), the store a `file://` directory"
            ' on this disk. "cold" replays the start-up trace an untimed run on another'
            ' node cache recorded into the store first; "no trace" has none'
            " (LAZYFS_PREFETCH=0). Warm local: the same command in a chroot of the image"
            " unpacked on local disk, its pages cached.",
            f"- This disk reads {rates['disk'] / 1e9:.2f} GB/s sequentially (the store's"
            " packs, page cache dropped); zstd inflates"
            f" {rates['inflate'] / 1e6:.0f} MB/s of compressed"
            f" bytes here (ratio {rates['ratio']:.2f}). The physical limit of a cold run's"
            " bytes = bytes fetched / disk rate + bytes fetched / inflate rate.",
            "- S3 rows: their limit takes the link's 125 MB/s (1 Gbit/s) for the disk's.",
            f"- sympy tests: `{' '.join(PYTEST)}` (67 passed).",
        ]
    )
    sections = [("Conditions", cond)]
    head = [
        "",
        "warm local, s",
        "lazyfs, s",
        "lazyfs / local",
        "goal",
        "",
        "fetched from the store",
        "physical limit of those bytes",
    ]
    rows = []
    for key, label in (("agent", "sympy, agent"), ("run", "sympy, lazyfs run")):
        if key in res:
            r = res[key]
            for v in VARIANTS:
                goal = GOALS[f"{key} {v.split(',')[0]}"]
                rows.append(ratio_row(f"{label}, {v}", goal, r[v], r[f"base {v}"], rates))
    if "s3" in res:
        r = res["s3"]
        for v in S3_VARIANTS:
            kind, _, rest = v.partition(" ")
            goal = GOALS[f"{kind} cold"]
            label = f"sympy, {'agent' if kind == 'agent' else 'lazyfs run'}, {rest}, S3"
            link = {**rates, "disk": LINK_BYTES_PER_S}  # the link, not the disk, bounds it
            rows.append(ratio_row(label, goal, r[v], r["base"], link))
    if rows:
        sections.append(("sympy's tests, cold and warm", table(head, rows)))
    rows = []
    if "hello" in res:
        r = res["hello"]
        for v in ("cold", "cold, no trace"):
            ratios = [t / c["s"] for t, c in zip(r["tar"], r[v], strict=True)]
            limits = [limit_s(c.get("bytes_fetched"), rates) for c in r[v]]
            rows.append(
                [
                    f"python3 -c print, {v}",
                    spread(r["tar"]),
                    spread([c["s"] for c in r[v]]),
                    spread(ratios, unit="x"),
                    f">= {HELLO_GOAL}x",
                    met(min(ratios) >= HELLO_GOAL),
                    f"{median([c['bytes_fetched'] for c in r[v]]) / 1e6:.1f} MB",
                    f"{median([x for x in limits if x]):.3f} s",
                ]
            )
    if "burst" in res:
        r = res["burst"]
        ratios = [t / lz for t, lz in zip(r["tar"], r["lazyfs"], strict=True)]
        rows.append(
            [
                "32 lazyfs run of 16 images, cold",
                spread(r["tar"]),
                spread(r["lazyfs"]),
                spread(ratios, unit="x"),
                f">= {BURST_GOAL}x; peak RSS <= {RSS_GOAL_MB} MB",
                met(min(ratios) >= BURST_GOAL)
                + f"; peak RSS {spread(r['peak_rss_mb'], 0)} MB "
                + met(max(r["peak_rss_mb"]) <= RSS_GOAL_MB),
                "-",
                "-",
            ]
        )
    if rows:
        head2 = ["", "GNU tar + chroot, s", "lazyfs run, s", "tar / lazyfs", "goal", "", "", ""]
        sections.append(("Against unpacking with GNU tar", table(head2, rows)))
    notes = [
        "- Each sympy ratio divides a run by the mean of the warm local runs just before and"
        " after it; the range is over rounds, and a goal counts as met only if every round"
        " meets it.",
        "- Agent rows: create + exec + delete through `lazyfs.client`; the agent (started on"
        f" an empty node cache, `--warm {AGENT_WARM}`) is not timed; the page cache is dropped"
        " once it is up with its generic pool full. Each sandbox is claimed from that pool"
        " (checked by the agent's claim metrics) and given the image's root then; the pool"
        " refills in the background, at low priority, during the run.",
        "- `lazyfs run` rows include the command's whole life: its Python start-up, the data"
        " daemon's start (cold), the mount, `runc run --detach`, the command, the"
        " sandbox's delete.",
    ]
    sections.append(("Notes", "\n".join(notes)))
    return "\n\n".join(f"## {h}\n\n{b}" for h, b in sections)


def plot(res: dict[str, Any]) -> None:
    labels, local, lazy = [], [], []
    for key, label in (("agent", "agent"), ("run", "lazyfs run")):
        if key in res:
            for v in VARIANTS:
                labels.append(f"sympy, {label}, {v}")
                local.append(median(res[key][f"base {v}"]))
                lazy.append(median([r["s"] for r in res[key][v]]))
    if "s3" in res:
        for v in S3_VARIANTS:
            labels.append(f"sympy, {v}, S3")
            local.append(median(res["s3"]["base"]))
            lazy.append(median([r["s"] for r in res["s3"][v]]))
    if "hello" in res:
        for v in ("cold", "cold, no trace"):
            labels.append(f"python3 -c print, {v}")
            local.append(median(res["hello"]["tar"]))
            lazy.append(median([c["s"] for c in res["hello"][v]]))
    if "burst" in res:
        labels.append("burst of 32, cold")
        local.append(median(res["burst"]["tar"]))
        lazy.append(median(res["burst"]["lazyfs"]))
    fig, ax = pyplot().subplots(figsize=(9, 0.6 * len(labels) + 1.5))
    grouped_bars(ax, {"baseline (warm local / GNU tar)": local, "lazyfs": lazy}, horizontal=True)
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("seconds (median)")
    ax.legend()
    ax.set_title("Cold starts, page cache dropped (bench/cold_start.py)")
    fig.tight_layout()
    save_plot(fig, "cold_start", dpi=100)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--only", action="append", choices=SECTIONS)
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/cold_start.py runs as root (mounts, drop_caches)")
    load_before = load_average()
    res: dict[str, Any] = {}
    tree_images()  # built before any clock starts
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the clean-up still runs
    with scratch_node("lazyfs-bench-cold-", LAZYFS_DAEMON_IDLE="1") as b:
        b.image("sympy")
        inflate, ratio = inflate_rate(tree_rootfs("sympy"))
        packs = sorted((b.root / "store" / "packs").iterdir())
        res["rates"] = {"disk": cold_read_bandwidth(*packs), "inflate": inflate, "ratio": ratio}
        steps = {"agent": section_agent, "run": section_run, "hello": section_hello}
        steps.update(burst=section_burst, s3=section_s3)
        for section in args.only or SECTIONS:
            print(f"{section}:", flush=True)
            res[section] = steps[section](b, args.repeat)
    load_after = load_average()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cold_start.json").write_text(json.dumps(res, indent=1))
    body = report(res, args, (load_before, load_after))
    write("cold_start", f"# Cold starts, page cache dropped\n\n{body}\n")
    plot(res)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
