"""The fleet model (issue 25): how long 10^5 sandboxes of 10^4 images take to start on
10^3 nodes, from the figures this machine measured.

What it computes. S sandboxes of I images (k = S/I each) are placed on N nodes at once,
and T is the time until the last sandbox's first command has been created and has its
start-up data on its node (the command's own run time, the same on any system, is left
out). Every node cache starts empty of these images; "trace" means every image has a
start-up trace in the store (recorded by its first mount anywhere), "no trace" that none
has. T is the largest of these bounds, each a time that one resource alone needs:

  placement   P = (node, image) cold starts, A = nodes used, L = sandboxes on the
              busiest node, C = distinct images on the node with the most.
              random: each sandbox to a uniformly random node; an image of k sandboxes
              is cold on E = N (1 - (1 - 1/N)^k) distinct nodes (balls in bins), so
              P = sum over images of E, exactly. cache: the gateway's rule (issue 25):
              the first node in the image's rendezvous (highest random weight) order
              whose load is below ceil((1 + eps) x the running mean load), consistent
              hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam); simulated
              with a fixed seed, as are L and C for both placements.
  costs       a cold start on a node fetches the shared base's start-up reads once per
              node (g_b GETs, b_b bytes: a node's second image of the same base finds
              them in its node cache, which fetches a chunk at most once per node), and
              per (node, image) the image's own reads plus its metadata objects (g_p,
              b_p). G = A g_b + P g_p requests, B = A b_b + P b_p bytes.
  bounds      S3 GET rate, one partition  G / R        R = 5,500 GET/s per partition
              S3 GET rate, hottest key    A g_b h / R  h = the base's hottest pack's
                                                       share of its start-up GETs
              store bandwidth             B / W
              node link                   (b_b + C b_p) / link
              node creates                L / r + C t_tree   (r, t_tree scaled by cores)
              one cold start              t_cold - t_warm, measured for one sandbox
  T           partitioned bucket: max(hottest key, bandwidth, link, node, cold start);
              fresh bucket: max(one partition, bandwidth, link, node, cold start).

Assumptions, each visible in the output: the stages overlap perfectly (max, not sum: T is
a lower bound on a real burst; a node's queue and its last image's cold start can add);
all images share one base; every image has the same k; generic pools (`--warm`) are
full before the burst (`--pools none` models cold creates); a node's create rate
scales with its cores; S3 has no per-bucket bandwidth cap (W is a parameter). Two
workloads bracket what an image's own start-up reads are: "python task" (the 50 agent
images of testbed/agent_images.py: the python image plus a layer of a few KB; the first
command reads python3's start-up and its task file) and "sympy task" (the first command
is sympy's tests and sympy is the task's own code, shared with no other image: the base
is python3's start-up, everything else is the image's own).

S3 and lazyfs's keys (docs/FORMATS.md "Store layout"): below the store URL's prefix,
`packs/<blake3 hex>` (ranged GETs: nearly all of a cold start's requests), `images/<id>`,
`erofs/<blake3 hex>`, `traces/<id>` and `refs/names/<name>` (one GET each per node and
image: the agent keeps its name lookups), `index/` and `layers/` (convert only). S3 gives
"at least 5,500 GET/HEAD requests per second per partitioned prefix" and partitions a
prefix only after sustained load, answering 503 Slow Down meanwhile
(https://docs.aws.amazon.com/AmazonS3/latest/userguide/optimizing-performance.html,
https://repost.aws/knowledge-center/s3-object-key-naming-pattern). Every name after its
type word is a uniform hash, so a partitioned bucket can split them evenly; what no split
helps is one hot key: the base's pack that every node reads. A fresh bucket is one
partition for the whole burst.

Inputs come from bench/results/*.json where a bench records them, else from a constant
whose comment (and the output's source column) says where it was measured; each is
printed beside its source. `--set NAME=VALUE` overrides any of them.

`--fleet-results FILE` (bench/results/fleet.json, written by the fleet benchmark of issue
25) adds a workload fitted to what 4 nodes fetched, and checks the model at that scale:

  {"nodes": 4, "cores": 2,                        cores of the machine the nodes share
   "images": 50, "sandboxes": 200,
   "store_gbit": 1,                               the link to the store (default 1)
   "link": "1 Gbit/s tbf + 4 ms",                 free text
   "runs": [{"placement": "cache" | "random",
             "trace": true | false,               traces stored before the burst
             "wall_s": 6.1,                       burst start to the last first output
             "create_p50_s": 1.2, "create_p99_s": 3.4,
             "store_gets": 812,                   requests the store served, all keys
             "store_bytes": 301000000,            bytes the nodes received from it
             "node_sandboxes": [50, 50, 50, 50],  sandboxes each node ran
             "node_images": [13, 12, 13, 12],     distinct images each node started
             "node_cache_bytes": [...]}, ...]}    each node cache's bytes after it

With a cache and a random run of the same trace setting, G = A g_b + P g_p holds for
both, which gives g_b and g_p (and b_b, b_p from the bytes). The model is then run at the
benchmark's own scale (its nodes sharing the machine's cores and the store's link; the
S3 bounds left out, SeaweedFS has no prefix partitions) beside what it measured.

Run: PYTHONPATH=. .venv/bin/python bench/fleet_model.py [--fleet-results FILE]
     [--nodes N] [--images I] [--sandboxes S] [--pools generic|none] [--set NAME=VALUE]...
     [--results DIR] [--out DIR] [--no-plot]
Results: bench/results/fleet_model.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from _report import RESULTS, grouped_bars, pyplot, table

from lazyfs.gateway.placement import FLOOR_PER_CPU

GOAL_S = 10.0
MB = 1e6
GBIT = 1e9 / 8  # bytes per second in 1 Gbit/s
ORDER_DEPTH = 64  # rendezvous order kept per image; the bounded load never reaches its end
FRESH, PARTITIONED = "fresh bucket", "partitioned bucket"
BOUNDS = (
    "S3 GET rate, one partition",
    "S3 GET rate, hottest key",
    "store bandwidth",
    "node link",
    "node creates",
    "one cold start",
)
SKIPPED = {FRESH: "S3 GET rate, hottest key", PARTITIONED: "S3 GET rate, one partition"}


# ---------------------------------------------------------------------------------------
# Inputs, each beside its source


@dataclass(frozen=True)
class Figure:
    value: float
    unit: str
    source: str


@dataclass(frozen=True)
class Inputs:
    # What a cold start fetches: chunk GETs and compressed MB (the node cache's stats).
    base_gets_trace: Figure  # python3 -c print: the shared base's start-up
    base_mb_trace: Figure
    base_gets_none: Figure
    base_mb_none: Figure
    sympy_gets_trace: Figure  # sympy's tests through the agent, S3 over the link
    sympy_mb_trace: Figure
    sympy_gets_none: Figure
    sympy_mb_none: Figure
    task_gets: Figure  # a small task layer's own reads (the 50 agent images)
    task_mb: Figure
    meta_gets: Figure  # refs/names, images/, erofs/, traces/: per node and image
    meta_mb_python: Figure  # images/ + erofs/ objects of one image
    meta_mb_sympy: Figure
    hot_pack_share: Figure  # of the base's start-up GETs, those on its hottest pack
    # One sandbox's cold start, and its command warm.
    hello_cold_trace_s: Figure
    hello_cold_none_s: Figure
    hello_warm_s: Figure
    sympy_cold_trace_s: Figure
    sympy_cold_none_s: Figure
    sympy_warm_s: Figure
    # A node: bursts of 200 sandboxes of 50 images on an empty node cache.
    burst_sandboxes: Figure
    burst_images: Figure
    burst_cold_s: Figure
    burst_generic_s: Figure
    burst_tree_s: Figure
    measured_cores: Figure
    # Assumptions and published limits.
    cores: Figure
    eps: Figure
    prefix_gets_per_s: Figure
    store_gbit: Figure
    link_gbit: Figure

    def rows(self) -> list[tuple[str, Figure]]:
        return [(f.name, getattr(self, f.name)) for f in fields(self)]


def _dig(doc: Any, keys: Sequence[Any]) -> Any:
    for key in keys:
        doc = doc[key]
    return doc


def _med(key: str) -> Callable[[list[dict]], float]:
    return lambda runs: statistics.median(r[key] for r in runs)


def _run_where(field: str, want: Callable[[dict], bool], key: Sequence[str]) -> Callable:
    """From a list of runs, `key` of the first run whose `field` passes `want`."""
    return lambda runs: _dig(next(r for r in runs if want(r[field])), key)


class Reader:
    """Figures from bench/results/<name>.json, or the fallback constant with its origin."""

    def __init__(self, results: Path) -> None:
        self.results = results
        self.docs: dict[str, Any] = {}

    def doc(self, name: str) -> Any:
        if name not in self.docs:
            path = self.results / f"{name}.json"
            self.docs[name] = json.loads(path.read_text()) if path.exists() else {}
        return self.docs[name]

    def get(
        self,
        name: str,
        keys: Sequence[Any],
        reduce: Callable[[Any], float],
        unit: str,
        fallback: float,
        origin: str,
    ) -> Figure:
        where = f"bench/results/{name}.json {' / '.join(str(k) for k in keys)}"
        try:
            return Figure(float(reduce(_dig(self.doc(name), keys))), unit, where)
        except (KeyError, IndexError, TypeError, ValueError, StopIteration):
            return Figure(fallback, unit, f"constant ({name}.json lacks it): {origin}")


def const(value: float, unit: str, source: str) -> Figure:
    return Figure(value, unit, source)


def load_inputs(results: Path) -> Inputs:
    r = Reader(results)
    mb = lambda key: lambda runs: _med(key)(runs) / MB  # noqa: E731
    gets, got = _med("store_requests"), mb("bytes_fetched")
    cold = "bench/results/cold_start.md, 2026-12-02"
    burst = "bench/results/generic_claims.md, burst, 2026-12-02 18:32"
    no_pool = _run_where("warm", lambda w: w == 0, ["last_output"])
    all_pool = _run_where("warm", lambda w: w >= 200, ["last_output"])
    pool_tree = _run_where("warm", lambda w: w >= 200, ["logged_p50", "generic", "tree"])
    return Inputs(
        base_gets_trace=r.get("cold_start", ["hello", "cold"], gets, "GETs", 13, cold),
        base_mb_trace=r.get("cold_start", ["hello", "cold"], got, "MB", 5.83, cold),
        base_gets_none=r.get("cold_start", ["hello", "cold, no trace"], gets, "GETs", 26, cold),
        base_mb_none=r.get("cold_start", ["hello", "cold, no trace"], got, "MB", 7.70, cold),
        sympy_gets_trace=r.get("cold_start", ["s3", "agent cold"], gets, "GETs", 26, cold),
        sympy_mb_trace=r.get("cold_start", ["s3", "agent cold"], got, "MB", 35.78, cold),
        sympy_gets_none=r.get(
            "cold_start", ["s3", "agent cold, no trace"], gets, "GETs", 119, cold
        ),
        sympy_mb_none=r.get("cold_start", ["s3", "agent cold, no trace"], got, "MB", 27.61, cold),
        # testbed/agent_images.py: the task reads /task/id.txt, one line: one chunk, one GET.
        task_gets=const(1, "GETs", "testbed/agent_images.py: `cat /task/id.txt`, one chunk"),
        task_mb=const(0.001, "MB", "testbed/agent_images.py: a line of ~40 bytes (rounded up)"),
        # S3 requests the server counted minus the node cache's chunk GETs, sympy cold with a
        # trace: refs/names, images/, erofs/, traces/ (3 in the no-trace rows, which asked
        # for no trace at all: LAZYFS_PREFETCH=0).
        meta_gets=r.get(
            "tree_perf",
            ["sympy", "cold, S3"],
            lambda runs: statistics.median(x["s3_requests"] - x["store_requests"] for x in runs),
            "GETs",
            4,
            "bench/results/tree_perf.md, 27 S3 requests against 23 chunk GETs",
        ),
        # Object sizes in the store bench/agent_scale.py builds (agent-store-v50-m2-e1 in
        # $LAZYFS_TEST_CACHE/bench-v1): images/<id> 715,6xx B + erofs/<id> 140,3xx B for
        # each of the 50 images; a node fetches both whole for each image it mounts.
        meta_mb_python=const(0.856, "MB", "agent_scale's store: images/ 0.716 + erofs/ 0.140"),
        # The sympy tree image (testbed/tree_images.py) converted here: 1,114,200 + 215,901 B.
        meta_mb_sympy=const(1.330, "MB", "sympy image's store: images/ 1.114 + erofs/ 0.216"),
        # A python:3.11 start-up trace (python3 -c print) decoded here and coalesced with
        # node_cache's policy (1 MiB gap, 16 MiB span, 8 MiB batches): 11 GETs over 4
        # packs, 4 of them on the hottest pack.
        hot_pack_share=const(4 / 11, "", "python3 start-up trace: 4 of 11 GETs on one pack"),
        # bench/results/agent_bench.md (2026-12-02 06:13, --cold 7): cold create to python3
        # hello's first output 0.286 s, no trace 0.667 s; hello again warm 0.013 s.
        hello_cold_trace_s=const(0.286, "s", "bench/results/agent_bench.md, cold create p50"),
        hello_cold_none_s=const(0.667, "s", "bench/results/agent_bench.md, no trace p50"),
        hello_warm_s=const(0.013, "s", "bench/results/agent_bench.md, python3 hello warm"),
        sympy_cold_trace_s=r.get("cold_start", ["s3", "agent cold"], _med("s"), "s", 1.35, cold),
        sympy_cold_none_s=r.get(
            "cold_start", ["s3", "agent cold, no trace"], _med("s"), "s", 2.67, cold
        ),
        sympy_warm_s=r.get("cold_start", ["s3", "base"], statistics.median, "s", 0.71, cold),
        burst_sandboxes=r.get(
            "generic_claims", ["burst", "runs", 0, "sandboxes"], float, "", 200, burst
        ),
        burst_images=r.get("generic_claims", ["burst", "runs", 0, "images"], float, "", 50, burst),
        burst_cold_s=r.get("generic_claims", ["burst", "runs"], no_pool, "s", 7.80, burst),
        burst_generic_s=r.get("generic_claims", ["burst", "runs"], all_pool, "s", 4.82, burst),
        burst_tree_s=r.get("generic_claims", ["burst", "runs"], pool_tree, "s", 1.724, burst),
        measured_cores=const(2, "cores", "this machine (bench/results/*.md: 2 cores)"),
        cores=const(2, "cores", "assumed: a node like this machine"),
        eps=const(0.25, "", "assumed: the gateway's bounded-load slack (not fixed yet)"),
        prefix_gets_per_s=const(
            5500,
            "GET/s",
            "AWS: per partitioned prefix, docs.aws.amazon.com/AmazonS3/latest/userguide/"
            "optimizing-performance.html",
        ),
        store_gbit=const(100, "Gbit/s", "assumed: S3 publishes no per-bucket cap"),
        link_gbit=const(10, "Gbit/s", "assumed: a cloud node's NIC (the benches shape 1)"),
    )


def with_overrides(inputs: Inputs, sets: Sequence[str]) -> Inputs:
    """--set NAME=VALUE, for any input."""
    changes = {}
    for item in sets:
        name, _, value = item.partition("=")
        if name not in {f.name for f in fields(inputs)}:
            raise SystemExit(f"--set: no input named {name!r}")
        old = getattr(inputs, name)
        changes[name] = Figure(float(value), old.unit, "--set on the command line")
    return replace(inputs, **changes)


# ---------------------------------------------------------------------------------------
# Workloads: what a cold start costs


@dataclass(frozen=True)
class Cost:
    gets: float
    bytes: float

    def plus(self, other: Cost) -> Cost:
        return Cost(self.gets + other.gets, self.bytes + other.bytes)


@dataclass(frozen=True)
class Workload:
    name: str
    trace: bool
    base: Cost  # once per node: the shared base's start-up reads
    pair: Cost  # per node and image: its own reads and its metadata objects
    chain_s: float  # one cold start's own latency (create + start-up reads)
    hot_share: float  # of the base's GETs, those on its hottest pack


def _cost(gets: Figure, mb: Figure) -> Cost:
    return Cost(gets.value, mb.value * MB)


def workloads(inp: Inputs, trace: bool) -> list[Workload]:
    """The python task and the sympy task, with or without start-up traces."""
    t = "trace" if trace else "none"
    base = _cost(getattr(inp, f"base_gets_{t}"), getattr(inp, f"base_mb_{t}"))
    sympy = _cost(getattr(inp, f"sympy_gets_{t}"), getattr(inp, f"sympy_mb_{t}"))
    sympy_own = Cost(max(0.0, sympy.gets - base.gets), max(0.0, sympy.bytes - base.bytes))
    python_own = _cost(inp.task_gets, inp.task_mb)
    meta = inp.meta_gets.value
    share = inp.hot_pack_share.value
    hello_s = getattr(inp, f"hello_cold_{t}_s").value - inp.hello_warm_s.value
    sympy_s = getattr(inp, f"sympy_cold_{t}_s").value - inp.sympy_warm_s.value
    python_pair = python_own.plus(Cost(meta, inp.meta_mb_python.value * MB))
    sympy_pair = sympy_own.plus(Cost(meta, inp.meta_mb_sympy.value * MB))
    return [
        Workload("python task", trace, base, python_pair, hello_s, share),
        Workload("sympy task", trace, base, sympy_pair, sympy_s, share),
    ]


# ---------------------------------------------------------------------------------------
# Placement: how many (node, image) cold starts, and the busiest node


@dataclass(frozen=True)
class Fleet:
    sandboxes: int
    images: int
    nodes: int

    def per_image(self) -> list[int]:
        """Sandboxes of each image: S/I each, the remainder one more to the first images."""
        k, extra = divmod(self.sandboxes, self.images)
        return [k + (i < extra) for i in range(self.images)]


@dataclass(frozen=True)
class Spread:
    placement: str
    pairs: float  # (node, image) cold starts
    active_nodes: int  # nodes with at least one sandbox
    max_load: int  # sandboxes on the busiest node
    max_images: int  # distinct images on the node with the most


def expected_distinct_nodes(k: int, nodes: int) -> float:
    """How many distinct nodes k sandboxes placed uniformly at random land on, on average:
    each node is missed by all k with probability (1 - 1/nodes)^k."""
    return nodes * (1 - (1 - 1 / nodes) ** k)


def arrivals(fleet: Fleet, rng: random.Random) -> list[int]:
    """The burst's creates in the order the gateway sees them: each sandbox's image."""
    order = [image for image, k in enumerate(fleet.per_image()) for _ in range(k)]
    rng.shuffle(order)
    return order


def _summary(placement: str, load: list[int], held: list[set[int]], pairs: float) -> Spread:
    return Spread(
        placement,
        pairs,
        sum(1 for n in load if n),
        max(load),
        max(len(h) for h in held),
    )


def place_random(fleet: Fleet, seed: int = 1) -> Spread:
    """Each sandbox to a uniformly random node. The cold starts are the exact expectation;
    the busiest node's load and images come from one seeded draw."""
    rng = random.Random(seed)
    load = [0] * fleet.nodes
    held: list[set[int]] = [set() for _ in range(fleet.nodes)]
    for image in arrivals(fleet, rng):
        node = rng.randrange(fleet.nodes)
        load[node] += 1
        held[node].add(image)
    pairs = sum(expected_distinct_nodes(k, fleet.nodes) for k in fleet.per_image())
    return _summary("random", load, held, pairs)


