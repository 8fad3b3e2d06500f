"""The shape of the code: no import circle, and no import from a lower package into a
higher one. Read from the source with `ast` (every import, at any depth of a function,
and those only for type checkers too), so it is quick and imports nothing.

The floors, from the ground up: chunker (the store, chunks, manifests) carries
registry_bridge (reading images, the convert pipeline) and node_cache (the node's chunk
cache), which know nothing of each other; lazyfs (the node: trees, sandboxes, agent,
snapshotter) stands on all three. Those four are the product, and know nothing of what
stands on them: testbed (test images, real servers, mounts and processes, node checks),
and on it the test suite (tests) and the benchmarks (bench), which know nothing of each
other: a benchmark takes what it shares with the tests from testbed, never from a test
module or a conftest.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLOOR = {"chunker": 1, "registry_bridge": 2, "node_cache": 2, "lazyfs": 3}
FLOOR |= {"testbed": 4, "tests": 5, "bench": 5}


def modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the packages (bench/'s scripts as
    bench.NAME)."""
    found = {}
    for package in FLOOR:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def imported(path: Path, name: str, known: dict[str, Path]) -> Iterator[str]:
    """The project's modules that module `name` (at `path`) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    # A bench script runs with bench/ on the path: `import _common` is bench/_common.py.
    scripts = "bench." if name.startswith("bench.") else ""

    def absolute(module: str) -> str:
        return f"{scripts}{module}" if f"{scripts}{module.split('.')[0]}" in known else module

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [absolute(alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = absolute(node.module or "")
            if node.level:  # relative: from the package `level - 1` steps up
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, node.module] if node.module else anchor)
            # `from a.b import c` imports the submodule a.b.c if there is one, else a.b
            targets = [f"{base}.{alias.name}" for alias in node.names]
            targets = [t if t in known else base for t in targets]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` of a name inside a.b
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target


@functools.cache  # read once for all the checks here (do not change what it returns)
def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: set(imported(path, name, known)) for name, path in known.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import graph's strongly connected components of more than one module
    (Tarjan's algorithm, iterative: no recursion limit on a deep chain)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_import_circle() -> None:
    found = circles(import_graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def against_floors(graph: dict[str, set[str]]) -> list[str]:
    """Imports of another package on the same floor or a higher one."""
    wrong = []
    for name, targets in sorted(graph.items()):
        package = name.split(".")[0]
        for target in sorted(targets):
            top = target.split(".")[0]
            if top != package and FLOOR[top] >= FLOOR[package]:
                wrong.append(f"{name} imports {target}")
    return wrong


def test_no_import_from_a_lower_package_into_a_higher_one() -> None:
    wrong = against_floors(import_graph())
    assert not wrong, "imports against the floors: " + "; ".join(wrong)


def test_the_structure_checks_can_fail() -> None:
    """The two checks above on a graph that breaks each rule: they must see it."""
    graph = {"chunker.a": {"chunker.b"}, "chunker.b": {"chunker.c"}, "chunker.c": {"chunker.a"}}
    graph |= {"chunker.d": {"chunker.d"}, "node_cache.x": set()}
    assert circles(graph) == [["chunker.a", "chunker.b", "chunker.c"]]
    graph = {"chunker.a": {"node_cache.x"}, "node_cache.x": {"registry_bridge.y", "chunker.a"}}
    assert against_floors(graph | {"registry_bridge.y": {"lazyfs.z"}, "lazyfs.z": set()}) == [
        "chunker.a imports node_cache.x",
        "node_cache.x imports registry_bridge.y",
        "registry_bridge.y imports lazyfs.z",
    ]
    graph = import_graph()
    # the reader sees real imports
    assert "chunker.store.interface" in graph["chunker.store.backends"]
    assert "registry_bridge.registry" in graph["registry_bridge.transports"]  # in a function


def bench_imports_of_tests(graph: dict[str, set[str]]) -> list[str]:
    """Imports of the test suite (tests/) by a benchmark (bench/)."""
    return [
        f"{name} imports {target}"
        for name, targets in sorted(graph.items())
        if name.split(".")[0] == "bench"
        for target in sorted(targets)
        if target.split(".")[0] == "tests"
    ]


def test_no_benchmark_imports_a_test_module() -> None:
    """What a benchmark shares with the tests is in testbed/: bench/ imports no module of
    tests/ (no test module, no conftest, nothing there)."""
    wrong = bench_imports_of_tests(import_graph())
    assert not wrong, "bench imports the tests: " + "; ".join(wrong)


def imports_of_test_modules(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a test module (tests/**/test_*.py) by any module: what two test files
    share belongs in testbed/ or a conftest, so that each test file stands alone."""
    return [
        f"{name} imports {target}"
        for name, targets in sorted(graph.items())
        for target in sorted(targets)
        if target.split(".")[0] == "tests" and target.split(".")[-1].startswith("test_")
    ]


def test_no_module_imports_a_test_module() -> None:
    wrong = imports_of_test_modules(import_graph())
    assert not wrong, "test modules imported: " + "; ".join(wrong)


def test_the_bench_and_testbed_checks_can_fail() -> None:
    """The checks above see a benchmark's import of tests, the product's of testbed or
    tests, and bench's real imports (a script's bare import of a sibling, too)."""
    graph = {"bench.x": {"tests.lazyfs.conftest", "testbed.mounts"}, "bench.y": {"tests"}}
    assert bench_imports_of_tests(graph) == [
        "bench.x imports tests.lazyfs.conftest",
        "bench.y imports tests",
    ]
    graph = {"lazyfs.a": {"testbed.b"}, "chunker.c": {"tests.d"}, "testbed.b": {"bench.e"}}
    assert against_floors(graph) == [
        "chunker.c imports tests.d",
        "lazyfs.a imports testbed.b",
        "testbed.b imports bench.e",
    ]
    assert against_floors({"bench.e": {"tests.d"}, "tests.d": {"bench.e"}}) == [
        "bench.e imports tests.d",
        "tests.d imports bench.e",
    ]
    graph = {"tests.lazyfs.test_a": {"tests.lazyfs.test_b", "tests.lazyfs.conftest"}}
    assert imports_of_test_modules(graph) == ["tests.lazyfs.test_a imports tests.lazyfs.test_b"]
    graph = import_graph()
    assert "testbed.images" in graph["bench._common"]  # the reader sees bench's imports
    assert "bench._common" in graph["bench.dedup"]  # `from _common import ...`
    assert "lazyfs.mount_table" in graph["testbed.mounts"]
    assert "testbed.mounted_trees" in graph["tests.conftest"]
