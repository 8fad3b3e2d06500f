"""Images on one base, merged trees against layer trees (`lazyfs convert --layer-trees`).

The 50 images of testbed/agent_images.py (a shared 218 MB python base and a small task
layer each) in two file:// stores, one converted as before (a merged tree per image), one
with --layer-trees (the agent stacks each image's layer trees: docs/FORMATS.md). Each
round runs both sides, one after the other, the order flipped every round; each side on
a new agent (bench/agent_scale.py's agent_on: a private node, an empty node cache, a
private copy of its store).

  start   the generic pool filled to 50 (--warm 50), the page cache dropped, then the 50
          images one after another: create + `python3 -c pass`, timed as the client sees
          it. With all 50 sandboxes up: the growth of the page cache (Cached in
          /proc/meminfo, the whole machine's) since the drop, and the data daemon's RSS;
          then every sandbox deleted. What a node pays for an image new to it whose base
          it already runs.
  burst   bench/agent_scale.py's first burst with --warm 200: 200 creates of the 50
          images at once, each running `cat /task/id.txt` (checked), the generic pool
          full before it starts; create p50 and p99, the last output, the CPU seconds
          of the agent and of the data daemon. Then the same burst again on the same
          agent, its trees mounted (what every claim costs, new image or not). Issue
          23's goal for the first: create p50 <= 0.5 s.
  cold    one image cold, as bench/cold_start.py's agent rows take it: sympy's tests
          (67 pass) in a sandbox claimed from the generic pool of a new agent on an
          empty node cache, the page cache dropped once the pool is full; the sympy tree
          image converted both ways into one store. With a start-up trace (recorded by
          one untimed run on another node cache: `lazyfs run` for the merged tree, the
          agent for the layer trees) and without one (LAZYFS_PREFETCH=0). The warm
          local run (a chroot of the unpacked image) before and after each round.
  convert what a convert pays for the trees, 2 cores, an empty store each round: the
          python test image, then the sympy tree image (its python layers converted
          before), then sympy again under another name (every layer converted before);
          each `lazyfs convert` timed as a process, with and without --no-layer-trees.

Results: bench/results/layer_trees.{md,json,png}.

Run (as root): .venv/bin/python bench/layer_trees.py [--rounds 4] [--only start|burst|cold|convert]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from _common import (
    LAZYFS,
    cache_root,
    cached_bytes,
    drop_caches,
    images,
    run,
    tree_images,
    tree_rootfs,
)
from _report import (
    RESULTS,
    grouped_bars,
    machine_note,
    median,
    pyplot,
    save_markdown,
    save_plot,
    spread,
    table,
)
from agent_scale import Counts, agent_on, lazyfs_burst, node_daemons, store, wait_pool_full
from cold_start import PYTEST, agent_cold, local_run, no_trace, record_trace
from tree_perf import scratch_node, wait_for_no_data_daemon

from testbed.agent_images import AgentImages, ensure_agent_images
from testbed.mounts import wait_no_mounts_below

SIDES = ("merged", "layered")
START_IMAGES = 50
BURST = Counts(images=50, sandboxes=200)
GOAL_BURST_P50 = 0.5


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def start_round(root: Path, store_dir: Path, images: AgentImages) -> dict:
    """One side's `start` round (see the top)."""
    n = START_IMAGES
    args = ["--warm", str(n), "--max-sandboxes", str(2 * n + 10)]
    with agent_on(root, store_dir, *args) as agent, agent.client() as c:
        wait_pool_full(c, n)
        drop_caches()
        before = cached_bytes()
        boxes, seconds = [], []
        for tag in images.tags[:n]:
            t0 = time.perf_counter()
            sb = c.create(tag, ttl=600)
            boxes.append(sb)
            if sb.exec(["python3", "-c", "pass"]).exit_code != 0:
                raise RuntimeError(f"python3 -c pass failed in {tag}")
            seconds.append(time.perf_counter() - t0)
        cache = cached_bytes() - before
        daemon_rss = rss(node_daemons(agent)["data daemon"])
        from_pool = sum(1 for sb in boxes if sb.info["from_pool"])
        for sb in boxes:
            sb.delete()
    return {
        "seconds": seconds,
        "total": sum(seconds),
        "cache_mb": cache / 1e6,
        "daemon_rss_mb": daemon_rss / 1e6,
        "from_pool": from_pool,
    }


