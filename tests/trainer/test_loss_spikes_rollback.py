"""LossSpikes(rollback_after=N) (callbacks/loss_spikes.py, trainer/loop/fit_checkpoints.py): after N consecutive
skipped steps the newest checkpoint's weights, optimizer, schedulers and RNG come back, the data goes on
past the bad batches, and a resumed run stays exact."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers import forklaunch
from tests.helpers.models import Regressor, make_net, regression_data
from trainforge import CheckpointError, ConfigurationError, Trainer, TrainforgeError, seed_everything
from trainforge.callbacks import Callback, EMAWeightAveraging, LossSpikes, ModelCheckpoint

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
BAD = (5, 6)  # two NaN batches in a row, in every epoch (8 batches of 8)


def data(bad=BAD, batch_size=8):
    x, y = regression_data(n=64).tensors
    x = x.clone()
    for b in bad:
        x[b * batch_size + 1] = math.nan
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


class AfterRollback(Callback):
    """The module's weights and the step at the batch end where a rollback happened."""

    def __init__(self, spikes):
        self.spikes, self.seen, self.at = spikes, 0, []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self.spikes.rollbacks > self.seen:
            self.seen = self.spikes.rollbacks
            self.at.append((trainer.global_step, {k: v.clone() for k, v in module.state_dict().items()}))


def fit(root, net, spikes, ckpt_path=None, every=2, loader=None, extra=(), **kwargs):
    kwargs.setdefault("max_epochs", 2)
    module = Regressor(net, step_lr=True)
    probe = AfterRollback(spikes)
    trainer = Trainer(
        default_root_dir=str(root),
        enable_progress_bar=False,
        callbacks=[spikes, probe, *extra, ModelCheckpoint(every_n_steps=every)],
        logger=False,  # checkpoints in <root>/checkpoints (a logger's would be in its version folder)
        **kwargs,
    )
    trainer.fit(module, loader or data(), ckpt_path=ckpt_path)
    return trainer, module, probe


def hand_loop(net, batches):
    """AdamW(lr=1e-2) + StepLR per step (Regressor(step_lr=True)) over ``batches`` (epoch, index)."""
    loader = list(data(bad=()))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    for _, i in batches:
        x, y = loader[i]
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return net


def test_rollback_restores_the_checkpoint_and_skips_the_bad_data(tmp_path):
    """Epoch 0: steps 1-5 on batches 0-4 (checkpoints at steps 2, 4), batches 5-6 skipped -> back to step 4,
    batch 7 trains on. Epoch 1 the same, back to step 10 (the newest checkpoint, written at batch 4)."""
    seed_everything(0)
    net = make_net()
    spikes = LossSpikes(threshold=10.0, window=2, rollback_after=2)
    trainer, module, probe = fit(tmp_path, copy.deepcopy(net), spikes)
    assert spikes.rollbacks == 2 and spikes.skipped_steps == 4 and spikes.consecutive_skips == 0
    assert trainer.global_step == 11 and trainer.current_epoch == 2  # the data went on: every batch counted
    assert trainer.callback_metrics["train/rollbacks"] == 2
    assert [step for step, _ in probe.at] == [4, 10]
    saved = load_file(str(tmp_path / "checkpoints" / "epoch=0-step=4" / "model.safetensors"))
    assert saved.keys() == probe.at[0][1].keys()
    assert all(torch.equal(saved[k], probe.at[0][1][k]) for k in saved)  # the checkpoint's weights, exactly
    order = [(0, i) for i in (0, 1, 2, 3, 7)] + [(1, i) for i in (0, 1, 2, 3, 4, 7)]
    reference = hand_loop(copy.deepcopy(net), order)  # optimizer and scheduler state rolled back with the weights
    assert all(torch.equal(p, q) for p, q in zip(module.net.parameters(), reference.parameters()))


@pytest.mark.parametrize("resume_from", ["epoch=0-step=4", "epoch=1-step=6"])
def test_resume_before_or_after_a_rollback_is_exact(tmp_path, resume_from):
    """Dropout (RNG) and a scheduler: resumed from the checkpoint the rollback restores (the same spikes and
    rollback replay) or from one written after it, the run ends on the uninterrupted run's weights."""
    seed_everything(0)
    net = make_net(dropout=0.2)
    seed_everything(1)
    _, whole, _ = fit(tmp_path / "a", copy.deepcopy(net), LossSpikes(window=2, rollback_after=2))
    seed_everything(1)
    first = LossSpikes(window=2, rollback_after=2)
    fit(tmp_path / "b", copy.deepcopy(net), first, max_steps=7)
    assert first.rollbacks == 1
    seed_everything(123)  # the checkpoint's RNG must win
    resumed = LossSpikes(window=2, rollback_after=2)
    ckpt = tmp_path / "b" / "checkpoints" / resume_from
    _, module, _ = fit(tmp_path / "b", copy.deepcopy(net), resumed, ckpt_path=str(ckpt))
    assert resumed.rollbacks == 2
    assert all(torch.equal(p, q) for p, q in zip(module.net.parameters(), whole.net.parameters()))