def place_cache(fleet: Fleet, eps: float, seed: int = 1, floor: int = 0) -> Spread:
    """The gateway's placement (lazyfs/gateway/placement.py), simulated: each create
    goes to a node already holding its image if one is below ceil((1 + 2 eps) x the
    running mean, this create included), else to the first node in its image's
    rendezvous order below ceil((1 + eps) x that mean); a node below its floor (2
    sandboxes per CPU) is never skipped. An image's rendezvous order over hashed node
    weights is a uniformly random permutation: drawn here."""
    rng = random.Random(seed)
    n = fleet.nodes
    load = [0] * n
    held: list[set[int]] = [set() for _ in range(n)]
    orders: dict[int, list[int]] = {}
    for t, image in enumerate(arrivals(fleet, rng)):
        if image not in orders:
            orders[image] = rng.sample(range(n), min(n, ORDER_DEPTH))
        mean = (t + 1) / n
        cap = max(floor, math.ceil((1 + eps) * mean))
        warm_cap = max(floor, math.ceil((1 + 2 * eps) * mean))
        order = orders[image]
        node = next((x for x in order if image in held[x] and load[x] < warm_cap), None)
        if node is None:
            node = next((x for x in order if load[x] < cap), None)
        if node is None:  # the whole kept order is full: never seen, but not a crash
            node = min(range(n), key=load.__getitem__)
        load[node] += 1
        held[node].add(image)
    return _summary("cache", load, held, float(sum(len(h) for h in held)))


