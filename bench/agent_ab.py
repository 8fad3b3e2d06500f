"""The node agent of this checkout against an older one, request by request.

Two `lazyfs serve`s run side by side, each from its own checkout (its own .venv, exec
server and waiter, as scripts/setup.sh builds them), each with its own run, sandbox and
cache directories and cgroup parent, over one store holding the python test image. The
same client then alternates between them, request by request, so that both see the same
machine at the same moment (on this shared 2-core VM the speed drifts by +-10-20 %
between runs minutes apart):

  exec          `exec true` into one running sandbox of each
  warm claim    from a full pool of 2: create + `exec true`, then delete
  create        no pool, the image's tree mounted: create + `exec true`, then delete
                (the bundle, the writable layer, `runc run`, the exec server's start)

Why: issue 20 asked that the sandbox boundary's changes (a tmpfs writable layer, the
exec channel handed over as fd 3, capped bodies and outputs) leave cold create and warm
claim latency no worse than before. Check out the older commit elsewhere, run
scripts/setup.sh there, then:

  .venv/bin/python bench/agent_ab.py --old OLD_CHECKOUT [--execs N] [--claims N] [--creates N]

Results: bench/results/agent_ab.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from _common import LAZYFS, images, timed
from _report import RESULTS, machine_note, save_markdown, table

from lazyfs.client import AgentError, Client

HERE = Path(__file__).resolve().parents[1]
POOL = 2
START_TIMEOUT = 60.0


class Agent:
    """A `lazyfs serve` of one checkout, on private directories under `tmp`."""

    def __init__(self, label: str, tree: Path, store: Path, tmp: Path) -> None:
        self.label, self.tmp = label, tmp
        env = {k: v for k, v in os.environ.items() if not k.startswith("LAZYFS_")}
        env |= {
            "LAZYFS_STORE": f"file://{store}",
            "LAZYFS_CACHE": str(tmp / "cache"),
            "LAZYFS_RUN_DIR": str(tmp / "run"),
            "LAZYFS_SANDBOX_DIR": str(tmp / "sandboxes"),
            "LAZYFS_CGROUP_PARENT": f"lazyfs-ab-{label}-{os.getpid()}",
            "LAZYFS_DAEMON_IDLE": "0",
        }
        self.cgroup_parent = env["LAZYFS_CGROUP_PARENT"]
        self.socket = tmp / "agent.sock"
        with open(tmp / "agent.log", "wb") as log:
            self.proc = subprocess.Popen(
                [str(tree / ".venv/bin/lazyfs"), "serve", "--socket", str(self.socket)]
                + ["--pool", f"py={POOL}"],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd="/",
            )
        self.client = self._connect()

    def _connect(self) -> Client:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the {self.label} agent exited: see {self.tmp}/agent.log")
            try:
                client = Client(socket=self.socket)
                client.health()
                return client
            except AgentError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def pool_full(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while sum(p["ready"] for p in self.client.pools()) < POOL:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {self.label} agent's pool did not fill")
            time.sleep(0.01)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)  # it deletes its sandboxes
        self.proc.wait(60)
        for controller in Path("/sys/fs/cgroup").iterdir():  # its sandboxes' parent, now empty
            with contextlib.suppress(OSError):
                (controller / self.cgroup_parent).rmdir()


def alternate(agents: list[Agent], n: int, one: Callable[[Agent], float]) -> dict[str, list]:
    """n samples of one() per agent, the order flipped every round."""
    samples: dict[str, list] = {a.label: [] for a in agents}
    for i in range(n):
        for agent in agents if i % 2 else reversed(agents):
            samples[agent.label].append(one(agent))
    return samples


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", type=Path, required=True, help="the older checkout (set up)")
    p.add_argument("--execs", type=int, default=400)
    p.add_argument("--claims", type=int, default=80)
    p.add_argument("--creates", type=int, default=40)
    args = p.parse_args()
    if not (args.old / ".venv/bin/lazyfs").exists():
        print(f"agent_ab: {args.old} has no .venv: run scripts/setup.sh there", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="lazyfs-bench-ab-"))
    store = root / "store"
    layout = images().layout
    subprocess.run(
        [LAZYFS, "convert", f"oci:{layout}:python", "--name", "py", "--store", f"file://{store}"],
        check=True,
        capture_output=True,
    )
    agents: list[Agent] = []
    try:
        for label, tree in (("old", args.old.resolve()), ("new", HERE)):
            (root / label).mkdir()
            agents.append(Agent(label, tree, store, root / label))
        boxes = {a.label: a.client.create("py") for a in agents}
        for box in boxes.values():
            box.exec(["true"])  # the exec server is up from here on
        execs = alternate(
            agents, args.execs, lambda a: timed(lambda: boxes[a.label].exec(["true"]))
        )
        for box in boxes.values():
            box.delete()

        def claim(agent: Agent) -> float:
            agent.pool_full()
            return create_and_exec(agent)

        claims = alternate(agents, args.claims, claim)
        for agent in agents:
            agent.client.set_pool("py", 0)
        creates = alternate(agents, args.creates, create_and_exec)
    finally:
        for agent in agents:
            agent.stop()
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    for what, samples in (
        ("exec `true` into a running sandbox", execs),
        ("warm claim (pool of 2) + exec `true`", claims),
        ("create, no pool, tree mounted, + exec `true`", creates),
    ):
        old, new = (sorted(samples[k]) for k in ("old", "new"))
        rows.append(
            [
                f"{what} (n={len(old)} each)",
                _ms(old),
                _ms(new),
                f"{_pct(new, 0.5) / _pct(old, 0.5):.2f}x",
            ]
        )
    text = table(["measure", "old: p50 (p10-p90)", "new: p50 (p10-p90)", "new / old"], rows)
    notes = (
        f"- Command: `.venv/bin/python bench/agent_ab.py {' '.join(sys.argv[1:])}`\n"
        f"- Machine: {machine_note()}; both agents up at once, requests alternated."
    )
    save_markdown(
        "agent_ab",
        "Node agent: this checkout against an older one",
        [("Results", text), ("Notes", notes)],
    )
    print(text)
    print(f"(saved in {RESULTS})")
    return 0


def create_and_exec(agent: Agent) -> float:
    """Seconds of a create + `exec true` (from the pool if it has a ready sandbox); the
    sandbox is deleted after, untimed."""
    t0 = time.perf_counter()
    sb = agent.client.create("py")
    sb.exec(["true"])
    seconds = time.perf_counter() - t0
    sb.delete()
    return seconds


def _pct(ordered: list[float], q: float) -> float:
    return ordered[int(q * (len(ordered) - 1))]


def _ms(ordered: list[float]) -> str:
    p10, p50, p90 = (_pct(ordered, q) * 1e3 for q in (0.1, 0.5, 0.9))
    return f"{p50:.2f} ms ({p10:.2f}-{p90:.2f})"


if __name__ == "__main__":
    sys.exit(main())
