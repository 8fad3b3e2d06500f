"""Generic warm sandboxes (issue 23, "any image in milliseconds"): claims, a burst, density.

`lazyfs serve --warm N` keeps N generic sandboxes ready, started with no image; a create
of any image whose user is root takes one, and the agent gives it the image's root then
(mounting the image's tree first if it is not). Each section starts its own agents
(bench/agent_scale.py's agent_on: a private node, an empty node cache) over a file://
store of the 50 images of testbed/agent_images.py (a shared 218 MB python base and a small
task layer each), and talks to them only through lazyfs.client over the unix socket.

  claims   CLAIMS creates, each timed as the client sees it from the create request to
           the end of `exec true` in the sandbox (its delete follows, not timed), one at
           a time, round-robin over IMAGES images: from a generic pool of WARM, and cold
           (no --warm, today's create), each with the image's tree already mounted on
           the node and with it not mounted yet. Mounted: one agent of each kind, whose
           trees were warmed by one create + exec + delete of each image (trees stay
           LAZYFS_AGENT_LINGER, 60 s, after their last sandbox; the table says whether
           all were still mounted at the end). Not mounted: a new pair of agents (empty
           node cache, nothing mounted) for every IMAGES claims, so that each claim is its
           image's first on its node; these run after the mounted rows, so every image's
           start-up trace is in the store already (as for an image run before on any
           node). The two agents of a pair run side by side and take turns claim by
           claim, each claim made with the generic pool full again (the wait is not timed,
           and is reported): no refill runs during a claim, of either agent, so a claim is
           measured at a pace the pool keeps up with. One more row: the generic agent
           alone, BLOCK claims back to back between such waits, where the refills (one
           sandbox at a time, after each claim's first command) overlap the next claims
           as in a stream. Which source served the claims is counted from each agent's
           metrics (lazyfs_claims_total{source}), the agent's own mean claim time from
           lazyfs_claim_seconds, and where its time went from the line the agent logs
           for each claim (a cold create's image, tree, prepare, runtime; a generic
           claim's tree, user, root).
           Goals: generic, mounted p50 <= 10 ms and p99 <= 30 ms; not mounted p50 <= 40 ms.
  burst    agent_scale.py's burst (SANDBOXES sandboxes of IMAGES images created at once,
           one client thread each, each running `cat /task/id.txt`, checked, on an empty
           node cache), once with no --warm, once with --warm WARM and once with --warm
           SANDBOXES (one ready for every create), the generic pool full before the burst
           starts; then GNU tar + chroot as the full pull (agent_scale.tar_burst).
           Goal: create p50 <= 0.5 s.
  density  DENSITY idle sandboxes on one agent (--max-sandboxes DENSITY): the generic
           pool set to DENSITY (Client.set_warm) and filled; then every one claimed for
           an image (round-robin, CLIENTS client threads); then each runs `true` once
           (checked); then the pool target goes to 0 and all are deleted (8 client
           threads). At each stage: MemAvailable (/proc/meminfo, the whole machine's, so
           whatever else runs there is in it too), the memory cgroup of the agent's
           cgroup parent, which holds every sandbox's cgroup (v1 memory.usage_in_bytes,
           v2 memory.current: the sandboxes' processes and the kernel memory charged to
           them; the agent, runc and the tmpfs pages the agent writes are outside it),
           the agent's RSS, the node data daemon's, and the host's mount count (the
           claim path reads the mount table).

Results: bench/results/generic_claims.{md,json,png}. With --only, the other sections come
from the previous generic_claims.json. Timings on a shared 2-core machine are noisy.

Run (as root): .venv/bin/python bench/generic_claims.py [--only SECTION]... [--scale 0.1]
               [--claims N] [--density N]
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from _common import meminfo_bytes
from _report import (
    RESULTS,
    median,
    save_plot,
    section_axes,
    show_sections,
    table,
)
from agent_scale import Counts as BurstCounts  # noqa: E402
from agent_scale import (  # noqa: E402
    agent_on,
    can_run,
    claim_metrics,
    lazyfs_burst,
    left_text,
    logged_claims,
    no_generic,
    node_daemons,
    node_leftovers,
    pct,
    peak_rss,
    run_on_store,
    section_parser,
    tar_burst,
    vm_bytes,
    wait_pool_full,
)

from lazyfs.client import Client, Sandbox  # noqa: E402
from testbed.agent import AgentProcess  # noqa: E402
from testbed.agent_images import AgentImages  # noqa: E402

SECTIONS = ("claims", "burst", "density")
TRUE = ["true"]
CGROUP_FS = Path("/sys/fs/cgroup")
PARTS = ("logged", "image", "tree", "user", "prepare", "runtime", "root")  # columns, in order
GOALS = {"mounted_p50": 0.010, "mounted_p99": 0.030, "fresh_p50": 0.040, "burst_p50": 0.5}


@dataclass
class Counts:
    images: int = 50
    claims: int = 200
    warm: int = 16
    block: int = 10  # claims: back-to-back generic claims between pool refills
    sandboxes: int = 200  # burst
    density: int = 1000
    clients: int = 4  # density: client threads claiming

    def scaled(self, factor: float) -> Counts:
        """The counts times factor; the pool size and the block are settings, kept."""

        def s(n: int, least: int) -> int:
            return max(least, round(n * factor))

        return replace(
            self,
            images=s(self.images, 2),
            claims=s(self.claims, 4),
            sandboxes=s(self.sandboxes, 4),
            density=s(self.density, 4),
        )


# ---------------------------------------------------------------------------------------
# claims


def claim_once(c: Client, tag: str) -> dict[str, float]:
    """create + exec `true`, timed as the client sees them; the delete after, untimed."""
    t0 = time.perf_counter()
    sb = c.create(tag)
    try:
        t1 = time.perf_counter()
        r = sb.exec(TRUE, timeout=60)
        t2 = time.perf_counter()
    finally:
        sb.delete(missing_ok=True)
    if r.exit_code != 0:
        raise RuntimeError(f"{tag}: `true` exited {r.exit_code}: {r.stderr[-300:]!r}")
    return {"create": t1 - t0, "exec": t2 - t1, "total": t2 - t0}


@dataclass
class Side:
    """One agent of a pair and what its measured claims gave."""

    agent: AgentProcess
    client: Client
    samples: list[dict[str, float]]
    metrics: dict[str, dict[str, float]]  # claim_metrics() before the measured claims
    log_from: int  # where its log stood then

    @classmethod
    def on(cls, agent: AgentProcess, stack: ExitStack) -> Side:
        client = stack.enter_context(agent.client())
        return cls(agent, client, [], claim_metrics(client), len(agent.log()))

    def mark(self) -> None:
        """What came before is not measured."""
        self.metrics, self.log_from = claim_metrics(self.client), len(self.agent.log())

    def sources(self) -> dict[str, dict[str, float]]:
        """The measured claims' count and agent-side seconds, by source."""
        now = claim_metrics(self.client)
        return {
            source: {k: v - self.metrics.get(source, {}).get(k, 0.0) for k, v in d.items()}
            for source, d in now.items()
        }

    def logged(self) -> dict[str, list[dict[str, float]]]:
        """Where the measured claims' time went in the agent (agent_scale.logged_claims)."""
        return logged_claims(self.agent.log()[self.log_from :])