def place_both(fleet: Fleet, eps: float, cores: float, seed: int = 1) -> list[Spread]:
    floor = int(FLOOR_PER_CPU * cores)
    return [place_cache(fleet, eps, seed, floor), place_random(fleet, seed)]


# ---------------------------------------------------------------------------------------
# The bounds


@dataclass(frozen=True)
class NodeSpeed:
    rate: float  # sandboxes per second, trees aside
    tree_s: float  # node time per image mounted


def node_speed(inp: Inputs, pools: bool) -> NodeSpeed:
    """From the bursts of 200 sandboxes of 50 images on one node: the median claim of the
    all-generic burst waited burst_tree_s for its tree while the 50 mounted at once, so a
    tree costs the node burst_tree_s / 50; the rest of a burst is its sandboxes. Both
    scale with the node's cores (assumed linear)."""
    scale = inp.cores.value / inp.measured_cores.value
    burst = inp.burst_generic_s.value if pools else inp.burst_cold_s.value
    rate = inp.burst_sandboxes.value / (burst - inp.burst_tree_s.value) * scale
    return NodeSpeed(rate, inp.burst_tree_s.value / inp.burst_images.value / scale)


@dataclass(frozen=True)
class Outcome:
    workload: str
    placement: str
    trace: bool
    pairs: float
    gets: float
    bytes: float
    bounds: dict[str, float]

    def binding(self, bucket: str) -> tuple[str, float]:
        """The bound that decides T in this bucket state, and T."""
        kept = {k: v for k, v in self.bounds.items() if k != SKIPPED[bucket]}
        name = max(kept, key=kept.__getitem__)
        return name, kept[name]


