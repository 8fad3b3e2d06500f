"""Which trees the containerd snapshotter keeps held (lazyfs/snapshotter/snapshotter.py,
`_trees_in_use`), in process over a real converted store: every Remove asks it, so it
must cost one walk per parent snapshot, not one per container."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from chunker.refs import list_images
from chunker.store.backends import open_store
from lazyfs.settings import Settings
from lazyfs.snapshotter.snapshotter import Snapshotter
from lazyfs.snapshotter.state import Kind, LazyLayer


@pytest.fixture
def snapshotter(
    converted: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Snapshotter]:
    monkeypatch.setenv("LAZYFS_RUN_DIR", str(tmp_path / "run"))
    url = f"file://{converted}"
    settings = Settings.from_env()
    sn = Snapshotter(tmp_path / "root", open_store(url), url, tmp_path / "cache", settings)
    yield sn
    sn.close()


def test_the_trees_in_use_take_one_walk_per_parent_not_per_container(
    snapshotter: Snapshotter, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = snapshotter.state
    (image,) = list_images(snapshotter.store)
    trees = snapshotter.remote.layer_trees(image.image)
    assert len(trees) == 2, trees  # the python image: a base layer and a python3 layer
    # The image's two layers, pulled lazily: placeholders, the top one over the base.
    parent = ""
    for layer in range(2):
        lazy = LazyLayer(image.image, layer, layer == 1)
        state.create(Kind.ACTIVE, f"pull-{layer}", parent, {}, lazy)
        state.commit(f"layer-{layer}", f"pull-{layer}", {}, (0, 0))
        parent = f"layer-{layer}"
    for n in range(50):  # its containers
        state.create(Kind.ACTIVE, f"container-{n}", parent, {})
    state.create(Kind.ACTIVE, "a-plain-one", "", {})  # a container of no image

    walks = []
    chain = state.chain
    monkeypatch.setattr(state, "chain", lambda snap: walks.append(snap.key) or chain(snap))
    assert snapshotter._trees_in_use() == {t for t in trees if t is not None}
    assert len(walks) == 2, walks  # the 50 containers' parent, and the one without

    for n in range(50):
        state.remove(f"container-{n}")
    assert snapshotter._trees_in_use() == set()
