"""The security suite (issue 20): each test performs an attack from inside a sandbox, or
as a local user of the node, and asserts that it fails. The fixtures are the sandbox
tests' own: a private node for `lazyfs run` (sandbox_node) and a real `lazyfs serve`
(agent), each checked clean after the test; and (autouse) each test's own
LAZYFS_RUN_DIR with a short data daemon idle, whatever data daemon it started gone
afterwards (private_run_dir)."""

from tests.lazyfs.conftest import (  # noqa: F401  (fixtures)
    agent,
    private_run_dir,
    py_store,
    sandbox_node,
    userns_node,
)
