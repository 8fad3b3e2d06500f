"""argparse's ArgumentParser without its import of shutil, for every lazyfs command line.

argparse makes a help formatter for each add_argument (not only for --help), and the
formatter asks shutil for the terminal's width; shutil brings zlib, bz2 and lzma. From a
cold page cache that was ~10 ms of `lazyfs run` before it started the node data daemon,
and as much again in the daemon's supervisor before it started its worker: both on a
cold node's first sandbox start (docs/design-changes.md, session 27)."""

from __future__ import annotations

import argparse
import os
import sys

TYPE_CHECKING = False  # typing is not imported at run time (a daemon's start)
if TYPE_CHECKING:
    from typing import Any


class HelpFormatter(argparse.HelpFormatter):
    """argparse's, told the terminal's width rather than asking shutil for it."""

    def __init__(
        self,
        prog: str,
        indent_increment: int = 2,
        max_help_position: int = 24,
        width: int | None = None,
    ) -> None:
        super().__init__(prog, indent_increment, max_help_position, width or columns() - 2)


def columns() -> int:
    """shutil.get_terminal_size().columns: $COLUMNS, else stdout's terminal, else 80."""
    try:
        return int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        pass
    try:
        return os.get_terminal_size(sys.__stdout__.fileno()).columns or 80
    except (AttributeError, ValueError, OSError):
        return 80


class Parser(argparse.ArgumentParser):
    """argparse's, with HelpFormatter unless told another; a subcommand's parser is one
    too (argparse makes them of their parent's class)."""

    def __init__(self, *args: Any, formatter_class: type = HelpFormatter, **kwargs: Any) -> None:
        super().__init__(*args, formatter_class=formatter_class, **kwargs)
