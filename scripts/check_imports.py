"""The import floors of docs/ARCHITECTURE.md, checked on the source with ``ast`` (run by scripts/lint.sh).

    python3 scripts/check_imports.py [ROOT]     # ROOT: the repository (default: this script's parent's parent)

Rules, each reported as ``path:line: rule: what and the fix``:

- ``strategies-upward``: ``strategies/`` imports nothing of trainforge but ``trainforge.strategies``
  (not ``trainforge.trainer``, ``trainforge.callbacks``, nor the top-level ``trainforge`` names, which
  are the Trainer's), not even under ``TYPE_CHECKING``.
- ``callbacks-runtime-trainer``: ``callbacks/`` imports ``trainforge.trainer`` (or the top-level names,
  or ``trainforge.utils``/``trainforge.lightning``, defined in trainer/) only inside an
  ``if TYPE_CHECKING:`` block.
- ``compat-below``: ``trainforge.trainer.compat`` (Lightning's and Accelerate's names) is imported by
  nothing under ``strategies/`` or ``callbacks/``, type hints included.

Every import counts wherever it is written (module level, inside a function, a relative import that
climbs out of its package), and so does a string that is exactly a module path (``"trainforge.trainer.x"``,
``"trainforge.trainer.x:Name"``), the form lazy registries hand to ``importlib.import_module``.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path
from typing import Iterator, List, NamedTuple, Optional

# The repository's folders and the package each is installed as (setup.py package_dir).
PACKAGES = {
    "trainforge": "trainforge",
    "trainer": "trainforge.trainer",
    "callbacks": "trainforge.callbacks",
    "strategies": "trainforge.strategies",
}
# Top-level names that are modules of their own; any other `from trainforge import X` reads
# trainforge/__init__.py, which imports the Trainer.
TOP_LEVEL_MODULES = {"trainer", "callbacks", "strategies"}
MODULE_PATH = re.compile(r"^trainforge(\.[A-Za-z_]\w*)+(:[A-Za-z_]\w*)?$")
FLOORS = "docs/ARCHITECTURE.md, Floors"


class Violation(NamedTuple):
    path: str
    line: int
    rule: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.rule}: {self.message}"


class Import(NamedTuple):
    module: str
    line: int
    type_only: bool


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _resolve(package: str, node: ast.ImportFrom) -> Optional[str]:
    """The absolute module a ``from ... import`` names; None when it climbs above ``trainforge``."""
    if not node.level:
        return node.module
    parts = package.split(".")
    if node.level > len(parts):
        return None
    base = parts[: len(parts) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _from_targets(module: str, node: ast.ImportFrom) -> List[str]:
    # `from trainforge import strategies` imports trainforge.strategies, not the top-level names
    if module != "trainforge":
        return [module]
    return [f"trainforge.{a.name}" if a.name in TOP_LEVEL_MODULES else "trainforge" for a in node.names]


def _walk(node: ast.AST, package: str, type_only: bool) -> Iterator[Import]:
    """Every import under ``node`` (functions included), marking those inside ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        yield from _walk_one(child, package, type_only)


def _walk_one(node: ast.AST, package: str, type_only: bool) -> Iterator[Import]:
    if isinstance(node, ast.If) and _is_type_checking(node.test):
        for stmt in node.body:
            yield from _walk_one(stmt, package, True)
        for stmt in node.orelse:
            yield from _walk_one(stmt, package, type_only)
        return
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield Import(alias.name, node.lineno, type_only)
    elif isinstance(node, ast.ImportFrom):
        module = _resolve(package, node)
        for target in _from_targets(module, node) if module else []:
            yield Import(target, node.lineno, type_only)
    elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_PATH.match(node.value):
        yield Import(node.value.split(":")[0], node.lineno, type_only)
    yield from _walk(node, package, type_only)


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _strategies_rule(imp: Import) -> Optional[str]:
    if _under(imp.module, "trainforge") and not _under(imp.module, "trainforge.strategies"):
        return (
            f"strategies/ imports {imp.module}; strategies/ is the bottom floor and imports only torch, the "
            "library it wraps and trainforge.strategies: move the shared code down into strategies/, or "
            f"pass what it needs in as an argument ({FLOORS})"
        )
    return None


def _callbacks_rule(imp: Import) -> Optional[str]:
    above = _under(imp.module, "trainforge") and not any(
        _under(imp.module, f"trainforge.{below}") for below in ("callbacks", "strategies")
    )
    if above and not imp.type_only:
        return (
            f"callbacks/ imports {imp.module} at run time; a callback talks to the trainer it is handed "
            "(TrainerView): import it only for type hints, inside `if TYPE_CHECKING:` "
            f"({FLOORS})"
        )
    return None


def _compat_rule(imp: Import, folder: str) -> Optional[str]:
    if _under(imp.module, "trainforge.trainer.compat"):
        return (
            f"{folder}/ imports {imp.module}; the compatibility layers translate names for users and nothing "
            f"below the trainer uses them: import the core name they translate to ({FLOORS})"
        )
    return None


RULES = {
    "strategies": [("strategies-upward", _strategies_rule)],
    "callbacks": [("callbacks-runtime-trainer", _callbacks_rule)],
}


def _package_of(rel: Path) -> str:
    """``strategies/data/loader.py`` -> ``trainforge.strategies.data`` (the package a relative import starts at)."""
    parts = [PACKAGES[rel.parts[0]], *rel.parts[1:-1]]
    return ".".join(parts)


def _violations(rel: Path, imp: Import) -> Iterator[Violation]:
    folder = rel.parts[0]
    for rule, check in RULES[folder]:
        message = check(imp)
        if message:
            yield Violation(rel.as_posix(), imp.line, rule, message)
    message = _compat_rule(imp, folder)
    if message:
        yield Violation(rel.as_posix(), imp.line, "compat-below", message)


def check_file(root: Path, path: Path) -> List[Violation]:
    rel = path.relative_to(root)
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: List[Violation] = []
    for imp in _walk(tree, _package_of(rel), False):
        # `from trainforge import A, B` yields one import per name: report the line once per rule
        found.extend(v for v in _violations(rel, imp) if v not in found)
    return found


def check_tree(root: Path) -> List[Violation]:
    violations: List[Violation] = []
    for folder in RULES:
        for path in sorted((root / folder).rglob("*.py")):
            violations.extend(check_file(root, path))
    return violations


def main(argv: List[str]) -> int:
    root = Path(argv[0]) if argv else Path(__file__).resolve().parent.parent
    violations = check_tree(root)
    for v in violations:
        print(v)
    if violations:
        print(f"check_imports: {len(violations)} import(s) break the floors of {FLOORS}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
