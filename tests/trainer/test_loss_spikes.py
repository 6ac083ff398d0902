"""LossSpikes (callbacks/loss_spikes.py): a non-finite or spiking loss skips its optimizer step on every
rank together, the run goes on, and a resumed run takes the same decisions."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers import forklaunch
from tests.helpers.models import Regressor, make_net, regression_data
from trainforge import ConfigurationError, Trainer, TrainingModule, seed_everything
from trainforge.callbacks import LossSpikes

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def data(nan_batch=None, spike_batch=None, batch_size=8):
    x, y = regression_data(n=64).tensors
    x, y = x.clone(), y.clone()
    if nan_batch is not None:
        x[nan_batch * batch_size + 1] = math.nan  # one item of NaN
    if spike_batch is not None:
        y[spike_batch * batch_size : (spike_batch + 1) * batch_size] *= 1e4  # targets x 1e4 (tanh bounds x's)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def fit(tmp_path, net, loader, spikes, ckpt_path=None, **kwargs):
    kwargs.setdefault("max_epochs", 1)
    module = Regressor(net)
    trainer = Trainer(
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_checkpointing=False,
        callbacks=[spikes],
        **kwargs,
    )
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer, module


def hand_loop(net, loader, skip):
    """The same training written by hand: AdamW(lr=1e-2), no step for the batches in ``skip``."""
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for i, (x, y) in enumerate(loader):
        if i in skip:
            continue
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    return net


def assert_same(a, b):
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_nan_batch_is_skipped_and_the_run_finishes(tmp_path):
    seed_everything(0)
    net = make_net()
    reference = hand_loop(copy.deepcopy(net), data(nan_batch=3), skip={3})
    spikes = LossSpikes(threshold=10.0, window=3)
    trainer, module = fit(tmp_path, net, data(nan_batch=3), spikes)
    assert spikes.skipped_steps == 1 and trainer.global_step == 7  # 8 batches, one skipped
    assert trainer.progress.batch_idx == 0 and trainer.current_epoch == 1  # every batch counted
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert_same(module.net, reference)
    assert trainer.callback_metrics["train/skipped_steps"] == 1


def test_spike_above_threshold_is_skipped(tmp_path):
    seed_everything(0)
    net = make_net()
    reference = hand_loop(copy.deepcopy(net), data(spike_batch=5), skip={5})
    spikes = LossSpikes(threshold=10.0, window=3)
    trainer, module = fit(tmp_path, net, data(spike_batch=5), spikes)
    assert spikes.skipped_steps == 1 and spikes.consecutive_skips == 0
    assert_same(module.net, reference)


def test_without_history_a_spike_is_trained_on(tmp_path):
    """The median is judged once ``window`` step losses are known: a spike before that trains."""
    seed_everything(0)
    spikes = LossSpikes(threshold=10.0, window=8)
    fit(tmp_path, make_net(), data(spike_batch=5), spikes)
    assert spikes.skipped_steps == 0


def test_resume_after_a_skip_is_bit_identical(tmp_path):
    """A NaN at batch 2, a spike at batch 6; the checkpoint is taken after the skip, before the spike:
    the resumed run skips the spike from the restored median window and ends on the same weights."""
    seed_everything(0)
    net = make_net()
    loader = lambda: data(nan_batch=2, spike_batch=6)  # noqa: E731
    whole = LossSpikes(threshold=10.0, window=3)
    _, uninterrupted = fit(tmp_path / "a", copy.deepcopy(net), loader(), whole)
    assert whole.skipped_steps == 2
    first = LossSpikes(threshold=10.0, window=3)
    trainer, _ = fit(tmp_path / "b", copy.deepcopy(net), loader(), first, max_steps=4)
    assert first.skipped_steps == 1 and trainer.progress.batch_idx == 5
    ckpt = trainer.save_checkpoint(str(tmp_path / "b" / "ckpt"))
    resumed = LossSpikes(threshold=10.0, window=3)
    _, module = fit(tmp_path / "c", copy.deepcopy(net), loader(), resumed, ckpt_path=str(ckpt))
    assert resumed.skipped_steps == 2
    assert_same(module.net, uninterrupted.net)


def test_accumulation_decides_per_optimizer_step(tmp_path):
    """With 2 batches per step, the NaN batch's whole window is skipped (both its batches)."""
    seed_everything(0)
    spikes = LossSpikes(threshold=10.0, window=2)
    trainer, module = fit(tmp_path, make_net(), data(nan_batch=3), spikes, accumulate_grad_batches=2)
    assert spikes.skipped_steps == 1 and trainer.global_step == 3
    assert all(torch.isfinite(p).all() for p in module.parameters())


@pytest.mark.slow
def test_two_ranks_skip_together(tmp_path):
    out = tmp_path / "spikes.json"
    forklaunch.launch(SCRIPTS / "loss_spikes_dist.py", str(out), timeout=120)
    r = json.loads(out.read_text())
    saw_nan = [row[0] for row in r["rows"]]
    assert sorted(saw_nan) == [False, True]  # the NaN is on one rank only
    assert [row[1:] for row in r["rows"]] == [[1, 3, 4], [1, 3, 4]]  # both skipped the same step
    assert r["agree"] and r["finite"]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"threshold": 1.0}, r"threshold=1.0\): threshold must be a number > 1.*pass e.g. threshold=10.0"),
        ({"threshold": "10"}, r"threshold='10'"),
        ({"window": 1}, r"window=1\): window must be an int >= 2.*pass e.g. window=50"),
        ({"window": 2.5}, r"window=2.5"),
    ],
)
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        LossSpikes(**kwargs)


def test_unknown_nonfinite_policy_lists_the_choices():
    with pytest.raises(ConfigurationError, match=r"nonfinite_loss='skip_step' is not one of: raise, skip, off"):
        Trainer(max_epochs=1, nonfinite_loss="skip_step")


def test_nonfinite_skip_with_loss_spikes_is_refused(tmp_path):
    with pytest.raises(ConfigurationError, match=r"nonfinite_loss='skip' and LossSpikes.*remove nonfinite_loss"):
        fit(tmp_path, make_net(), data(), LossSpikes(), nonfinite_loss="skip")


def test_manual_optimization_is_refused(tmp_path):
    class Manual(TrainingModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.net = make_net()

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
            self.manual_backward(loss)
            opt.step()
            opt.zero_grad()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), enable_progress_bar=False, callbacks=[LossSpikes()])
    with pytest.raises(ConfigurationError, match=r"LossSpikes needs automatic optimization.*skip opt.step\(\)"):
        trainer.fit(Manual(), data())
