"""A container's files as tar archives: `docker cp`, docker-py's put_archive and
get_archive, over the sandbox's rootfs.

- PUT /containers/{id}/archive?path=DIR unpacks the body (a tar: plain, gzip, bzip2 or
  xz, told by its first bytes) into DIR, which must be a directory.
- GET /containers/{id}/archive?path=P answers a tar of P (a directory recursively),
  with P's stat in the X-Docker-Container-Path-Stat header (base64 of JSON, as dockerd
  sends it); HEAD answers that header alone (`docker cp` asks it of its destination).

Security. This process is root on the host, and everything in the rootfs, symlinks
included, may have been made by the code the sandbox runs; the tar is the client's. So
no host path is ever joined with the rootfs. Every path is opened with the agent's file
helpers (lazyfs/agent/files.py): openat2(RESOLVE_IN_ROOT) from an fd of the rootfs, so
that "..", absolute links and relative ones resolve as if the rootfs were "/", and
nothing, a link the tar made a moment ago included, can lead out of it. What the tar
adds:
- Entry names: an absolute name is taken inside DIR (as dockerd does); one whose ".."
  leads out of DIR is refused (400), as are NUL bytes.
- Symlinks are made as symlinks: their target is only text, and a later entry that goes
  through one (`link -> /etc`, then `link/evil`) has its parents resolved in the root
  again, so it lands in the sandbox's /etc, never the host's (dockerd, chrooted into the
  container, does the same).
- Hard links: only to a regular file made by an earlier entry of the same tar, and that
  file is looked up with DIR as the root of the resolution, so a link cannot reach any
  other file (a link to /etc/passwd is refused).
- Device nodes and FIFOs are refused (a sandbox has no mknod; a host-made device node in
  a rootfs is a way out), and so are types tarfile does not know.
- Modes keep their permission and sticky bits; setuid and setgid are dropped. What is
  made belongs to the sandbox's user, or to root where the tar names root (uid/gid 0).
- Sizes: the body is read as it comes into a spool (memory up to SPOOL_MEMORY, then an
  unlinked file in the node's sandbox directory), at most MAX_STREAM bytes (413 beyond);
  decompressed, no header read over MAX_HEADER (a PAX or GNU long-name header is read
  whole), no more than MAX_UNPACKED of files, MAX_ENTRIES entries and MAX_STREAM of tar
  in all: a gzip bomb stops there (413).
- The whole tar is checked (names, types, links, sizes) before anything is written, so
  a hostile archive is refused without a trace.
A GET reads the same way: O_PATH first, fstat, and only a regular file is opened for
I/O (a FIFO or a device node in the sandbox is stored as a header, never opened);
symlinks are stored, not followed. The tar is streamed as it is made, CHUNK bytes at a
time (SandboxIO.stream): what a sandbox holds does not become the agent's memory. It
was held whole once, up to 1 GiB: a 1000 MB sparse file, 28 kB of the sandbox's disk,
took the agent to 1.07 GB, 3.1 GB with three GETs at once, none of it the sandbox's.
Once the headers are sent, an error (a file the sandbox made unreadable, a tree deeper
than MAX_DEPTH) breaks the answer off: its client sees a body cut short, never a tar
that ends as if whole. A GET's length is bounded by its time (TIMEOUT), as dockerd's
is by nothing.

The file work is blocking, so it runs in threads (a SandboxIO pool of its own: daemon
threads with a timeout, for the reason sandbox_io.py gives: a sandbox's files may block).
This module is the endpoints; the work is tar_unpack.py's (PUT) and tar_pack.py's (GET,
HEAD), with what they share in tar_paths.py.
"""

from __future__ import annotations

import base64
import contextlib
import json
import tempfile
from collections.abc import AsyncGenerator, Iterator
from functools import partial
from pathlib import Path
from typing import IO

import anyio
import anyio.to_thread

from lazyfs.agent.errors import ReadOnlyRoot
from lazyfs.agent.node import Agent
from lazyfs.agent.sandbox_io import Produced, SandboxIO, TooSlow
from lazyfs.docker.container_api import Containers
from lazyfs.docker.errors import docker_errors
from lazyfs.docker.http import Answer, HttpError, Reply, Request, Streamed
from lazyfs.docker.tar_pack import pack, stat_path
from lazyfs.docker.tar_paths import MiB, PathNotFound
from lazyfs.docker.tar_unpack import MAX_STREAM, unpack

SPOOL_MEMORY = 8 * MiB  # of a PUT's body held in memory; past it, spooled to disk
THREADS = 4  # archive operations at once, node-wide
TIMEOUT = 600.0  # seconds one may take (a cold 1 GiB read from the image's store)
STAT_HEADER = "X-Docker-Container-Path-Stat"
TAR = "application/x-tar"