def outcome(spread: Spread, w: Workload, inp: Inputs, node: NodeSpeed) -> Outcome:
    gets = spread.active_nodes * w.base.gets + spread.pairs * w.pair.gets
    size = spread.active_nodes * w.base.bytes + spread.pairs * w.pair.bytes
    per_prefix = inp.prefix_gets_per_s.value
    node_bytes = w.base.bytes + spread.max_images * w.pair.bytes
    bounds = {
        "S3 GET rate, one partition": gets / per_prefix,
        "S3 GET rate, hottest key": spread.active_nodes * w.base.gets * w.hot_share / per_prefix,
        "store bandwidth": size / (inp.store_gbit.value * GBIT),
        "node link": node_bytes / (inp.link_gbit.value * GBIT),
        "node creates": spread.max_load / node.rate + spread.max_images * node.tree_s,
        "one cold start": w.chain_s,
    }
    return Outcome(w.name, spread.placement, w.trace, spread.pairs, gets, size, bounds)


def model(
    fleet: Fleet, inp: Inputs, pools: bool, extra: Sequence[Workload] = (), seed: int = 1
) -> tuple[list[Spread], list[Outcome]]:
    spreads = place_both(fleet, inp.eps.value, inp.cores.value, seed)
    node = node_speed(inp, pools)
    loads = [*workloads(inp, True), *workloads(inp, False), *extra]
    outcomes = [outcome(s, w, inp, node) for w in loads for s in spreads]
    order = {w.name: i for i, w in enumerate(loads)}
    outcomes.sort(key=lambda o: (order[o.workload], not o.trace, o.placement != "cache"))
    return spreads, outcomes


