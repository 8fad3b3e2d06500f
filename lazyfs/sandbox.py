"""`lazyfs run`: one command in a fresh sandbox of an image, on an OCI runtime.

The image's tree is mounted at most once per node and shared by every concurrent sandbox
of that image (lazyfs/image_mounts.py, `ImageMounts.use`); the sandbox itself (a private
overlay on that tree, the runtime's container, its cgroup) is lazyfs/sandbox_runtime.py's
`Sandbox`, deleted when the command ends, whatever the exit status.
"""

from __future__ import annotations

import sys
from pathlib import Path

from chunker.errors import BadInputError
from chunker.images import resolve_image
from chunker.manifest import Manifest
from chunker.store import open_store
from lazyfs.image_mounts import ImageMounts
from lazyfs.mount import cached_manifest
from lazyfs.oci_spec import Limits
from lazyfs.sandbox_runtime import (
    DEFAULT_RUNTIME,
    Sandbox,
    SandboxRequest,
    cleanup_stale,
    find_runtime,
)


def run(
    image: str,
    command: list[str],
    store_url: str | None,
    cache_dir: Path,
    linger: float = 0.0,
    *,
    limits: Limits | None = None,
    env: list[str] | None = None,
    cwd: str | None = None,
    network: bool = False,
    runtime: str = DEFAULT_RUNTIME,
) -> int:
    """Run COMMAND in a fresh sandbox of IMAGE on an OCI runtime; returns its exit status.
    The image stays mounted `linger` seconds after its last sandbox, for the next one."""
    if not command:
        raise BadInputError("lazyfs run needs a command after --")
    find_runtime(runtime)  # before mounting anything
    cleanup_stale()  # what a killed `lazyfs run` left: it may still hold an image mount
    store = open_store(store_url)
    image_id = resolve_image(store, image)
    manifest = Manifest(cached_manifest(store, image_id, cache_dir))
    try:
        config = manifest.config.get("config") or {}
    finally:
        manifest.close()
    request = SandboxRequest(config, command, env or [], cwd, limits or Limits(), network, runtime)
    with ImageMounts(store_url, cache_dir).use(image_id, linger) as lower:
        box = Sandbox.prepare(lower, request)
        try:
            status = box.run_foreground()
            if box.oom_kills() and request.limits.memory is not None:
                print(
                    f"lazyfs: the sandbox ran out of memory (--memory"
                    f" {_mib(request.limits.memory)}) and was killed",
                    file=sys.stderr,
                )
                status = 137
            return status
        finally:
            box.delete()


def _mib(size: int) -> str:
    return f"{size / 2**20:g} MiB"
