"""Where the time of `python3 -c print` goes in a sandbox (issue 12's python3 ratio).

  start-up   a static timer (C, built here with gcc -static) forks and execs
             `python3 -c print` REPS times and prints the median. It runs on the host
             (/usr/bin/python3), chrooted into the image unpacked by umoci and into its
             EROFS tree (`lazyfs mount`), and inside a lazyfs sandbox (made with
             lazyfs.sandbox.runtime, the timer bind-mounted at /dev/spawnt) in variants
             of its config.json: as lazyfs makes it; without seccomp; its overlay over a
             plain directory instead of the EROFS tree; its root a plain directory (no
             overlay); without cgroup resources. Also one run in each of FRESH new
             sandboxes (a fresh overlay: nothing of it in the dentry cache). ROUNDS
             rounds, the places interleaved.
  claims     three `lazyfs serve` at once with `--pool IMAGE=2`: LAZYFS_REFILL_DEFER=0
             (the refill starts at the claim, as before 2026-12-01), the default, and
             --max-sandboxes 2 (no refill while the claimed sandbox runs: the floor).
             Each claim, from a full pool, runs python3 printing its own
             /proc/self/schedstat (time on a CPU, time runnable but waiting); claims on
             the three and the host's python3 interleaved in random order, CLAIMS times.

Run as root: .venv/bin/python bench/sandbox_python.py [--rounds N] [--claims N] [--quick]
Results: bench/results/sandbox_python.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from _common import LAZYFS, images, rootfs, run
from _report import load_average, machine_note, save_markdown, table
from agent_bench import Bench, wait_pool_full

from lazyfs.client import Client

TAG, NAME = "python", "bench-py"
REPS, ROUNDS, FRESH, CLAIMS = 100, 3, 8, 60
PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CGROUP_PARENT = "lazyfs-bench-sbpy"  # for the start-up sandboxes, unless set
SCHEDSTAT = ["python3", "-c", "import sys; sys.stdout.write(open('/proc/self/schedstat').read())"]

TIMER_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#include <fcntl.h>
#include <sys/wait.h>
static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b; return x < y ? -1 : x > y; }
int main(int argc, char **argv) {  /* spawnt [-r ROOT] N CMD...: median ms of N runs */
    const char *root = 0;
    if (argv[1][0] == '-') { root = argv[2]; argv += 2; }
    int n = atoi(argv[1]), devnull = open("/dev/null", O_RDWR);
    double *s = malloc(sizeof(double) * n);
    for (int i = 0; i < n; i++) {
        struct timespec a, b; int st;
        clock_gettime(CLOCK_MONOTONIC, &a);
        pid_t p = fork();
        if (p == 0) {
            if (root && (chroot(root) || chdir("/"))) _exit(126);
            dup2(devnull, 0); dup2(devnull, 1); execvp(argv[2], argv + 2); _exit(127);
        }
        waitpid(p, &st, 0);
        clock_gettime(CLOCK_MONOTONIC, &b);
        if (!WIFEXITED(st) || WEXITSTATUS(st)) { fprintf(stderr, "failed %d\n", st); return 1; }
        s[i] = (b.tv_sec - a.tv_sec) * 1e3 + (b.tv_nsec - a.tv_nsec) / 1e6;
    }
    qsort(s, n, sizeof(double), cmp);
    printf("%.3f\n", s[n / 2]);
    return 0;
}
"""

VARIANTS = {
    "sandbox, as made (overlay on EROFS, seccomp, cgroup, masked paths)": "default",
    "sandbox without seccomp": "noseccomp",
    "sandbox, overlay over a plain directory": "plainlower",
    "sandbox, root a plain directory (no overlay)": "plainroot",
    "sandbox without cgroup resources": "nores",
}


def build_timer(root: Path) -> Path:
    (root / "spawnt.c").write_text(TIMER_C)
    run(["gcc", "-O2", "-static", "-o", root / "spawnt", root / "spawnt.c"])
    return root / "spawnt"


