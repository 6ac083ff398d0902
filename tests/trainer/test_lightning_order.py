"""Lightning's order and per-loop settings that ported programs rely on (issue 20): ``setup`` and
``configure_model`` run before the loaders are asked for and the optimizers are built, the sanity
validation leaves the random streams as it found them, and each evaluation loop has its own limit."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from tests.helpers.models import regression_data
from trainforge import ConfigurationError, Trainer, TrainingModule


def trainer(root, **kwargs):
    kwargs.setdefault("max_epochs", 1)
    return Trainer(default_root_dir=str(root), enable_progress_bar=False, enable_checkpointing=False, **kwargs)


class BuiltLate(TrainingModule):
    """Layers created in ``setup`` (the body) and ``configure_model`` (the head), data in ``setup``."""

    def __init__(self):
        super().__init__()
        self.body = self.head = self.data = None
        self.order = []

    def setup(self, stage):
        self.order.append(f"setup:{stage}")
        if self.body is None:
            self.body = nn.Linear(8, 16)
        self.data = regression_data(32)

    def configure_model(self):
        self.order.append("configure_model")
        if self.head is None:
            self.head = nn.Linear(16, 1)

    def train_dataloader(self):
        self.order.append("train_dataloader")
        return DataLoader(self.data, batch_size=8)

    def test_dataloader(self):
        return DataLoader(self.data, batch_size=8)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.head(torch.tanh(self.body(x))), y)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test/loss", nn.functional.mse_loss(self.head(torch.tanh(self.body(x))), y))

    def configure_optimizers(self):
        self.order.append("configure_optimizers")
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_layers_built_in_setup_and_configure_model_are_trained(tmp_path):
    module = BuiltLate()
    t = trainer(tmp_path)
    t.fit(module)
    assert module.order == ["setup:fit", "configure_model", "train_dataloader", "configure_optimizers"]
    assert sum(len(g["params"]) for g in t.optimizers[0].param_groups) == 4  # all four tensors, not two
    body = module.body
    t.test(module)  # setup("test") and configure_model again: nothing rebuilt, the trained layers kept
    assert module.order[-2:] == ["setup:test", "configure_model"]
    assert module.body is body


class Dropout(TrainingModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.5), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        torch.rand(3)  # a validation step that draws random numbers too
        self.log("val/loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def fit_dropout(root, sanity_steps):
    module = Dropout()
    t = trainer(root, seed=7, max_epochs=2, num_sanity_val_steps=sanity_steps)
    t.fit(
        module,
        DataLoader(regression_data(64), batch_size=8, shuffle=True),
        DataLoader(regression_data(32, seed=5), batch_size=8, shuffle=True),
    )
    return {k: v.clone() for k, v in module.state_dict().items()}


def test_the_sanity_validation_does_not_shift_the_random_streams(tmp_path):
    without = fit_dropout(tmp_path / "a", 0)
    with_sanity = fit_dropout(tmp_path / "b", 2)
    assert all(torch.equal(without[k], with_sanity[k]) for k in without)


class Counting(TrainingModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(8, 1)
        self.seen = {"val": 0, "test": 0}

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        self.seen["val"] += 1

    def test_step(self, batch, batch_idx):
        self.seen["test"] += 1

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_each_evaluation_loop_has_its_own_limit(tmp_path):
    data = DataLoader(regression_data(64), batch_size=8)  # 8 batches
    module = Counting()
    t = trainer(tmp_path, limit_val_batches=1, num_sanity_val_steps=0)
    t.fit(module, data, data)
    assert module.seen["val"] == 1
    t.test(module, data)
    assert module.seen["test"] == 8  # limit_val_batches does not cut the test loop
    limited = trainer(tmp_path, limit_test_batches=2, limit_predict_batches=0.25)
    limited.test(module, data)
    assert module.seen["test"] == 8 + 2
    assert len(limited.predict(module, data)) == 2  # a quarter of 8 batches


@pytest.mark.parametrize("name", ["limit_test_batches", "limit_predict_batches"])
@pytest.mark.parametrize("value", [-1, 1.5, "2", True])
def test_a_bad_limit_names_the_setting(tmp_path, name, value):
    with pytest.raises(ConfigurationError, match=name):
        trainer(tmp_path, **{name: value})


def test_limit_of_a_loader_without_length_must_be_a_count(tmp_path):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(regression_data(16))

    module = Counting()
    with pytest.raises(ConfigurationError, match="limit_test_batches=0.5 is a fraction"):
        trainer(tmp_path, limit_test_batches=0.5).test(module, DataLoader(Stream(), batch_size=4))


def test_a_checkpoint_holds_the_state_other_callbacks_reached_at_the_same_event(tmp_path):
    """EarlyStopping listed after ModelCheckpoint (issue 20): both act at validation end; the
    checkpoint must hold EarlyStopping's count of that validation, or a resumed run trains longer."""
    from trainforge.callbacks import EarlyStopping, ModelCheckpoint
    from trainforge.strategies.checkpoint.io import load_object

    class Worsening(Counting):
        def validation_step(self, batch, batch_idx):
            self.log("val/loss", float(self.current_epoch))  # worse every epoch: the count grows

    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), monitor="val/loss", mode="max", save_top_k=1)
    stop = EarlyStopping(monitor="val/loss", mode="min", patience=5)
    t = trainer(tmp_path, max_epochs=3, num_sanity_val_steps=0, callbacks=[ckpt, stop])
    assert t.callbacks[-1] is ckpt
    data = DataLoader(regression_data(16), batch_size=8)
    t.fit(Worsening(), data, data)
    saved = load_object(ckpt.best_model_path, "trainer_state")["callbacks"][stop.state_key]
    assert saved["wait_count"] == stop.wait_count == 2  # epochs 1 and 2 did not improve on epoch 0
