"""Quick latencies of a running node agent (not the issue-12 benchmark suite):

    lazyfs serve --pool IMAGE=2 &
    python bench/agent_latency.py --socket /run/lazyfs/agent.sock --image IMAGE

prints p50/p99 of `exec true` into a running sandbox and of a claim from the warm pool
followed by `exec true` (waiting for the pool to refill between claims).
"""

from __future__ import annotations

import argparse
import time

from lazyfs.client import Client


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--socket", default="/run/lazyfs/agent.sock")
    p.add_argument("--image", default="py")
    p.add_argument("--execs", type=int, default=100)
    p.add_argument("--claims", type=int, default=20)
    args = p.parse_args()
    c = Client(socket=args.socket)
    with c.create(args.image) as sb:
        sb.exec(["true"])  # the exec server is up from here on
        execs = []
        for _ in range(args.execs):
            t0 = time.perf_counter()
            assert sb.exec(["true"]).exit_code == 0
            execs.append(time.perf_counter() - t0)
    claims, pooled = [], 0
    for _ in range(args.claims):
        deadline = time.monotonic() + 30
        while not any(p["ready"] for p in c.pools()) and time.monotonic() < deadline:
            time.sleep(0.02)
        t0 = time.perf_counter()
        sb = c.create(args.image)
        assert sb.exec(["true"]).exit_code == 0
        claims.append(time.perf_counter() - t0)
        pooled += bool(sb.info["from_pool"])
        sb.delete()
    p50, p99 = pct(execs, 0.5), pct(execs, 0.99)
    print(f"exec true (n={len(execs)}): p50 {p50:.1f} ms, p99 {p99:.1f} ms")
    print(
        f"claim + exec true (n={len(claims)}, {pooled} from the pool):"
        f" p50 {pct(claims, 0.5):.1f} ms, p99 {pct(claims, 0.99):.1f} ms"
    )


if __name__ == "__main__":
    main()