def test_weight_average_rolls_back_with_the_weights(tmp_path):
    """EMAWeightAveraging (restore_on_rollback): the checkpoint's model is the average and its state the
    current weights; both come back, so the run resumed before the rollback ends on the same average."""
    seed_everything(0)
    net = make_net()
    _, whole, probe = fit(tmp_path / "a", copy.deepcopy(net), LossSpikes(window=2, rollback_after=2), extra=[ema()])
    state = torch.load(tmp_path / "a" / "checkpoints" / "epoch=0-step=4" / "trainer_state.pt", weights_only=True)
    current = state["callbacks"]["EMAWeightAveraging"]["current_model_state"]
    assert all(torch.equal(current[k], probe.at[0][1][k]) for k in current)  # the current weights came back
    fit(tmp_path / "b", copy.deepcopy(net), LossSpikes(window=2, rollback_after=2), extra=[ema()], max_steps=7)
    ckpt = str(tmp_path / "b" / "checkpoints" / "epoch=0-step=4")
    _, module, _ = fit(tmp_path / "b", copy.deepcopy(net), LossSpikes(window=2, rollback_after=2), ckpt, extra=[ema()])
    assert all(torch.equal(p, q) for p, q in zip(module.net.parameters(), whole.net.parameters()))


class MidWindowSave(Callback):
    """A checkpoint after batch 2 of every epoch: inside an accumulation window of 2 (partial gradients)."""

    def __init__(self, root):
        self.root = root

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx == 2:
            trainer.save_checkpoint(str(self.root / f"mid-{trainer.current_epoch}"))


def test_rollback_to_a_checkpoint_inside_an_accumulation_window(tmp_path):
    """The checkpoint's partial gradients are not restored: the rollback happens at a window boundary and the
    data goes on from there. Epoch e: window (0, 1) steps, the save after batch 2, window (2, 3) steps,
    windows (4, 5) and (6, 7) hold NaNs and are skipped -> back to the save. What remains: one step per epoch
    on batches 0 and 1."""
    seed_everything(0)
    net = make_net()
    spikes = LossSpikes(window=2, rollback_after=2)
    bad = data(bad=(4, 5, 6, 7))
    extra = [MidWindowSave(tmp_path / "mid")]
    trainer, module, _ = fit(
        tmp_path, copy.deepcopy(net), spikes, every=100, loader=bad, extra=extra, accumulate_grad_batches=2
    )
    assert spikes.rollbacks == 2 and trainer.global_step == 2 and trainer.current_epoch == 2
    assert all(p.grad is None for p in module.parameters())
    assert (tmp_path / "mid" / "mid-1" / "grads_rank0.pt").exists()  # written inside the window indeed
    reference = copy.deepcopy(net)
    loader = list(data(bad=()))
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)  # StepLR(step_size=3): lr unchanged for 2 steps
    for _ in range(2):
        for x, y in loader[:2]:
            (torch.nn.functional.mse_loss(reference(x), y) / 2).backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(module.net.parameters(), reference.parameters()))


def ema():
    return EMAWeightAveraging(decay=0.5)


def test_too_many_rollbacks_is_an_error(tmp_path):
    seed_everything(0)
    spikes = LossSpikes(window=2, rollback_after=2, max_rollbacks=1)
    with pytest.raises(TrainforgeError, match=r"skipped again after 1 rollback\(s\) \(max_rollbacks=1\).*learning"):
        fit(tmp_path, make_net(), spikes)
    assert spikes.rollbacks == 1


def test_a_streak_before_the_first_checkpoint_names_the_fix(tmp_path):
    seed_everything(0)
    spikes = LossSpikes(window=2, rollback_after=2)
    with pytest.raises(
        CheckpointError,
        match=r"no checkpoint to roll back to: this fit has written no checkpoint yet.*every_n_steps=.*raise rollback_after",
    ):
        fit(tmp_path, make_net(), spikes, every=4, loader=data(bad=(1, 2)))


def test_without_a_checkpoint_callback_rollback_is_refused_at_fit_start(tmp_path):
    trainer = Trainer(
        default_root_dir=str(tmp_path),
        max_epochs=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
        callbacks=[LossSpikes(rollback_after=2)],
    )
    with pytest.raises(ConfigurationError, match=r"rollback_after=2\) restores.*add ModelCheckpoint\(every_n_steps"):
        trainer.fit(Regressor(make_net()), data())


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"rollback_after": 0}, r"rollback_after=0\): rollback_after must be None .* an int >= 1"),
        ({"rollback_after": 2.0}, r"rollback_after=2.0\)"),
        ({"rollback_after": 2, "max_rollbacks": 0}, r"max_rollbacks=0\): max_rollbacks must be an int >= 1"),
    ],
)
def test_bad_rollback_settings_are_refused(kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        LossSpikes(**kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_roll_back_together(tmp_path, strategy):
    """A NaN on rank 0 and a spike on rank 1: both ranks skip both steps and roll back together; under
    FSDP2 through the sharded (DCP) checkpoint into the live optimizer state."""
    out = tmp_path / "rollback.json"
    forklaunch.launch(SCRIPTS / "loss_spikes_rollback_dist.py", str(out), strategy, timeout=180)
    r = json.loads(out.read_text())
    assert r["rows"][0] == r["rows"][1] and r["rows"][0][:3] == [1, 2, 5]  # rollbacks, skips, step after
    assert r["restored_equal"] == [True, True] and r["agree"] and r["finite"]
    assert r["resumed_equal"] and r["final_step"] == r["resumed_step"]
