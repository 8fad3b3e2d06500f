"""Settings are read once, at entry points, from one module (issue 22).

Read from the source with `ast`, like tests/test_structure.py: where the product reads
the environment (os.environ, os.getenv) and where it calls Settings.from_env(). Each
exception is listed with its reason; a new read elsewhere fails here, so that a setting
is never read deep inside, or at import time, again.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("chunker", "registry_bridge", "node_cache", "lazyfs")

# Modules that may read the environment themselves, and why.
ENVIRONMENT_READERS = {
    "lazyfs/settings.py": "the one place lazyfs's own settings are read",
    "lazyfs/sandbox/run_wait.py": "`lazyfs run`'s slot, taken before any import (early_slot)",
    "lazyfs/sandbox/process.py": "TERM, passed through to a sandbox's processes",
    "lazyfs/sandbox/runtime.py": "the OCI runtime's environment: ours, passed through",
    "lazyfs/tree/tree_release.py": "the linger reaper's environment: ours, passed through",
    "lazyfs/tree/daemon_start.py": "a FUSE daemon's environment: ours, passed through",
    "lazyfs/arguments.py": "COLUMNS, the terminal's width for help, as shutil reads it",
    "chunker/store/s3_http.py": "the AWS SDKs' variables, read where the S3 client is made",
    "chunker/store/s3.py": "the AWS SDKs' variables, read where boto3's client is made",
    "registry_bridge/auth.py": "where skopeo and docker keep registry auth files",
}
# Entry points: each reads the settings once and passes them down.
SETTINGS_READERS = {
    "lazyfs/cli.py": "the `lazyfs` commands that run on the node",
    "lazyfs/agent/cli.py": "`lazyfs serve`",
    "lazyfs/tree/data_daemon.py": "the data daemon's process",
    "lazyfs/tree/fuse_mount.py": "the per-image FUSE daemon's process",
}


def sources() -> Iterator[tuple[str, ast.AST]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield str(path.relative_to(ROOT)), ast.parse(path.read_text(), str(path))


ENVIRONMENT = ("environ", "getenv", "environb")


def reads_environment(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in ENVIRONMENT
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
        ):
            return True
        if (
            isinstance(node, ast.ImportFrom)
            and node.module == "os"
            and any(a.name in ENVIRONMENT for a in node.names)
        ):
            return True
    return False


def calls_from_env(tree: ast.AST) -> bool:
    return any(
        isinstance(node, ast.Attribute)
        and node.attr == "from_env"
        and isinstance(node.value, ast.Name)
        and node.value.id == "Settings"
        for node in ast.walk(tree)
    )


def reads_at_import(tree: ast.AST) -> bool:
    """A Settings.from_env() call or an environment read in a module's top-level code
    (outside every function)."""
    outside = [n for n in tree.body if not isinstance(n, ast.FunctionDef | ast.ClassDef)]
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    for cls in classes:  # class bodies run at import too; their methods do not
        outside += [
            n for n in cls.body if not isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        ]
    return any(reads_environment(n) or calls_from_env(n) for n in outside)


def test_only_the_listed_modules_read_the_environment() -> None:
    readers = {name for name, tree in sources() if reads_environment(tree)}
    assert readers - set(ENVIRONMENT_READERS) == set()


def test_settings_are_read_only_at_entry_points() -> None:
    readers = {name for name, tree in sources() if calls_from_env(tree)}
    assert readers - set(SETTINGS_READERS) == set()


def test_nothing_reads_settings_at_import_time() -> None:
    assert [name for name, tree in sources() if reads_at_import(tree)] == []


def test_the_checks_can_fail() -> None:
    """Each check finds what it looks for in a module made to have it."""
    deep = ast.parse("import os\ndef f():\n    return os.environ.get('X')\n")
    assert reads_environment(deep) and not reads_at_import(deep)
    assert reads_environment(ast.parse("from os import getenv\n"))
    at_import = ast.parse("from lazyfs.settings import Settings\nS = Settings.from_env()\n")
    assert calls_from_env(at_import) and reads_at_import(at_import)
    in_class = ast.parse("import os\nclass C:\n    X = os.environ['Y']\n")
    assert reads_at_import(in_class)
    assert not reads_environment(ast.parse("environ = {}\nenviron.get('X')\n"))
