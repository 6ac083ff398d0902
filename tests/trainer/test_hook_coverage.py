"""Every Lightning 2.6 hook a module or callback can override is honoured, in Lightning's order, with
Lightning's numbers (issue 38, item 1). Lightning's side is recorded, not imported (it is not a
dependency): ``tests/scripts/lightning_ported/lightning26_hooks.json`` is ``hook_order.py lightning`` run
with Lightning 2.6.6, ``hook_recipes_lightning26.json`` is ``hook_recipes.py`` run with ``import lightning
as L``; both on torch 2.13 CPU. When Lightning is importable the hook lists are checked against it."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainforge import ConfigurationError, DataModule, Trainer, TrainingModule
from trainforge.callbacks import Callback
from trainforge.trainer.loop.step_hooks import step_overrides

PORTED = Path(__file__).resolve().parents[1] / "scripts" / "lightning_ported"
RECORDED = json.loads((PORTED / "lightning26_hooks.json").read_text())
# The loader hooks return the stage's loaders (tests/trainer/test_lightning_order.py,
# test_eval_loaders.py); configure_sharded_model is Lightning's deprecated configure_model (below);
# a callback's load_state_dict is called only with a non-empty state, as in Lightning (test_checkpointing.py).
CHECKED_ELSEWHERE = {
    "train_dataloader",
    "val_dataloader",
    "test_dataloader",
    "predict_dataloader",
    "configure_sharded_model",
    "load_state_dict",
}


def run_hook_order(tmp_path, monkeypatch):
    out = tmp_path / "order.json"
    hooks = PORTED / "lightning26_hooks.json"
    monkeypatch.setattr(sys, "argv", ["hook_order.py", "trainforge", str(out), str(tmp_path / "root"), str(hooks)])
    runpy.run_path(str(PORTED / "hook_order.py"), run_name="ported")
    return json.loads(out.read_text())["order"]


def _move(order, item, before):
    """``item``'s occurrences each moved to just before the next ``before`` that follows them."""
    out, pending = [], 0
    for entry in order:
        if entry == item:
            pending += 1
            continue
        if entry == before and pending:
            out += [item] * pending
            pending = 0
        out.append(entry)
    return out + [item] * pending


def _validation_before_batch_end(order):
    """trainforge validates before the epoch's last BATCH_END (a checkpoint written there includes it)."""
    out, i = [], 0
    batch_end = ["c:on_train_batch_end", "m:on_train_batch_end"]
    while i < len(order):
        if order[i : i + 3] == [*batch_end, "m:on_validation_model_zero_grad"]:
            end = order.index("m:on_validation_model_train", i) + 1
            out += order[i + 2 : end] + batch_end
            i = end
            continue
        out.append(order[i])
        i += 1
    return out


def expected_trainforge_order(lightning):
    """Lightning's order with trainforge's deliberate differences (docs/guides/lightning.md):
    validation before the last batch's on_train_batch_end; epoch-interval schedulers stepped at the epoch's
    end; callbacks' state_dict read after on_save_checkpoint; optimizers built before a resume's
    on_load_checkpoint; teardown also after a failure."""
    order = _validation_before_batch_end(lightning)
    epoch_steps = [i for i, e in enumerate(order) if e == "m:lr_scheduler_step"]
    for i in reversed(epoch_steps):  # StepLR has interval "epoch"
        del order[i]
        order.insert(order.index("c:on_train_epoch_end", i), "m:lr_scheduler_step")
    order = _move(order, "c:state_dict", "=resume")
    save = order.index("=resume")
    order[save - 1 : save] = []  # c:state_dict now just before =resume: after on_save_checkpoint
    order.insert(order.index("m:on_save_checkpoint") + 1, "c:state_dict")
    resume = order.index("=resume")
    opt = order.index("m:configure_optimizers", resume)
    del order[opt]
    order.insert(order.index("m:on_load_checkpoint", resume), "m:configure_optimizers")
    return [*order, "c:teardown", "m:teardown"]


def test_lightning_hooks_are_called_in_lightnings_order(tmp_path, monkeypatch):
    order = run_hook_order(tmp_path, monkeypatch)
    assert order == expected_trainforge_order(RECORDED["order"])


