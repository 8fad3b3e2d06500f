"""`lazyfs run` of this checkout against an older one, run by run, on a warm node.

Both sides run on this checkout's venv: the older one's Python through PYTHONPATH, its
C helpers (the waiter above all) built from its own sources with its own
scripts/build_helpers.py into OLD/build/ab-helpers, and both trees' modules compiled
first, so that neither side compiles on the clock. Each side has its own run, sandbox
and cache directories and cgroup parent, over one store holding the sympy tree image.
Its first run mounts the image's tree and leaves it lingering; the timed runs then find
it mounted: the CLI's start, the sandbox's overlay, `runc run`, the command and the
teardown, the fixed cost of every `lazyfs run` that a change to that path moves. The two
sides alternate, the order flipping every pair, so that both see the same machine at
the same moment (on this shared 2-core VM the speed drifts by 10-20 % within minutes).

Why: session 37 moved the teardown into the waiter (lazyfs/sandbox/run_teardown.c);
this is how its figure was measured. Check out the older commit elsewhere, then:

  .venv/bin/python bench/run_ab.py --old OLD_CHECKOUT [--pairs N] [-- COMMAND...]

COMMAND defaults to `true`. Results: bench/results/run_ab.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import timed_run
from _report import machine_note, save_markdown, table
from run_vs_pull import cleanup
from tree_perf import Bench

from testbed.mounted_trees import clean_run_dir

HERE = Path(__file__).resolve().parents[1]
PACKAGES = ("chunker", "registry_bridge", "node_cache", "lazyfs")
LINGER = 600  # seconds: longer than the run; unmounted at its end


def prepare_old(old: Path) -> dict[str, str]:
    """The environment that runs the older checkout: its modules, its waiter."""
    helpers = old / "build" / "ab-helpers"
    subprocess.run([sys.executable, old / "scripts" / "build_helpers.py", helpers], check=True)
    return {"PYTHONPATH": str(old), "LAZYFS_RUN_WAIT": str(helpers / "lazyfs-run-wait")}


def compile_tree(tree: Path) -> None:
    dirs = [str(tree / p) for p in PACKAGES if (tree / p).is_dir()]
    subprocess.run([sys.executable, "-m", "compileall", "-q", *dirs], check=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", type=Path, required=True, help="a checkout of the older commit")
    p.add_argument("--pairs", type=int, default=20)
    p.add_argument("command", nargs="*", default=["true"])
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/run_ab.py runs as root (mounts, runc)")
    if not (args.old / "lazyfs" / "sandbox" / "run.py").is_file():
        sys.exit(f"{args.old} is not a lazyfs checkout")
    for tree in (HERE, args.old):
        compile_tree(tree)
    extra = {"old": prepare_old(args.old.resolve()), "new": {}}
    root = Path(tempfile.mkdtemp(prefix="lazyfs-bench-run-ab-", dir="/var/tmp"))
    base = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "LAZYFS_"))}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the clean-up still runs
    sides: dict[str, Bench] = {}
    try:
        for side in ("old", "new"):
            env = {**base, **extra[side], "LAZYFS_DAEMON_IDLE": "1"}
            env.update(LAZYFS_RUN_DIR=str(root / side / "run"))
            env.update(LAZYFS_SANDBOX_DIR=str(root / side / "sandboxes"))
            env.update(LAZYFS_CGROUP_PARENT=f"lazyfs-bench-run-ab-{side}-{os.getpid()}")
            sides[side] = Bench(root / side, env)
            (root / side).mkdir()
        sides["old"].converted = sides["new"].converted  # one store: converted once
        name = sides["new"].image("sympy")
        store = sides["new"].url
        caches = {side: root / side / "cache" for side in sides}

        def one(side: str) -> float:
            b = sides[side]
            argv = b.run_argv(name, caches[side], args.command, url=store, linger=LINGER)
            return timed_run(argv, b.env).exit  # which fails on a non-zero exit

        for side in sides:  # mounts the tree, caches the image's config
            one(side)
            one(side)
        times: dict[str, list[float]] = {"old": [], "new": []}
        for i in range(args.pairs):
            for side in ("old", "new") if i % 2 == 0 else ("new", "old"):
                times[side].append(one(side))
        report(args, times)
    finally:
        for side in sides:  # its trees, their linger reapers, its data daemon: by pid
            clean_run_dir(root / side / "run")
        if problems := cleanup(root):
            print(f"clean-up had to remove: {problems}", file=sys.stderr)
        shutil.rmtree(root, ignore_errors=True)
        for b in sides.values():
            for hierarchy in Path("/sys/fs/cgroup").iterdir():
                with contextlib.suppress(OSError):
                    (hierarchy / b.cgroup_parent).rmdir()
    return 0


def report(args: argparse.Namespace, times: dict[str, list[float]]) -> None:
    ms = {side: [t * 1000 for t in ts] for side, ts in times.items()}
    diffs = [n - o for o, n in zip(ms["old"], ms["new"], strict=True)]
    rows = [
        [side, f"{statistics.median(v):.1f}", f"{min(v):.1f}-{max(v):.1f}"]
        for side, v in ms.items()
    ]
    rows.append(
        [
            "new - old, per pair",
            f"{statistics.median(diffs):+.1f}",
            f"{min(diffs):+.1f} to {max(diffs):+.1f}; new faster in"
            f" {sum(d < 0 for d in diffs)} of {len(diffs)}",
        ]
    )
    command = " ".join(args.command)
    body = "\n".join(
        [
            f"- {machine_note()}",
            f"- Old: {args.old}; new: {HERE}. Command: `.venv/bin/python bench/run_ab.py"
            f" --old {args.old} --pairs {args.pairs} -- {command}`.",
            f"- Each run: `lazyfs run --linger {LINGER} sympy -- {command}`, its image's tree"
            " mounted and lingering from an untimed run; wall time from the CLI's start to"
            " its exit, the sandbox deleted.",
            "",
            table(["side", "median, ms", "range"], rows),
        ]
    )
    path = save_markdown("run_ab", "`lazyfs run`, this checkout against an older one", [
        ("Warm runs, interleaved", body),
    ])  # fmt: skip
    print(body)
    print(f"written: {path}")


if __name__ == "__main__":
    sys.exit(main())
