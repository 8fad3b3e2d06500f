"""docker-py's own integration tests for containers and exec, against the Docker Engine
API of `lazyfs serve --docker-socket` (issue 24): which pass, which are out of scope and
why, and which show a lazyfs gap.

One agent on a private node (bench/agent_scale.py's agent_on) over a file:// store. The
upstream tests ask for `alpine:3.10` (the api_* files) and `alpine` (models_*): both
names are the python tag of the test images layout (testbed/images.py), converted under
them. That image is Debian bookworm minbase plus python3, not Alpine: a test that needs
a busybox applet (`top`, for one) fails for that reason, not lazyfs's.

The tests (tests/integration/{api_exec,api_container,models_containers}_test.py with
their base.py, conftest.py and tests/helpers.py) come out of a git directory of
docker-py at the tag of the installed docker-py (--source: a bare clone, or a checkout)
into a scratch directory, unchanged; they are not kept. Only their import of paramiko
(for SSH, which they do not use here) is met by a stand-in module. pytest runs them with
DOCKER_HOST=unix://<the agent's Docker socket> and DOCKER_TEST_API_VERSION = the API
version /version answers, each test under a time limit, and writes JUnit XML; every
outcome is read from it. A failing test is classified by CLASSES below (kept by hand
after reading the failures): out of scope for lazyfs, needing the image's busybox, not
built yet (docs/docker.md's list), or a lazyfs gap; each with the reason. A failure that
CLASSES does not name is reported as unclassified. FIXED names the tests that failed
before the fixes made for them in lazyfs/docker/ (tests/docker/test_docker_fidelity.py).

Afterwards the containers the tests left (some upstream tests remove none) are counted
and removed, the agent is stopped, and the node is checked clean (no mount, cgroup,
process or sandbox directory left).

Results: bench/results/docker_py_suite.md.

Run (as root, from the repository):
  PYTHONPATH=. .venv/bin/python bench/docker_py_suite.py [--source GIT_DIR] [--tag TAG]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import docker
from _common import images
from _report import machine_note, save_markdown, table
from agent_scale import agent_on

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from testbed.node import convert  # noqa: E402

DEFAULT_SOURCE = Path("/work/.mirror/docker+docker-py/repo")
FILES = ("api_exec_test.py", "api_container_test.py", "models_containers_test.py")
SUPPORT = (
    "pytest.ini",
    "tests/__init__.py",
    "tests/helpers.py",
    "tests/integration/__init__.py",
    "tests/integration/base.py",
    "tests/integration/conftest.py",
)
IMAGE_NAMES = ("alpine:3.10", "alpine")  # what the tests ask for: TEST_IMG, and "alpine"
IMAGE_TAG = "python"  # of the test images layout: Debian bookworm minbase + python3
TEST_TIMEOUT = 120  # seconds, each test
PARAMIKO_STANDIN = '''"""Stand-in for paramiko: tests/helpers.py imports it for SSH, unused here."""


class Channel:
    pass
'''

# ---------------------------------------------------------------------------------------
# What each failing test needs, by Class::test (unique across the three files; kept by
# hand after reading the failures). A kind is SCOPE (out of scope for lazyfs: not a
# sandbox's to give, or a dockerd feature it does not mean to have), IMAGE (needs
# Alpine's busybox: the image is Debian minbase), TODO (not built yet: in docs/docker.md's
# list, being done elsewhere) or GAP (a lazyfs gap worth fixing, open).

SCOPE, IMAGE, TODO, GAP = "out of scope", "image", "not built yet", "lazyfs gap"
KINDS = (SCOPE, IMAGE, TODO, GAP)

CLASSES: dict[str, tuple[str, str]] = {
    # api_exec_test.py
    "ExecTest::test_exec_command_as_user": (
        IMAGE,
        "User `postgres`: Alpine's /etc/passwd has it, Debian minbase's has not (a 400:"
        " no such user)",
    ),
    # api_container_test.py
    "CreateContainerTest::test_create_with_host_pid_mode": (
        SCOPE,
        "PidMode host: the host's PID namespace is not a sandbox's to share (warned of)",
    ),
    "CreateContainerTest::test_create_with_uts_mode": (
        SCOPE,
        "UTSMode host: the host's UTS namespace is not a sandbox's to share (warned of)",
    ),
    "CreateContainerTest::test_create_with_cgroupns": (
        SCOPE,
        "CgroupnsMode private: a sandbox has no cgroup namespace of its own (warned of)",
    ),
    "CreateContainerTest::test_create_with_device_cgroup_rules": (
        SCOPE,
        "DeviceCgroupRules: a sandbox gets no host devices (warned of)",
    ),
    "CreateContainerTest::test_create_with_links": (
        SCOPE,
        "legacy links (a linked container's env over a bridge network): no networks",
    ),
    "LinkTest::test_remove_link": (SCOPE, "legacy links: no networks"),
    "CreateContainerTest::test_create_with_mac_address": (
        SCOPE,
        "MacAddress: a sandbox has loopback only",
    ),
    "CreateContainerTest::test_create_with_restart_policy": (
        SCOPE,
        "restart policies: dockerd restarts the container; lazyfs does not (warned of)",
    ),
    "CreateContainerTest::test_create_container_with_volumes_from": (
        SCOPE,
        "VolumesFrom: volumes shared between containers; lazyfs has no volumes (warned of)",
    ),
    **{
        f"VolumeBindTest::{t}": (
            SCOPE,
            "host bind mounts are refused: they would expose the host (its setUp binds one)",
        )
        for t in (
            "test_create_with_binds_rw",
            "test_create_with_binds_ro",
            "test_create_with_binds_rw_rshared",
            "test_create_with_mounts",
            "test_create_with_mounts_ro",
            "test_create_with_volume_mount",
        )
    },
    "PortTest::test_port": (
        TODO,
        "a UDP port among its bindings: only TCP is published (UDP is refused with 400)",
    ),
    "AttachContainerTest::test_run_container_reading_socket_ws": (
        SCOPE,
        "attach over a websocket: docker-py needs websocket-client (not installed here),"
        " and lazyfs has no /containers/{id}/attach/ws",
    ),
    "ContainerUpdateTest::test_restart_policy_update": (
        SCOPE,
        "restart policies: dockerd restarts the container; lazyfs does not (update warns of it)",
    ),
    # models_containers_test.py
    "ContainerCollectionTest::test_run_with_volume": (SCOPE, "host bind mounts are refused"),
    "ContainerCollectionTest::test_run_with_named_volume": (SCOPE, "the volumes API"),
    **{
        f"ContainerCollectionTest::test_run_with_{t}": (SCOPE, "the networks API")
        for t in (
            "network",
            "networking_config",
            "networking_config_with_undeclared_network",
            "networking_config_only_undeclared_network",
        )
    },
    "ContainerTest::test_commit": (SCOPE, "commit (making an image): lazyfs converts images"),
    "ContainerTest::test_top": (SCOPE, "top (and busybox's `top`, not in the image)"),
    "ContainerTest::test_create_with_volume_driver": (SCOPE, "volume drivers (warned of)"),
    **{
        f"ContainerTest::test_ports_target_{t}": (TODO, "published ports: not built yet")
        for t in ("none", "tuple", "list")
    },
}

# Tests that failed before the fixes on this branch (lazyfs/docker/, with regression
# tests in tests/docker/test_docker_fidelity.py), and the fix.
FIXES = {
    "hijack": "a hijacked stream's first bytes wait until the client has read the headers"
    " (docker-py read `attach(logs=True)` of an exited container as b'' one time in two)",
    "restart": "POST /containers/{id}/restart",
    "logs": "logs: `tail`, `since`, `until`, `timestamps`",
    "lines": "logs: a frame a line, as dockerd sends them (a streamed log is read by line)",
    "start": "start answers once the main process runs, as dockerd's does",
    "logconfig": "LogConfig: json-file, local or none, its options kept; another driver"
    " refused with dockerd's words; none: logs answer 501",
    "inspect": "inspect: every HostConfig key dockerd shows, Init, Isolation, Runtime, StopTimeout",
    "env": "Env: a bare NAME (dockerd's unset) is accepted",
    "volumes": "anonymous volumes (Config.Volumes) are directories of the sandbox",
    "prune": "POST /containers/prune",
    "cpu": "CpuShares and CpusetCpus: the sandbox's cpu.shares and cpuset.cpus, at its"
    " create or claim",
    "tmpfs": "Tmpfs and Mounts of type tmpfs: mounts of the sandbox's own (made for the container)",
    "update": "POST /containers/{id}/update: the sandbox's limits while it runs",
    "stats": "GET /containers/{id}/stats: the sandbox's cgroup counters in dockerd's shape",
    "diff": "GET /containers/{id}/changes: the sandbox's overlay upper layer against its image",
    "pause": "POST /containers/{id}/pause and unpause: the sandbox's cgroup freezer",
}
FIXED = {
    "AttachContainerTest::test_attach_no_stream": "hijack",
    "RestartContainerTest::test_restart": "restart",
    "RestartContainerTest::test_restart_with_dict_instead_of_id": "restart",
    "RestartContainerTest::test_restart_with_low_timeout": "restart",
    "ContainerTest::test_restart": "restart",
    "LogsTest::test_logs_tail_option": "logs",
    "LogsTest::test_logs_with_tail_0": "logs",
    "LogsTest::test_logs_with_until": "logs",
    "ContainerCollectionTest::test_run_with_streamed_logs": "lines",
    "ContainerCollectionTest::test_run_with_streamed_logs_and_cancel": "lines",
    "ContainerTest::test_exec_run_success": "start",
    "CreateContainerTest::test_invalid_log_driver_raises_exception": "logconfig",
    "CreateContainerTest::test_valid_log_driver_and_log_opt": "logconfig",
    "CreateContainerTest::test_valid_no_log_driver_specified": "logconfig",
    "ContainerCollectionTest::test_run_with_none_driver": "logconfig",
    "CreateContainerTest::test_create_with_init": "inspect",
    "CreateContainerTest::test_create_with_isolation": "inspect",
    "CreateContainerTest::test_create_with_stop_timeout": "inspect",
    "CreateContainerTest::test_create_with_memory_constraints_with_str": "inspect",
    "CreateContainerTest::test_create_with_memory_constraints_with_int": "inspect",
    "ContainerCPUTest::test_create_with_runtime": "inspect",
    "CreateContainerTest::test_create_with_environment_variable_no_value": "env",
    "ArchiveTest::test_get_file_archive_from_container": "volumes",
    "ArchiveTest::test_get_file_stat_from_container": "volumes",
    "ArchiveTest::test_copy_file_to_container": "volumes",
    "ArchiveTest::test_copy_directory_to_container": "volumes",
    "PruneTest::test_prune_containers": "prune",
    "ContainerCPUTest::test_container_cpu_shares": "cpu",
    "ContainerCPUTest::test_container_cpuset": "cpu",
    "CreateContainerTest::test_create_with_tmpfs": "tmpfs",
    "ContainerUpdateTest::test_update_container": "update",
    "ContainerTest::test_update": "update",
    "GetContainerStatsTest::test_get_container_stats_no_stream": "stats",
    "ContainerTest::test_stats": "stats",
    "DiffTest::test_diff": "diff",
    "DiffTest::test_diff_with_dict_instead_of_id": "diff",
    "ContainerTest::test_diff": "diff",
    "PauseTest::test_pause_unpause": "pause",
    "ContainerTest::test_pause": "pause",
}


# ---------------------------------------------------------------------------------------
# The upstream tests


def extract_tests(source: Path, tag: str, dest: Path) -> None:
    """The test files and their support at `tag` from a git directory (or a checkout)."""
    paths = [*SUPPORT, *(f"tests/integration/{f}" for f in FILES)]
    if (source / "tests" / "integration").is_dir() and not (source / "objects").is_dir():
        for path in paths:
            (dest / path).parent.mkdir(parents=True, exist_ok=True)
            (dest / path).write_bytes((source / path).read_bytes())
        return
    archive = subprocess.run(
        ["git", f"--git-dir={source}", "archive", "--format=tar", tag, *paths],
        capture_output=True,
        check=False,
    )
    if archive.returncode != 0:
        raise SystemExit(
            f"cannot read docker-py {tag} from {source}: {archive.stderr.decode().strip()}\n"
            "(--source: a clone of https://github.com/docker/docker-py with its tags)"
        )
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        # The data filter (no paths outside dest, no devices) where this Python has it:
        # Debian 12's 3.11.2 predates it (3.11.4); a git archive of named paths has
        # neither anyway.
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(dest, **safe)


def run_pytest(tests: Path, socket: Path, api_version: str, junit: Path, select: str | None) -> str:
    """pytest on the three files (only the tests `select` picks: pytest's -k); its
    output (the tail is the summary)."""
    standin = tests / "standin"
    standin.mkdir()
    (standin / "paramiko.py").write_text(PARAMIKO_STANDIN)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DOCKER_")}
    env |= {
        "DOCKER_HOST": f"unix://{socket}",
        "DOCKER_TEST_API_VERSION": api_version,
        "DOCKER_CONFIG": str(tests / "docker-config"),  # no user's config (detach keys...)
        "PYTHONPATH": str(standin),  # not this repository's: its tests/ is another package
    }
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-c",
        str(tests / "pytest.ini"),
        "--rootdir",
        str(tests),
        "-p",
        "no:cacheprovider",
        f"--timeout={TEST_TIMEOUT}",
        f"--junitxml={junit}",
        "-rA",
        *(["-k", select, "--tb=long"] if select else []),
        *(f"tests/integration/{f}" for f in FILES),
    ]
    proc = subprocess.run(argv, cwd=tests, env=env, capture_output=True, text=True)
    return proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------------
# Outcomes


@dataclass
class Outcome:
    file: str
    test: str  # Class::test_name
    result: str  # passed | failed | error | skipped | xfailed
    message: str
    seconds: float

    @property
    def name(self) -> str:
        return self.test.split("::")[-1]

    @property
    def failed(self) -> bool:
        return self.result in ("failed", "error")


def read_junit(junit: Path) -> list[Outcome]:
    outcomes = []
    for case in ET.parse(junit).iter("testcase"):
        module, _, cls = case.get("classname", "").rpartition(".")
        file = module.rpartition(".")[2] + ".py"
        result, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                result = "failed" if child.tag == "failure" else "error"
                message = child.get("message") or (child.text or "").strip()
            elif child.tag == "skipped":
                xfail = child.get("type") == "pytest.xfail"
                result = "xfailed" if xfail else "skipped"
                message = child.get("message") or ""
        line = next((x for x in message.splitlines() if x.strip()), "")
        outcomes.append(
            Outcome(file, f"{cls}::{case.get('name')}", result, line, float(case.get("time", 0)))
        )
    return outcomes


def kind_of(o: Outcome) -> str:
    return CLASSES.get(o.test, ("unclassified", ""))[0]


# ---------------------------------------------------------------------------------------
# The report


def short(text: str, width: int = 140) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= width else text[: width - 3] + "..."


def shown(o: Outcome) -> str:
    return f"{o.file.removesuffix('_test.py')}::{o.test}"


def counts_table(outcomes: list[Outcome]) -> str:
    rows: list[list[object]] = []
    for file in FILES:
        mine = [o for o in outcomes if o.file == file]
        n = Counter(o.result for o in mine)
        k = Counter(kind_of(o) for o in mine if o.failed)
        rows.append(
            [file, len(mine), n["passed"], n["failed"] + n["error"], n["skipped"], n["xfailed"]]
            + [k[kind] for kind in KINDS]
            + [k["unclassified"]]
        )
    rows.append(["all", *(sum(int(r[i]) for r in rows) for i in range(1, len(rows[0])))])
    headers = ["file", "tests", "passed", "failed", "skipped", "xfailed", *KINDS, "unclassified"]
    return table(headers, rows)


def report(
    outcomes: list[Outcome], conditions: list[str], leftover: int, clean: dict
) -> list[tuple[str, str]]:
    failing = [o for o in outcomes if o.failed]
    by_kind = Counter(kind_of(o) for o in failing)
    passed = [o for o in outcomes if o.result == "passed"]
    summary = (
        f"{len(outcomes)} tests: {len(passed)} passed, {len(failing)} failed, the rest"
        f" skipped or xfailed by the tests themselves. Of the failures, {by_kind[SCOPE]} are"
        f" out of scope for lazyfs, {by_kind[TODO]} need what is not built yet,"
        f" {by_kind[GAP]} are lazyfs gaps still open, {by_kind[IMAGE]} fail for the image"
        f" (Debian minbase under Alpine's name) and {by_kind['unclassified']} are"
        " unclassified."
    )
    counts = counts_table(outcomes) + (
        "\n\nfailed = failed + errors. A failure is out of scope (not a sandbox's to give,"
        " or a dockerd feature lazyfs does not mean to have), image (needs Alpine's"
        " busybox or user), not built yet (in docs/docker.md's list), or a"
        " lazyfs gap (worth fixing, open)."
    )
    sections = [("Summary", summary), ("Counts", counts)]
    by_test = {o.test: o for o in outcomes}
    lines = [
        [
            shown(by_test[t]) if t in by_test else t,
            FIXES[fix],
            by_test[t].result if t in by_test else "not run",
        ]
        for t, fix in FIXED.items()
    ]
    sections.append(
        (
            f"Fixed on this branch ({len(FIXED)} tests)",
            "These failed before the fixes in lazyfs/docker/ on this branch (each with a"
            " regression test in tests/docker/test_docker_fidelity.py); some only now and"
            " then (races: a log read by line, an exec right after a start).\n\n"
            + table(["test", "fix", "now"], lines),
        )
    )
    for kind in (GAP, "unclassified", TODO, SCOPE, IMAGE):
        mine = [o for o in failing if kind_of(o) == kind]
        if mine:
            lines = [[shown(o), CLASSES.get(o.test, ("", ""))[1], short(o.message)] for o in mine]
            title = f"Failing: {kind} ({len(mine)})"
            sections.append((title, table(["test", "why", "failure"], lines)))
    others = [o for o in outcomes if o.result in ("skipped", "xfailed")]
    if others:
        lines = [[shown(o), o.result, short(o.message)] for o in others]
        sections.append(("Skipped and xfailed", table(["test", "", "reason"], lines)))
    lines = [f"- {shown(o)}" for o in passed]
    sections.append((f"Passing ({len(passed)})", "\n".join(lines)))
    cleanup = [
        f"Containers the tests left (removed afterwards): {leftover}.",
        "Node after the agent stopped: "
        + ("clean." if not clean else f"NOT clean, scrubbed: {clean}."),
    ]
    sections.append(("Conditions", "\n".join(f"- {c}" for c in [*conditions, *cleanup])))
    return sections


def lazyfs_commit() -> str:
    """This checkout's commit, and whether it has changes beside it."""
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "lazyfs"], capture_output=True, text=True
    ).stdout.strip()
    return f"{head or 'unknown'}{' + uncommitted changes' if dirty else ''}"


