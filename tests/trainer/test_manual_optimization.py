"""Manual optimization and several optimizers (Lightning: automatic_optimization = False,
self.optimizers(), self.lr_schedulers(), self.manual_backward(loss); a GAN-style step)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from tests.helpers.models import make_net, regression_data
from trainforge import ConfigurationError, Trainer, TrainforgeError, TrainingModule, seed_everything


class TwoNets(TrainingModule):
    """Two players, two optimizers, a scheduler on the second; stepped by hand."""

    def __init__(self, g, d):
        super().__init__()
        self.automatic_optimization = False
        self.g, self.d = g, d

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_g, opt_d = self.optimizers()
        loss_g = nn.functional.mse_loss(self.g(x), y)
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        opt_g.step()
        loss_d = nn.functional.mse_loss(self.d(x), self.g(x).detach())
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        opt_d.step()
        self.lr_schedulers().step()
        self.log("loss_g", loss_g)

    def configure_optimizers(self):
        opt_g = torch.optim.AdamW(self.g.parameters(), lr=1e-2)
        opt_d = torch.optim.SGD(self.d.parameters(), lr=1e-1)
        return [opt_g, opt_d], [torch.optim.lr_scheduler.StepLR(opt_d, step_size=2, gamma=0.5)]


def raw(g, d):
    opt_g = torch.optim.AdamW(g.parameters(), lr=1e-2)
    opt_d = torch.optim.SGD(d.parameters(), lr=1e-1)
    sched = torch.optim.lr_scheduler.StepLR(opt_d, step_size=2, gamma=0.5)
    for x, y in DataLoader(regression_data(n=32), batch_size=8):
        loss_g = nn.functional.mse_loss(g(x), y)
        opt_g.zero_grad()
        loss_g.backward()
        opt_g.step()
        loss_d = nn.functional.mse_loss(d(x), g(x).detach())
        opt_d.zero_grad()
        loss_d.backward()
        opt_d.step()
        sched.step()
    return g, d


def test_two_optimizers_stepped_by_hand_match_the_raw_loop(tmp_path):
    seed_everything(0)
    g0, d0 = make_net(), make_net()
    g_ref, d_ref = raw(copy.deepcopy(g0), copy.deepcopy(d0))
    module = TwoNets(copy.deepcopy(g0), copy.deepcopy(d0))
    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), enable_progress_bar=False, log_every_n_steps=2)
    trainer.fit(module, DataLoader(regression_data(n=32), batch_size=8))
    for ref, got in ((g_ref, module.g), (d_ref, module.d)):
        for a, b in zip(ref.state_dict().values(), got.state_dict().values()):
            assert torch.equal(a, b)
    assert trainer.global_step == 8  # Lightning counts every optimizer step
    assert trainer.optimizers[1].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)
    assert "loss_g" in trainer.logged_metrics
    assert len(trainer.optimizers) == 2  # both saved in checkpoints (the default ModelCheckpoint wrote one)


def test_several_optimizers_need_manual_optimization_and_manual_rejects_accumulation(tmp_path):
    """Lightning: multiple optimizers with automatic optimization, and accumulate_grad_batches or
    gradient_clip_val with manual optimization, are configuration errors."""

    class Auto(TwoNets):
        def __init__(self):
            super().__init__(make_net(), make_net())
            self.automatic_optimization = True

    kwargs = dict(max_epochs=1, default_root_dir=str(tmp_path), enable_progress_bar=False, enable_checkpointing=False)
    loader = DataLoader(regression_data(n=16), batch_size=8)
    with pytest.raises(ConfigurationError, match="2 optimizers.*automatic_optimization = False"):
        Trainer(**kwargs).fit(Auto(), loader)
    with pytest.raises(ConfigurationError, match="accumulate_grad_batches=2 with manual optimization"):
        Trainer(accumulate_grad_batches=2, **kwargs).fit(TwoNets(make_net(), make_net()), loader)
    with pytest.raises(ConfigurationError, match="gradient_clip_val=1.0 with manual optimization"):
        Trainer(gradient_clip_val=1.0, **kwargs).fit(TwoNets(make_net(), make_net()), loader)


class NeverSteps(TrainingModule):
    """Manual optimization that forgets ``opt.step()``."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.net = make_net()
        self.batches = 0

    def training_step(self, batch, batch_idx):
        self.batches += 1
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_an_epoch_without_an_optimizer_step_and_no_max_epochs_is_an_error_not_an_endless_run(tmp_path):
    module = NeverSteps()
    trainer = Trainer(
        max_steps=4,
        max_epochs=None,
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    with pytest.raises(
        TrainforgeError,
        match=r"epoch 0 ran its batches without an optimizer step.*max_steps=4.*"
        r"call opt\.step\(\) in training_step",
    ):
        trainer.fit(module, DataLoader(regression_data(16), batch_size=4))
    assert module.batches == 4  # one epoch, then the error
    # with max_epochs the run ends on its own: no error
    done = Trainer(
        max_steps=4, max_epochs=2, default_root_dir=str(tmp_path), enable_progress_bar=False, enable_checkpointing=False
    )
    done.fit(NeverSteps(), DataLoader(regression_data(16), batch_size=4))
    assert done.current_epoch == 2 and done.global_step == 0


class StepsInAutomatic(TrainingModule):
    def __init__(self):
        super().__init__()
        self.net = make_net()

    def training_step(self, batch, batch_idx):
        loss = nn.functional.mse_loss(self.net(batch[0]), batch[1])
        # a second step of the same gradients: the Trainer steps too under automatic optimization
        self.optimizers().step()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class StepsTwice(NeverSteps):
    def training_step(self, batch, batch_idx):
        self.batches += 1
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(nn.functional.mse_loss(self.net(batch[0]), batch[1]))
        opt.step()
        # a copy-paste slip: the same gradients applied twice
        opt.step()


def test_optimizer_step_in_training_step_under_automatic_optimization_is_refused(tmp_path):
    trainer = Trainer(
        max_steps=4, default_root_dir=str(tmp_path), enable_progress_bar=False, enable_checkpointing=False
    )
    with pytest.raises(ConfigurationError, match=r"calls self.optimizers\(\).step\(\) under automatic optimization"):
        trainer.fit(StepsInAutomatic(), DataLoader(regression_data(16), batch_size=4))
    assert trainer.global_step == 0


def test_stepping_one_optimizer_twice_per_backward_warns_once(tmp_path):
    trainer = Trainer(
        max_steps=8,
        max_epochs=None,
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    with pytest.warns(UserWarning, match=r"SGD.step\(\) ran twice without a manual_backward in between") as seen:
        trainer.fit(StepsTwice(), DataLoader(regression_data(16), batch_size=4))
    assert sum("ran twice" in str(w.message) for w in seen) == 1
    assert trainer.global_step == 8  # Lightning counts every step too; the warning says so
