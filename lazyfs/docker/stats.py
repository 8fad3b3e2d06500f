"""`GET /containers/{id}/stats` (`docker stats`, docker-py's `stats()`): a container's
sandbox usage (Agent.usage: its cgroup's counters) in dockerd's shape.

- `stream` (default true): a document a second until the client leaves; false: one.
- `one-shot` with stream false: at once, with precpu_stats zero; without it dockerd
  waits for a second sample to fill precpu_stats (from which a client takes the CPU
  percentage), and so does this, a second later.

CPU is the sandbox's CPU time (cpu_usage.total_usage, and the user/kernel split) beside
the host's (system_cpu_usage), memory what its memory cgroup charges it (its processes'
pages and its RAM-backed files: lazyfs/sandbox/usage.py) with its limit and memory.stat,
pids its task count and limit. A sandbox has only loopback: `networks` is empty, and
`blkio_stats` lists nothing (its files are on the node's trees and a tmpfs).
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncGenerator

import anyio

from lazyfs.agent.node import Agent
from lazyfs.docker.container_api import Containers
from lazyfs.docker.containers import Container, timestamp
from lazyfs.docker.errors import docker_errors
from lazyfs.docker.http import Answer, HttpError, Request, Streamed, json_line, json_reply
from lazyfs.sandbox.limits import cpu_list, node_cpus
from lazyfs.sandbox.usage import Usage, system_cpu_ns

INTERVAL = 1.0  # seconds between two documents of a stream, as dockerd's
NO_CPU = {
    "cpu_usage": {"total_usage": 0, "usage_in_kernelmode": 0, "usage_in_usermode": 0},
    "system_cpu_usage": 0,
    "online_cpus": 0,
    "throttling_data": {"periods": 0, "throttled_periods": 0, "throttled_time": 0},
}
NO_BLKIO = {
    k: None
    for k in (
        "io_service_bytes_recursive",
        "io_serviced_recursive",
        "io_queue_recursive",
        "io_service_time_recursive",
        "io_wait_time_recursive",
        "io_merged_recursive",
        "io_time_recursive",
        "sectors_recursive",
    )
}


class Stats:
    def __init__(self, agent: Agent, containers: Containers) -> None:
        self.agent = agent
        self.containers = containers

    @docker_errors
    async def stats(self, request: Request) -> Answer:
        container = self.containers.find(request.params["id"])
        if request.flag("stream", True):
            return Streamed(self._stream(container))
        if request.flag("one-shot"):
            return json_reply(self._document(container, None))
        before = self._sample(container)
        await anyio.sleep(INTERVAL)
        return json_reply(self._document(container, before))

    async def _stream(self, container: Container) -> AsyncGenerator[bytes, None]:
        before = None
        while True:
            doc = self._document(container, before)
            before = (doc["read"], doc["cpu_stats"])
            yield json_line(doc)
            await anyio.sleep(INTERVAL)

    def _sample(self, container: Container) -> tuple[str, dict]:
        """(when, cpu_stats): what the next document shows as its pre-read."""
        doc = self._document(container, None)
        return doc["read"], doc["cpu_stats"]

    def _document(self, container: Container, before: tuple[str, dict] | None) -> dict:
        box = self.agent.boxes.get(container.box_id)
        if box is None:
            raise HttpError(404, f"No such container: {container.id}")
        used = self.agent.usage(box.id)
        return {
            "read": timestamp(time.time()),
            "preread": before[0] if before else timestamp(None),
            "pids_stats": _pids(used),
            "blkio_stats": NO_BLKIO,
            "num_procs": 0,
            "storage_stats": {},
            "cpu_stats": _cpu_stats(used, box.record.cpuset),
            "precpu_stats": before[1] if before else NO_CPU,
            "memory_stats": _memory(used),
            "name": f"/{container.name}",
            "id": container.id,
            "networks": {},
        }


def _cpu_stats(used: Usage, cpuset: str | None) -> dict:
    return {
        "cpu_usage": {
            "total_usage": used.cpu_ns,
            "usage_in_kernelmode": used.cpu_system_ns,
            "usage_in_usermode": used.cpu_user_ns,
        },
        "system_cpu_usage": system_cpu_ns(),
        "online_cpus": len(cpu_list(cpuset) if cpuset else node_cpus()),
        "throttling_data": NO_CPU["throttling_data"],
    }


def _memory(used: Usage) -> dict:
    return {
        "usage": used.memory,
        "limit": used.memory_limit if used.memory_limit is not None else _ram(),
        "stats": used.memory_stat,
    }


def _pids(used: Usage) -> dict:
    return {"current": used.pids, **({"limit": used.pids_limit} if used.pids_limit else {})}


def _ram() -> int:
    """The host's RAM: the limit dockerd shows for a container without one."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