# ---------------------------------------------------------------------------------------
# The fleet benchmark's results (bench/results/fleet.json)


def _fit(cache: dict, rand: dict, key: str) -> tuple[float, float]:
    """(once per node, per node and image) from G = A g_b + P g_p in both runs."""
    active = sum(1 for n in cache["node_sandboxes"] if n)
    pc, pr = sum(cache["node_images"]), sum(rand["node_images"])
    yc, yr = cache[key], rand[key]
    pair = (yr - yc) / (pr - pc) if pr != pc else yc / max(pc, 1)
    pair = max(0.0, pair)
    return max(0.0, (yc - pc * pair) / active), pair


def fleet_workloads(doc: dict, inp: Inputs) -> list[Workload]:
    """A workload fitted to what the fleet benchmark's nodes fetched, per trace setting
    with both a cache and a random run; its cold start is the python task's (the fleet
    runs the same kind of images), and so is its hottest pack's share."""
    found = []
    for trace in (True, False):
        runs = {r["placement"]: r for r in doc.get("runs", []) if bool(r["trace"]) == trace}
        if not {"cache", "random"} <= runs.keys():
            continue
        gb, gp = _fit(runs["cache"], runs["random"], "store_gets")
        bb, bp = _fit(runs["cache"], runs["random"], "store_bytes")
        python = workloads(inp, trace)[0]
        found.append(replace(python, name="fleet bench", base=Cost(gb, bb), pair=Cost(gp, bp)))
    return found


def fleet_check(doc: dict, inp: Inputs, pools: bool, fitted: Sequence[Workload]) -> list[dict]:
    """The model at the fleet benchmark's own scale (its nodes share one machine's cores
    and one store link; SeaweedFS has no prefix partitions) against what it measured."""
    fleet = Fleet(int(doc["sandboxes"]), int(doc["images"]), int(doc["nodes"]))
    link = float(doc.get("store_gbit", 1.0))
    here = replace(
        inp,
        cores=Figure(float(doc.get("cores", 2)) / fleet.nodes, "cores", "fleet.json"),
        store_gbit=Figure(link, "Gbit/s", "fleet.json"),
        link_gbit=Figure(link, "Gbit/s", "fleet.json"),
    )
    # each agent reports its machine's CPUs, which its floor counts (shared or not)
    shared = float(doc.get("cores", 2))
    spreads = {s.placement: s for s in place_both(fleet, here.eps.value, shared)}
    node = node_speed(here, pools)
    rows = []
    for run in doc.get("runs", []):
        w = next((f for f in fitted if f.trace == bool(run["trace"])), None)
        if w is None:
            continue
        o = outcome(spreads[run["placement"]], w, here, node)
        o.bounds.pop("S3 GET rate, one partition")
        o.bounds.pop("S3 GET rate, hottest key")
        name = max(o.bounds, key=o.bounds.__getitem__)
        rows.append(
            {
                "placement": run["placement"],
                "trace": bool(run["trace"]),
                "pairs_model": o.pairs,
                "pairs_measured": sum(run["node_images"]),
                "t_model": o.bounds[name],
                "binds": name,
                "wall_measured": run["wall_s"],
            }
        )
    return rows


# ---------------------------------------------------------------------------------------
# Report


def secs(x: float) -> str:
    if x >= 100:
        return f"{x:,.0f} s"
    return f"{x:.1f} s" if x >= 1 else f"{x:.2f} s"


def verdict(o: Outcome, bucket: str) -> str:
    name, t = o.binding(bucket)
    mark = "met" if t <= GOAL_S else "missed"
    return f"**{secs(t)}** {name} ({mark})"


def trace_word(trace: bool) -> str:
    return "trace" if trace else "no trace"


def readme_table(outcomes: Sequence[Outcome]) -> str:
    rows = [
        [
            o.workload,
            o.placement,
            trace_word(o.trace),
            f"{o.pairs:,.0f}",
            verdict(o, PARTITIONED),
            verdict(o, FRESH),
        ]
        for o in outcomes
    ]
    head = ["workload", "placement", "traces", "cold starts", f"T, {PARTITIONED}", f"T, {FRESH}"]
    return table(head, rows)


