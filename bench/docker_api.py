"""The Docker Engine API (issue 24) beside the agent's own API, on one agent.

One `lazyfs serve --pool py=POOL --docker-socket ...` on a private node (bench/
agent_scale.py's agent_on) over a file:// store holding the python test image as `py`.
Its own client (lazyfs.client over the agent's socket) and docker-py 7 (over the Docker
socket) take turns, sample by sample, so both see the same machine at the same moment:

  claim + exec   from a full pool: docker-py `containers.create` + `start` +
                 `exec_run(["true"])` (the container's command is `sleep infinity`),
                 against the client's `create` + `exec(["true"])`. The remove or delete
                 that follows is not timed, nor is the wait for the pool to be full
                 again before the next sample.
                 Goal: docker-py p50 <= 20 ms.
  exec           `exec_run(["true"])` into one running container, against `exec(["true"])`
                 into one running sandbox. Goal: docker-py p50 <= 8 ms.
  docker run     Debian's docker CLI, `docker run --rm py true`, as a user types it: the
                 CLI's own start (a Go binary), create, attach, wait, start, the output,
                 the removal; from a full pool. No baseline beside it: the agent has no
                 one-shot command of its own.

Results: bench/results/docker_api.md. Timings on a shared 2-core machine are noisy.

Run (as root): .venv/bin/python bench/docker_api.py [--samples N]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import docker
from _common import images
from _report import machine_note, save_markdown, spread, table
from agent_scale import agent_on

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from testbed.node import convert  # noqa: E402

POOL = 4
DOCKER = "/usr/bin/docker"  # Debian's docker.io
GOALS = {"claim + exec": 20.0, "exec": 8.0}


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def wait_pool_full(client, image: str = "py", timeout: float = 60) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while True:
        pools = {p["image"]: p for p in client.pools()}
        if pools.get(image, {}).get("ready", 0) >= POOL:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"the pool of {image} did not fill: {pools}")
        time.sleep(0.02)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=100)
    args = parser.parse_args()
    n = args.samples
    rows: dict[str, tuple[list[float], list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="docker-bench-") as tmp:
        store = Path(tmp) / "store"
        convert(f"oci:{images().layout}:python", "py", store)
        sock = Path(tmp) / "node" / "docker.sock"
        with agent_on(
            Path(tmp) / "node", store, "--pool", f"py={POOL}", "--docker-socket", str(sock)
        ) as agent:
            client = agent.client()
            dpy = docker.DockerClient(base_url=f"unix://{sock}", timeout=60)
            wait_pool_full(client)
            # One of each first: the tree is mounted, both paths warm.
            for box in (client.create("py"),):
                box.exec(["true"])
                box.delete()
            c = dpy.containers.create("py", ["sleep", "infinity"])
            c.start()
            c.exec_run(["true"])
            c.remove(force=True)

            docker_claims, agent_claims = [], []
            for _ in range(n):
                wait_pool_full(client)
                made: list = []

                def docker_claim(made: list = made) -> None:
                    c = dpy.containers.create("py", ["sleep", "infinity"])
                    c.start()
                    assert c.exec_run(["true"]).exit_code == 0
                    made.append(c)

                docker_claims.append(timed(docker_claim))
                made.pop().remove(force=True)
                wait_pool_full(client)
                boxes: list = []

                def agent_claim(boxes: list = boxes) -> None:
                    box = client.create("py")
                    assert box.exec(["true"]).exit_code == 0
                    boxes.append(box)

                agent_claims.append(timed(agent_claim))
                boxes.pop().delete()
            rows["claim + exec"] = (docker_claims, agent_claims)

            container = dpy.containers.run("py", ["sleep", "infinity"], detach=True)
            box = client.create("py")
            docker_execs, agent_execs = [], []
            for _ in range(n):
                docker_execs.append(timed(lambda: container.exec_run(["true"])))
                agent_execs.append(timed(lambda: box.exec(["true"])))
            rows["exec"] = (docker_execs, agent_execs)
            container.remove(force=True)
            box.delete()

            env = {**os.environ, "DOCKER_HOST": f"unix://{sock}", "DOCKER_CONFIG": tmp}
            runs = []
            argv = [DOCKER, "run", "--rm", "py", "true"]
            for _ in range(max(n // 4, 5)):
                wait_pool_full(client)
                runs.append(timed(lambda: subprocess.run(argv, env=env, check=True)))
            dpy.close()
            client.close()
        # The node's data daemon leaves LAZYFS_DAEMON_IDLE after the agent: before the
        # directory under its mount is removed.
        if agent.node.wait_clean():
            agent.node.scrub()

    lines = []
    for name, (docker_ms, agent_ms) in rows.items():
        goal = GOALS[name]
        met = "met" if sorted(docker_ms)[len(docker_ms) // 2] <= goal else "missed"
        lines.append(
            [
                name,
                spread(docker_ms, 1, " ms"),
                spread(agent_ms, 1, " ms"),
                f"p50 <= {goal:g} ms: {met}",
                f"p99 {sorted(docker_ms)[int(len(docker_ms) * 0.99) - 1]:.1f} ms",
            ]
        )
    lines.append(["docker run --rm py true", spread(runs, 1, " ms"), "-", "-", f"n={len(runs)}"])
    text = table(["", "docker-py / docker CLI", "lazyfs client", "goal", ""], lines)
    note = (
        f"{n} samples of each, the two clients taking turns; pool of {POOL}, refilled"
        " before each claim (not timed). Median (min-max).\n\n" + machine_note()
    )
    path = save_markdown("docker_api", "Docker Engine API against the agent's own API",
                         [("Latency", text), ("Conditions", note)])  # fmt: skip
    print(text)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
