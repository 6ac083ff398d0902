"""Exact resume from checkpoints written at an epoch boundary, in process (fast).

DESIGN: "A checkpoint describes a state from which the rest of the run is exactly the
uninterrupted run, wherever it was written (mid-epoch, last batch of an epoch, epoch end)".
Lightning: a step checkpoint taken on an epoch's last batch resumes with the epoch's scheduler
step and epoch-end hooks still to come."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.utils.data import DataLoader

from tests.helpers.models import make_net, regression_data
from trainforge import Trainer, TrainingModule, seed_everything
from trainforge.callbacks import ModelCheckpoint

BATCH, STEPS_PER_EPOCH = 8, 8  # 64 samples


class EpochLR(TrainingModule):
    def __init__(self, net):
        super().__init__()
        self.net = net
        self.epoch_ends = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.5)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # interval "epoch"

    def on_train_epoch_end(self):
        self.epoch_ends += 1


def _fit(initial, root, max_epochs, ckpt_path=None):
    module = EpochLR(copy.deepcopy(initial))
    trainer = Trainer(
        max_epochs=max_epochs,
        default_root_dir=str(root),
        enable_progress_bar=False,
        callbacks=[ModelCheckpoint(every_n_steps=STEPS_PER_EPOCH, save_last=True)],
    )
    trainer.fit(module, DataLoader(regression_data(), batch_size=BATCH, shuffle=True), ckpt_path=ckpt_path)
    return trainer, module


def test_step_checkpoint_on_last_batch_of_epoch_resumes_with_the_epoch_end_still_to_come(tmp_path):
    seed_everything(0)
    initial = make_net()
    seed_everything(1)
    full, full_module = _fit(initial, tmp_path / "full", max_epochs=2)
    assert full.optimizers[0].param_groups[0]["lr"] == 0.125

    seed_everything(1)
    _fit(initial, tmp_path / "cut", max_epochs=1)  # its only checkpoint: step 8, written at the last batch
    seed_everything(123)  # the resumed run must not depend on the random state it starts in
    resumed, module = _fit(initial, tmp_path / "cut", max_epochs=2, ckpt_path="last")
    assert resumed.optimizers[0].param_groups[0]["lr"] == 0.125
    assert module.epoch_ends == 2, "the pending epoch end (hooks, scheduler step) ran once after the resume"
    for name, ref in full_module.state_dict().items():
        assert torch.equal(module.state_dict()[name], ref), f"weights differ at {name}"


# ---- Accelerator ------------------------------------------------------------------------------
def _acc_objects(initial):
    from trainforge import Accelerator

    acc = Accelerator()
    model = copy.deepcopy(initial)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(regression_data(), batch_size=BATCH, shuffle=True)
    model, opt, loader = acc.prepare(model, opt, loader)
    return acc, model, opt, loader


def _acc_epoch(model, opt, loader, acc, seen):
    for x, y in loader:
        seen.append(x[:, 0].tolist())
        acc.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()


def test_accelerator_save_state_at_epoch_end_then_load_into_fresh_objects_continues_with_the_next_order(tmp_path):
    """Accelerate test_state_checkpointing::test_can_resume_training_with_folder: train, save_state
    after an epoch, load_state into fresh objects, train on: the same weights and batches as the
    uninterrupted run (the next epoch's shuffle, not a replay of the saved one)."""
    initial = make_net(dropout=0.2)
    seed_everything(0)
    acc, model, opt, loader = _acc_objects(initial)
    full_seen = []
    for _ in range(3):
        _acc_epoch(model, opt, loader, acc, full_seen)
    reference = acc.unwrap_model(model).state_dict()

    seed_everything(0)
    acc, model, opt, loader = _acc_objects(initial)
    seen = []
    _acc_epoch(model, opt, loader, acc, seen)
    acc.save_state(str(tmp_path / "epoch1"))
    seed_everything(99)
    acc, model, opt, loader = _acc_objects(initial)
    acc.load_state(str(tmp_path / "epoch1"))
    for _ in range(2):
        _acc_epoch(model, opt, loader, acc, seen)
    assert seen == full_seen, "the batches after the resume differ from the uninterrupted run"
    for name, ref in reference.items():
        assert torch.equal(acc.unwrap_model(model).state_dict()[name], ref), f"weights differ at {name}"
