"""The ``trainforge`` command line: one subcommand per module.

To add a subcommand, add one line to ``COMMANDS``: its module defines ``HELP`` (one line),
``add_arguments(parser)`` and ``run(args) -> int`` (the exit code). Errors of ours
(``TrainforgeError``) raised by ``run`` are bad input found before any work started: they are
printed without a traceback and exit with code 2, as argparse's own usage errors do; an ``OSError``
(a file that cannot be read or written) is printed as one line too, with exit code 1.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

from trainforge.strategies.errors import TrainforgeError

COMMANDS = {
    "launch": "trainforge.trainer.cli.launch",
    "config": "trainforge.trainer.cli.config",
    "env": "trainforge.trainer.cli.env",
    "estimate-memory": "trainforge.trainer.cli.estimate_memory",
    "merge-weights": "trainforge.trainer.cli.merge_weights",
}


def build_parser() -> argparse.ArgumentParser:
    from importlib.metadata import PackageNotFoundError, version

    try:
        own_version = version("trainforge")
    except PackageNotFoundError:  # running from a source tree that was not installed
        own_version = "unknown"
    parser = argparse.ArgumentParser(prog="trainforge", description="trainforge command line")
    parser.add_argument("--version", action="version", version=f"trainforge {own_version}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        sub = commands.add_parser(
            name, help=module.HELP, description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``trainforge`` and ``python -m trainforge``; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.run(args) or 0)
    except TrainforgeError as error:
        print(f"trainforge {args.command}: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # a file that cannot be read or written: its name and the cause, one line
        where = f": {error.filename!r}" if error.filename else ""
        print(f"trainforge {args.command}: error: {error.strerror or error}{where}", file=sys.stderr)
        return 1
