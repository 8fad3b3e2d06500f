"""What tests and benchmarks both stand on: test images, real servers (registry,
SeaweedFS, containerd, the snapshotter, the agent), mounts and processes, node checks.

Development support, not part of the installed product (pyproject.toml does not list it):
it is imported from the repository root, as `tests` is. pytest fixtures stay in the
conftest.py files under tests/ and call what is here; nothing here imports pytest, so the
benchmarks (bench/) use the same code without pytest.
"""