def take_turns(sides: list[Side], tags: list[str], block: int, pool: Client, size: int) -> float:
    """Claim each of `tags` on each side's agent, the sides taking turns in blocks of
    `block` (which goes first alternates), with `pool`'s generic pool at `size` ready at
    the start of every block; returns the seconds waited for it in all (not timed)."""
    waited = 0.0
    for n, start in enumerate(range(0, len(tags), block)):
        part = tags[start : start + block]
        for side in sides if n % 2 == 0 else sides[::-1]:
            waited += wait_pool_full(pool, size, poll=0.005)
            side.samples += [claim_once(side.client, tag) for tag in part]
    return waited


def row(side: Side, generic: bool, mounted: bool, waited: float) -> dict:
    return {
        "generic": generic,
        "mounted": mounted,
        "samples": side.samples,
        "sources": side.sources(),
        "logged": side.logged(),
        "pool_wait": waited,
    }


@contextmanager
def agent_pair(
    scratch: Path, store_dir: Path, label: str, warm: int, left: dict[str, list]
) -> Iterator[tuple[Side, Side, ExitStack]]:
    """A generic agent (--warm warm) and a cold one, side by side on nodes of their own
    under scratch; once they stopped, what they left there is added to `left`."""
    agents: list[AgentProcess] = []
    try:
        with ExitStack() as stack:
            args = ("--warm", str(warm))
            for kind, extra in (("warm", args), ("cold", ())):
                agent = agent_on(scratch / f"{label}-{kind}", store_dir, *extra)
                agents.append(stack.enter_context(agent))
            yield Side.on(agents[0], stack), Side.on(agents[1], stack), stack
    finally:
        for agent in agents:  # also waits for its data daemon's exit
            for kind, found in node_leftovers(agent, None).items():
                left.setdefault(kind, []).extend(found)