def burst_round(root: Path, store_dir: Path, images: AgentImages) -> dict:
    r = lazyfs_burst(root, store_dir, images, BURST, BURST.sandboxes, again=True)
    if r["right"] != r["sandboxes"] or r["again"]["right"] != r["sandboxes"]:
        raise RuntimeError(f"wrong outputs: {r['right']}, again {r['again']['right']}")
    keep = ("create_p50", "create_p99", "last_output", "cpu_s")
    return {**{k: r[k] for k in keep}, "again_p50": r["again"]["create_p50"]}


def cold_rounds(rounds: int) -> dict:
    """The `cold` section (see the top), every round both sides, the order flipped."""
    tree_images()  # built before any clock starts
    res: dict = {side: [] for side in SIDES}
    res["local"] = []
    with scratch_node("lazyfs-bench-layers-cold-", LAZYFS_DAEMON_IDLE="1") as b:
        names = {"layered": b.image("sympy"), "merged": "bench-sympy-merged"}
        layout = tree_images().layout
        merged = [LAZYFS, "convert", f"oci:{layout}:sympy", "--store", b.url]
        run([*merged, "--name", names["merged"], "--no-layer-trees"], env=b.env)
        record_trace(b, names["merged"], PYTEST)  # `lazyfs run`: the merged tree's trace
        agent_cold(b, names["layered"], b.env)  # the agent: each layer tree's own
        wait_for_no_data_daemon(b, timeout=120)  # it writes the traces as its trees go
        local = tree_rootfs("sympy")
        local_run(local, PYTEST)  # its pages in
        for n in range(rounds):
            before = local_run(local, PYTEST)
            sides = SIDES if n % 2 == 0 else SIDES[::-1]
            for side in sides:
                res[side].append({"no trace": agent_cold(b, names[side], no_trace(b))["s"]})
            for side in sides:
                res[side][-1]["trace"] = agent_cold(b, names[side], b.env)["s"]
            after = local_run(local, PYTEST)
            res["local"].append((before + after) / 2)
            line = ", ".join(
                f"{side} {res[side][-1]['trace']:.2f} / {res[side][-1]['no trace']:.2f} s"
                for side in SIDES
            )
            print(f"round {n + 1} cold (trace / no trace): {line}", flush=True)
    return res


CONVERTS = ("python", "sympy on python", "sympy again")


def convert_rounds(rounds: int) -> dict:
    """The `convert` section (see the top), both sides every round, the order flipped."""
    python, sympy = images().layout, tree_images().layout
    steps = [(f"oci:{python}:python", "python"), (f"oci:{sympy}:sympy", "s1")]
    steps.append((f"oci:{sympy}:sympy", "s2"))
    res: dict = {side: [] for side in SIDES}
    for n in range(rounds):
        for side in SIDES if n % 2 == 0 else SIDES[::-1]:
            flag = "--no-layer-trees" if side == "merged" else "--layer-trees"
            where = Path(tempfile.mkdtemp(prefix="lazyfs-bench-layers-conv-", dir="/var/tmp"))
            try:
                times = []
                for ref, name in steps:
                    url = f"file://{where / 'store'}"
                    t0 = time.perf_counter()
                    run([LAZYFS, "convert", ref, "--store", url, "--name", name, flag])
                    times.append(time.perf_counter() - t0)
            finally:
                shutil.rmtree(where, ignore_errors=True)
            res[side].append(dict(zip(CONVERTS, times, strict=True)))
            print(f"round {n + 1} convert {side}: {_seconds(times)}", flush=True)
    return res


def _seconds(times: list[float]) -> str:
    return ", ".join(f"{t:.2f} s" for t in times)


