"""The Trainer is built from parts it composes (trainer/loop/), not from mixins that re-declare its attributes:
the parts get what they use as arguments and touch no ``_`` name of the Trainer (docs/ARCHITECTURE.md, "The loop
and its events")."""

from __future__ import annotations

import ast
from pathlib import Path

from torch.utils.data import DataLoader

from tests.helpers.ast_rules import type_checking_blocks_in_classes
from tests.helpers.models import Regressor, make_net, regression_data
from trainforge import Trainer
from trainforge.trainer.compat.lightning.trainer_args import LightningAttributes

REPO = Path(__file__).resolve().parents[2]
LOOP = REPO / "trainer" / "loop"
# the names under which a part is handed the Trainer itself (FitCheckpoints' view, StageLoaders' owner)
TRAINER_NAMES = {"trainer", "view", "owner"}


def _private_trainer_uses(tree: ast.AST) -> list:
    """``trainer._x``, ``self.view._x``, ``self.owner._x``: a part reaching into the Trainer's private names."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        holder = node.value
        name = holder.attr if isinstance(holder, ast.Attribute) else getattr(holder, "id", None)
        if name in TRAINER_NAMES:
            found.append(f"{ast.unparse(node)}:{node.lineno}")
    return found


def test_the_trainer_mixes_in_only_lightning_attributes():
    assert Trainer.__bases__ == (LightningAttributes,)


def test_no_class_of_the_loop_redeclares_its_host_under_type_checking():
    offenders = []
    for path in [*sorted(LOOP.glob("*.py")), REPO / "trainer" / "compat" / "lightning" / "trainer_args.py"]:
        offenders += [f"{path.name}:{where}" for where in type_checking_blocks_in_classes(ast.parse(path.read_text()))]
    assert not offenders, offenders


def test_the_parts_use_no_private_name_of_the_trainer():
    offenders = []
    for path in sorted(LOOP.glob("*.py")):
        if path.name != "trainer.py":
            offenders += [f"{path.name}:{use}" for use in _private_trainer_uses(ast.parse(path.read_text()))]
    assert not offenders, offenders


def test_the_checks_bite():
    source = (
        "class Part:\n    if TYPE_CHECKING:\n        model: int\n    def f(self):\n        return self.view._fire\n"
    )
    tree = ast.parse(source)
    assert type_checking_blocks_in_classes(tree) == ["Part:2"]
    assert _private_trainer_uses(tree) == ["self.view._fire:5"]


def test_the_parts_see_the_trainer_state_they_were_built_with(tmp_path):
    """The parts share the Trainer's Progress and metric stores: what the loop counts and logs is what
    the Trainer's public names show after fit."""
    trainer = Trainer(
        max_steps=3,
        log_every_n_steps=1,
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_checkpointing=False,
        logger=False,
    )
    trainer.fit(Regressor(make_net()), DataLoader(regression_data(32), batch_size=4))
    assert trainer.global_step == 3 and trainer.progress.global_step == 3
    # log_every_n_steps=1: the last step's value went to the trackers and is the latest one
    assert trainer.logged_metrics["train/loss"] == float(trainer.callback_metrics["train/loss"])
