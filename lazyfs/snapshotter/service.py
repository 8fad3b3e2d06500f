"""`lazyfs snapshotter`: containerd's Snapshots gRPC service on a unix socket (a proxy
plugin), a thin shell around snapshotter.Snapshotter.

Every call runs under one lock: containerd's requests are short, except a lazy image's
first mount (a fraction of a second) and a hydration (rare), and one lock keeps the
state's multi-step changes simple. Domain errors become gRPC codes here, in one place.
"""

from __future__ import annotations

import logging
import signal
import socket
import stat
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import TypeVar

import grpc
from google.protobuf import empty_pb2, timestamp_pb2

from chunker.errors import BadInputError, LazyfsError, StoreError
from chunker.store.backends import open_store
from lazyfs.fds import raise_open_files_limit
from lazyfs.settings import Settings
from lazyfs.snapshotter import snapshots_pb2 as pb
from lazyfs.snapshotter import snapshots_pb2_grpc as pb_grpc
from lazyfs.snapshotter.snapshotter import Mount, Snapshotter
from lazyfs.snapshotter.state import Snapshot, SnapshotError

log = logging.getLogger("lazyfs.snapshotter")
T = TypeVar("T")


def _grpc_code(exc: Exception) -> grpc.StatusCode:
    """The one place domain errors become gRPC status codes."""
    if isinstance(exc, SnapshotError):
        return grpc.StatusCode[exc.code]
    if isinstance(exc, StoreError):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, BadInputError):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.UNKNOWN


def _mounts(mounts: list[Mount]) -> list[pb.Mount]:
    return [pb.Mount(type=m.type, source=m.source, options=list(m.options)) for m in mounts]


def _timestamp(ns: int) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(ns)
    return ts


def _info(snap: Snapshot) -> pb.Info:
    return pb.Info(
        name=snap.key,
        parent=snap.parent,
        kind=int(snap.kind),
        created_at=_timestamp(snap.created_ns),
        updated_at=_timestamp(snap.updated_ns),
        labels=snap.labels,
    )


class SnapshotsService(pb_grpc.SnapshotsServicer):
    def __init__(self, snapshotter: Snapshotter) -> None:
        self.sn = snapshotter
        self._lock = threading.Lock()

    def _call(self, context: grpc.ServicerContext, what: str, fn: Callable[[], T]) -> T:
        try:
            with self._lock:
                return fn()
        except (SnapshotError, LazyfsError) as exc:
            code = _grpc_code(exc)
            if code != grpc.StatusCode.ALREADY_EXISTS:
                log.info("%s: %s: %s", what, code.name, exc)
            context.abort(code, str(exc))
        except Exception as exc:
            log.exception("%s failed", what)
            context.abort(grpc.StatusCode.UNKNOWN, f"{what}: {exc}")
        raise AssertionError("unreachable: abort raises")

    def Prepare(self, request, context):  # noqa: N802, ANN001, ANN201 - gRPC's naming
        labels = dict(request.labels)
        mounts = self._call(
            context, "prepare", lambda: self.sn.prepare(request.key, request.parent, labels)
        )
        return pb.PrepareSnapshotResponse(mounts=_mounts(mounts))

    def View(self, request, context):  # noqa: N802, ANN001, ANN201
        labels = dict(request.labels)
        mounts = self._call(
            context, "view", lambda: self.sn.view(request.key, request.parent, labels)
        )
        return pb.ViewSnapshotResponse(mounts=_mounts(mounts))

    def Mounts(self, request, context):  # noqa: N802, ANN001, ANN201
        mounts = self._call(context, "mounts", lambda: self.sn.mounts(request.key))
        return pb.MountsResponse(mounts=_mounts(mounts))

    def Commit(self, request, context):  # noqa: N802, ANN001, ANN201
        labels = dict(request.labels)
        self._call(context, "commit", lambda: self.sn.commit(request.name, request.key, labels))
        return empty_pb2.Empty()

    def Remove(self, request, context):  # noqa: N802, ANN001, ANN201
        self._call(context, "remove", lambda: self.sn.remove(request.key))
        return empty_pb2.Empty()

    def Stat(self, request, context):  # noqa: N802, ANN001, ANN201
        snap = self._call(context, "stat", lambda: self.sn.stat(request.key))
        return pb.StatSnapshotResponse(info=_info(snap))

    def Update(self, request, context):  # noqa: N802, ANN001, ANN201
        labels = dict(request.info.labels)
        paths = list(request.update_mask.paths)
        snap = self._call(
            context, "update", lambda: self.sn.update(request.info.name, labels, paths)
        )
        return pb.UpdateSnapshotResponse(info=_info(snap))

    def List(self, request, context) -> Iterator[pb.ListSnapshotsResponse]:  # noqa: N802, ANN001
        snaps = self._call(context, "list", lambda: self.sn.list(list(request.filters)))
        for i in range(0, len(snaps), 100):  # containerd reads batches of any size
            yield pb.ListSnapshotsResponse(info=[_info(s) for s in snaps[i : i + 100]])

    def Usage(self, request, context):  # noqa: N802, ANN001, ANN201
        size, inodes = self._call(context, "usage", lambda: self.sn.usage(request.key))
        return pb.UsageResponse(size=size, inodes=inodes)

    def Cleanup(self, request, context):  # noqa: N802, ANN001, ANN201
        self._call(context, "cleanup", self.sn.cleanup)
        return empty_pb2.Empty()


def _claim_socket(path: Path) -> None:
    """Remove a stale socket file (no server answers on it); refuse anything else."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise BadInputError(f"{path} exists and is not a socket")
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(str(path))
        except OSError:
            path.unlink()
            return
    raise BadInputError(f"another server is listening on {path}")


def serve(
    address: Path,
    root: Path,
    store_url: str,
    cache_dir: Path,
    settings: Settings,
    linger: float = 0.0,
) -> int:
    """Serve until SIGTERM or SIGINT; an image's lazy tree goes `linger` seconds after its
    last container (lazyfs/tree/image_mounts.py unmounts it, if no other user came)."""
    address = address.absolute()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BadInputError(f"cannot use {root} as the snapshotter root: {exc.strerror}") from None
    _claim_socket(address)
    raise_open_files_limit()  # one per tree held, and gRPC's connections
    store = open_store(store_url)
    snapshotter = Snapshotter(root, store, store_url, cache_dir, settings, linger)
    snapshotter.reattach()
    # In the background: the daemon's start must not delay the socket containerd dials.
    threading.Thread(target=snapshotter.keep_data_daemon, name="data-daemon", daemon=True).start()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    service = SnapshotsService(snapshotter)
    pb_grpc.add_SnapshotsServicer_to_server(service, server)
    if server.add_insecure_port(f"unix://{address}") == 0:
        raise BadInputError(f"cannot listen on {address}")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    log.info("serving containerd snapshots on %s (root %s)", address, root)
    while not stop.wait(1.0):  # a timed wait lets the signal handlers run
        pass
    server.stop(grace=5).wait()
    snapshotter.close()
    address.unlink(missing_ok=True)
    return 0