class Archive:
    """The archive endpoints of Docker's API."""

    def __init__(self, agent: Agent, containers: Containers) -> None:
        self.agent = agent
        self.containers = containers
        self.io = SandboxIO(THREADS, TIMEOUT)
        self.spool_dir = agent.settings.sandbox_dir  # a disk the node keeps for sandboxes

    def _rootfs(self, ref: str, write: bool = False) -> tuple[Path, tuple[int, int]]:
        """The container's rootfs and its user (uid, gid); to `write` into, a 403 for a
        container with ReadonlyRootfs (dockerd's answer and words)."""
        container = self.containers.find(ref)
        box = self.agent.boxes.get(container.box_id)
        if box is None:  # deleted meanwhile (its TTL, the agent's own API)
            raise HttpError(404, f"No such container: {ref}")
        if write:
            try:
                box.check_writable()
            except ReadOnlyRoot:
                raise HttpError(403, "container rootfs is marked read-only") from None
        return box.sandbox.rootfs, (box.record.uid, box.record.gid)

    async def _run(self, ref: str, path: str, fn: partial) -> object:
        with _errors(ref, path):
            return await self.io.run(fn)

    @docker_errors
    async def put_archive(self, request: Request) -> Answer:
        ref = request.params["id"]
        rootfs, owner = self._rootfs(ref, write=True)
        path = _path_arg(request)
        assert request.pieces is not None  # a streamed route (api.py)
        if int(request.headers.get("content-length") or 0) > MAX_STREAM:
            raise HttpError(413, f"an archive over {MAX_STREAM} bytes")
        with tempfile.SpooledTemporaryFile(SPOOL_MEMORY, dir=self.spool_dir) as body:
            await _spool(request.pieces(), body)
            await self._run(ref, path, partial(unpack, rootfs, path, body, owner))
        return Reply(200, b"")

    @docker_errors
    async def head_archive(self, request: Request) -> Answer:
        ref = request.params["id"]
        rootfs, _ = self._rootfs(ref)
        path = _path_arg(request)
        found = await self._run(ref, path, partial(stat_path, rootfs, path))
        assert isinstance(found, dict)
        return Reply(200, b"", TAR, [(STAT_HEADER, _stat_header(found))])

    @docker_errors
    async def get_archive(self, request: Request) -> Answer:
        ref = request.params["id"]
        rootfs, _ = self._rootfs(ref)
        path = _path_arg(request)
        with _errors(ref, path):
            produced = await self.io.stream(partial(pack, rootfs, path))
            try:
                doc = await anext(produced)  # the path's stat, or why it has none
            except BaseException:
                await produced.aclose()
                raise
        assert isinstance(doc, dict)
        return Streamed(
            _pieces(ref, path, produced), TAR, headers=[(STAT_HEADER, _stat_header(doc))]
        )


@contextlib.contextmanager
def _errors(ref: str, path: str) -> Iterator[None]:
    """The pool's and the walk's own errors as Docker's answers."""
    try:
        yield
    except PathNotFound:
        raise HttpError(404, f"Could not find the file {path} in container {ref}") from None
    except TooSlow as exc:
        raise HttpError(504, str(exc)) from None


async def _pieces(ref: str, path: str, produced: Produced[object]) -> AsyncGenerator[bytes, None]:
    """A GET's tar after its stat; the stream is closed however its answer ends."""
    try:
        with _errors(ref, path):
            async for piece in produced:
                assert isinstance(piece, bytes)
                yield piece
    finally:
        await produced.aclose()


async def _spool(pieces: AsyncGenerator[bytes, None], spool: IO[bytes]) -> None:
    """The body into the spool, at most MAX_STREAM bytes; writes past the memory part
    go to disk, so they are made in a thread, a MiB at a time."""
    size, pending = 0, bytearray()
    async with contextlib.aclosing(pieces):
        async for piece in pieces:
            size += len(piece)
            if size > MAX_STREAM:
                raise HttpError(413, f"an archive over {MAX_STREAM} bytes")
            pending += piece
            if len(pending) >= MiB:
                await anyio.to_thread.run_sync(spool.write, bytes(pending))
                pending.clear()
    await anyio.to_thread.run_sync(spool.write, bytes(pending))
    spool.seek(0)


def _path_arg(request: Request) -> str:
    """The path query parameter, absolute (dockerd takes a relative one from "/")."""
    path = request.arg("path") or ""
    if not path:
        raise HttpError(400, "Path cannot be empty")
    if "\0" in path:
        raise HttpError(400, "Path cannot contain a NUL byte")
    return path if path.startswith("/") else "/" + path


def _stat_header(doc: dict) -> str:
    return base64.b64encode(json.dumps(doc).encode()).decode()
