"""The agent's Prometheus metrics (one registry per agent, served at /metrics)."""

from __future__ import annotations

import json
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from lazyfs.agent.boxes import BoxState
from lazyfs.agent.execute import ExecResult
from lazyfs.agent.node import Agent
from lazyfs.tree.node_files import state_path

# The label values of lazyfs_sandboxes: every state a sandbox can be in, from the one
# table (boxes.py), so that a new state is counted without an edit here.
STATES = tuple(state.value for state in BoxState)
# Claims and execs are milliseconds when warm, seconds when cold or when the command is long.
LATENCY_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60, 300)


class AgentMetrics:
    def __init__(self, agent: Agent) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        sandboxes = Gauge("lazyfs_sandboxes", "Sandboxes by state", ["state"], registry=reg)
        for state in BoxState:
            sandboxes.labels(state.value).set_function(
                lambda state=state: sum(1 for b in agent.boxes.values() if b.state is state)
            )
        creating = Gauge("lazyfs_sandboxes_creating", "Sandboxes being made", registry=reg)
        creating.set_function(lambda: agent.creating)
        mounted = Gauge("lazyfs_mounted_images", "Image trees the agent holds", registry=reg)
        mounted.set_function(lambda: len(agent.trees))
        pool_ready = Gauge("lazyfs_pool_ready", "Ready sandboxes in pools", registry=reg)
        pool_ready.set_function(lambda: sum(len(p.ready) for p in agent.pools.values()))
        pool_target = Gauge("lazyfs_pool_target", "Pools' target sizes", registry=reg)
        pool_target.set_function(lambda: sum(p.target for p in agent.pools.values()))
        self.claims = Counter(
            "lazyfs_claims", "Sandboxes handed out, by source", ["source"], registry=reg
        )
        self.claim_seconds = Histogram(
            "lazyfs_claim_seconds",
            "Create request to a running sandbox",
            ["source"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.exec_seconds = Histogram(
            "lazyfs_exec_seconds",
            "One command in a sandbox, start to exit",
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        # "runtime": the exec server did not answer and `runc exec` ran the command
        # (execute.py); a sign that an operator or a failure broke a sandbox's server.
        self.execs = Counter("lazyfs_execs", "Commands run, by channel", ["channel"], registry=reg)
        self.errors = Counter(
            "lazyfs_api_errors", "API requests answered with an error", ["status"], registry=reg
        )
        for source in ("pool", "generic", "cold"):  # present from the start, at 0
            self.claims.labels(source)
            self.claim_seconds.labels(source)
        for channel in ("server", "runtime"):
            self.execs.labels(channel)
        reg.register(NodeCacheCollector(agent))
        agent.on_claim = self._claimed
        agent.on_exec = self._executed

    def _claimed(self, source: str, seconds: float) -> None:
        self.claims.labels(source).inc()
        self.claim_seconds.labels(source).observe(seconds)

    def _executed(self, result: ExecResult) -> None:
        self.exec_seconds.observe(result.seconds)
        self.execs.labels(result.channel).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


# The node cache's counters, as the data daemon (or a per-image FUSE daemon) publishes
# them in its stats files; node-wide, so the largest over the agent's trees is taken.
# Gauges, not counters: a restarted daemon starts them again from 0.
CACHE_STATS = {
    "hits": "Chunk reads the node cache answered",
    "misses": "Chunk reads that went to the store",
    "bytes_fetched": "Bytes fetched from the store",
    "store_requests": "Requests to the store",
    "evictions": "Chunks evicted from the node cache",
    "image_files_removed": "Image files (manifests, metadata images) removed from the node cache",
}


class NodeCacheCollector(Collector):
    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def collect(self) -> Iterator[GaugeMetricFamily]:
        values = dict.fromkeys(CACHE_STATS, 0)
        mounts = self.agent.mounts
        for image_id, path in self.agent.trees.paths().items():
            for point in (mounts.data_dir / image_id, path):  # erofs, fuse
                try:
                    stats = json.loads(state_path(mounts.cache_dir, point, ".json").read_text())
                except (OSError, ValueError):
                    continue
                for key in CACHE_STATS:
                    if isinstance(stats.get(key), int):
                        values[key] = max(values[key], stats[key])
        for key, help_text in CACHE_STATS.items():
            yield GaugeMetricFamily(f"lazyfs_node_cache_{key}", help_text, value=values[key])
