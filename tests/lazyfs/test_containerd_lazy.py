"""Real containerd 1.6 with lazyfs as its snapshotter: CRI pulls from a real registry, and
containers started with `ctr run --snapshotter lazyfs`.

The registry holds the test images pushed with skopeo; `python` is converted into a file://
store from the registry (so the store knows its manifest digest), `base` and `pip` are not.
The registry's own access log shows which blobs containerd downloaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lazyfs.snapshotter.remote import LABEL_LAZY_IMAGE, chain_ids
from lazyfs.tree.node_files import mount_stats as node_mount_stats
from testbed.containerd import Containerd
from testbed.images import TestImages
from testbed.registry import Registry
from testbed.snapshotter import Snapshotter

LAZYFS = str(Path(sys.executable).parent / "lazyfs")
HELLO = ["python3", "-c", "print('hello from python3')"]
RECONNECT_TIMEOUT = 20.0


@pytest.fixture
def registry(registry_factory, test_images: TestImages) -> Registry:  # noqa: ANN001
    reg = registry_factory("none")
    for tag in ("base", "python", "pip"):
        reg.push(f"oci:{test_images.layout}:{tag}", f"lazyfs-ctd/{tag}:v1")
    return reg


@pytest.fixture
def store(registry: Registry, tmp_path: Path) -> Path:
    """The python image converted from the registry, nothing else."""
    store = tmp_path / "store"
    subprocess.run(
        [LAZYFS, "convert", registry.ref("lazyfs-ctd/python:v1"), "--tls-verify=false",
         "--store", f"file://{store}"],
        check=True, capture_output=True,
    )  # fmt: skip
    return store


@pytest.fixture
def node(snapshotter_factory, containerd_factory, registry: Registry, store: Path):  # noqa: ANN001, ANN201
    sn = snapshotter_factory(f"file://{store}")
    ctd = containerd_factory(sn.socket, cri_snapshotter="lazyfs", registries=[registry.host])
    return sn, ctd


def image(registry: Registry, tag: str) -> str:
    return f"{registry.host}/lazyfs-ctd/{tag}:v1"


def layer_blobs_fetched(registry: Registry, since: int, images: TestImages, tag: str) -> set:
    """Layer digests of `tag` that the registry served since the log offset."""
    layers = {layer.digest for layer in images.layers[tag]}
    fetched = {line.split()[1] for line in registry.requests("GET", "blobs", since)}
    return layers & fetched


def mount_stats(sn: Snapshotter) -> list[dict]:
    return [json.loads(p.read_text()) for p in (sn.cache / "mounts").glob("*.json")]


def released_mount_stats(sn: Snapshotter, timeout: float = 10.0) -> dict:
    """The lazy trees' final figures, once all were released (their last container
    gone). EROFS trees' figures come from the node data daemon, which writes them up to a
    second after a tree's first read, and at its exit; node_files.mount_stats gives each
    tree's file that daemon's newest node-wide figures."""
    deadline = time.monotonic() + timeout
    while True:
        found = node_mount_stats(sn.cache)
        if found and all(not s["mounted"] for s in found):
            return found[0]
        if time.monotonic() > deadline:
            raise AssertionError(f"lazy trees still mounted: {found}")
        time.sleep(0.05)


def test_converted_image_pulls_nothing_and_runs_lazily(
    node: tuple[Snapshotter, Containerd],
    registry: Registry,
    test_images: TestImages,
) -> None:
    sn, ctd = node
    since = registry.log_size()
    ctd.pull(image(registry, "python"))
    assert layer_blobs_fetched(registry, since, test_images, "python") == set()
    assert registry.requests("GET", "manifests", since)  # it did talk to the registry
    top = chain_ids([layer.diff_id for layer in test_images.layers["python"]])[-1]
    # How an operator tells a lazy pull (docs/containerd.md): the label, and no disk used.
    info = json.loads(ctd.ctr("snapshots", "--snapshotter", "lazyfs", "info", top).stdout)
    assert info["Labels"][LABEL_LAZY_IMAGE], info
    usage = ctd.ctr("snapshots", "--snapshotter", "lazyfs", "usage", top).stdout
    (row,) = [line.split() for line in usage.splitlines() if line.startswith(top)]
    assert row[1:3] == ["0.0", "B"], usage

    code, out = ctd.run(image(registry, "python"), HELLO, snapshotter="lazyfs")
    assert (code, out) == (0, "hello from python3\n"), ctd.log_tail()
    stats = released_mount_stats(sn)
    image_bytes = sum(layer.uncompressed_size for layer in test_images.layers["python"])
    assert 0 < stats["bytes_fetched"] < 0.15 * image_bytes, stats
    assert "is lazy" in sn.log()

    # An image never converted that shares the converted one's layers (pip = python + one
    # layer): only its own layer is downloaded, applied over the lazy mount.
    since = registry.log_size()
    ctd.pull(image(registry, "pip"))
    fetched = layer_blobs_fetched(registry, since, test_images, "pip")
    assert fetched == {test_images.layers["pip"][-1].digest}
    probe = f"import {test_images.pip_package} as m; print(m.__name__)"
    code, out = ctd.run(image(registry, "pip"), ["python3", "-c", probe], snapshotter="lazyfs")
    assert (code, out) == (0, f"{test_images.pip_package}\n"), ctd.log_tail()

    # And one whose only layer is an inner layer of the converted image: containerd sees it
    # unpacked already; its container stands on that layer's tree.
    since = registry.log_size()
    ctd.pull(image(registry, "base"))
    assert layer_blobs_fetched(registry, since, test_images, "base") == set()
    code, out = ctd.run(image(registry, "base"), ["cat", "/etc/debian_version"], "lazyfs")
    assert code == 0 and out.strip().startswith("12"), (out, ctd.log_tail())
    no_python = ctd.run(image(registry, "base"), ["sh", "-c", "test ! -e /usr/bin/python3"],
                        "lazyfs")  # fmt: skip
    assert no_python[0] == 0  # the base layer alone, not the lazy image's whole tree


def test_unconverted_image_pulls_and_runs(
    node: tuple[Snapshotter, Containerd],
    registry: Registry,
    test_images: TestImages,
) -> None:
    sn, ctd = node
    since = registry.log_size()
    ctd.pull(image(registry, "pip"))
    fetched = layer_blobs_fetched(registry, since, test_images, "pip")
    assert fetched == {layer.digest for layer in test_images.layers["pip"]}
    code, out = ctd.run(image(registry, "pip"), HELLO, snapshotter="lazyfs")
    assert (code, out) == (0, "hello from python3\n"), ctd.log_tail()
    assert mount_stats(sn) == []  # no lazy mount was involved


def pull_retrying(ctd: Containerd, ref: str) -> None:
    """containerd redials a restarted snapshotter within seconds; retry until then."""
    deadline = time.monotonic() + RECONNECT_TIMEOUT
    while True:
        try:
            ctd.pull(ref)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_snapshotter_restart_keeps_containers_and_pulls_working(
    node: tuple[Snapshotter, Containerd],
    registry: Registry,
    test_images: TestImages,
) -> None:
    sn, ctd = node
    ctd.pull(image(registry, "python"))
    name = ctd.start_task(image(registry, "python"), ["sleep", "600"], snapshotter="lazyfs")
    first = ctd.exec(name, ["python3", "-c", "print('before')"])
    assert first.stdout == "before\n", first.stderr

    sn.kill()
    during = ctd.exec(name, ["python3", "-c", "import json; print('during')"])
    assert during.stdout == "during\n", during.stderr
    sn.start()

    after = ctd.exec(name, ["sh", "-c", "echo written > /tmp/x && cat /tmp/x /etc/hostname"])
    assert after.stdout.startswith("written\n"), after.stderr
    pull_retrying(ctd, image(registry, "pip"))
    code, out = ctd.run(image(registry, "pip"), HELLO, snapshotter="lazyfs")
    assert (code, out) == (0, "hello from python3\n"), ctd.log_tail()
    ctd.kill(name)
