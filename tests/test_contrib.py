"""The deployment files in contrib/ run commands lazyfs takes: each `lazyfs` command in
the Kubernetes manifests and the systemd units parses with today's options (a renamed
flag would otherwise break a deployment silently)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from lazyfs.cli import build_parser

CONTRIB = Path(__file__).resolve().parent.parent / "contrib"


def kubernetes_commands() -> list[tuple[str, list[str]]]:
    found = []
    for path in sorted((CONTRIB / "kubernetes").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            pod = (doc.get("spec") or {}).get("template", {}).get("spec", {})
            for container in pod.get("containers", []):
                command = container.get("command") or []
                if command and command[0].endswith("/lazyfs"):
                    found.append((f"{path.name}:{container['name']}", command[1:]))
    return found


def systemd_commands() -> list[tuple[str, list[str]]]:
    found = []
    for path in sorted((CONTRIB / "systemd").glob("*.service")):
        for line in path.read_text().replace("\\\n", " ").splitlines():
            if line.startswith("ExecStart="):
                argv = shlex.split(line.removeprefix("ExecStart="))
                if argv[0].endswith("/lazyfs"):
                    found.append((path.name, argv[1:]))
    return found


def test_every_deployment_runs_a_lazyfs_command() -> None:
    names = {name.split(":")[0] for name, _ in kubernetes_commands() + systemd_commands()}
    assert {"lazyfs-agent.yaml", "lazyfs-gateway.yaml", "lazyfs-agent.service"} <= names


@pytest.mark.parametrize("name,argv", kubernetes_commands() + systemd_commands())
def test_the_command_parses(name: str, argv: list[str]) -> None:
    # What the deployment fills in: the pod's IP; systemd's $VARS (empty by default)
    argv = [a.replace("$(POD_IP)", "10.0.0.1") for a in argv]
    argv = [a for a in argv if not a.startswith("$")]
    args = build_parser().parse_args(argv)
    assert args.func is not None, name
