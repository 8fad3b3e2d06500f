"""A SWE-bench style task image for the Docker API's harness tests: the python test image
plus git and procps (as SWE-bench's images have them), and a small project at /testbed, a
git repository whose test fails until a patch fixes its bug.

Built once into the test images' cache (`swe-task-v1`) as an OCI layout with tag
`swe-task`: the python image's layout copied, unpacked with umoci, apt-get in a chroot,
the repository committed with the image's own git, repacked as one more layer.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from testbed.images import (
    TestImages,
    _chroot,
    _chroot_mounts,
    _repack,
    _run,
    cached_build,
)

TAG = "swe-task"
REPO = "/testbed"
BUGGY = "def add(a, b):\n    return a - b\n"
TEST = (
    "import unittest\n\nfrom calc import add\n\n\n"
    "class TestAdd(unittest.TestCase):\n"
    "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n"
)
# The fix, as SWE-bench gives a model's patch: a unified diff of the repository.
PATCH = """diff --git a/calc.py b/calc.py
--- a/calc.py
+++ b/calc.py
@@ -1,2 +1,2 @@
 def add(a, b):
-    return a - b
+    return a + b
"""


def ensure_swe_image(images: TestImages) -> Path:
    """The OCI layout holding tag `swe-task` (built on first use)."""
    cache = images.layout.parent.parent
    return cached_build(cache, "swe-task-v1", lambda out: _build(out, images), ".swe-lock")


def _build(out: Path, images: TestImages) -> None:
    out.mkdir(parents=True)
    layout = out / "layout"
    bundle = out / "work" / "bundle"
    rootfs = bundle / "rootfs"
    shutil.copytree(images.layout, layout, symlinks=True)
    _run(["umoci", "unpack", "--image", f"{layout}:python", str(bundle)])
    _run(["umoci", "tag", "--image", f"{layout}:python", TAG])
    with _chroot_mounts(rootfs):
        _chroot(rootfs, ["apt-get", "update", "-q"])
        install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "git", "procps"]
        _chroot(rootfs, install)
        _chroot(rootfs, ["apt-get", "clean"])
        repo = rootfs / REPO.lstrip("/")
        repo.mkdir()
        (repo / "calc.py").write_text(BUGGY)
        (repo / "test_calc.py").write_text(TEST)
        git = ["git", "-C", REPO, "-c", "user.name=task", "-c", "user.email=task@example.org"]
        _chroot(rootfs, [*git, "init", "-q"])
        _chroot(rootfs, [*git, "add", "."])
        _chroot(rootfs, [*git, "commit", "-q", "-m", "the task's base commit"])
    for entry in (rootfs / "var/lib/apt/lists").iterdir():
        if entry.is_file():
            entry.unlink()
    _repack(layout, TAG, bundle, "apt-get install git procps; /testbed")
    _run(["umoci", "gc", "--layout", str(layout)])
    shutil.rmtree(out / "work")
    (out / "info.json").write_text('{"tag": "swe-task"}\n')
