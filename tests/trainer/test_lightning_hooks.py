"""Module hooks, sanity validation, train/eval modes and data sources as Lightning users expect."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from tests.helpers.models import Regressor, make_net, regression_data
from trainforge import ConfigurationError, DataModule, Trainer
from trainforge.callbacks import Callback


def _trainer(tmp_path, **kwargs):
    kwargs.setdefault("max_epochs", 1)
    return Trainer(default_root_dir=str(tmp_path), enable_progress_bar=False, enable_checkpointing=False, **kwargs)


def _loader(n=16, batch_size=8):
    return DataLoader(regression_data(n=n), batch_size=batch_size)


class HookArgs(Regressor):
    """Every hook records its arguments: Lightning's module signatures (no trainer/module)."""

    def __init__(self):
        super().__init__(make_net())
        self.calls = []

    def setup(self, stage):
        self.calls.append(("setup", stage))

    def teardown(self, stage):
        self.calls.append(("teardown", stage))

    def on_train_start(self):
        self.calls.append(("on_train_start",))

    def on_train_end(self):
        self.calls.append(("on_train_end",))

    def on_train_epoch_end(self):
        self.calls.append(("on_train_epoch_end",))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.calls.append(("on_train_batch_end", float(outputs.detach()) > 0, batch_idx))

    def on_before_zero_grad(self, optimizer):
        self.calls.append(("on_before_zero_grad", isinstance(optimizer, torch.optim.Optimizer)))

    def on_validation_epoch_start(self):
        self.calls.append(("on_validation_epoch_start",))

    def on_validation_batch_start(self, batch, batch_idx):
        self.calls.append(("on_validation_batch_start", batch_idx))

    def on_validation_epoch_end(self):
        self.calls.append(("on_validation_epoch_end",))

    def test_step(self, batch, batch_idx):
        self.log("test/loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    def on_test_epoch_end(self):
        self.calls.append(("on_test_epoch_end",))

    def on_test_batch_end(self, outputs, batch, batch_idx):
        self.calls.append(("on_test_batch_end", batch_idx))

    def on_predict_batch_end(self, outputs, batch, batch_idx):
        self.calls.append(("on_predict_batch_end", tuple(outputs.shape)))

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])


def test_module_hooks_take_lightnings_signatures_and_callbacks_keep_trainer_module(tmp_path):
    """Lightning models/test_hooks.py: module hooks are called with Lightning's signatures, once per
    event, after the callbacks as Lightning 2.6 calls them (the callbacks keep (trainer, module, ...))."""
    order = []

    class Cb(Callback):
        def on_train_epoch_end(self, trainer, module):
            order.append(("callback", module.calls[-1][0]))

    module = HookArgs()
    trainer = _trainer(tmp_path, callbacks=[Cb()], num_sanity_val_steps=0)
    trainer.fit(module, _loader(), _loader(batch_size=16))
    assert module.calls[0] == ("setup", "fit") and module.calls[1] == ("on_train_start",)
    assert ("on_train_batch_end", True, 1) in module.calls and ("on_before_zero_grad", True) in module.calls
    assert ("on_validation_batch_start", 0) in module.calls
    assert module.calls[-3:] == [("on_train_epoch_end",), ("on_train_end",), ("teardown", "fit")]
    # Lightning's order: a (non-monitoring) callback's on_train_epoch_end runs before the module's
    assert order == [("callback", "on_train_batch_end")]
    module.calls.clear()
    trainer.test(module, _loader())
    assert module.calls == [
        ("setup", "test"),
        ("on_test_batch_end", 0),
        ("on_test_batch_end", 1),
        ("on_test_epoch_end",),
        ("teardown", "test"),
    ]
    module.calls.clear()
    trainer.predict(module, _loader())
    assert ("on_predict_batch_end", (8, 1)) in module.calls


def test_unknown_module_hook_warns_and_callback_style_module_hook_still_runs_loudly(tmp_path):
    """Lightning users' on_* methods the Trainer never calls are not silently ignored."""

    class Typo(Regressor):
        ran = 0

        def on_train_epoch_ends(self):
            pass

        def on_fit_start(self, trainer, module):  # the pre-Lightning (callback) signature
            type(self).ran += 1

    typo = "on_train_epoch_ends, which the Trainer never calls"
    old_signature = r"on_fit_start\(trainer, module, ...\) uses the callback signature"
    with pytest.warns(UserWarning, match=typo), pytest.warns(FutureWarning, match=old_signature):
        _trainer(tmp_path).fit(Typo(make_net()), _loader())
    assert Typo.ran == 1


