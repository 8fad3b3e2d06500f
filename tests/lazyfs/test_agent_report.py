"""The agent's placement report (GET /placement) lists the images a node uses now or
was asked for lately, not every name it ever looked up: a node that ran thousands of
images would otherwise send every gateway all of them every second."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

from lazyfs.agent.images import ImageInfo, Images
from lazyfs.agent.report import NAMES_FOR, placement_report
from lazyfs.settings import Settings
from lazyfs.tree.image_mounts import ImageMounts


def test_the_report_names_the_images_in_use_or_asked_for_lately(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store"
    images = Images(ImageMounts(url, tmp_path / "cache", Settings.from_env()), url, tmp_path, 30)
    now = time.monotonic()
    ids = {name: name[0] * 64 for name in ("recent", "old", "mounted", "sandboxed")}
    for name, image_id in ids.items():
        asked = now - 5 if name == "recent" else now - NAMES_FOR - 60
        images._known[name] = (asked, ImageInfo(name, image_id, {}))
    for n in range(2000):  # what the node ran long ago
        images._known[f"task-{n}"] = (now - 3600, ImageInfo(f"task-{n}", f"{n:064x}", {}))
    box = SimpleNamespace(state="running", record=SimpleNamespace(image_id=ids["sandboxed"]))
    agent = SimpleNamespace(
        images=images,
        trees=SimpleNamespace(paths=lambda: {ids["mounted"]: tmp_path / "tree"}),
        pools={},
        boxes={"sb-1": box},
        creating=0,
        config=SimpleNamespace(max_sandboxes=10, cache_dir=tmp_path / "cache"),
    )
    listed = placement_report(agent)["images"]
    assert {image_id: entry["names"] for image_id, entry in listed.items()} == {
        ids["recent"]: ["recent"],
        ids["mounted"]: ["mounted"],
        ids["sandboxed"]: ["sandboxed"],
    }
    assert listed[ids["mounted"]]["mounted"] and listed[ids["sandboxed"]]["sandboxes"] == 1
