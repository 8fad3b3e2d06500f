"""`lazyfs run` parses its command line with a parser of that command alone (it is on
every sandbox's start path): the same line must give the same arguments, the same help
and the same errors as through the parser of every command."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest

from lazyfs.arguments import Parser
from lazyfs.cli import build_parser
from tests.fresh_interpreter import run_fresh

RUN_LINES = [
    ["run", "python"],
    ["run", "--linger", "30", "--cache", "/c", "--store", "file:///s", "python", "true"],
    ["run", "img", "--cpus", "0.5", "--memory", "256M", "--pids", "64", "--disk", "1G"],
    ["run", "--network", "--env", "A=1", "--env", "B=2", "--cwd", "/tmp", "img", "sh"],
    ["run", "--runtime", "/usr/bin/crun", "img", "python3", "hello.py"],
]


def outcome(only: str | None, argv: list[str]) -> tuple[object, str]:
    """What parsing argv gives: its arguments, or its exit status, and what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            return vars(build_parser(only).parse_args(argv)), out.getvalue()
        except SystemExit as exit:
            return exit.code, out.getvalue()


@pytest.mark.parametrize("argv", RUN_LINES)
def test_a_run_line_parses_the_same_with_the_run_parser_alone(argv: list[str]) -> None:
    assert outcome("run", argv) == outcome(None, argv)
    assert outcome("run", argv)[0]["command"] == "run"  # type: ignore[index]


@pytest.mark.parametrize(
    "argv",
    [["run", "--help"], ["run"], ["run", "img", "--bogus"], ["run", "img", "--linger", "x"]],
)
def test_run_help_and_errors_are_the_same(argv: list[str]) -> None:
    code, text = outcome("run", argv)
    assert (code, text) == outcome(None, argv)
    assert code == (0 if "--help" in argv else 2) and text.startswith("usage: lazyfs")


def test_parsing_a_run_line_imports_no_shutil() -> None:
    """argparse asks shutil for the terminal's width (and shutil brings zlib, bz2 and
    lzma): ~10 ms of a cold `lazyfs run` before it starts the node data daemon."""
    code = (
        f"from lazyfs.cli import build_parser\nbuild_parser('run').parse_args({RUN_LINES[1]!r})\n"
    )
    run_fresh(code, unloaded={"shutil"})


def test_what_run_imports_before_it_starts_the_data_daemon_is_light() -> None:
    """Everything `lazyfs run` imports before it starts the node data daemon (cmd_run up
    to lazyfs/sandbox/run.py's start_data_daemon_soon) delays a cold start by its import
    time. dataclasses (with inspect, ast, dis, tokenize) was ~15 ms of it from a cold page
    cache and ctypes ~5 ms; both now come after the start."""
    code = (
        "from lazyfs.cli import build_parser\n"
        f"args = build_parser('run').parse_args({RUN_LINES[2]!r})\n"
        "from lazyfs.sandbox.limits import parse_limits\n"
        "parse_limits(args.cpus, args.memory, args.pids, args.disk)\n"
        "from lazyfs.settings import Settings\n"
        "settings = Settings.from_env()\n"
        "import lazyfs.sandbox.run\n"
        "from lazyfs.tree.image_mounts import ImageMounts\n"
        "ImageMounts('file:///nowhere', '/nowhere', settings)\n"
    )
    run_fresh(code, unloaded={"dataclasses", "inspect", "ctypes"})


@pytest.mark.parametrize("columns", ["44", "120"])
def test_help_wraps_to_the_terminal_as_argparse_does(
    columns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", columns)

    def help_text(parser: argparse.ArgumentParser) -> str:
        parser.add_argument("--cache", metavar="DIR", help="the node cache " * 6)
        parser.add_argument("image", help="an image name or id in the store " * 3)
        return parser.format_help()

    ours = help_text(Parser(prog="lazyfs run"))
    assert ours == help_text(argparse.ArgumentParser(prog="lazyfs run"))
    assert max(map(len, ours.splitlines())) <= int(columns)
