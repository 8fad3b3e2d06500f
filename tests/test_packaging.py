"""Any install of the project has the C helpers (issue 22): a wheel built by the packaging
carries the static helpers (lazyfs-exec-server, lazyfs-run-wait, lazyfs-attach-root) as
scripts, installed beside the `lazyfs` command, where the settings look for them."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from lazyfs.sandbox.run_wait import helpers_dir

ROOT = Path(__file__).resolve().parent.parent
HELPERS = ("lazyfs-exec-server", "lazyfs-run-wait", "lazyfs-attach-root")


def test_a_wheel_from_the_sdist_has_every_static_helper(tmp_path: Path) -> None:
    source = tmp_path / "src"
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    for name in filter(None, files):
        path = Path(name.decode())
        if (ROOT / path).is_file():
            (source / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / path, source / path)
    # The sdist first, and the wheel from it: what `pip install lazyfs-*.tar.gz` does,
    # so the sdist must carry what the helpers' build needs (MANIFEST.in).
    subprocess.run(
        [sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "sdist")],
        cwd=source, check=True, capture_output=True,
    )  # fmt: skip
    (sdist,) = (tmp_path / "sdist").glob("lazyfs-*.tar.gz")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "-w", str(tmp_path / "dist"), str(sdist)],
        check=True, capture_output=True,
    )  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("lazyfs-*.whl")
    with zipfile.ZipFile(wheel) as whl:
        scripts = {Path(i.filename).name: i for i in whl.infolist() if "/scripts/" in i.filename}
        assert set(HELPERS) <= set(scripts)
        for name in HELPERS:
            data = whl.read(scripts[name])
            assert data[:4] == b"\x7fELF"  # compiled, not a Python script
            assert not has_interpreter(data)  # static: runs in any image


def has_interpreter(elf: bytes) -> bool:
    """Whether a 64-bit ELF executable names a dynamic loader (a PT_INTERP header)."""
    phoff = int.from_bytes(elf[32:40], "little")
    size, count = int.from_bytes(elf[54:56], "little"), int.from_bytes(elf[56:58], "little")
    headers = (elf[phoff + i * size : phoff + i * size + 4] for i in range(count))
    return any(int.from_bytes(h, "little") == 3 for h in headers)  # PT_INTERP


def test_the_static_check_can_fail() -> None:
    assert has_interpreter(Path(sys.executable).resolve().read_bytes())


def test_the_settings_look_where_the_install_puts_them() -> None:
    """This venv was installed by scripts/setup.sh through the same packaging."""
    for name in HELPERS:
        path = Path(helpers_dir()) / name
        assert path.is_file() and path.stat().st_mode & 0o111, path


def test_every_package_directory_is_packaged() -> None:
    """A new subpackage left out of pyproject.toml's list would be missing from installs
    (the venv's editable install would not show it)."""
    import tomllib

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(d.relative_to(ROOT).parts)
        for top in ("lazyfs", "chunker", "registry_bridge", "node_cache")
        for d in [ROOT / top, *(ROOT / top).rglob("*")]
        if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py"))
    }
    assert found == listed