STEPS = {"start": start_round, "burst": burst_round}
SECTIONS = (*STEPS, "cold", "convert")


def run_sections(rounds: int, only: list[str]) -> dict:
    images = ensure_agent_images(cache_root())
    stores = {"merged": store(images, layer_trees=False), "layered": store(images)}
    res: dict = {s: {side: [] for side in SIDES} for s in only if s in STEPS}
    scratch = Path(tempfile.mkdtemp(prefix="lazyfs-bench-layers-", dir="/var/tmp"))
    try:
        for n in range(rounds):
            for section in (s for s in only if s in STEPS):
                for side in SIDES if n % 2 == 0 else SIDES[::-1]:
                    where = scratch / f"{section}-{side}-{n}"
                    where.mkdir()
                    shutil.copytree(stores[side], where / "store")
                    out = STEPS[section](where / "node", where / "store", images)
                    res[section][side].append(out)
                    print(f"round {n + 1} {section} {side}: {_brief(section, out)}", flush=True)
                    wait_no_mounts_below(where)
                    shutil.rmtree(where, ignore_errors=True)
    finally:
        wait_no_mounts_below(scratch)
        shutil.rmtree(scratch, ignore_errors=True)
    if "cold" in only:
        res["cold"] = cold_rounds(rounds)
    if "convert" in only:
        res["convert"] = convert_rounds(rounds)
    return res


def _brief(section: str, out: dict) -> str:
    if section == "start":
        return (
            f"{out['total']:.2f} s, p50 {median(out['seconds']) * 1e3:.0f} ms,"
            f" page cache +{out['cache_mb']:.0f} MB"
        )
    return f"create p50 {out['create_p50']:.3f} s, again {out['again_p50']:.3f} s"


def tables(res: dict) -> list[tuple[str, str]]:
    out = []
    if "start" in res:
        r = res["start"]
        rows = []
        for side in SIDES:
            xs = r[side]
            rows.append(
                [
                    side,
                    spread([median(x["seconds"]) * 1e3 for x in xs], 0, " ms"),
                    spread([x["total"] for x in xs], 2, " s"),
                    spread([x["cache_mb"] for x in xs], 0, " MB"),
                    spread([x["daemon_rss_mb"] for x in xs], 0, " MB"),
                    f"{min(x['from_pool'] for x in xs)}/{START_IMAGES}",
                ]
            )
        pairs = [b["total"] - a["total"] for a, b in zip(r["merged"], r["layered"], strict=True)]
        text = table(
            [
                "trees",
                "create + python3 -c pass, p50 per image",
                f"all {START_IMAGES}, one after another",
                f"page cache with {START_IMAGES} up",
                "data daemon RSS",
                "from the generic pool",
            ],
            rows,
        )
        text += "\n\nPer round, layered minus merged, all 50: " + ", ".join(
            f"{p:+.2f} s" for p in pairs
        )
        out.append((f"{START_IMAGES} new images on one base, one after another", text))
    if "burst" in res:
        r = res["burst"]
        rows = []
        for side in SIDES:
            xs = r[side]
            rows.append(
                [
                    side,
                    spread([x["create_p50"] for x in xs], 2, " s"),
                    spread([x["create_p99"] for x in xs], 2, " s"),
                    spread([x["last_output"] for x in xs], 2, " s"),
                    spread([x["cpu_s"]["agent"] for x in xs], 2, " s"),
                    spread([x["cpu_s"]["data daemon"] for x in xs], 2, " s"),
                    spread([x["again_p50"] for x in xs], 2, " s"),
                ]
            )
        pairs = [
            b["create_p50"] - a["create_p50"]
            for a, b in zip(r["merged"], r["layered"], strict=True)
        ]
        text = table(
            [
                "trees",
                "create p50 (goal 0.5 s)",
                "create p99",
                "last output",
                "agent CPU",
                "data daemon CPU",
                "again, trees mounted: p50",
            ],
            rows,
        )
        text += "\n\nPer round, layered minus merged, create p50: " + ", ".join(
            f"{p:+.3f} s" for p in pairs
        )
        out.append(("The first `--warm 200` burst: 200 creates of 50 new images at once", text))
    if "cold" in res:
        r = res["cold"]
        rows = []
        for kind in ("trace", "no trace"):
            for side in SIDES:
                xs = [x[kind] for x in r[side]]
                ratios = [x / local for x, local in zip(xs, r["local"], strict=True)]
                rows.append([f"{side}, {kind}", spread(xs, 2, " s"), spread(ratios, 2, "x")])
        text = table(["sympy's tests, agent, cold", "seconds", "/ warm local run"], rows)
        text += f"\n\nWarm local run: {spread(r['local'], 2, ' s')}."
        for kind in ("trace", "no trace"):
            pairs = [b[kind] - a[kind] for a, b in zip(r["merged"], r["layered"], strict=True)]
            text += f"\n\nPer round, layered minus merged, {kind}: " + ", ".join(
                f"{p:+.2f} s" for p in pairs
            )
        out.append(("One image cold: sympy's tests through the agent", text))
    if "convert" in res:
        r = res["convert"]
        rows = [
            [side, *(spread([x[step] for x in r[side]], 2, " s") for step in CONVERTS)]
            for side in SIDES
        ]
        text = table(["`lazyfs convert`", *CONVERTS], rows)
        out.append(("What a convert pays", text))
    return out