def claims_mounted(
    scratch: Path, store_dir: Path, tags: list[str], counts: Counts, left: dict[str, list]
) -> dict:
    order = [tags[i % len(tags)] for i in range(counts.claims)]
    with agent_pair(scratch, store_dir, "mounted", counts.warm, left) as (warm, cold, stack):
        for side in (warm, cold):  # mounts each tree, reads `true` into its page cache
            for tag in tags:
                claim_once(side.client, tag)
            side.mark()
        waited = take_turns([warm, cold], order, 1, warm.client, counts.warm)
        rows = {
            "generic_mounted": row(warm, True, True, waited),
            "cold_mounted": row(cold, False, True, 0.0),
        }
        stream = Side.on(warm.agent, stack)
        waited = take_turns([stream], order, counts.block, warm.client, counts.warm)
        rows["generic_mounted_stream"] = row(stream, True, True, waited)
        for r, side in zip(rows.values(), (warm, cold, stream), strict=True):
            r["mounted_at_end"] = f"{side.client.health()['mounted_images']} of {len(tags)}"
    return rows


def claims_fresh(
    scratch: Path, store_dir: Path, tags: list[str], counts: Counts, left: dict[str, list]
) -> dict:
    order = [tags[i % len(tags)] for i in range(counts.claims)]
    rounds = [order[i : i + len(tags)] for i in range(0, len(order), len(tags))]
    rows = {
        "generic_fresh": row_acc(True),
        "cold_fresh": row_acc(False),
    }
    for n, part in enumerate(rounds):
        with agent_pair(scratch, store_dir, f"fresh-{n}", counts.warm, left) as (warm, cold, _):
            waited = take_turns([warm, cold], part, 1, warm.client, counts.warm)
            for key, side, w in (("generic_fresh", warm, waited), ("cold_fresh", cold, 0.0)):
                add_row(rows[key], row(side, side is warm, False, w))
    return rows


def row_acc(generic: bool) -> dict:
    return {"generic": generic, "mounted": False, "samples": [], "sources": {}}


def add_row(acc: dict, r: dict) -> None:
    """Sum one fresh pair's row into the section's."""
    acc["samples"] += r["samples"]
    for source, parts in r["logged"].items():
        acc.setdefault("logged", {}).setdefault(source, []).extend(parts)
    acc["pool_wait"] = acc.get("pool_wait", 0.0) + r["pool_wait"]
    for source, d in r["sources"].items():
        into = acc["sources"].setdefault(source, {"count": 0.0, "seconds": 0.0})
        for k, v in d.items():
            into[k] += v


def bench_claims(scratch: Path, store_dir: Path, images: AgentImages, counts: Counts) -> dict:
    tags = images.tags[: counts.images]
    res = {"images": len(tags), "claims": counts.claims, "warm": counts.warm}
    res["block"] = counts.block
    left: dict[str, list] = {}
    res["rows"] = claims_mounted(scratch, store_dir, tags, counts, left)
    print("  mounted: " + _claims_line(res["rows"]), flush=True)
    res["rows"].update(claims_fresh(scratch, store_dir, tags, counts, left))
    res["left_after_stop"] = left
    print("  + not mounted: " + _claims_line(res["rows"]), flush=True)
    return res