def test_every_lightning_hook_is_honoured(tmp_path, monkeypatch):
    order = set(run_hook_order(tmp_path, monkeypatch))
    missing = [n for n in RECORDED["module_hooks"] if f"m:{n}" not in order and n not in CHECKED_ELSEWHERE]
    missing += [n for n in RECORDED["callback_hooks"] if f"c:{n}" not in order and n not in CHECKED_ELSEWHERE]
    assert not missing, f"Lightning hooks never called: {missing}"


def test_the_recorded_hook_lists_are_lightnings():
    lightning = pytest.importorskip("lightning")
    from lightning.pytorch.core.hooks import CheckpointHooks, DataHooks, ModelHooks

    live = [n for c in (ModelHooks, DataHooks, CheckpointHooks) for n, f in vars(c).items() if callable(f)]
    assert [n for n in live if not n.startswith("_")] == RECORDED["module_hooks"][:-6]
    callbacks = [n for n, f in vars(lightning.Callback).items() if callable(f) and not n.startswith("_")]
    assert callbacks == RECORDED["callback_hooks"]


RECIPES = json.loads((PORTED / "hook_recipes_lightning26.json").read_text())


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_step_hook_recipes_give_lightnings_numbers(recipe, tmp_path):
    """optimizer_step (warm-up, the UvA per-iteration scheduler, skipped steps), optimizer_zero_grad,
    backward, lr_scheduler_step, on_train_batch_start returning -1 and the batch-transfer hooks."""
    program = runpy.run_path(str(PORTED / "hook_recipes.py"), run_name="ported")
    weights, lrs, global_step = program["run"](recipe, str(tmp_path))
    reference = RECIPES[recipe]
    assert (global_step, lrs) == (reference["global_step"], reference["lrs"])
    torch.testing.assert_close(weights, torch.tensor(reference["weights"]), rtol=0, atol=1e-6)


# ---- the hooks' contracts and their bad input ------------------------------------------------------
class Small(TrainingModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.seen = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.seen.append(self.training)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(module, tmp_path, val=None, **kwargs):
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    trainer = Trainer(
        max_epochs=1, default_root_dir=str(tmp_path), enable_progress_bar=False, enable_checkpointing=False, **kwargs
    )
    trainer.fit(module, DataLoader(data, batch_size=4), val)
    return trainer


def test_an_optimizer_step_that_never_runs_the_closure_is_refused(tmp_path):
    class NoClosure(Small):
        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
            optimizer.step()

    with pytest.raises(ConfigurationError, match=r"NoClosure.optimizer_step did not run optimizer_closure \(batch 0\)"):
        _fit(NoClosure(), tmp_path)


def test_a_closure_run_twice_or_a_step_with_options_is_refused(tmp_path):
    class Twice(Small):
        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
            optimizer_closure()
            optimizer.step(closure=optimizer_closure)

    with pytest.raises(ConfigurationError, match="optimizer_closure was called twice"):
        _fit(Twice(), tmp_path)

    class Options(Small):
        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
            optimizer.step(closure=optimizer_closure, lr=0.5)

    with pytest.raises(ConfigurationError, match=r"optimizer.step\(lr=...\) inside optimizer_step"):
        _fit(Options(), tmp_path)


def test_a_backward_hook_is_refused_where_the_backend_runs_the_backward():
    class OwnBackward(Small):
        def backward(self, loss, *args, **kwargs):
            loss.backward()

    deepspeed_like = SimpleNamespace(own_backward=True, pipelined=False)
    with pytest.raises(ConfigurationError, match=r"OwnBackward.backward is overridden, but under SimpleNamespace"):
        step_overrides(OwnBackward(), deepspeed_like)
    pipeline = SimpleNamespace(own_backward=False, pipelined=True)
    with pytest.raises(ConfigurationError, match="the pipeline schedule runs it"):
        step_overrides(OwnBackward(), pipeline)


def test_step_hooks_under_manual_optimization_are_warned_of(tmp_path):
    class Manual(Small):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(super().training_step(batch, batch_idx))
            opt.step()

        def optimizer_step(self, *args, **kwargs):
            raise AssertionError("never called under manual optimization")

    with pytest.warns(UserWarning, match="Manual overrides optimizer_step, which manual optimization"):
        _fit(Manual(), tmp_path)


def test_configure_sharded_model_runs_as_configure_model_and_both_are_refused(tmp_path):
    class Sharded(Small):
        def configure_sharded_model(self):
            self.head = nn.Linear(1, 1)

    module = Sharded()
    with pytest.warns(FutureWarning, match="configure_sharded_model is Lightning's deprecated name"):
        _fit(module, tmp_path)
    assert hasattr(module, "head")

    class Both(Sharded):
        def configure_model(self):
            pass

    with pytest.raises(ConfigurationError, match="overrides both configure_model and configure_sharded_model"):
        _fit(Both(), tmp_path)


def test_configure_callbacks_replaces_the_trainers_callback_of_its_type(tmp_path):
    class Counter(Callback):
        def __init__(self, owner):
            self.owner, self.batches = owner, 0

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.batches += 1

    class FinerCounter(Counter):
        pass

    mine = FinerCounter("module")

    class WithCallbacks(Small):
        def configure_callbacks(self):
            return mine  # one callback, or a list of them

    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), callbacks=[Counter("trainer")])
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    trainer.fit(WithCallbacks(), DataLoader(data, batch_size=4), DataLoader(data, batch_size=16))
    counters = [cb for cb in trainer.callbacks if isinstance(cb, Counter)]
    assert counters == [mine] and mine.batches == 4
    # Lightning's order: the module's callbacks after the Trainer's, checkpointing last
    assert [type(cb).__name__ for cb in trainer.callbacks][-2:] == ["FinerCounter", "ModelCheckpoint"]


