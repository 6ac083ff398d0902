"""Checks of the code's shape read with ``ast``, shared by the tests that keep the Trainer's and the
Accelerator's parts composed (tests/trainer/test_trainer_parts.py, test_accelerator_parts.py)."""

from __future__ import annotations

import ast
from typing import List


def type_checking_blocks_in_classes(tree: ast.AST) -> List[str]:
    """``Class:line`` of each ``if TYPE_CHECKING:`` in a class body: a mixin declaring its host's attributes."""
    found = []
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for stmt in cls.body:
            if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test):
                found.append(f"{cls.name}:{stmt.lineno}")
    return found
