"""The `lazyfs` command's entry point: lazyfs.cli.main, after one step that must come
before it imports anything (argparse, the settings, ...) for `lazyfs run`: taking its
node-wide slot, or waiting for one as the small C gate (lazyfs/sandbox/run_wait.py says why)."""

import sys


def main() -> int:
    if sys.argv[1:2] == ["run"]:
        from lazyfs.sandbox.run_wait import early_slot

        early_slot()
    from lazyfs.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":  # python -m lazyfs.launcher: the agent runs `convert` so
    raise SystemExit(main())