def plot(res: dict) -> None:
    present = [s for s in ("start", "burst", "cold", "convert") if s in res]
    fig, axes = pyplot().subplots(1, len(present), figsize=(5.5 * len(present), 4.2))
    axes = [axes] if len(present) == 1 else list(axes)
    for ax, section in zip(axes, present, strict=True):
        r = res[section]
        if section == "convert":
            labels = list(CONVERTS)
            series = {side: [[x[step] for x in r[side]] for step in CONVERTS] for side in SIDES}
            ax.set_title("lazyfs convert, s")
        elif section == "cold":
            labels = ["trace, s", "no trace, s"]
            series = {
                side: [[x["trace"] for x in r[side]], [x["no trace"] for x in r[side]]]
                for side in SIDES
            }
            ax.set_title("sympy's tests, cold, through the agent")
        elif section == "start":
            labels = ["all 50, s", "page cache, GB"]
            series = {
                side: [[x["total"] for x in r[side]], [x["cache_mb"] / 1e3 for x in r[side]]]
                for side in SIDES
            }
            ax.set_title("50 new images on one base, one after another")
        else:
            labels = ["create p50, s", "create p99, s", "again p50, s"]
            series = {
                side: [
                    [x["create_p50"] for x in r[side]],
                    [x["create_p99"] for x in r[side]],
                    [x["again_p50"] for x in r[side]],
                ]
                for side in SIDES
            }
            ax.axhline(GOAL_BURST_P50, ls="--", lw=0.8, color="green", label="goal: p50")
            ax.set_title("first --warm 200 burst, 50 new images")
        grouped_bars(ax, series, samples=True)
        ax.set_xticks(range(len(labels)), labels)
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_plot(fig, "layer_trees")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--only", action="append", choices=list(SECTIONS))
    args = p.parse_args()
    only = args.only or list(SECTIONS)
    res = run_sections(args.rounds, only)
    (RESULTS / "layer_trees.json").write_text(json.dumps(res, indent=1))
    notes = (
        f"- Command: `.venv/bin/python bench/{Path(__file__).name} {' '.join(sys.argv[1:])}`\n"
        f"- Machine: {machine_note()}; {args.rounds} rounds, the sides alternating.\n"
        "- Cells: median (min-max) over the rounds."
    )
    sections = tables(res)
    save_markdown(
        "layer_trees",
        "Images on one base: merged trees and layer trees",
        [*sections, ("Notes", notes)],
    )
    plot(res)
    for heading, text in sections:
        print(f"\n{heading}\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
