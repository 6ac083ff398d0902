"""Parity: the same seed through a raw PyTorch loop, the Trainer and the Accelerator gives
bit-identical weights on CPU in fp32."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from tests.helpers.models import Regressor, make_net, regression_data
from trainforge import Accelerator, Trainer, seed_everything

EPOCHS, BATCH = 2, 8


def raw_loop(net: nn.Module, accum: int, clip: float | None, step_lr: bool) -> nn.Module:
    """A hand-written loop: the reference. A plain shuffled DataLoader: on one process trainforge
    iterates it in the same order, drawing from the global RNG as it does (Accelerate, Lightning)."""
    loader = DataLoader(regression_data(), batch_size=BATCH, shuffle=True)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5) if step_lr else None
    for epoch in range(EPOCHS):
        for i, (x, y) in enumerate(loader):
            loss = nn.functional.mse_loss(net(x), y) / accum
            loss.backward()
            if (i + 1) % accum == 0 or i + 1 == len(loader):
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
                opt.step()
                opt.zero_grad()
                if sched is not None:
                    sched.step()
    return net


def trainer_run(net: nn.Module, accum: int, clip: float | None, step_lr: bool, tmp_path) -> nn.Module:
    module = Regressor(net, step_lr=step_lr)
    trainer = Trainer(
        max_epochs=EPOCHS,
        accumulate_grad_batches=accum,
        gradient_clip_val=clip,
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, DataLoader(regression_data(), batch_size=BATCH, shuffle=True))
    return module.net


def accelerator_run(net: nn.Module, accum: int, clip: float | None, step_lr: bool) -> nn.Module:
    acc = Accelerator(gradient_accumulation_steps=accum)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5) if step_lr else None
    loader = DataLoader(regression_data(), batch_size=BATCH, shuffle=True)
    model, opt, loader = acc.prepare(net, opt, loader)  # changed line 1
    sched = acc.prepare(sched) if sched is not None else None  # changed line 2
    for _ in range(EPOCHS):
        for x, y in loader:
            with acc.accumulate(model):  # changed line 3
                loss = nn.functional.mse_loss(model(x), y)
                acc.backward(loss)  # changed line 4
                if clip is not None and acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), clip)  # changed line 5
                opt.step()
                if sched is not None:
                    sched.step()
                opt.zero_grad()
    return model


CASES = {
    "plain": (1, None, False),
    "accumulate4": (4, None, False),
    "clip": (1, 0.05, False),
    "step_scheduler": (1, None, True),
    "all": (3, 0.05, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_trainer_and_accelerator_match_raw_loop_bit_for_bit(case, tmp_path):
    accum, clip, step_lr = CASES[case]
    seed_everything(0)
    initial = make_net()
    seed_everything(1)  # each run starts from the same random state: the shuffle order draws from it
    reference = raw_loop(copy.deepcopy(initial), accum, clip, step_lr)
    seed_everything(1)
    via_trainer = trainer_run(copy.deepcopy(initial), accum, clip, step_lr, tmp_path)
    seed_everything(1)
    via_accelerator = accelerator_run(copy.deepcopy(initial), accum, clip, step_lr)
    changed = any(not torch.equal(a, b) for a, b in zip(initial.state_dict().values(), reference.state_dict().values()))
    assert changed, "the reference loop did not train"
    for name, ref in reference.state_dict().items():
        assert torch.equal(via_trainer.state_dict()[name], ref), f"Trainer differs from raw loop at {name}"
        assert torch.equal(via_accelerator.state_dict()[name], ref), f"Accelerator differs from raw loop at {name}"


def test_accumulation_remainder_still_steps(tmp_path):
    """8 batches per epoch with accumulation 3: windows of 3, 3 and a remainder of 2 -> 3 steps/epoch."""
    trainer = Trainer(
        max_epochs=2,
        accumulate_grad_batches=3,
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(Regressor(make_net()), DataLoader(regression_data(), batch_size=BATCH))
    assert trainer.global_step == 6


class PerLayerClipping(Regressor):
    """Lightning's configure_gradient_clipping overridden: the first layer clipped by value, the
    rest by the Trainer's norm; records what the loop passed."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__(net)
        self.calls: list = []

    def configure_optimizers(self):
        first = list(self.net[0].parameters())
        rest = [p for p in self.net.parameters() if all(p is not q for q in first)]
        return torch.optim.AdamW([{"params": first}, {"params": rest}], lr=1e-2)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.calls.append((optimizer, gradient_clip_val, gradient_clip_algorithm))
        torch.nn.utils.clip_grad_value_(optimizer.param_groups[0]["params"], 0.01)
        torch.nn.utils.clip_grad_norm_(optimizer.param_groups[1]["params"], gradient_clip_val)


def test_configure_gradient_clipping_override_decides_the_clipping(tmp_path):
    """Lightning calls the module's configure_gradient_clipping on every optimizer step with the Trainer's
    settings and the torch optimizer; an override replaces the Trainer's own clipping (was ignored)."""
    seed_everything(0)
    initial = make_net()
    seed_everything(1)
    net = copy.deepcopy(initial)
    opt = torch.optim.AdamW([{"params": list(net[0].parameters())}, {"params": list(net[3].parameters())}], lr=1e-2)
    for _ in range(EPOCHS):
        for x, y in DataLoader(regression_data(), batch_size=BATCH, shuffle=True):
            nn.functional.mse_loss(net(x), y).backward()
            torch.nn.utils.clip_grad_value_(opt.param_groups[0]["params"], 0.01)
            torch.nn.utils.clip_grad_norm_(opt.param_groups[1]["params"], 0.05)
            opt.step()
            opt.zero_grad()
    seed_everything(1)
    module = PerLayerClipping(copy.deepcopy(initial))
    trainer = Trainer(
        max_epochs=EPOCHS,
        gradient_clip_val=0.05,
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, DataLoader(regression_data(), batch_size=BATCH, shuffle=True))
    assert len(module.calls) == trainer.global_step > 0
    assert {(type(o), v, a) for o, v, a in module.calls} == {(torch.optim.AdamW, 0.05, "norm")}
    for name, ref in net.state_dict().items():
        assert torch.equal(module.net.state_dict()[name], ref), name


def test_default_configure_gradient_clipping_clips_as_the_trainer_says(tmp_path):
    """An override that only calls the default (super()) changes nothing: the same weights as without it."""

    class CallsSuper(Regressor):
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    seed_everything(0)
    initial = make_net()
    nets = []
    for cls in (Regressor, CallsSuper):
        seed_everything(1)
        module = cls(copy.deepcopy(initial))
        Trainer(
            max_epochs=EPOCHS,
            gradient_clip_val=0.05,
            default_root_dir=str(tmp_path),
            enable_progress_bar=False,
            enable_checkpointing=False,
        ).fit(module, DataLoader(regression_data(), batch_size=BATCH, shuffle=True))
        nets.append(module.net.state_dict())
    seed_everything(1)
    reference = raw_loop(copy.deepcopy(initial), 1, 0.05, False).state_dict()
    for name, ref in reference.items():
        assert torch.equal(nets[0][name], ref) and torch.equal(nets[1][name], ref), name