def test_lightning_1x_epoch_end_hooks_are_refused_with_their_replacement(tmp_path):
    """validation_epoch_end/training_epoch_end (removed in Lightning 2.0, which refuses them) would never
    be called, and nothing would say so."""

    class Old(Regressor):
        def validation_epoch_end(self, outputs):
            raise AssertionError("never called")

        def training_epoch_end(self, outputs):
            raise AssertionError("never called")

    with pytest.raises(
        ConfigurationError,
        match=r"Old defines training_epoch_end, validation_epoch_end, which "
        r"Lightning 2\.0 removed.*on_train_epoch_end, on_validation_epoch_end",
    ):
        _trainer(tmp_path).fit(Old(make_net()), _loader(), _loader())


def test_a_callback_hook_with_a_typo_gets_a_warning(tmp_path):
    """A Callback's misspelt hook would never run and, unlike the module's, get no warning."""

    class Export(Callback):
        calls = 0

        def on_train_epoch_ends(self, trainer, module):  # typo
            type(self).calls += 1

        def on_train_epoch_end(self, trainer, module):
            pass

    with pytest.warns(UserWarning, match=r"Export defines on_train_epoch_ends, which is not a Callback hook"):
        _trainer(tmp_path, callbacks=[Export()]).fit(Regressor(make_net()), _loader())
    assert Export.calls == 0


def test_sanity_validation_fails_fast_and_its_metrics_are_dropped(tmp_path):
    """Lightning: num_sanity_val_steps=2 validation batches run before training, so a broken
    validation_step fails before any training step; the sanity values are not logged."""

    class Broken(Regressor):
        def validation_step(self, batch, batch_idx):
            raise RuntimeError("broken validation_step")

    trainer = _trainer(tmp_path)
    with pytest.raises(RuntimeError, match="broken validation_step"):
        trainer.fit(Broken(make_net()), _loader(), _loader())
    assert trainer.global_step == 0

    seen = []

    class Count(Regressor):
        def validation_step(self, batch, batch_idx):
            seen.append((self.trainer.sanity_checking, batch_idx))
            super().validation_step(batch, batch_idx)

    trainer = _trainer(tmp_path, num_sanity_val_steps=2, max_steps=1, max_epochs=None)
    trainer.fit(Count(make_net()), _loader(), _loader(n=64, batch_size=8))
    assert seen == [(True, 0), (True, 1)] and "val/loss" not in trainer.logged_metrics


def test_submodule_in_eval_mode_stays_there_and_modes_are_restored_after_eval(tmp_path):
    """Lightning 2.2+: the Trainer restores train/eval modes per submodule (a frozen part stays frozen)."""
    modes = []

    class Frozen(Regressor):
        def training_step(self, batch, batch_idx):
            modes.append((self.net[0].training, self.net[3].training))
            return super().training_step(batch, batch_idx)

    module = Frozen(make_net())
    module.net[0].eval()
    trainer = _trainer(tmp_path, max_epochs=2)
    trainer.fit(module, _loader(), _loader())
    assert modes == [(False, True)] * 4
    trainer.validate(module, _loader())
    assert not module.net[0].training and module.net[3].training and module.training


class OwnData(Regressor):
    def train_dataloader(self):
        return _loader()

    def val_dataloader(self):
        return _loader(batch_size=16)


class DM(DataModule):
    def __init__(self):
        self.calls, self.counter = [], 0

    def prepare_data(self):
        self.calls.append("prepare_data")

    def setup(self, stage):
        self.calls.append(f"setup:{stage}")

    def train_dataloader(self):
        return _loader()

    def test_dataloader(self):
        return _loader()

    def state_dict(self):
        return {"counter": self.counter}

    def load_state_dict(self, state):
        self.counter = state["counter"]


def test_fit_takes_loaders_from_the_module_or_a_datamodule(tmp_path):
    """Lightning: fit(model) uses model.train_dataloader()/val_dataloader(); a LightningDataModule is
    accepted by fit/test(..., datamodule=dm): prepare_data, setup(stage), *_dataloader(), state_dict."""
    trainer = _trainer(tmp_path, num_sanity_val_steps=0)
    trainer.fit(OwnData(make_net()))
    assert trainer.global_step == 2 and "val/loss" in trainer.callback_metrics

    dm = DM()
    dm.counter = 5
    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path / "dm"), enable_progress_bar=False)
    trainer.fit(Regressor(make_net()), datamodule=dm)
    assert dm.calls == ["prepare_data", "setup:fit"] and trainer.global_step == 2
    resumed_dm = DM()
    Trainer(max_epochs=2, default_root_dir=str(tmp_path / "dm"), enable_progress_bar=False).fit(
        Regressor(make_net()), datamodule=resumed_dm, ckpt_path="last"
    )
    assert resumed_dm.counter == 5  # its state came back with the checkpoint
    module = HookArgs()
    trainer.test(module, datamodule=DM())
    assert "test/loss" in trainer.callback_metrics
    with pytest.raises(Exception, match=r"got no train_dataloaders.*Regressor.train_dataloader\(\)"):
        _trainer(tmp_path).fit(Regressor(make_net()))
