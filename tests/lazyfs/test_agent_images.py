"""The agent's image lookups (lazyfs/agent/images.py): the creates that ask for a name at
the same moment share one lookup (one manifest fetch), its error included, and a lookup
whose caller left does not leave the others without an answer."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import pytest

from chunker.errors import NotFoundError
from chunker.refs import NAMES_PREFIX, resolve_image
from chunker.store.backends import open_store
from lazyfs.agent import images as images_module
from lazyfs.agent.images import ImageInfo, Images
from lazyfs.settings import Settings
from lazyfs.tree.image_mounts import ImageMounts
from testbed.image_builder import ImageBuilder, publish_one_file_images
from tests.counting_store import CountingStore, gets

CREATES = 8


class CountedImages(Images):
    """The agent's Images, counting the lookups it really makes (each one a store read
    of the name and, unless cached, of the manifest)."""

    def __init__(self, url: str, cache: Path) -> None:
        super().__init__(ImageMounts(url, cache, Settings.from_env()), url, cache, 30.0)
        self.lookups: list[str] = []

    def _load(self, name: str) -> ImageInfo:
        self.lookups.append(name)
        return super()._load(name)


def _at_once(create: Callable[[], Awaitable[None]]) -> None:
    """CREATES calls of `create` at the same moment, as a burst's requests reach the agent."""

    async def burst() -> None:
        async with anyio.create_task_group() as tasks:
            for _ in range(CREATES):
                tasks.start_soon(create)

    anyio.run(burst)


def _store(tmp_path: Path) -> str:
    url = f"file://{tmp_path}/store"
    b = ImageBuilder(open_store(url))
    b.file("hello", b"hello\n")
    b.publish("one")
    return url


def test_creates_of_one_image_at_once_share_one_lookup(tmp_path: Path) -> None:
    images = CountedImages(_store(tmp_path), tmp_path / "cache")
    answers: list[ImageInfo] = []

    async def create() -> None:
        answers.append(await images.get("one"))

    _at_once(create)
    assert images.lookups == ["one"]
    assert len(answers) == CREATES and len({a.image_id for a in answers}) == 1
    assert len(list((tmp_path / "cache" / "manifests").glob("*.db"))) == 1


def test_a_failed_lookup_answers_every_create_that_waited_for_it(tmp_path: Path) -> None:
    images = CountedImages(_store(tmp_path), tmp_path / "cache")
    errors: list[str] = []

    async def create() -> None:
        try:
            await images.get("missing")
        except NotFoundError as exc:
            errors.append(str(exc))

    _at_once(create)
    assert images.lookups == ["missing"]
    assert len(errors) == CREATES and "missing" in errors[0]


def test_a_lookup_whose_create_left_is_made_again_by_a_waiting_one(tmp_path: Path) -> None:
    images = CountedImages(_store(tmp_path), tmp_path / "cache")

    async def main() -> ImageInfo:
        with anyio.fail_after(30):  # the waiting create neither hangs nor inherits the cancel
            return await both()

    async def both() -> ImageInfo:
        async with anyio.create_task_group() as tasks:
            first = anyio.CancelScope()

            async def leaving() -> None:
                with first:
                    await images.get("one")

            tasks.start_soon(leaving)
            await anyio.sleep(0)  # its lookup is running (in a thread)
            assert "one" in images._lookups  # so the next create waits for it
            first.cancel()  # its client left
            return await images.get("one")

    assert anyio.run(main).name == "one"


def test_an_image_given_by_its_id_reads_the_refs_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A create by image id looks the id up as a name first (no ref has it), then as an
    id: the refs are read once, not once more by a second lookup of the name."""
    url = _store(tmp_path)
    image_id = resolve_image(open_store(url), "one")
    log = tmp_path / "gets.log"

    def counting(url: str, **kwargs: object) -> CountingStore:
        return CountingStore(open_store(url, **kwargs), log)

    monkeypatch.setattr("lazyfs.agent.images.open_store", counting)
    monkeypatch.setattr("chunker.store.backends.open_store", counting)
    images = CountedImages(url, tmp_path / "cache")
    info = anyio.run(images.get, image_id)
    assert info.image_id == image_id
    ref_reads = [g["key"] for g in gets(log) if g["key"].startswith(NAMES_PREFIX)]
    assert ref_reads == [NAMES_PREFIX + image_id]


def test_the_least_recently_used_names_go_past_names_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node runs thousands of task images a day; before, every name it was asked for
    stayed (~2.7 kB each, walked by every placement report)."""
    monkeypatch.setattr(images_module, "NAMES_KEPT", 3)
    url = f"file://{tmp_path}/store"
    publish_one_file_images(url, 5)  # img0 ... img4
    images = CountedImages(url, tmp_path / "cache")

    async def ask(*names: str) -> None:
        for name in names:
            await images.get(name)

    anyio.run(ask, "img0", "img1", "img2", "img0", "img3", "img4")
    assert list(images.known()) == ["img0", "img3", "img4"]  # img0 was used again
    assert images.lookups == ["img0", "img1", "img2", "img3", "img4"]
    anyio.run(ask, "img1", "img4")
    assert images.lookups[-1] == "img1"  # looked up again, as a new name
    assert list(images.known()) == ["img3", "img1", "img4"]  # img0 went
