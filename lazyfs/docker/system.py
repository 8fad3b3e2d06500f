"""/_ping, /version and /info: what a client asks before anything else (the CLI
negotiates its API version from the Api-Version header of every answer)."""

from __future__ import annotations

import os
import platform
import socket
from typing import TYPE_CHECKING

from lazyfs.agent.node import Agent
from lazyfs.docker.http import Answer, Reply, Request, json_reply
from lazyfs.docker.images import arch, lazyfs_version

if TYPE_CHECKING:
    from lazyfs.docker.container_api import Containers

API_VERSION = "1.44"  # what docker-py 7 asks for; the CLI of Debian 12 (20.10) asks 1.41
MIN_API_VERSION = "1.24"


class System:
    def __init__(self, agent: Agent, containers: Containers) -> None:
        self.agent = agent
        self.containers = containers

    def headers(self) -> list[tuple[str, str]]:
        """Sent with every answer."""
        return [
            ("Api-Version", API_VERSION),
            ("Docker-Experimental", "false"),
            ("Ostype", "linux"),
            ("Server", f"lazyfs/{lazyfs_version()}"),
        ]

    async def ping(self, request: Request) -> Answer:
        return Reply(body=b"OK", content_type="text/plain; charset=utf-8")

    async def version(self, request: Request) -> Answer:
        return json_reply(
            {
                "Platform": {"Name": "lazyfs"},
                "Version": lazyfs_version(),
                "ApiVersion": API_VERSION,
                "MinAPIVersion": MIN_API_VERSION,
                "Os": "linux",
                "Arch": arch(),
                "KernelVersion": platform.release(),
                "GitCommit": "",
                "GoVersion": "",
                "BuildTime": "",
                "Components": [{"Name": "lazyfs", "Version": lazyfs_version()}],
            }
        )

    async def info(self, request: Request) -> Answer:
        self.containers.sync()
        states = [c.status for c in self.containers.all.values()]
        return json_reply(
            {
                "ID": socket.gethostname(),
                "Name": socket.gethostname(),
                "Containers": len(states),
                "ContainersRunning": states.count("running"),
                "ContainersPaused": 0,
                "ContainersStopped": len(states) - states.count("running"),
                "Images": 0,
                "Driver": "lazyfs",
                "DriverStatus": [],
                "OperatingSystem": "lazyfs node agent",
                "OSType": "linux",
                "Architecture": platform.machine(),
                "KernelVersion": platform.release(),
                "NCPU": os.cpu_count() or 1,
                "MemTotal": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                "ServerVersion": lazyfs_version(),
                "DockerRootDir": str(self.agent.settings.run_dir),
                "Runtimes": {"runc": {"path": "runc"}},
                "DefaultRuntime": "runc",
                "Swarm": {"LocalNodeState": "inactive"},
                "SecurityOptions": ["name=seccomp,profile=default"],
                "CgroupVersion": "1",
                "Plugins": {"Volume": [], "Network": [], "Log": []},
                "Labels": [],
                "Warnings": [],
            }
        )
