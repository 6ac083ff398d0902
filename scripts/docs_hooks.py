"""MkDocs hooks (mkdocs.yml ``hooks:``) for the documentation site.

The repository's trainer/, callbacks/ and strategies/ folders are installed as ``trainforge.trainer``,
``trainforge.callbacks`` and ``trainforge.strategies`` (setup.py ``package_dir``). griffe, which reads
the sources for mkdocstrings, cannot follow that mapping, so it reads a view of the package made of
symlinks (build/docs_view/, git-ignored), as scripts/typecheck.sh does for mypy. The view is made before
mkdocstrings loads anything; mkdocs.yml points the handler's ``paths`` at it.

A page line ``<!-- trainforge --help -->`` becomes the ``--help`` of the command and of every
subcommand, read from the parser itself (``trainforge.trainer.cli.main.build_parser``), so the page cannot
drift from the CLI.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VIEW = ROOT / "build" / "docs_view"


def make_view() -> Path:
    """Make (or bring up to date) the view; safe when two builds run at once (tests under xdist)."""
    pkg = VIEW / "trainforge"
    pkg.mkdir(parents=True, exist_ok=True)
    links = {pkg / f.name: f for f in (ROOT / "trainforge").glob("*.py")}
    links.update({pkg / folder: ROOT / folder for folder in ("trainer", "callbacks", "strategies")})
    for link in pkg.iterdir():
        if link not in links:  # a module that was removed or renamed
            with contextlib.suppress(FileNotFoundError):
                link.unlink()
    for link, target in links.items():
        with contextlib.suppress(FileExistsError):
            link.symlink_to(target, target_is_directory=target.is_dir())
    return VIEW


def on_startup(**kwargs: object) -> None:
    make_view()


CLI_HELP_MARKER = "<!-- trainforge --help -->"


def cli_help_markdown() -> str:
    from trainforge.trainer.cli.main import build_parser

    os.environ.setdefault("COLUMNS", "100")  # argparse wraps to the terminal's width: the same on every machine
    parser = build_parser()
    parts = ["```text\n$ trainforge --help\n" + parser.format_help() + "```"]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                parts.append(f"### trainforge {name}\n\n```text\n$ trainforge {name} --help\n{sub.format_help()}```")
    return "\n\n".join(parts)


def on_page_markdown(markdown: str, **kwargs: object) -> str:
    if CLI_HELP_MARKER in markdown:
        markdown = markdown.replace(CLI_HELP_MARKER, cli_help_markdown())
    return markdown
