"""Callbacks see the trainer through ``TrainerView`` (callbacks/view.py): the Trainer provides all of it,
and the built-in callbacks use nothing else of it that is private or probed."""

from __future__ import annotations

import ast
from pathlib import Path

from torch.utils.data import DataLoader

from tests.helpers.models import Regressor, make_net, regression_data
from trainforge import Trainer
from trainforge.callbacks import Callback, TrainerView

CALLBACKS = Path(__file__).resolve().parents[2] / "callbacks"


def test_the_trainer_is_a_trainer_view_before_and_during_fit(tmp_path):
    seen = []

    class Check(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            seen.append(isinstance(trainer, TrainerView) and trainer.global_step >= 1)

    trainer = Trainer(
        max_steps=2,
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_checkpointing=False,
        callbacks=[Check()],
    )
    assert isinstance(trainer, TrainerView)
    trainer.fit(Regressor(make_net()), DataLoader(regression_data(16), batch_size=8))
    assert seen == [True, True]


def test_an_object_missing_a_member_is_not_a_trainer_view():
    class Partial:
        global_step = 0

    assert not isinstance(Partial(), TrainerView)


def _trainer_uses(tree: ast.AST) -> list:
    """``trainer._x`` accesses and ``getattr``/``hasattr`` calls on ``trainer`` or ``trainer.strategy``."""
    bad = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "trainer"
            and node.attr.startswith("_")
        ):
            bad.append(f"trainer.{node.attr}")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and node.args
            and "trainer" in ast.unparse(node.args[0])
        ):
            bad.append(ast.unparse(node))
    return bad


def test_builtin_callbacks_use_no_private_name_and_no_probe_of_the_trainer():
    found = {str(p.relative_to(CALLBACKS)): _trainer_uses(ast.parse(p.read_text())) for p in CALLBACKS.rglob("*.py")}
    assert {k: v for k, v in found.items() if v} == {}
    assert _trainer_uses(ast.parse("x = trainer._metrics; getattr(trainer, 'stage', 'fit')")) != []  # the check bites
