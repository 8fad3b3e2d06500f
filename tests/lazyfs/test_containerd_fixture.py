"""The containerd fixture itself, with containerd's built-in overlayfs snapshotter (no lazyfs).

What the lazyfs snapshotter tests rely on: a CRI pull from a loopback registry over plain
HTTP, `ctr run` printing a container's output, a background container that `exec` reaches,
a `stop()` that leaves no process, shim or mount behind, and a proxy snapshotter socket
that containerd reaches again after the snapshotter restarts.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from testbed.containerd import Containerd, _mounts_below, _shims_of, shim_socket
from testbed.images import TestImages
from testbed.registry import Registry


def test_cri_pull_then_run_and_exec_with_overlayfs(
    containerd_factory: Callable[..., Containerd],
    registry_factory: Callable[..., Registry],
    test_images: TestImages,
) -> None:
    reg = registry_factory("none")
    repo = "containerd-fixture/python"
    reg.push(f"oci:{test_images.layout}:python", f"{repo}:v1")
    image = f"{reg.host}/{repo}:v1"
    ctd = containerd_factory(cri_snapshotter="overlayfs", registries=[reg.host])

    since = reg.log_size()
    t0 = time.monotonic()
    image_ref = ctd.pull(image)
    pull_s = time.monotonic() - t0
    assert image_ref.startswith("sha256:")
    status = ctd.image_status(image)
    assert status is not None and status.id == image_ref
    assert image in status.repo_tags
    # Every layer blob came from the registry, each once, answered 200.
    fetched = reg.requests("GET", "blobs", since=since, repo=repo)
    for layer in test_images.layers["python"]:
        assert fetched.count(f"{repo} {layer.digest} 200") == 1, (layer.digest, fetched)

    t0 = time.monotonic()
    code, out = ctd.run(image, ["python3", "-c", 'print("hello")'], snapshotter="overlayfs")
    run_s = time.monotonic() - t0
    assert (code, out) == (0, "hello\n")
    assert ctd.ctr("containers", "ls", "-q").stdout.split() == []  # --rm removed it

    name = ctd.start_task(
        image, ["sh", "-c", "echo started; exec sleep 600"], snapshotter="overlayfs"
    )
    assert ctd.task_status(name) == "RUNNING"
    done = ctd.exec(name, ["cat", "/etc/os-release"])
    assert done.returncode == 0, done.stderr
    assert "ID=debian" in done.stdout
    assert ctd.exec(name, ["sh", "-c", "exit 3"]).returncode == 3
    assert ctd.task_log(name).read_text() == "started\n"
    # The container's rootfs is an overlay mount below this instance's scratch dir.
    assert any(p.endswith(f"/{name}/rootfs") for p in _mounts_below([ctd.scratch]))
    print(f"containerd up in {ctd.start_seconds:.2f} s, pull {pull_s:.2f} s, run {run_s:.2f} s")


def test_stop_cleans_up_a_running_container_and_its_shim(
    containerd_factory: Callable[..., Containerd],
    registry_factory: Callable[..., Registry],
    test_images: TestImages,
) -> None:
    reg = registry_factory("none")
    repo = "containerd-fixture/base"
    reg.push(f"oci:{test_images.layout}:base", f"{repo}:v1")
    image = f"{reg.host}/{repo}:v1"
    ctd = containerd_factory(registries=[reg.host])
    ctd.pull(image)
    name = ctd.start_task(image, ["sleep", "600"], snapshotter="overlayfs")
    ((shim_pid, namespace, shim_id),) = _shims_of(ctd.address)
    assert (namespace, shim_id) == ("k8s.io", name)
    assert shim_socket(ctd.address, namespace, name).is_socket()
    ps_lines = ctd.ctr("task", "ps", name).stdout.splitlines()[1:]  # under "PID INFO"
    container_pids = [int(line.split()[0]) for line in ps_lines]
    assert container_pids
    scratch = ctd.scratch

    # containerd dies first, as on a crash: the shim and container outlive it.
    ctd.proc.kill()  # type: ignore[union-attr]
    ctd.proc.wait()  # type: ignore[union-attr]
    assert Path(f"/proc/{shim_pid}").exists()
    ctd.stop()

    assert _shims_of(ctd.address) == []
    assert not shim_socket(ctd.address, namespace, name).exists()
    for pid in [shim_pid, *container_pids]:
        assert not _alive(pid), pid
    assert _mounts_below([scratch]) == []
    assert not scratch.exists()
    ctd.stop()  # a second stop (the factory's) is harmless


def _alive(pid: int) -> bool:
    """True for a live process; a zombie (exited, not yet reaped by init) counts as dead."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_ctr_reports_failures_with_containerd_log(
    containerd_factory: Callable[..., Containerd],
) -> None:
    ctd = containerd_factory()
    try:
        ctd.ctr("containers", "info", "no-such-container")
    except AssertionError as exc:
        assert "no-such-container" in str(exc)
        assert "containerd log tail" in str(exc)
    else:
        raise AssertionError("ctr containers info of a missing container succeeded")
    proc = ctd.ctr("containers", "info", "no-such-container", check=False)
    assert isinstance(proc, subprocess.CompletedProcess) and proc.returncode != 0


def test_a_named_proxy_snapshotter_and_cri_settings_reach_containerd(tmp_path: Path) -> None:
    """What bench/cri_sympy.py needs: a peer's proxy snapshotter under its own name, and
    CRI settings (its pods' pause image; the OOM score adjustment this machine allows)."""
    ctd = Containerd(
        tmp_path / "ctd",
        tmp_path / "peer.sock",  # never listened on: containerd dials proxies lazily
        cri_snapshotter="peer",
        proxy_name="peer",
        cri_settings={"sandbox_image": "127.0.0.1:1/pause:1", "restrict_oom_score_adj": True},
    )
    try:
        ctd.start()
        plugins = ctd.ctr("plugins", "ls").stdout.split("\n")
        assert any(p.split()[:2] == ["io.containerd.snapshotter.v1", "peer"] for p in plugins)
        log = ctd.log_path.read_text()
        assert "SandboxImage:127.0.0.1:1/pause:1 " in log
        assert "RestrictOOMScoreAdj:true " in log
        assert "Snapshotter:peer " in log
    finally:
        ctd.stop()