def _claims_line(rows: dict) -> str:
    return ", ".join(
        f"{k} p50 {pct([s['total'] for s in r['samples']], 0.5) * 1e3:.1f} ms"
        for k, r in rows.items()
    )


# ---------------------------------------------------------------------------------------
# burst


def bench_burst(scratch: Path, store_dir: Path, images: AgentImages, counts: Counts) -> dict:
    burst = BurstCounts(images=counts.images, sandboxes=counts.sandboxes)
    res: dict[str, Any] = {"runs": []}
    for warm in sorted({0, counts.warm, counts.sandboxes}):
        # The full pool's burst once more with its trees mounted: what new images cost.
        again = warm == counts.sandboxes
        r = lazyfs_burst(scratch / f"burst-warm{warm}", store_dir, images, burst, warm, again)
        res["runs"].append(r)
        for label, x in (("", r), (", again", r.get("again"))):
            if x is not None:
                cpu = {k: round(v, 2) for k, v in x["cpu_s"].items()}
                print(
                    f"  --warm {warm}{label}: create p50 {x['create_p50']:.2f} s, last output"
                    f" {x['last_output']:.1f} s, {x['right']}/{r['sandboxes']} right,"
                    f" {x['claims']}, CPU s {cpu}",
                    flush=True,
                )
    res["tar"] = tar_burst(scratch / "tar", images, burst)
    print(f"  GNU tar + chroot: last output {res['tar']['last_output']:.1f} s", flush=True)
    return res


# ---------------------------------------------------------------------------------------
# density


def cgroup_memory(parent: str) -> int:
    """Memory charged to the sandboxes' cgroup parent (v1 or v2), bytes; 0 if none."""
    for path in (
        CGROUP_FS / "memory" / parent / "memory.usage_in_bytes",
        CGROUP_FS / parent / "memory.current",
    ):
        try:
            return int(path.read_text())
        except (OSError, ValueError):
            continue
    return 0


def sample(agent: AgentProcess) -> dict[str, int]:
    assert agent.proc is not None
    daemons = node_daemons(agent)
    return {
        "mem_available": meminfo_bytes("MemAvailable"),
        "cgroup": cgroup_memory(agent.node.cgroup_parent),
        "agent_rss": vm_bytes(agent.proc.pid, "VmRSS"),
        "daemon_rss": vm_bytes(daemons.get("data daemon", 0), "VmRSS"),
        "mounts": len(Path("/proc/self/mountinfo").read_text().splitlines()),
    }


def fill_curve(c: Client, n: int, timeout: float) -> list[tuple[float, int]]:
    """(seconds, ready) once a second while the generic pool fills to n."""
    t0 = time.monotonic()
    curve = [(0.0, 0)]
    while curve[-1][1] < n:
        assert time.monotonic() < t0 + timeout, f"the pool did not fill: {c.pools()}"
        time.sleep(0.2)
        ready = sum(p["ready"] for p in c.pools())
        if ready == n or time.monotonic() - t0 >= len(curve):
            curve.append((time.monotonic() - t0, ready))
    return curve


def in_threads(
    n: int, items: list, work: Callable[[Client, Any], Any], agent: AgentProcess
) -> tuple[list, float]:
    """work(client, item) for every item from n client threads; (results, wall seconds)."""
    todo = iter(enumerate(items))
    out: list = [None] * len(items)

    def loop() -> None:
        with agent.client() as c:
            for i, item in todo:  # one shared iterator: next() under the GIL
                out[i] = work(c, item)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        for f in [pool.submit(loop) for _ in range(n)]:
            f.result()
    return out, time.perf_counter() - t0


def timed_create(c: Client, tag: str) -> tuple[str, float, bool]:
    t0 = time.perf_counter()
    sb = c.create(tag)
    return sb.id, time.perf_counter() - t0, bool(sb.info["from_pool"])


