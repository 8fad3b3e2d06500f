"""The gateway's Prometheus metrics (GET /metrics): where creates went and why, how long
they took, the calls nodes failed, and the nodes by state. The nodes' own metrics stay
on each node (each agent's GET /metrics)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from lazyfs.gateway.fleet import Fleet


class GatewayMetrics:
    def __init__(self, fleet: Fleet) -> None:
        self.registry = CollectorRegistry()
        self.creates = Counter(
            "lazyfs_gateway_creates",
            "Sandboxes created through the gateway, by node and placement reason"
            " (pool, warm, hash, overflow, random)",
            ["node", "reason"],
            registry=self.registry,
        )
        self.create_seconds = Histogram(
            "lazyfs_gateway_create_seconds",
            "Time from a create's placement to the node's answer (retries included)",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
        self.node_errors = Counter(
            "lazyfs_gateway_node_errors",
            "Calls a node did not answer or broke off",
            ["node"],
            registry=self.registry,
        )
        self.registry.register(_NodeStates(fleet))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _NodeStates(Collector):
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "lazyfs_gateway_nodes", "Nodes of the fleet, by whether they answer", labels=["state"]
        )
        healthy = len(self.fleet.healthy())
        family.add_metric(["healthy"], healthy)
        family.add_metric(["unhealthy"], len(self.fleet.nodes) - healthy)
        yield family