def in_sandbox(timer: Path, tree: Path, plain: Path, variant: str, n: int) -> float:
    """Median ms of n runs of python3 -c print inside one new sandbox."""
    from lazyfs.sandbox.runtime import Sandbox, SandboxHost, SandboxRequest
    from lazyfs.settings import Settings

    lower = plain if variant == "plainlower" else tree
    host = SandboxHost.of(Settings.from_env())
    box = Sandbox.prepare(lower, SandboxRequest({"Env": [PATH]}, ["true"]), host)
    try:
        spec = json.loads((box.dir / "config.json").read_text())
        spec["mounts"].append(
            {
                "destination": "/dev/spawnt",
                "type": "bind",
                "source": str(timer),
                "options": ["bind", "ro"],
            }
        )
        args = spec["process"]["args"]
        spec["process"]["args"] = [
            *args[: args.index("--") + 1],
            "/dev/spawnt",
            str(n),
            "python3",
            "-c",
            "print",
        ]
        if variant == "noseccomp":
            del spec["linux"]["seccomp"]
        elif variant == "plainroot":
            spec["root"]["path"] = str(plain)
        elif variant == "nores":
            spec["linux"]["resources"] = {"devices": spec["linux"]["resources"]["devices"]}
        (box.dir / "config.json").write_text(json.dumps(spec))
        r, w = os.pipe()
        saved = os.dup(1)
        os.dup2(w, 1)  # the runtime hands its stdout to the container
        os.close(w)
        try:
            box.create()
            box.start()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        status = box.wait()
        out = os.read(r, 4096).decode()
        os.close(r)
        if status != 0:
            raise RuntimeError(f"{variant}: exit {status}")
        return float(out)
    finally:
        box.delete()


def startup(root: Path, rounds: int, fresh: int) -> str:
    timer = build_timer(root)
    plain = root / "rootfs"
    run(["cp", "-a", rootfs(TAG), plain])
    (plain / "spawnt").write_bytes(timer.read_bytes())
    (plain / "spawnt").chmod(0o755)
    env = {
        **os.environ,
        "LAZYFS_STORE": f"file://{root / 'store'}",
        "LAZYFS_CACHE": str(root / "cache"),
        "LAZYFS_RUN_DIR": str(root / "run"),
        "LAZYFS_SANDBOX_DIR": str(root / "sandboxes"),
        "LAZYFS_CGROUP_PARENT": os.environ.get("LAZYFS_CGROUP_PARENT", CGROUP_PARENT),
        "LAZYFS_DAEMON_IDLE": "0.2",  # the data daemon goes with the umount: nothing left
    }
    os.environ.update({k: v for k, v in env.items() if k.startswith("LAZYFS_")})
    run([LAZYFS, "convert", f"oci:{images().layout}:{TAG}", "--name", NAME], env=env)
    tree = root / "tree"
    tree.mkdir()
    run([LAZYFS, "mount", NAME, tree], env=env)
    try:
        places = {
            "host /usr/bin/python3": lambda n: float(
                run([timer, n, "/usr/bin/python3", "-c", "print"]).stdout
            ),
            "chroot, image unpacked (ext4)": lambda n: float(
                run([timer, "-r", plain, n, "python3", "-c", "print"]).stdout
            ),
            "chroot, image's EROFS tree": lambda n: float(
                run([timer, "-r", tree, n, "python3", "-c", "print"]).stdout
            ),
        }
        for label, v in VARIANTS.items():
            places[label] = lambda n, v=v: in_sandbox(timer, tree, plain, v, int(n))
        got: dict[str, list[float]] = {k: [] for k in places}
        first: dict[str, list[float]] = {k: [] for k in places}
        for i in range(rounds):
            order = list(places)
            random.shuffle(order)
            for label in order:
                got[label].append(places[label](str(REPS)))
            print(f"  round {i + 1}: " + ", ".join(f"{got[k][-1]:.1f}" for k in places), flush=True)
        for _ in range(fresh):  # one run per new sandbox (or per chroot exec)
            for label in places:
                first[label].append(places[label]("1"))
        rows = [
            [
                label,
                " / ".join(f"{x:.1f}" for x in got[label]),
                f"{statistics.median(first[label]):.1f}",
            ]
            for label in places
        ]
        return table(
            [
                "where python3 -c print runs",
                f"median ms of {REPS} runs, per round",
                f"one run, median of {fresh}",
            ],
            rows,
        )
    finally:
        run([LAZYFS, "umount", tree], env=env)
        if env["LAZYFS_CGROUP_PARENT"] == CGROUP_PARENT:  # ours: empty once its boxes went
            for parent in Path("/sys/fs/cgroup").glob(f"*/{CGROUP_PARENT}"):
                parent.rmdir()


