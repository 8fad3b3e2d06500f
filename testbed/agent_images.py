"""The 50 distinct images of bench/agent_scale.py and the fleet (testbed/fleet.py),
built once and cached as
testbed/tree_images.py builds its 16: the test image `python` plus one small task
layer each (TASK_FILE, a line unique to the image, and a few kilobytes of seeded bytes
beside it), appended with `umoci raw add-layer`, so all of them take seconds and share
the 218 MB base. A sandbox's task prints TASK_FILE; the bench checks it against
`expected`. (Here, not in bench/, since the fleet's test converts some of them too.)
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from testbed.images import _run, cached_build, ensure_images
from testbed.layerbuild import build_layer, directory, file

AGENT_IMAGES_VERSION = "1"  # bump on any change to the recipe: the cache is keyed by it
COUNT = 50
TASK_DIR = "task"
TASK_FILE = f"/{TASK_DIR}/id.txt"


@dataclass(frozen=True)
class AgentImages:
    layout: Path  # tags python, agent-00 .. agent-49
    expected: dict[str, str]  # tag -> the content of TASK_FILE in it

    @property
    def tags(self) -> list[str]:
        return sorted(self.expected)


def tag(i: int) -> str:
    return f"agent-{i:02d}"


def ensure_agent_images(cache: Path) -> AgentImages:
    ensure_images(cache)  # before our lock: its build takes its own
    root = cached_build(
        cache, f"agent-v{AGENT_IMAGES_VERSION}-on-images", _build, ".lock-agent-images"
    )
    info = json.loads((root / "info.json").read_text())
    return AgentImages(root / "layout", info["expected"])


def _build(out: Path) -> None:
    src = ensure_images(out.parent)
    out.mkdir(parents=True)
    layout = out / "layout"
    _run(["skopeo", "copy", "-q", f"oci:{src.layout}:python", f"oci:{layout}:python"])
    expected = {}
    for i in range(COUNT):
        rng = random.Random(5000 + i)
        line = f"image {i:02d} token {rng.getrandbits(64):016x}\n"
        layer = out / "task.tar"
        layer.write_bytes(
            build_layer(
                [
                    directory(TASK_DIR),
                    file(TASK_FILE.lstrip("/"), line.encode()),
                    file(f"{TASK_DIR}/data.bin", rng.randbytes(rng.randint(2000, 8000))),
                ]
            )
        )
        _run(
            ["umoci", "raw", "add-layer", f"--history.created_by=agent task layer {i}"]
            + ["--image", f"{layout}:python", "--tag", tag(i), str(layer)]
        )
        expected[tag(i)] = line
    (out / "task.tar").unlink()
    (out / "info.json").write_text(json.dumps({"expected": expected}, indent=1))