def test_configure_callbacks_must_return_callbacks(tmp_path):
    class Bad(Small):
        def configure_callbacks(self):
            return [object()]

    with pytest.raises(ConfigurationError, match=r"callbacks\[0\]=.* is a object, not a Callback"):
        _fit(Bad(), tmp_path)


def test_eval_mode_hooks_are_honoured(tmp_path):
    class KeepTraining(Small):
        def on_validation_model_eval(self):
            pass  # e.g. Monte-Carlo dropout: stay in train mode

    module = KeepTraining()
    data = TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    _fit(module, tmp_path, num_sanity_val_steps=0, val=DataLoader(data, batch_size=4))
    assert module.seen == [True, True]
    plain = Small()
    _fit(plain, tmp_path, num_sanity_val_steps=0, val=DataLoader(data, batch_size=4))
    assert plain.seen == [False, False]


def test_a_datamodules_transfer_hook_is_preferred_to_the_modules(tmp_path):
    class Module(Small):
        def on_before_batch_transfer(self, batch, dataloader_idx):
            raise AssertionError("the datamodule's hook runs instead")

        def training_step(self, batch, batch_idx):
            assert torch.equal(batch[1], torch.full_like(batch[1], 7.0))
            return super().training_step(batch, batch_idx)

    class Data(DataModule):
        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(8, 4), torch.zeros(8, 1)), batch_size=4)

        def on_before_batch_transfer(self, batch, dataloader_idx):
            return batch[0], batch[1] + 7

    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), enable_progress_bar=False)
    trainer.fit(Module(), datamodule=Data())
    assert trainer.global_step == 2


def test_lightning_module_methods(tmp_path, capsys):
    module = Small()
    module.freeze()
    assert not module.training and not any(p.requires_grad for p in module.parameters())
    module.unfreeze()
    assert module.training and all(p.requires_grad for p in module.parameters())
    module.print("shown without a trainer")
    assert "shown without a trainer" in capsys.readouterr().out
    gathered = module.all_gather({"loss": 1.5, "t": torch.ones(2)})
    assert torch.equal(gathered["loss"], torch.tensor(1.5)) and torch.equal(gathered["t"], torch.ones(2))
    traced = module.to_torchscript(method="trace", example_inputs=torch.randn(2, 4))
    x = torch.randn(3, 4)
    torch.testing.assert_close(traced(x), module.net(x))
    with pytest.raises(ConfigurationError, match="to_torchscript.method.*'compile'.*script, trace|method"):
        module.to_torchscript(method="compile")
    with pytest.raises(ConfigurationError, match="torch_tensorrt.compile"):
        module.to_tensorrt()
    with pytest.raises(ConfigurationError, match=r"to_onnx needs input_sample=\.\.\., or set self.example_input_array"):
        module.to_onnx(str(tmp_path / "model.onnx"))
    with pytest.raises(ConfigurationError, match=r"to_torchscript\(method='trace'\) needs example_inputs"):
        module.to_torchscript(method="trace")