def claims(root: Path, n: int) -> str:
    bench = Bench(root / "agents")
    bench.root.mkdir()
    run(
        [
            LAZYFS,
            "convert",
            f"oci:{images().layout}:{TAG}",
            "--name",
            NAME,
            "--store",
            f"file://{bench.store}",
        ]
    )
    kinds = {
        "refill at the claim (LAZYFS_REFILL_DEFER=0)": ((), {"LAZYFS_REFILL_DEFER": "0"}),
        "refill after the first command (default)": ((), {}),
        "no refill at all (--max-sandboxes 2)": (("--max-sandboxes", "2"), {}),
    }
    clients: dict[str, Client] = {}
    try:
        with ExitStack() as stack:
            for i, (label, (args, env)) in enumerate(kinds.items()):
                clients[label] = stack.enter_context(
                    bench.agent(f"a{i}", "--pool", f"{NAME}=2", *args, env=env)
                )
            total: dict[str, list[float]] = {k: [] for k in [*kinds, "host"]}
            stats: dict[str, list[list[int]]] = {k: [] for k in total}
            for _ in range(n):
                order = [*kinds, "host"]
                random.shuffle(order)
                for label in order:
                    for c in clients.values():
                        wait_pool_full(c, 2)
                    t0 = time.perf_counter()
                    if label == "host":
                        out = subprocess.run(
                            ["/usr/bin/python3", *SCHEDSTAT[1:]], capture_output=True, check=True
                        ).stdout
                    else:
                        sb = clients[label].create(NAME)
                        r = sb.exec(SCHEDSTAT)
                        out = r.stdout
                    total[label].append(time.perf_counter() - t0)
                    if label != "host":
                        if r.exit_code != 0 or not sb.info["from_pool"]:
                            raise RuntimeError(f"{label}: {r}")
                        sb.delete()
                    stats[label].append([int(x) for x in out.split()])
    finally:
        left = bench.wait_clean()
        if left:
            bench.scrub()
        bench.remove_cgroup_parents()
    host = statistics.median(total["host"])
    rows = []
    for label, times in total.items():
        med = statistics.median(times)
        rows.append(
            [
                label if label != "host" else "the host's python3 (subprocess.run)",
                f"{med * 1000:.1f}",
                f"{sorted(times)[int(0.9 * len(times))] * 1000:.1f}",
                f"{med / host:.2f}x",
                f"{statistics.median(s[0] for s in stats[label]) / 1e6:.1f}",
                f"{statistics.median(s[1] for s in stats[label]) / 1e6:.2f}",
            ]
        )
    return table(
        [
            f"claim + exec python3 (n={n} each)",
            "p50 ms",
            "p90 ms",
            "p50 / host",
            "python3 on CPU ms",
            "python3 waiting ms",
        ],
        rows,
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=ROUNDS)
    p.add_argument("--claims", type=int, default=CLAIMS)
    p.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.claims = 1, 10
    if os.geteuid() != 0:
        print("sandbox_python needs root (mounts, runc, chroot)", file=sys.stderr)
        return 2
    load = load_average()
    root = Path(tempfile.mkdtemp(prefix="lazyfs-bench-sbpy-"))
    try:
        print("start-up ...", flush=True)
        first = startup(root, args.rounds, 2 if args.quick else FRESH)
        print(first, flush=True)
        print("claims ...", flush=True)
        second = claims(root, args.claims)
        print(second, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load_after = load_average()
    note = (
        f"- Command: `.venv/bin/python bench/sandbox_python.py{' --quick' if args.quick else ''}`\n"
        f"- Machine: {machine_note()}; load average {load} before,"
        f" {load_after} after (shared: only differences within a run count)."
    )
    path = save_markdown(
        "sandbox_python",
        "python3 -c print in a sandbox",
        [("Start-up, by where it runs", f"{note}\n\n{first}"), ("Claims from a warm pool", second)],
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
