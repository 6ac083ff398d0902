"""``trainer.should_stop`` obeyed mid-epoch as Lightning obeys it (issue 20): the batch ends, validation
runs if this epoch validates and it did not run at this batch, then the epoch ends (epoch-end hooks,
epoch metrics, ``current_epoch + 1``) and fit stops. The expected hook lists and counters are Lightning
2.6's for the same program (measured; Lightning is not a dependency) except that trainforge validates
before ``on_train_batch_end`` on a batch where validation is due anyway (callbacks/events.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainforge import Trainer, TrainingModule
from trainforge.callbacks import Callback, EarlyStopping, ModelCheckpoint


def loader(n: int, seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randn(n, 8, generator=g)), batch_size=8)


class Boring(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(8, 2)
        self.hooks: list = []

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).pow(2).mean()
        self.log("train_loss", loss, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("valid_loss", (self.layer(batch[0]) - 1).pow(2).mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_train_epoch_start(self):
        self.hooks.append(f"E{self.current_epoch}s@{self.global_step}")

    def on_train_epoch_end(self):
        self.hooks.append(f"E{self.current_epoch}e@{self.global_step}")

    def on_validation_end(self):
        self.hooks.append(f"V@{self.global_step}" + ("S" if self.trainer.sanity_checking else ""))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.hooks.append(f"b{batch_idx}")


class StopAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.should_stop = True


def fit(root, callbacks, module=None, ckpt_path=None, **kwargs):
    module = module or Boring()
    kwargs.setdefault("max_epochs", 10)
    kwargs.setdefault("enable_checkpointing", False)
    trainer = Trainer(
        default_root_dir=str(root),
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )
    trainer.fit(module, loader(32, 0), loader(16, 1), ckpt_path=ckpt_path)
    return trainer, module


# (case, callbacks, Trainer arguments, Lightning 2.6's hooks in trainforge's order, epoch, step)
CASES = [
    (
        "should_stop set in on_train_batch_end",
        lambda: [StopAt(6)],
        {},
        "V@0S E0s@0 b0 b1 b2 V@4 b3 E0e@4 E1s@4 b0 b1 V@6 E1e@6",
        2,
        6,
    ),
    (
        "and this epoch validates (check_val_every_n_epoch=2)",
        lambda: [StopAt(6)],
        {"check_val_every_n_epoch": 2},
        "V@0S E0s@0 b0 b1 b2 b3 E0e@4 E1s@4 b0 b1 V@6 E1e@6",
        2,
        6,
    ),
    (
        "EarlyStopping(check_on_train_epoch_end=False) at a mid-epoch validation",
        lambda: [EarlyStopping("valid_loss", patience=0, check_on_train_epoch_end=False)],
        {"val_check_interval": 3, "num_sanity_val_steps": 0},
        "E0s@0 b0 b1 V@3 b2 b3 E0e@4 E1s@4 b0 b1 V@7 b2 E1e@7",
        2,
        7,
    ),
]


@pytest.mark.parametrize("case, callbacks, kwargs, hooks, epoch, step", CASES, ids=[c[0] for c in CASES])
def test_should_stop_mid_epoch_ends_the_epoch_as_lightning(tmp_path, case, callbacks, kwargs, hooks, epoch, step):
    trainer, module = fit(tmp_path, callbacks(), **kwargs)
    assert " ".join(module.hooks) == hooks
    assert (trainer.current_epoch, trainer.global_step) == (epoch, step)
    assert "train_loss_epoch" in trainer.logged_metrics  # the stopped epoch's metrics were logged


def test_a_checkpoint_of_the_stopped_epochs_end_resumes_at_the_next_epoch(tmp_path):
    ckpt = lambda: ModelCheckpoint(dirpath=str(tmp_path / "ck"), save_last=True)  # noqa: E731
    fit(tmp_path, [StopAt(6), ckpt()], max_epochs=3, enable_checkpointing=True)
    trainer, module = fit(tmp_path, [ckpt()], max_epochs=3, enable_checkpointing=True, ckpt_path="last")
    assert " ".join(module.hooks) == "V@6S E2s@6 b0 b1 b2 V@10 b3 E2e@10"
    assert (trainer.current_epoch, trainer.global_step) == (3, 10)


def test_max_steps_mid_epoch_still_ends_fit_at_that_batch(tmp_path):
    trainer, module = fit(tmp_path, [], max_steps=6)  # Lightning also runs the epoch end here (guides/lightning.md)
    assert module.hooks[-2:] == ["b0", "b1"] and (trainer.current_epoch, trainer.global_step) == (1, 6)