def bounds_table(outcomes: Sequence[Outcome]) -> str:
    rows = [
        [
            o.workload,
            o.placement,
            trace_word(o.trace),
            f"{o.gets:,.0f}",
            f"{o.bytes / 1e9:,.1f}",
            *(secs(o.bounds[b]) for b in BOUNDS),
        ]
        for o in outcomes
    ]
    return table(["workload", "placement", "traces", "GETs", "GB", *BOUNDS], rows)


def placement_table(fleet: Fleet, spreads: Sequence[Spread]) -> str:
    rows = []
    for s in spreads:
        rows.append(
            [
                s.placement,
                f"{s.pairs:,.0f}",
                f"{s.pairs / fleet.images:.2f}",
                s.active_nodes,
                f"{s.max_load} (mean {fleet.sandboxes / fleet.nodes:.0f})",
                f"{s.max_images} (mean {s.pairs / fleet.nodes:.1f})",
            ]
        )
    head = [
        "placement",
        "(node, image) cold starts",
        "nodes per image",
        "nodes used",
        "busiest node's sandboxes",
        "most images on a node",
    ]
    return table(head, rows)


def inputs_table(inp: Inputs, node: NodeSpeed, pools: bool) -> str:
    rows = [[name, f"{f.value:,.4g}", f.unit, f.source] for name, f in inp.rows()]
    how = "generic pools full" if pools else "cold creates, no pools"
    rows.append(["node rate (derived)", f"{node.rate:.1f}", "sandboxes/s", how])
    rows.append(["node tree time (derived)", f"{node.tree_s * 1000:.0f}", "ms", "per image"])
    return table(["input", "value", "unit", "source"], rows)


def workloads_table(loads: Sequence[Workload]) -> str:
    rows = [
        [
            w.name,
            trace_word(w.trace),
            f"{w.base.gets:.0f} / {w.base.bytes / MB:.1f}",
            f"{w.pair.gets:.0f} / {w.pair.bytes / MB:.2f}",
            f"{w.chain_s:.2f} s",
        ]
        for w in loads
    ]
    head = [
        "workload",
        "traces",
        "once per node: GETs / MB",
        "per node and image: GETs / MB",
        "one cold start",
    ]
    return table(head, rows)


def fleet_check_table(rows: Sequence[dict]) -> str:
    body = [
        [
            r["placement"],
            trace_word(r["trace"]),
            f"{r['pairs_model']:.0f} / {r['pairs_measured']}",
            f"{secs(r['t_model'])} ({r['binds']})",
            secs(r["wall_measured"]),
        ]
        for r in rows
    ]
    head = ["placement", "traces", "cold starts: model / measured", "model T", "measured wall"]
    return table(head, body)


def pick(outcomes: Sequence[Outcome], workload: str, placement: str, trace: bool) -> Outcome:
    return next(
        o for o in outcomes if (o.workload, o.placement, o.trace) == (workload, placement, trace)
    )


def _t(o: Outcome, bucket: str = PARTITIONED) -> str:
    name, value = o.binding(bucket)
    return f"{secs(value)} ({name})"


def summary(
    fleet: Fleet, inp: Inputs, spreads: Sequence[Spread], outcomes: Sequence[Outcome]
) -> str:
    cache, rand = spreads
    py_c, py_r = (pick(outcomes, "python task", p, True) for p in ("cache", "random"))
    sy_c, sy_r = (pick(outcomes, "sympy task", p, True) for p in ("cache", "random"))
    own = inp.sympy_mb_trace.value - inp.base_mb_trace.value
    meta_share = py_c.pairs * inp.meta_gets.value / py_c.gets
    return (
        f"**The fleet model** (`bench/fleet_model.py`, issue 25): {fleet.sandboxes:,} "
        f"sandboxes of {fleet.images:,} images at once on {fleet.nodes:,} nodes of "
        f"{inp.cores.value:g} cores with full generic pools, from this node's "
        "measurements (each input beside its source in bench/results/fleet_model.md). "
        "T is the time until the last sandbox "
        "exists and its first command has its start-up data on its node: the largest of "
        "the bounds set by S3's GET rate (one partition's, or the hottest key's once the "
        f"bucket is partitioned), the store's bandwidth ({inp.store_gbit.value:g} Gbit/s "
        f"assumed), a node's link, a node's creates and one cold start. Cache placement "
        f"cold-starts each image on {cache.pairs / fleet.images:.2f} nodes, random on "
        f"{rand.pairs / fleet.images:.2f}. With start-up traces and a partitioned bucket, "
        f"images like testbed/agent_images.py's (python and a small task layer) start in "
        f"{_t(py_c)} with cache placement and {_t(py_r)} with random: the goal of 10 s is "
        f"met. If each image's first command reads {own:.0f} MB of its own (sympy's tests, "
        f"sympy being the task's code), it takes {_t(sy_c)} and {_t(sy_r)}: missed. On a "
        f"bucket S3 has not partitioned, one partition's "
        f"{inp.prefix_gets_per_s.value:,.0f} GET/s decides every row: "
        f"{secs(py_c.binding(FRESH)[1])} for the first, where {meta_share:.0%} of the GETs "
        "are the 4 metadata objects each node fetches per image."
    )


def own_mb_limit(spread: Spread, w: Workload, inp: Inputs) -> float:
    """The most an image's own start-up data (MB, its metadata aside) may be for the store
    bandwidth and the busiest node's link to stay within the goal."""
    meta = inp.meta_mb_python.value * MB
    store = GOAL_S * inp.store_gbit.value * GBIT - spread.active_nodes * w.base.bytes
    link = GOAL_S * inp.link_gbit.value * GBIT - w.base.bytes
    return max(0.0, min(store / spread.pairs, link / spread.max_images) - meta) / MB