# ---------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--source",
        type=Path,
        default=DEFAULT_SOURCE,
        help="docker-py's git directory (a bare clone or a checkout)",
    )
    parser.add_argument(
        "--tag",
        default=importlib.metadata.version("docker"),
        help="the tag to take the tests from (default: the installed docker-py's version)",
    )
    parser.add_argument(
        "-k",
        dest="select",
        metavar="EXPR",
        help="only these tests (pytest's -k): prints pytest's output, writes no report",
    )
    args = parser.parse_args()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="docker-py-suite-") as tmp:
        tests = Path(tmp) / "upstream"
        tests.mkdir()
        extract_tests(args.source, args.tag, tests)
        store = Path(tmp) / "store"
        layout = images().layout
        for name in IMAGE_NAMES:
            convert(f"oci:{layout}:{IMAGE_TAG}", name, store)
        sock = Path(tmp) / "node" / "docker.sock"
        junit = Path(tmp) / "junit.xml"
        agent = None
        try:
            # Some upstream tests remove none of their containers: room for them all.
            with agent_on(
                Path(tmp) / "node", store, "--docker-socket", str(sock), "--max-sandboxes", "300"
            ) as agent:
                client = docker.DockerClient(base_url=f"unix://{sock}", timeout=60)
                try:
                    api_version = client.version()["ApiVersion"]
                    output = run_pytest(tests, sock, api_version, junit, args.select)
                    left = client.containers.list(all=True)
                    for container in left:
                        container.remove(force=True)
                finally:
                    client.close()
        finally:
            # The node's data daemon leaves LAZYFS_DAEMON_IDLE after the agent.
            clean = agent.node.wait_clean() if agent is not None else {}
            if clean:
                agent.node.scrub()
        if not junit.exists():
            raise SystemExit(f"pytest wrote no results:\n{output[-4000:]}")
        outcomes = read_junit(junit)
    if args.select:
        print(output)
        return
    summary = next((x for x in reversed(output.splitlines()) if x.startswith("=")), "")
    conditions = [
        f"docker-py {docker.__version__}'s tests at tag {args.tag}, unchanged"
        f" ({', '.join(FILES)}), API version {api_version}; pytest says: {summary.strip('= ')}.",
        f"Image: the test images' `{IMAGE_TAG}` tag (Debian bookworm minbase + python3)"
        f" converted as {' and '.join(f'`{n}`' for n in IMAGE_NAMES)}: not Alpine.",
        f"Each test under {TEST_TIMEOUT} s; the whole run took"
        f" {time.monotonic() - started:.0f} s. One agent, no pool (each create makes a sandbox).",
        f"lazyfs at {lazyfs_commit()}. " + machine_note() + ".",
    ]
    path = save_markdown(
        "docker_py_suite",
        "docker-py's integration tests (containers, exec) against lazyfs's Docker API",
        report(outcomes, conditions, len(left), clean),
    )
    print(counts_table(outcomes))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