def bench_density(scratch: Path, store_dir: Path, images: AgentImages, counts: Counts) -> dict:
    n = counts.density
    tags = images.tags[: counts.images]
    jobs = [tags[i % len(tags)] for i in range(n)]
    with agent_on(scratch / "density", store_dir, "--max-sandboxes", str(n)) as agent:
        assert agent.proc is not None
        with agent.client() as c:
            stages = {"agent up": sample(agent)}
            c.set_warm(n)
            curve = fill_curve(c, n, timeout=max(120.0, n * 1.0))
            stages["ready (generic)"] = sample(agent)
            made, claim_wall = in_threads(counts.clients, jobs, timed_create, agent)
            claim_metric = claim_metrics(c)
            stages["claimed (idle)"] = sample(agent)
            ok, exec_wall = in_threads(
                counts.clients,
                [i for i, _, _ in made],
                lambda cl, i: Sandbox(cl, i).exec(TRUE, timeout=60).exit_code == 0,
                agent,
            )
            stages["after one `true` each"] = sample(agent)
            no_generic(c)
            _, delete_wall = in_threads(
                8, [i for i, _, _ in made], lambda cl, i: Sandbox(cl, i).delete(), agent
            )
            stages["all deleted"] = sample(agent)
            left = len(c.list())
            daemons = node_daemons(agent)
            peaks = {k: peak_rss(pid) for k, pid in {"agent": agent.proc.pid, **daemons}.items()}
    left_after_stop = node_leftovers(agent, None)
    creates = [t for _, t, _ in made]
    return {
        "sandboxes": n,
        "images": len(tags),
        "clients": counts.clients,
        "fill": curve,
        "fill_seconds": curve[-1][0],
        "claim_wall": claim_wall,
        "claim_p50": pct(creates, 0.5),
        "claim_p99": pct(creates, 0.99),
        "claim_first_tenth_p50": pct(creates[: max(1, n // 10)], 0.5),
        "claim_last_tenth_p50": pct(creates[-max(1, n // 10) :], 0.5),
        "from_pool": sum(p for _, _, p in made),
        "claim_sources": {k: v["count"] for k, v in claim_metric.items()},
        "exec_ok": sum(ok),
        "exec_wall": exec_wall,
        "delete_wall": delete_wall,
        "left_listed": left,
        "left_after_stop": left_after_stop,
        "stages": stages,
        "peak_rss_mb": {k: v / 1e6 for k, v in peaks.items()},
    }


# ---------------------------------------------------------------------------------------
# Output


def _ms(v: float) -> str:
    return f"{v * 1e3:.1f}"


def _goal(value: float, goal: float | None) -> str:
    if goal is None:
        return ""
    return f" ({'met' if value <= goal else '**missed**'}: <= {goal * 1e3:.0f} ms)"


def row_names(block: int) -> dict[str, str]:
    """The claims section's rows, in the order shown."""
    return {
        "generic_mounted": "generic, tree mounted",
        "generic_mounted_stream": f"generic, tree mounted, in blocks of {block}",
        "cold_mounted": "cold, tree mounted",
        "generic_fresh": "generic, tree not mounted (fresh agents)",
        "cold_fresh": "cold, tree not mounted (fresh agents)",
    }


def claims_table(r: dict) -> str:
    names = row_names(r["block"])
    goals = {"generic_mounted": ("mounted_p50", "mounted_p99"), "generic_fresh": ("fresh_p50",)}
    rows = []
    for key, name in names.items():
        if key not in r["rows"]:
            continue
        x = r["rows"][key]
        total = [s["total"] for s in x["samples"]]
        g = [GOALS[k] for k in goals.get(key, ())] + [None, None]
        src = x["sources"]
        agent_side = {s: d["seconds"] / d["count"] for s, d in src.items() if d.get("count", 0) > 0}
        rows.append(
            [
                name,
                len(total),
                f"**{_ms(pct(total, 0.5))}**{_goal(pct(total, 0.5), g[0])}",
                f"{_ms(pct(total, 0.99))}{_goal(pct(total, 0.99), g[1])}",
                f"{_ms(min(total))}-{_ms(max(total))}",
                f"{_ms(pct([s['create'] for s in x['samples']], 0.5))}"
                f" / {_ms(pct([s['exec'] for s in x['samples']], 0.5))}",
                " / ".join(f"{int(src.get(s, {}).get('count', 0))}" for s in ("generic", "cold")),
                ", ".join(f"{s} {_ms(v)}" for s, v in agent_side.items()),
                f"{x['pool_wait']:.1f} s" if x["generic"] else "",
            ]
        )
    head = [
        f"create + exec `true`, {r['claims']} claims over {r['images']} images",
        "n",
        "p50 ms",
        "p99 ms",
        "range ms",
        "create / exec p50 ms",
        "generic / cold (metrics)",
        "agent's mean claim ms",
        "pool refill waits",
    ]
    text = [table(head, rows)]
    logged = [
        (f"{names[k]}: {source} ({len(parts)})", parts)
        for k in names
        if k in r["rows"]
        for source, parts in r["rows"][k].get("logged", {}).items()
    ]
    if logged:
        keys = [k for k in PARTS if any(k in c for _, p in logged for c in p)]
        text += [
            "",
            "Where the agent's part of a claim goes, as it logs it (medians of whole ms, as"
            " the log has them; `logged`: the logged whole, from the image lookup, with a"
            " cold create's wait for one of the agent's threads, which is in none of its"
            " parts; `image`: the lookup, and for an image new to the node its tree's mount"
            " and its wait for its place in the agent's line of them, lazyfs/agent/arrivals.py):",
            "",
            table(
                ["claims (source, n)", *keys],
                [
                    [what, *(_ms(median([c[x] for c in p])) if x in p[0] else "-" for x in keys)]
                    for what, p in logged
                ],
            ),
        ]
    ends = {k: x["mounted_at_end"] for k, x in r["rows"].items() if "mounted_at_end" in x}
    if ends:
        still = "; ".join(f"{names[k]}: {n}" for k, n in ends.items())
        text += ["", f"Trees the agent still held after the mounted rows: {still}."]
    if "left_after_stop" in r:
        text += [
            "",
            f"Left on the nodes after the agents stopped: {left_text(r['left_after_stop'])}.",
        ]
    return "\n".join(text)


def burst_table(r: dict) -> str:
    runs = []  # columns: each run, and after a run with "again" its repeat
    for x in r["runs"]:
        runs.append(x)
        if "again" in x:
            runs.append({**x, "warm_fill": 0.0, **x["again"], "label": "the same again"})
    tar = r["tar"]["last_output"]

    def cells(f: Callable[[dict], str]) -> list[str]:
        return [f(x) for x in runs]

    rows = [
        [
            "generic pool filled in",
            *cells(lambda x: f"{x['warm_fill']:.1f} s" if x["warm"] and "label" not in x else ""),
        ],
        [
            "claims: generic / cold",
            *cells(
                lambda x: f"{x['claims'].get('generic', 0):.0f} / {x['claims'].get('cold', 0):.0f}"
            ),
        ],
        [
            "right / wrong / errors / stuck",
            *cells(lambda x: f"{x['right']} / {x['wrong']} / {len(x['errors'])} / {x['stuck']}"),
        ],
        [
            "create p50 / p99 / max",
            *cells(
                lambda x: (
                    f"**{x['create_p50']:.2f}** / {x['create_p99']:.2f} / {x['create_max']:.2f} s"
                )
            ),
        ],
        *(
            [
                f"the agent's own part, {source} claims (median, s, as it logs it)",
                *cells(lambda x, source=source: _logged_cell(x.get("logged_p50", {}), source)),
            ]
            for source in ("generic", "cold")
        ),
        ["to the last output", *cells(lambda x: f"{x['last_output']:.2f} s")],
        ["CPU seconds: agent / data daemon", *cells(_cpu_cell)],
        ["GNU tar + chroot / this", *cells(lambda x: f"{tar / x['last_output']:.1f}x")],
        ["agent peak RSS", *cells(lambda x: f"{x['peak_rss_mb'].get('agent', 0):.0f} MB")],
        [
            "left after delete / stop",
            *cells(lambda x: f"{len(x['left_after_delete'])} / {len(x['left_after_stop'])} kinds"),
        ],
    ]
    head = [
        f"{runs[0]['sandboxes']} sandboxes of {runs[0]['images']} images at once",
        *(
            x.get("label") or (f"--warm {x['warm']}" if x["warm"] else "no --warm (cold)")
            for x in runs
        ),
    ]
    note = (
        f"GNU tar + chroot (full pull): last output after {tar:.2f} s,"
        f" {r['tar']['disk_mb']:,.0f} MB unpacked. Goal: create p50 <= {GOALS['burst_p50']} s."
    )
    return table(head, rows) + "\n\n" + note


def _cpu_cell(x: dict) -> str:
    cpu = x.get("cpu_s")
    if cpu is None:  # runs from before it was measured
        return ""
    daemon = cpu.get("supervisor", 0.0) + cpu.get("data daemon", 0.0)
    return f"{cpu['agent']:.2f} / {daemon:.2f}"


def _logged_cell(logged: dict[str, dict[str, float]], source: str) -> str:
    parts = logged.get(source)
    if not parts:
        return ""
    each = ", ".join(f"{k} {v:.2f}" for k, v in parts.items() if k != "logged")
    return f"{parts['logged']:.2f} ({each})"


def density_table(r: dict) -> str:
    n, st, peak = r["sandboxes"], r["stages"], r["peak_rss_mb"]
    base = st["agent up"]

    def per(key: str, stage: str) -> str:
        d = base[key] - st[stage][key] if key == "mem_available" else st[stage][key] - base[key]
        return f"{d / 1e6:,.0f} MB ({d / n / 1e3:,.0f} kB each)"

    stage_rows = [
        [
            stage,
            per("mem_available", stage),
            per("cgroup", stage),
            f"{s['agent_rss'] / 1e6:.0f} MB",
            f"{s['daemon_rss'] / 1e6:.0f} MB",
            s["mounts"],
        ]
        for stage, s in st.items()
        if stage != "agent up"
    ]
    memory = table(
        [
            f"{n} sandboxes",
            "MemAvailable drop",
            "sandboxes' cgroup parent",
            "agent RSS",
            "data daemon RSS",
            "host mounts",
        ],
        [
            [
                "agent up (before)",
                f"{base['mem_available'] / 1e9:.2f} GB available",
                f"{base['cgroup'] / 1e6:.0f} MB",
                f"{base['agent_rss'] / 1e6:.0f} MB",
                f"{base['daemon_rss'] / 1e6:.0f} MB",
                base["mounts"],
            ],
            *stage_rows,
        ],
    )
    rates = table(
        [f"{n} sandboxes, {r['images']} images", "value"],
        [
            [
                "generic pool filled (background, one at a time)",
                f"{r['fill_seconds']:.1f} s (**{n / r['fill_seconds']:.1f}/s**)",
            ],
            [
                f"claimed by {r['clients']} client threads",
                f"{r['claim_wall']:.1f} s (**{n / r['claim_wall']:.1f}/s**); from a pool"
                f" {r['from_pool']}, metrics {r['claim_sources']}",
            ],
            [
                "claim p50 / p99",
                f"{_ms(r['claim_p50'])} / {_ms(r['claim_p99'])} ms (p50 of the first tenth"
                f" {_ms(r['claim_first_tenth_p50'])}, of the last"
                f" {_ms(r['claim_last_tenth_p50'])})",
            ],
            ["`true` in each, right", f"{r['exec_ok']} of {n} in {r['exec_wall']:.1f} s"],
            [
                "deleted all (8 client threads)",
                f"**{r['delete_wall']:.1f} s** ({n / r['delete_wall']:.1f}/s);"
                f" listed after: {r['left_listed']}; left on the node after the agent"
                f" stopped: {left_text(r.get('left_after_stop', {}))}",
            ],
            [
                "peak RSS: agent / data daemon",
                f"{peak.get('agent', 0):.0f} / {peak.get('data daemon', 0):.0f} MB",
            ],
        ],
    )
    note = (
        "MemAvailable is the whole machine's: a negative drop means more became available"
        " meanwhile (other work on the machine ended); the cgroup parent counts only what is"
        " charged to the sandboxes' cgroups."
    )
    return memory + "\n\n" + note + "\n\n" + rates


TABLES: dict[str, Callable[[dict], str]] = {
    "claims": claims_table,
    "burst": burst_table,
    "density": density_table,
}


def plot(res: dict) -> None:
    fig, plots = section_axes(res, SECTIONS, (5.5, 4.6))
    for ax, section, r in plots:
        if section == "claims":
            keys = [k for k in row_names(r["block"]) if k in r["rows"]]
            data = [[s["total"] * 1e3 for s in r["rows"][k]["samples"]] for k in keys]
            ax.boxplot(data, whis=(1, 99), showfliers=True)
            ax.set_xticks(range(1, len(keys) + 1), [k.replace("_", "\n") for k in keys])
            ax.set_yscale("log")
            for goal, style, what in (("mounted_p50", "--", ""), ("fresh_p50", ":", "not ")):
                ms = GOALS[goal] * 1e3
                ax.axhline(ms, ls=style, lw=0.8, color="green", label=f"goal p50, {what}mounted")
            ax.legend(fontsize=8)
            ax.set_ylabel("ms, create + exec `true` (box: quartiles, whiskers p1-p99)")
            ax.set_title(f"{r['claims']} claims over {r['images']} images, --warm {r['warm']}")
        elif section == "burst":
            runs = r["runs"]
            labels = [f"--warm {x['warm']}" if x["warm"] else "cold" for x in runs]
            labels.append("GNU tar\n+ chroot")
            bars = ax.bar(
                labels,
                [x["last_output"] for x in runs] + [r["tar"]["last_output"]],
                label="last output",
            )
            ax.bar_label(bars, fmt="%.3g", fontsize=8)
            ax.plot(
                labels[:-1], [x["create_p50"] for x in runs], "o", color="k", label="create p50"
            )
            ax.plot(
                labels[:-1], [x["create_p99"] for x in runs], "^", color="r", label="create p99"
            )
            ax.set_ylabel("seconds (log)")
            ax.set_yscale("log")
            ax.set_title(f"{runs[0]['sandboxes']} sandboxes of {runs[0]['images']} images at once")
            ax.legend(fontsize=8)
        else:
            t, ready = zip(*r["fill"], strict=True)
            ax.plot(t, ready, label="generic ready")
            ax.set_xlabel("seconds after PUT /warm")
            ax.set_ylabel("ready generic sandboxes")
            ax.set_title(f"density: {r['sandboxes']} sandboxes, fill {r['fill_seconds']:.0f} s")
    fig.tight_layout()
    save_plot(fig, "generic_claims")


def show(res: dict) -> int:
    title = "Generic warm sandboxes: any image's claim (bench/generic_claims.py)"
    return show_sections("generic_claims", title, res, TABLES, plot)


# ---------------------------------------------------------------------------------------


def main() -> int:
    p = section_parser(__doc__, SECTIONS, "generic_claims")
    p.add_argument("--claims", type=int, help="claims: how many (default 200, scaled)")
    p.add_argument("--density", type=int, help="density: how many sandboxes (default 1000, scaled)")
    args = p.parse_args()
    if args.report:
        return show(json.loads((RESULTS / "generic_claims.json").read_text()))
    if not can_run("generic_claims"):
        return 2
    counts = Counts().scaled(args.scale)
    if args.claims:
        counts.claims = args.claims
    if args.density:
        counts.density = args.density
    steps = {"claims": bench_claims, "burst": bench_burst, "density": bench_density}
    return show(run_on_store("generic_claims", steps, args.only, counts))


if __name__ == "__main__":
    sys.exit(main())