def levers(inp: Inputs, pools: bool, spreads: Sequence[Spread]) -> list[str]:
    """What would bring the rows that miss to 10 s, each computed with the model."""
    cache = spreads[0]
    node = node_speed(inp, pools)

    def run(workload: int, trace: bool, **sets: float) -> Outcome:
        changed = replace(inp, **{k: replace(getattr(inp, k), value=v) for k, v in sets.items()})
        return outcome(cache, workloads(changed, trace)[workload], changed, node)

    sympy = run(1, True)
    limits = [own_mb_limit(s, workloads(inp, True)[0], inp) for s in spreads]
    lines = [
        f"- With traces on a partitioned bucket, the store and the node links allow 10 s "
        f"while an image's first command reads at most {limits[0]:.1f} MB of its own "
        f"(cache placement) or {limits[1]:.2f} MB (random) beyond the shared base.",
        f"- sympy task, cache placement, traces: the store must deliver "
        f"{sympy.bytes * 8 / GOAL_S / 1e9:,.0f} Gbit/s for 10 s ({sympy.bytes / 1e9:,.0f} GB).",
    ]
    one_meta = run(0, True, meta_gets=1)
    lines.append(
        "- python task, cache placement, traces, fresh bucket: one metadata GET per (node, "
        f"image) instead of 4 gives {_t(one_meta, FRESH)}."
    )
    express = run(0, True, prefix_gets_per_s=200_000)
    lines.append(
        "- python task, cache placement, traces, an S3 Express One Zone directory bucket "
        f"(200,000 GET/s by default, no prefixes to partition): {_t(express, FRESH)}."
    )
    unpooled = node_speed(inp, False)
    cold = [s.max_load / unpooled.rate + s.max_images * unpooled.tree_s for s in spreads]
    lines.append(
        f"- Without generic pools (cold creates), the node bound is {secs(cold[0])} with "
        f"cache placement and {secs(cold[1])} with random."
    )
    return lines


KEYS_NOTE = """\
lazyfs's store keys (docs/FORMATS.md, "Store layout"), below the store URL's prefix
(s3://BUCKET/PREFIX): `packs/<blake3 hex>` (the ranged chunk GETs: nearly all of a cold
start's requests); `images/<image id>`, `erofs/<blake3 hex>`, `traces/<image id>` and
`refs/names/<name>` (one GET each per node and image: the node fetches the manifest and
EROFS metadata whole, and the agent keeps its name lookups); `index/` and `layers/` (read
by convert only). A cold start's GETs therefore spread over four type words and, below each, over
uniformly distributed hashes.

- A **partitioned** bucket: S3 gives "at least 5,500 GET/HEAD requests per second per
  partitioned prefix" and can split hashed names evenly, so the aggregate is not the limit;
  a single key is, since no partition splits it. The hottest key is the base's pack
  holding most of python3's start-up: every node sends it 4 of the 11 GETs of a python3
  start-up trace (about twice as many without a trace, assumed in the same share). The
  model assumes S3 has partitioned `packs/` that far, which it does only after sustained
  load.
- A **fresh** bucket (or one that has not seen this load) is one partition: all of a
  burst's GETs share 5,500/s. S3 partitions in the background after sustained load and
  answers 503 Slow Down meanwhile, not within a 10 s burst
  (https://docs.aws.amazon.com/AmazonS3/latest/userguide/optimizing-performance.html,
  https://repost.aws/knowledge-center/s3-object-key-naming-pattern).
- What lazyfs could do: fewer GETs per (node, image), of which 4 are metadata objects
  (one object for manifest, EROFS metadata and trace; the name lookup cached on the
  node or done once by the gateway); a hot pack written under R keys, each node reading
  the one its own hash picks (R times the hottest-key bound); the base prefetched onto
  every node before a step; nodes fetching chunks from each other; several buckets (each
  has its own partitions); or an S3 Express One Zone directory bucket, 200,000 GET/s per
  bucket by default and up to 2,000,000
  (https://docs.aws.amazon.com/AmazonS3/latest/userguide/s3-express-performance.html)."""


ASSUMPTIONS_NOTE = """\
- T is the largest bound: it assumes the stages overlap perfectly, so a real burst takes
  at least T. A node's queue and the cold start of its last image can add up.
- "First command": created, with its start-up data on the node; the command's own run
  (sympy's tests: 0.7 s of CPU each, 100 per node) is the workload's, on any system.
- Every node cache starts without these images. In the next step of the same images,
  cache placement finds them warm where it left them (rendezvous order is stable while
  the membership is) and random placement mostly does not.
- One base shared by all images; every image has the same number of sandboxes.
- The gateway's bound is on the running mean load, with a floor of 2 sandboxes per CPU
  and (1 + 2 eps) x the mean where the image is warm (or was just sent): without the
  floor, early in a burst the bound is 1-2 sandboxes per node and an image's first
  sandboxes spread over several nodes. The fleet benchmark at its scale: 50-53 cold
  starts for 50 images on 4 nodes (one per image is the least there can be).
- A node's create rate and tree time come from one-node bursts of 200 sandboxes of 50
  images on a local store, scaled linearly by cores; the one cold start is measured for
  one sandbox (sympy over S3 behind 1 Gbit/s + 4 ms; python3 hello on a local store).
- The sympy task's own start-up data is sympy's start minus python3 hello's start, both
  measured cold (GETs and bytes). The python task's is its task file and its metadata.
- The issue's ~760 GETs per cold start without a trace was before the 1 MiB read-ahead
  of a miss (bench/results/tree_perf.md: 800 -> 136 chunk GETs); this model uses the
  current figures."""


# ---------------------------------------------------------------------------------------
# Plot


