"""The Docker Engine API on the agent: `lazyfs serve --docker-socket PATH`.

One table of routes over its parts, each a module: system.py (ping, version, info),
images.py, container_api.py (containers as the agent's sandboxes: containers.py),
execs.py, archive.py (`docker cp`, over tar_unpack.py and tar_pack.py) and stats.py.
Served by http.py; lazyfs's errors become Docker's by errors.py.
"""

from __future__ import annotations

from anyio.abc import TaskGroup

from lazyfs.agent.node import Agent
from lazyfs.docker.archive import Archive
from lazyfs.docker.container_api import Containers
from lazyfs.docker.execs import Execs
from lazyfs.docker.http import Router
from lazyfs.docker.images import Images
from lazyfs.docker.stats import Stats
from lazyfs.docker.system import System


class DockerAPI:
    def __init__(self, agent: Agent, tasks: TaskGroup) -> None:
        self.images = Images(agent)
        self.containers = Containers(agent, tasks, self.images)
        self.images.containers_of = lambda image_id: [
            c.id for c in self.containers.all.values() if c.image_id == image_id
        ]
        self.execs = Execs(agent, tasks, self.containers, self.images)
        self.system = System(agent, self.containers)
        self.archive = Archive(agent, self.containers)
        self.stats = Stats(agent, self.containers)

    def headers(self) -> list[tuple[str, str]]:
        return self.system.headers()

    def router(self) -> Router:
        system, images, c, execs = self.system, self.images, self.containers, self.execs
        r = Router()
        for method, path, handler in [
            ("GET", "/_ping", system.ping),
            ("GET", "/version", system.version),
            ("GET", "/info", system.info),
            ("GET", "/images/json", images.list_images),
            ("POST", "/images/create", images.pull),
            ("POST", "/build", images.build),
            ("GET", "/images/{name:path}/json", images.inspect_image),
            ("DELETE", "/images/{name:path}", images.remove),
            ("POST", "/containers/create", c.create),
            ("GET", "/containers/json", c.list_containers),
            ("GET", "/containers/{id}/json", c.inspect),
            ("POST", "/containers/prune", c.prune),
            ("POST", "/containers/{id}/start", c.start),
            ("POST", "/containers/{id}/restart", c.restart),
            ("POST", "/containers/{id}/wait", c.wait),
            ("GET", "/containers/{id}/logs", c.logs),
            ("POST", "/containers/{id}/attach", c.attach),
            ("POST", "/containers/{id}/stop", c.stop),
            ("POST", "/containers/{id}/kill", c.kill),
            ("POST", "/containers/{id}/rename", c.rename),
            ("POST", "/containers/{id}/update", c.update),
            ("POST", "/containers/{id}/pause", c.pause),
            ("POST", "/containers/{id}/unpause", c.unpause),
            ("GET", "/containers/{id}/stats", self.stats.stats),
            ("GET", "/containers/{id}/changes", c.changes),
            ("GET", "/containers/{id}/top", c.top),
            ("POST", "/containers/{id}/resize", c.resize),
            ("DELETE", "/containers/{id}", c.remove),
            ("HEAD", "/containers/{id}/archive", self.archive.head_archive),
            ("GET", "/containers/{id}/archive", self.archive.get_archive),
            ("POST", "/containers/{id}/exec", execs.exec_create),
            ("POST", "/exec/{id}/start", execs.exec_start),
            ("GET", "/exec/{id}/json", execs.exec_inspect),
            ("POST", "/exec/{id}/resize", execs.exec_resize),
        ]:
            r.add(method, path, handler)
        # `docker cp` into a container: a tar of any size, read as it comes.
        r.add("PUT", "/containers/{id}/archive", self.archive.put_archive, streamed=True)
        return r
