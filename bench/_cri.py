"""A pod through containerd's CRI runtime service, as the kubelet runs one: for benchmarks.

`run_to_exit` makes a pod sandbox (RunPodSandbox), one container in it (CreateContainer,
StartContainer) and polls ContainerStatus until the container has exited; `remove_pod`
stops and removes the sandbox and its container. The pod uses the node's network
namespace (NamespaceMode NODE), so containerd needs no CNI plugin; the container gets a
PID namespace of its own.

The pod's sandbox ("pause") container runs `pause_layout()`'s image: one static binary that
waits for a signal (a few KB, built here with gcc; the upstream pause image cannot be
fetched on this machine). A node pulls it before its timed part, as a kubelet's node has
it already.

The container's stdout and stderr go to CRI's log file (LOG_DIR/NAME.log, each line
"TIME STREAM P|F TEXT"); `log_text` gives the text back.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from _common import cached_dir, run

from testbed.containerd import Containerd
from testbed.cri import api_pb2, api_pb2_grpc
from testbed.mounted_trees import clean_run_dir
from testbed.mounts import detach_mounts_below
from testbed.snapshotter import Snapshotter

PAUSE_TAG = "pause"
PAUSE_C = r"""
#include <signal.h>
#include <unistd.h>
static void bye(int sig) { (void)sig; _exit(0); }
int main(void) {
    signal(SIGTERM, bye);
    signal(SIGINT, bye);
    for (;;) pause();
}
"""
POLL = 0.01  # seconds between ContainerStatus calls: the end of a run is known to +-10 ms


def pause_layout() -> Path:
    """An OCI layout with tag `pause`: /pause, a static binary, as its entrypoint."""

    def build(out: Path) -> None:
        layout, bundle = out / "layout", out / "bundle"
        out.mkdir(parents=True)
        (out / "pause.c").write_text(PAUSE_C)
        run(["gcc", "-static", "-Os", "-o", out / "pause", out / "pause.c"])
        image = f"{layout}:{PAUSE_TAG}"
        run(["umoci", "init", "--layout", layout])
        run(["umoci", "new", "--image", image])
        run(["umoci", "unpack", "--image", image, bundle])
        shutil.copy2(out / "pause", bundle / "rootfs" / "pause")
        run(["umoci", "repack", "--no-history", "--image", image, bundle])
        run(["umoci", "config", "--no-history", "--image", image, "--config.entrypoint", "/pause"])
        run(["umoci", "gc", "--layout", layout])
        shutil.rmtree(bundle)

    return cached_dir("pause-v1", build) / "layout"


@contextlib.contextmanager
def _runtime(cri_socket: Path) -> Iterator[api_pb2_grpc.RuntimeServiceStub]:
    with grpc.insecure_channel(f"unix://{cri_socket}") as channel:
        yield api_pb2_grpc.RuntimeServiceStub(channel)


def sandbox_config(name: str, log_dir: Path) -> api_pb2.PodSandboxConfig:
    node = api_pb2.NamespaceMode.NODE
    ns = api_pb2.NamespaceOption(network=node, pid=api_pb2.NamespaceMode.CONTAINER)
    linux = api_pb2.LinuxPodSandboxConfig(
        security_context=api_pb2.LinuxSandboxSecurityContext(namespace_options=ns)
    )
    meta = api_pb2.PodSandboxMetadata(name=name, uid=secrets.token_hex(8), namespace="bench")
    return api_pb2.PodSandboxConfig(metadata=meta, log_directory=str(log_dir), linux=linux)


@dataclass
class PodRun:
    pod_id: str
    container_id: str
    log_path: Path
    sandbox: float  # seconds in RunPodSandbox
    create: float  # CreateContainer
    start: float  # StartContainer
    exit: float  # from StartContainer's return to the exit seen
    exit_code: int


def run_to_exit(
    cri_socket: Path,
    image: str,
    command: Sequence[str],
    working_dir: str,
    log_dir: Path,
    timeout: float = 600.0,
) -> PodRun:
    """A new pod running `command` in one container of `image`, to its exit.

    The pod is left in place (its id in the result, or in the error): `remove_pod` it."""
    name = f"bench-{secrets.token_hex(4)}"
    config = sandbox_config(name, log_dir)
    with _runtime(cri_socket) as rt:
        t0 = time.perf_counter()
        pod_id = rt.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=config), timeout=timeout)
        pod_id = pod_id.pod_sandbox_id
        t1 = time.perf_counter()
        container = api_pb2.ContainerConfig(
            metadata=api_pb2.ContainerMetadata(name="main"),
            image=api_pb2.ImageSpec(image=image),
            command=list(command),
            working_dir=working_dir,
            log_path=f"{name}.log",
        )
        try:
            req = api_pb2.CreateContainerRequest(
                pod_sandbox_id=pod_id, config=container, sandbox_config=config
            )
            cid = rt.CreateContainer(req, timeout=timeout).container_id
            t2 = time.perf_counter()
            rt.StartContainer(api_pb2.StartContainerRequest(container_id=cid), timeout=timeout)
            t3 = time.perf_counter()
            status = _wait_exited(rt, cid, t3 + timeout)
            t4 = time.perf_counter()
        except Exception as exc:  # the caller removes the pod: it needs its id
            raise PodError(pod_id, exc) from exc
    return PodRun(
        pod_id, cid, log_dir / f"{name}.log", t1 - t0, t2 - t1, t3 - t2, t4 - t3, status.exit_code
    )


class PodError(RuntimeError):
    """A pod whose container did not run to its exit; `pod_id` is left for remove_pod."""

    def __init__(self, pod_id: str, cause: BaseException) -> None:
        super().__init__(f"pod {pod_id}: {cause}")
        self.pod_id = pod_id


def _wait_exited(
    rt: api_pb2_grpc.RuntimeServiceStub, cid: str, deadline: float
) -> api_pb2.ContainerStatus:
    req = api_pb2.ContainerStatusRequest(container_id=cid)
    while True:
        status = rt.ContainerStatus(req, timeout=30).status
        if status.state == api_pb2.ContainerState.CONTAINER_EXITED:
            return status
        if time.perf_counter() > deadline:
            raise TimeoutError(f"container {cid} still {status.state} at the deadline")
        time.sleep(POLL)


def remove_pod(cri_socket: Path, pod_id: str, timeout: float = 60) -> None:
    """StopPodSandbox then RemovePodSandbox (its containers go with it)."""
    with _runtime(cri_socket) as rt:
        rt.StopPodSandbox(api_pb2.StopPodSandboxRequest(pod_sandbox_id=pod_id), timeout=timeout)
        req = api_pb2.RemovePodSandboxRequest(pod_sandbox_id=pod_id)
        rt.RemovePodSandbox(req, timeout=timeout)


def log_text(path: Path) -> str:
    """The container's output from a CRI log file ("TIME STREAM P|F TEXT" lines)."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        parts = line.split(" ", 3)
        if len(parts) == 4:
            out.append(parts[3] + ("\n" if parts[2] == "F" else ""))
    return "".join(out)


def stop_node(ctd: Containerd | None, sn: Snapshotter | None) -> None:
    """Stop a bench node's containerd and lazyfs snapshotter (either may be None), then
    take down what the snapshotter's trees left: their mounts, reapers and daemons."""
    if ctd is not None:
        ctd.stop()
    if sn is not None:
        sn.stop()
        left = detach_mounts_below(sn.base)
        if left:
            print(f"  detached leftover mounts: {left}", file=sys.stderr)
        clean_run_dir(sn.run_dir)