def plot(
    outcomes: Sequence[Outcome],
    spreads: Sequence[Spread],
    inp: Inputs,
    fleet: Fleet,
    pools: bool,
    out: Path,
) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(16, 6), width_ratios=[3, 2])
    series = {b: [o.bounds[b] for o in outcomes] for b in BOUNDS}
    grouped_bars(left, series)
    left.set_yscale("log")
    left.axhline(GOAL_S, color="red", linestyle="--", label="goal 10 s")
    labels = [f"{o.workload}\n{o.placement}\n{trace_word(o.trace)}" for o in outcomes]
    left.set_xticks(range(len(outcomes)), labels, fontsize=7)
    left.set_ylabel("seconds (log)")
    left.set_title("Each bound, per workload, placement and traces")
    left.legend(fontsize=7)

    sizes = [10 ** (x / 4) for x in range(-8, 9)]  # 0.01 .. 100 MB
    node = node_speed(inp, pools)
    python = workloads(inp, True)[0]
    for spread in spreads:
        for bucket, style in ((PARTITIONED, "-"), (FRESH, ":")):
            ts = []
            for size in sizes:
                pair = Cost(python.pair.gets, size * MB + inp.meta_mb_python.value * MB)
                o = outcome(spread, replace(python, pair=pair), inp, node)
                ts.append(o.binding(bucket)[1])
            color = "C0" if spread.placement == "cache" else "C2"
            right.plot(sizes, ts, style, color=color, label=f"{spread.placement}, {bucket}")
    right.axhline(GOAL_S, color="red", linestyle="--")
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("an image's own start-up data, MB (python task's GETs, traces)")
    right.set_ylabel("T, seconds (log)")
    right.set_title("T against what an image reads beyond the shared base")
    right.legend(fontsize=7)
    fig.suptitle(
        f"{fleet.sandboxes:,} sandboxes, {fleet.images:,} images, {fleet.nodes:,} nodes "
        f"of {inp.cores.value:g} cores, store {inp.store_gbit.value:g} Gbit/s"
    )
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "fleet_model.png", dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------
# Main


def document(
    fleet: Fleet,
    inp: Inputs,
    pools: bool,
    spreads: Sequence[Spread],
    outcomes: Sequence[Outcome],
    loads: Sequence[Workload],
    check: Sequence[dict],
) -> str:
    node = node_speed(inp, pools)
    parts = [
        "# The fleet model (bench/fleet_model.py)",
        "",
        "## README section",
        "",
        summary(fleet, inp, spreads, outcomes),
        "",
        readme_table(outcomes),
        "",
        "## Every bound",
        "",
        f"Nodes with {'full generic pools' if pools else 'cold creates (no pools)'}. "
        f"Store {inp.store_gbit.value:g} Gbit/s, node links {inp.link_gbit.value:g} Gbit/s, "
        f"{inp.prefix_gets_per_s.value:,.0f} GET/s per S3 partition.",
        "",
        bounds_table(outcomes),
        "",
        "What would change it, computed with the model:",
        "",
        *levers(inp, pools, spreads),
        "",
        "## Placement",
        "",
        f"Cache: bounded loads with eps = {inp.eps.value:g} on the running mean, simulated "
        "(seed 1). Random: cold starts are the exact expectation "
        f"N (1 - (1 - 1/N)^k) per image; the busiest node from one seeded draw.",
        "",
        placement_table(fleet, spreads),
        "",
        "## What a cold start costs",
        "",
        workloads_table(loads),
        "",
        "## Inputs",
        "",
        inputs_table(inp, node, pools),
        "",
        "## Store keys and S3 prefixes",
        "",
        KEYS_NOTE,
        "",
        "## Assumptions",
        "",
        ASSUMPTIONS_NOTE,
        "",
    ]
    if check:
        parts += [
            "## The fleet benchmark against the model at its scale",
            "",
            fleet_check_table(check),
            "",
        ]
    return "\n".join(parts)


def results_json(
    fleet: Fleet,
    inp: Inputs,
    pools: bool,
    spreads: Sequence[Spread],
    outcomes: Sequence[Outcome],
    loads: Sequence[Workload],
    check: Sequence[dict],
) -> dict:
    return {
        "fleet": asdict(fleet),
        "pools": "generic" if pools else "none",
        "goal_s": GOAL_S,
        "inputs": {name: asdict(f) for name, f in inp.rows()},
        "node": asdict(node_speed(inp, pools)),
        "placements": [asdict(s) for s in spreads],
        "workloads": [asdict(w) for w in loads],
        "outcomes": [
            {
                **asdict(o),
                "t": {b: o.binding(b)[1] for b in (PARTITIONED, FRESH)},
                "binds": {b: o.binding(b)[0] for b in (PARTITIONED, FRESH)},
            }
            for o in outcomes
        ],
        "fleet_check": list(check),
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sandboxes", type=int, default=100_000)
    p.add_argument("--images", type=int, default=10_000)
    p.add_argument("--nodes", type=int, default=1_000)
    p.add_argument("--pools", choices=("generic", "none"), default="generic")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--fleet-results", type=Path, help="bench/results/fleet.json")
    p.add_argument("--results", type=Path, default=RESULTS, help="where inputs are read")
    p.add_argument("--out", type=Path, default=RESULTS, help="where fleet_model.* go")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    fleet = Fleet(args.sandboxes, args.images, args.nodes)
    pools = args.pools == "generic"
    inp = with_overrides(load_inputs(args.results), args.set)
    doc = json.loads(args.fleet_results.read_text()) if args.fleet_results else {}
    fitted = fleet_workloads(doc, inp) if doc else []
    spreads, outcomes = model(fleet, inp, pools, fitted, args.seed)
    loads = [*workloads(inp, True), *workloads(inp, False), *fitted]
    check = fleet_check(doc, inp, pools, fitted) if fitted else []
    text = document(fleet, inp, pools, spreads, outcomes, loads, check)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fleet_model.md").write_text(text)
    data = results_json(fleet, inp, pools, spreads, outcomes, loads, check)
    (args.out / "fleet_model.json").write_text(json.dumps(data, indent=1))
    if not args.no_plot:
        plot(outcomes, spreads, inp, fleet, pools, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
