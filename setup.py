"""The packaging's one build step beyond pyproject.toml: the C helpers
(scripts/build_helpers.py), built with the scripts and installed beside the `lazyfs`
command, so that every install of the project has them where the settings look
(LAZYFS_EXEC_SERVER, LAZYFS_RUN_WAIT)."""

import importlib.util
import tempfile
from distutils.command.build_scripts import build_scripts  # setuptools provides distutils
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("build_helpers", ROOT / "scripts/build_helpers.py")
build_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_helpers)


class BuildScriptsWithHelpers(build_scripts):
    """The scripts are the helpers: compiled, then copied as they are (build_scripts would
    read them as Python to rewrite a #! line)."""

    def run(self) -> None:
        self.mkpath(self.build_dir)
        # Compiled apart: an editable wheel ships whatever sits beside build_dir.
        with tempfile.TemporaryDirectory() as tmp:
            for path in build_helpers.build(Path(tmp), ROOT):
                self.copy_file(str(path), str(Path(self.build_dir) / path.name))


setup(
    scripts=[f"build/helpers/{name}" for name in build_helpers.HELPERS],
    cmdclass={"build_scripts": BuildScriptsWithHelpers},
)
