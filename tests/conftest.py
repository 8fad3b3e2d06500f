"""Shared pytest set-up: fixtures live in tests/fixtures/, one module per real component."""

pytest_plugins = [
    "tests.fixtures.seaweed",
    "tests.fixtures.images",
    "tests.fixtures.tree_images",
    "tests.fixtures.registry",
    "tests.fixtures.snapshotter",
    "tests.fixtures.containerd",
]
