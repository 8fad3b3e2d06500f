"""Shared pytest fixtures: each starts one real component from testbed/ (the support
package the benchmarks use too) and always stops it, even when the test fails."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# testbed's asserts explain a failure the way a test's own do (pytest rewrites them).
pytest.register_assert_rewrite("testbed")

from testbed.containerd import Containerd  # noqa: E402
from testbed.images import (  # noqa: E402
    TestImages,
    default_cache,
    ensure_images,
    reference_unpack,
)
from testbed.mounted_trees import clean_run_dir  # noqa: E402
from testbed.mounts import detach_mounts_below  # noqa: E402
from testbed.registry import Registry  # noqa: E402
from testbed.seaweed import Seaweed  # noqa: E402
from testbed.snapshotter import Snapshotter  # noqa: E402
from testbed.tree_images import TreeImages, ensure_tree_images  # noqa: E402


@pytest.fixture(scope="session")
def test_images() -> TestImages:
    return ensure_images(default_cache())


@pytest.fixture(scope="session")
def references(
    test_images: TestImages, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    """umoci's extraction of a test image's tag (the independent reference a tree is
    compared with), made once per session: ~4 s each for the python image. Compare
    with it, never write into it or run anything in it (a chroot's python would leave
    __pycache__ there); a test that does unpacks its own with reference_unpack."""
    made: dict[str, Path] = {}

    def get(tag: str) -> Path:
        if tag not in made:
            bundle = tmp_path_factory.mktemp(f"ref-{tag}") / "bundle"
            made[tag] = reference_unpack(test_images.layout, tag, bundle)
        return made[tag]

    return get


@pytest.fixture(scope="session")
def tree_images() -> TreeImages:
    return ensure_tree_images(default_cache())


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seaweed]:
    server = Seaweed(tmp_path_factory.mktemp("seaweed"))
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_url(seaweed: Seaweed, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh, empty s3:// store URL; the AWS_* variables point at the test server."""
    if not seaweed.running:  # a previous test left it down: bring it back
        seaweed.start()
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in seaweed.env.items():
        monkeypatch.setenv(name, value)
    return f"s3://{seaweed.bucket}/test-{uuid.uuid4().hex}"


@pytest.fixture(scope="session")
def registry_factory(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., Registry]]:
    """`registry_factory(auth, s3=None)` -> a running Registry, one per kind per session.

    `s3` is a Seaweed fixture: the registry then keeps blobs there and redirects blob GETs.
    """
    made: dict[tuple[str, bool], Registry] = {}

    def get(auth: str, s3: Any = None) -> Registry:
        key = (auth, s3 is not None)
        reg = made.get(key)
        if reg is None:
            reg = Registry(tmp_path_factory.mktemp(f"registry-{auth}"), auth, s3)
            made[key] = reg
            reg.start()
        return reg

    try:
        yield get
    finally:
        for reg in made.values():
            with contextlib.suppress(Exception):
                reg.close()


@pytest.fixture
def snapshotter_factory(tmp_path: Path) -> Iterator[Callable[..., Snapshotter]]:
    """`start(store_url, linger=0.0)` -> a running Snapshotter, stopped after the test."""
    started: list[Snapshotter] = []

    def start(store_url: str, linger: float = 0.0) -> Snapshotter:
        base = tmp_path / f"sn{len(started)}"
        base.mkdir()
        sn = Snapshotter(base, store_url, linger)
        started.append(sn)
        sn.start()
        return sn

    yield start
    left = []
    for sn in started:
        sn.stop()
        left += detach_mounts_below(sn.base)
    for run_dir in {sn.run_dir for sn in started}:
        clean_run_dir(run_dir)
    assert left == [], f"test left mounts: {left}"


@pytest.fixture
def containerd_factory(tmp_path: Path) -> Iterator[Callable[..., Containerd]]:
    """`start(snapshotter_socket=None, cri_snapshotter="overlayfs", registries=[])`.

    Returns a running Containerd; every instance is stopped and cleaned up after the test.
    """
    made: list[Containerd] = []

    def start(
        snapshotter_socket: Path | None = None,
        cri_snapshotter: str = "overlayfs",
        registries: list[str] | None = None,
    ) -> Containerd:
        instance = Containerd(
            tmp_path / f"containerd-{len(made)}", snapshotter_socket, cri_snapshotter, registries
        )
        made.append(instance)
        instance.start()
        return instance

    try:
        yield start
    finally:
        for instance in reversed(made):
            instance.stop()
