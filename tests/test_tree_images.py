"""The tree benchmark's images (testbed/tree_images.py) are what they claim to be."""

from __future__ import annotations

import subprocess
from pathlib import Path

from testbed.images import IMAGE_PATH_ENV, oci_manifest, reference_unpack
from testbed.tree_images import SYMPY_DIR, TASK_CHECK, TASK_FILES, TreeImages


def _chroot(root: Path, argv: list[str]) -> str:
    env = {"PATH": IMAGE_PATH_ENV, "HOME": "/root", "LC_ALL": "C"}
    out = subprocess.run(["chroot", str(root), *argv], check=True, capture_output=True, env=env)
    return out.stdout.decode()


def test_each_image_is_python_plus_one_layer(tree_images: TreeImages) -> None:
    python = oci_manifest(tree_images.layout, "python")["layers"]
    tops = set()
    for tag in ["sympy", *tree_images.task_tags]:
        layers = oci_manifest(tree_images.layout, tag)["layers"]
        assert layers[:-1] == python and len(layers) == len(python) + 1, tag
        tops.add(layers[-1]["digest"])
    assert len(tops) == 1 + len(tree_images.task_tags) == 17  # every task layer differs


def test_sympy_and_pytest_import_in_a_chroot(tree_images: TreeImages, tmp_path: Path) -> None:
    root = reference_unpack(tree_images.layout, "sympy", tmp_path / "bundle")
    assert (root / SYMPY_DIR / "core/tests/test_basic.py").is_file()
    out = _chroot(root, ["python3", "-c", "import sympy, pytest; print(sympy.__version__)"])
    assert out.startswith("1.")


def test_task_checks_print_what_the_builder_expects(
    tree_images: TreeImages, tmp_path: Path
) -> None:
    assert len(tree_images.task_files) == TASK_FILES
    assert len(set(tree_images.expected.values())) == len(tree_images.expected) == 16
    for tag in tree_images.task_tags[:2]:
        root = reference_unpack(tree_images.layout, tag, tmp_path / tag)
        assert all((root / f).is_file() for f in tree_images.task_files)
        assert _chroot(root, TASK_CHECK) == tree_images.expected[tag] + "\n"
