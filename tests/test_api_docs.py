"""The public API is documented where it is defined: every argument of the classes and methods users call
has its meaning in a Google-style ``Args:`` block (the class's or ``__init__``'s docstring, which
mkdocstrings renders on the API pages), and every ``trainforge launch`` option has a help text."""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
from typing import Callable, List, Set, Tuple

import pytest

# (what the test id says, how to get the class, the method whose parameters must be documented)
DOCUMENTED: List[Tuple[str, Callable[[], type], str]] = [
    ("Trainer", lambda: importlib.import_module("trainforge").Trainer, "__init__"),
    ("Accelerator", lambda: importlib.import_module("trainforge").Accelerator, "__init__"),
    (
        "TrainingModule.log",
        lambda: importlib.import_module("trainforge.trainer.module.training_module").TrainingModule,
        "log",
    ),
    ("ModelCheckpoint", lambda: importlib.import_module("trainforge.callbacks").ModelCheckpoint, "__init__"),
    ("EarlyStopping", lambda: importlib.import_module("trainforge.callbacks").EarlyStopping, "__init__"),
    ("Strategy", lambda: importlib.import_module("trainforge.strategies").Strategy, "__init__"),
] + [
    # imported as trainforge.strategies does, on first use: a backend library is needed only when chosen
    (name, lambda key=key: importlib.import_module("trainforge.strategies").strategy_class(key), "__init__")
    for name, key in (
        ("SingleDeviceStrategy", "single"),
        ("DDPStrategy", "ddp"),
        ("FSDPStrategy", "fsdp"),
        ("DeepSpeedStrategy", "deepspeed"),
        ("MegatronStrategy", "megatron"),
        ("XLAStrategy", "xla"),
    )
]

BACKENDS = ("deepspeed", "torch_xla")
# "name:" or "name (type):" at the entry's indentation; deeper lines continue the entry above
ENTRY = re.compile(r"^(\*{0,2}\w+)(?:\s*\([^)]*\))?:(\s|$)")
SECTION = re.compile(r"^[A-Z][A-Za-z ]*:$")


def args_block(docstring: str) -> Set[str]:
    """The names an ``Args:`` (or ``Arguments:``/``Parameters:``) section of a Google-style docstring documents."""
    names: Set[str] = set()
    lines = inspect.cleandoc(docstring or "").splitlines()
    inside, indent = False, None
    for line in lines:
        stripped = line.strip()
        if not inside:
            inside = stripped in ("Args:", "Arguments:", "Parameters:") and line == stripped
            indent = None
            continue
        if not stripped:
            continue
        depth = len(line) - len(line.lstrip())
        if depth == 0:
            inside = SECTION.match(stripped) is not None and stripped in ("Args:", "Arguments:", "Parameters:")
            continue
        if indent is None:
            indent = depth
        if depth == indent:
            match = ENTRY.match(stripped)
            if match:
                names.add(match.group(1).lstrip("*"))
    return names


def public_parameters(function: Callable) -> List[str]:
    """The parameters a caller names: not self, not *args/**kwargs."""
    skip = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p.name for p in inspect.signature(function).parameters.values() if p.name != "self" and p.kind not in skip]


def test_the_args_parser_reads_google_entries():
    doc = """Summary.

    Args:
        plain: meaning.
            More of it, with a colon: here.
        typed (int): meaning.
        **kwargs: passed on.

    Returns:
        not_an_arg: what comes back.
    """
    assert args_block(doc) == {"plain", "typed", "kwargs"}
    assert args_block("Summary without a section.") == set()


@pytest.mark.parametrize("owner, get_class, method", DOCUMENTED, ids=[d[0] for d in DOCUMENTED])
def test_every_public_argument_is_documented(owner, get_class, method):
    try:
        cls = get_class()
    except ModuleNotFoundError as error:
        # only a missing backend library skips: any other import error is a failure
        if error.name not in BACKENDS:
            raise
        pytest.skip(f"{owner} needs {error.name}, which is not installed")
    function = getattr(cls, method)
    documented = args_block(function.__doc__ or "")
    if method == "__init__":
        documented |= args_block(cls.__doc__ or "")
    missing = [name for name in public_parameters(function) if name not in documented]
    where = f"{cls.__module__}.{cls.__qualname__}" + ("" if method == "__init__" else f".{method}")
    assert not missing, (
        f"{where}: arguments without an entry in the docstring's Args: block: {missing}. "
        "Add `name: meaning (default ...)` under Args: (the class docstring for a constructor)"
    )


def launch_options() -> List[argparse.Action]:
    from trainforge.trainer.cli.main import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [a for a in commands.choices["launch"]._actions if not isinstance(a, argparse._HelpAction)]


def test_every_launch_option_has_a_help_text():
    actions = launch_options()
    assert {"--nproc-per-node", "--config-file", "--xla"} <= {s for a in actions for s in a.option_strings}
    empty = [a.option_strings or [a.dest] for a in actions if not (a.help or "").strip() or a.help == argparse.SUPPRESS]
    assert not empty, f"trainforge launch options without a help text: {empty}"
    # an option's default is part of its meaning: say it (a positional has none)
    silent = [a.option_strings for a in actions if a.option_strings and "default" not in a.help.lower()]
    assert not silent, f"trainforge launch options whose help does not say their default: {silent}"
