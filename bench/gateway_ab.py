"""The gateway of this checkout against an older one, and both against a direct client.

One `lazyfs serve` of this checkout listens on loopback TCP with TLS and a token; two
`lazyfs gateway`s in front of it, one from this checkout and one from an older
(`--old`, its own .venv, as scripts/setup.sh builds it), also with TLS. One client per
path (direct, new gateway, old gateway), each in turn, sample by sample, so that all
three see the same machine at the same moment (this shared 2-core VM's speed drifts by
tens of % within minutes; the fleet benchmark's gateway row, bench/fleet.py, is one
path at a time against direct):

  claim     from a full pool of 4: create + `exec true` timed (issue 25's "gateway
            overhead"), then `GET /sandboxes/ID` and the delete, each timed alone
  idle GET  `GET /sandboxes/ID` after the client slept 0, 1, 5, 20 ms: on this VM a
            process woken from an idle CPU pays for it, and a proxy adds two wake-ups
            to every request

  .venv/bin/python bench/gateway_ab.py --old OLD_CHECKOUT [--claims N] [--gets N]

Results: bench/results/gateway_ab.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from _common import LAZYFS, images, run, timed
from _report import RESULTS, machine_note, save_markdown, table

from lazyfs.client import Client
from testbed.agent import running_agent
from testbed.certs import make_certs
from testbed.gateway import running_gateway
from testbed.seaweed import free_ports

POOL = 4
TOKEN = "gateway-ab-token"
GAPS = (0.0, 0.001, 0.005, 0.02)  # seconds the client sleeps before an idle GET
PATHS = ("direct", "new", "old")
OPS = ("claim + exec", "create", "exec", "get", "delete")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", type=Path, required=True, help="the older checkout (set up)")
    p.add_argument("--claims", type=int, default=200)
    p.add_argument("--gets", type=int, default=150)
    args = p.parse_args()
    old_lazyfs = args.old.resolve() / ".venv/bin/lazyfs"
    if not old_lazyfs.exists():
        print(f"gateway_ab: {args.old} has no .venv: run scripts/setup.sh there", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="lazyfs-bench-gw-") as tmp, ExitStack() as stack:
        root = Path(tmp)
        store = root / "store"
        layout = images().layout
        run(
            [
                LAZYFS,
                "convert",
                f"oci:{layout}:python",
                "--name",
                "py",
                "--store",
                f"file://{store}",
            ]
        )
        clients = start(root, store, str(old_lazyfs), stack)
        claims, gets = measure(clients, args.claims, args.gets)
    text = report(claims, gets)
    notes = (
        f"- Command: `.venv/bin/python bench/gateway_ab.py {' '.join(sys.argv[1:])}`"
        f" (the old checkout: {args.old})\n"
        f"- Machine: {machine_note()}; one agent, two gateways and three clients up at once,"
        " all over TLS on loopback; samples taken in turn."
    )
    save_markdown(
        "gateway_ab",
        "The gateway: this checkout against an older one",
        [("Results", text), ("Notes", notes)],
    )
    print(text)
    print(f"(saved in {RESULTS})")
    return 0


def start(root: Path, store: Path, old_lazyfs: str, stack: ExitStack) -> dict[str, Client]:
    """The agent and both gateways started; a client for each path."""
    token = root / "token"
    token.write_text(TOKEN + "\n")
    certs = make_certs(root / "certs", ["127.0.0.1"])
    tls = ("--tls-cert", str(certs.cert), "--tls-key", str(certs.key))
    agent_port, *gateway_ports = free_ports(3)
    (root / "node").mkdir()
    agent = stack.enter_context(running_agent(root / "node", store))
    listen = ("--listen", f"127.0.0.1:{agent_port}", "--token-file", str(token))
    agent.start(*listen, *tls, "--docker-socket", "none")
    node = f"https://127.0.0.1:{agent_port}"
    clients = {"direct": Client(url=node, token=TOKEN, verify=certs.ca)}
    for label, program, port in zip(
        ("new", "old"), (str(LAZYFS), old_lazyfs), gateway_ports, strict=True
    ):
        sock = root / f"gateway-{label}.sock"
        gateway = stack.enter_context(
            running_gateway(sock, [node], token, certs.ca, 1.0, program=program)
        )
        gateway.start("--listen", f"127.0.0.1:{port}", "--token-file", str(token), *tls)
        gateway.wait_healthy(1)
        clients[label] = Client(url=f"https://127.0.0.1:{port}", token=TOKEN, verify=certs.ca)
    for client in clients.values():
        stack.callback(client.close)
    return clients


def measure(
    clients: dict[str, Client], n_claims: int, n_gets: int
) -> tuple[dict[str, dict[str, list[float]]], dict[float, dict[str, list[float]]]]:
    direct = clients["direct"]
    direct.set_pool("py", POOL)

    def full() -> None:
        deadline = time.monotonic() + 60
        while not any(p["ready"] >= POOL for p in direct.pools() if p.get("image") == "py"):
            assert time.monotonic() < deadline, "the pool did not refill"
            time.sleep(0.02)

    claims = {path: {op: [] for op in OPS} for path in PATHS}

    def claim(path: str) -> None:
        c, took = clients[path], claims[path]
        full()
        t0 = time.perf_counter()
        sb = c.create("py")
        t1 = time.perf_counter()
        sb.exec(["true"])
        t2 = time.perf_counter()
        c.sandbox(sb.id)
        t3 = time.perf_counter()
        sb.delete()
        t4 = time.perf_counter()
        for op, seconds in zip(OPS, (t2 - t0, t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            took[op].append(seconds)

    for path in PATHS:  # connections made, both gateways polled the node
        claim(path)
    for path in PATHS:
        for samples in claims[path].values():
            samples.clear()
    in_turn(n_claims, claim)
    direct.set_pool("py", 0)
    boxes = {path: c.create("py") for path, c in clients.items()}
    gets: dict[float, dict[str, list[float]]] = {}
    for gap in GAPS:
        gets[gap] = {path: [] for path in PATHS}

        def get(path: str, gap: float = gap) -> None:
            time.sleep(gap)
            gets[gap][path].append(timed(lambda: clients[path].sandbox(boxes[path].id)))

        in_turn(n_gets, get)
    for box in boxes.values():
        box.delete()
    return claims, gets


def in_turn(n: int, one: Callable[[str], None]) -> None:
    """n rounds of one(path) for every path, the order reversed every other round."""
    for i in range(n):
        for path in PATHS if i % 2 == 0 else PATHS[::-1]:
            one(path)


def report(
    claims: dict[str, dict[str, list[float]]], gets: dict[float, dict[str, list[float]]]
) -> str:
    rows = []
    for op in OPS:
        med = {path: statistics.median(claims[path][op]) * 1000 for path in PATHS}
        rows.append(
            [
                f"{op} (pool of {POOL}), n={len(claims['direct'][op])}",
                f"{med['direct']:.2f}",
                f"{med['new']:.2f} (+{med['new'] - med['direct']:.2f})",
                f"{med['old']:.2f} (+{med['old'] - med['direct']:.2f})",
            ]
        )
    for gap, samples in gets.items():
        med = {path: statistics.median(samples[path]) * 1000 for path in PATHS}
        rows.append(
            [
                f"GET after {gap * 1000:g} ms idle, n={len(samples['direct'])}",
                f"{med['direct']:.2f}",
                f"{med['new']:.2f} (+{med['new'] - med['direct']:.2f})",
                f"{med['old']:.2f} (+{med['old'] - med['direct']:.2f})",
            ]
        )
    headers = ["p50, ms", "direct to the agent", "this gateway (added)", "old gateway (added)"]
    return table(headers, rows)


if __name__ == "__main__":
    sys.exit(main())
