"""The event contract beside ``Callback`` (callbacks/events.py, callbacks/base.py) and the seams through which
the loop reaches callbacks without naming one (``StepGuard``, ``Checkpointer``)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers.models import Regressor, make_net, regression_data
from trainforge import ConfigurationError, Trainer
from trainforge.callbacks import Callback, LossSpikes, ModelCheckpoint
from trainforge.callbacks.base import Checkpointer, StepGuard
from trainforge.callbacks.events import Event

REPO = Path(__file__).resolve().parents[2]
# What every part of trainer/ may import of trainforge.callbacks: the contract, not a callback.
CONTRACT = {
    "trainforge.callbacks",
    "trainforge.callbacks.base",
    "trainforge.callbacks.events",
    "trainforge.callbacks.view",
}
# Modules that install callbacks from Trainer settings (defaults, profiler=, hang_timeout=) and the
# compatibility layers (Lightning's and Accelerate's attribute names for trackers, early stopping).
INSTALLERS = {"trainer/loop/defaults.py", "trainer/loop/profiling.py"}


def test_callback_has_exactly_one_method_per_event():
    hooks = {name for name, _ in inspect.getmembers(Callback, inspect.isfunction) if name.startswith("on_")}
    assert hooks == {event.value for event in Event}
    assert len({event.value for event in Event}) == len(Event)


def _callback_imports(path: Path):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trainforge.callbacks"):
            yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("trainforge.callbacks"):
                    yield node.lineno, alias.name


def test_the_loop_names_no_concrete_callback():
    offenders = []
    for path in sorted((REPO / "trainer").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel in INSTALLERS or rel.startswith("trainer/compat/"):
            continue
        offenders += [f"{rel}:{line} imports {mod}" for line, mod in _callback_imports(path) if mod not in CONTRACT]
    assert not offenders, "the loop reaches callbacks through callbacks/base.py's seams:\n" + "\n".join(offenders)


def test_built_in_callbacks_use_the_seams():
    assert issubclass(LossSpikes, StepGuard) and issubclass(ModelCheckpoint, Checkpointer)


class SkipEveryOther(StepGuard):
    """A user's own guard: skips the optimizer step of every second window."""

    def __init__(self):
        self.asked, self.skipped = 0, 0

    def decide(self, strategy, step, is_global_zero):
        self.asked += 1
        if self.asked % 2 == 0:
            self.skipped += 1
            return "skip"
        return "step"

    def metrics(self):
        return {"train/my_skips": float(self.skipped)}


def _fit(tmp_path, callbacks, batches=6):
    x, y = regression_data(n=8 * batches).tensors
    trainer = Trainer(
        default_root_dir=str(tmp_path),
        max_epochs=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
        callbacks=callbacks,
    )
    torch.manual_seed(0)
    module = Regressor(make_net())
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=8))
    return trainer


def test_a_users_step_guard_is_asked_at_every_step_and_its_skips_are_taken(tmp_path):
    guard = SkipEveryOther()
    trainer = _fit(tmp_path, [guard])
    assert guard.asked == 6
    assert trainer.global_step == 3  # the skipped steps are not optimizer steps
    assert trainer.callback_metrics["train/my_skips"] == 3


def test_two_step_guards_are_refused_naming_both(tmp_path):
    with pytest.raises(ConfigurationError, match=r"2 step guards were passed \(SkipEveryOther, LossSpikes\)"):
        _fit(tmp_path, [SkipEveryOther(), LossSpikes()])


class Recorder(Callback):
    def __init__(self, seen):
        self.seen = seen

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.seen.append("other")


class MyCheckpointer(Checkpointer):
    def __init__(self, seen):
        self.seen = seen

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.seen.append("checkpointer")


def test_a_users_checkpointer_runs_after_the_other_callbacks(tmp_path):
    seen = []
    _fit(tmp_path, [MyCheckpointer(seen), Recorder(seen)], batches=2)
    assert seen == ["other", "checkpointer"] * 2
