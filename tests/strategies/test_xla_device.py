"""strategy='xla' on one real XLA:CPU device (torch 2.9 + torch_xla 2.9, PJRT_DEVICE=CPU): run by
scripts/xla-env.sh as ``pytest -m xla``; skipped where torch_xla is not installed (tests/conftest.py).

The CPU strategy is the reference: same seed, same data, the losses agree within 1e-5 (XLA:CPU
compiles its own kernels, so bit equality is not expected across devices), a checkpoint written on
XLA loads on the CPU with equal weights, and a run resumed on XLA from a mid-epoch checkpoint is the
uninterrupted XLA run exactly."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from tests.helpers import procs
from tests.helpers.models import Regressor, make_net, regression_data
from trainforge import Accelerator, ConfigurationError, Trainer, seed_everything
from trainforge.callbacks import ModelCheckpoint
from trainforge.strategies.checkpoint.io import load_tensors

pytestmark = pytest.mark.xla
os.environ.setdefault("PJRT_DEVICE", "CPU")
torch_xla = pytest.importorskip("torch_xla")
# The XLA device must exist before this process's first backward: torch's autograd engine sizes its
# per-device queues then (a CPU backward first, then an XLA one, fails inside torch's engine).
torch_xla.device()


def _initial(dropout: float = 0.0) -> nn.Module:
    seed_everything(0)
    return make_net(dropout=dropout)


def _fit(strategy, root, initial, max_steps=12, ckpt_path=None, every=0, **kwargs):
    seed_everything(1)
    module = Regressor(copy.deepcopy(initial))
    callbacks = [ModelCheckpoint(every_n_steps=every, save_last=True)] if every else []
    extra = {"accelerator": "cpu"} if strategy == "single" else {}
    trainer = Trainer(
        strategy=strategy,
        max_steps=max_steps,
        default_root_dir=str(root),
        enable_progress_bar=False,
        enable_checkpointing=bool(every),
        callbacks=callbacks,
        **extra,
        **kwargs,
    )
    trainer.fit(module, DataLoader(regression_data(), batch_size=8, shuffle=True), ckpt_path=ckpt_path)
    weights = {k: v.detach().cpu() for k, v in module.state_dict().items()}
    return trainer, [float(loss.cpu()) for loss in module.losses], weights


def test_trainer_fit_on_xla_matches_the_cpu_strategy(tmp_path):
    initial = _initial()
    cpu_trainer, cpu_losses, cpu_weights = _fit(
        "single", tmp_path / "cpu", initial, accumulate_grad_batches=2, gradient_clip_val=1.0
    )
    xla_trainer, xla_losses, xla_weights = _fit(
        "xla", tmp_path / "xla", initial, accumulate_grad_batches=2, gradient_clip_val=1.0
    )
    assert xla_trainer.strategy.root_device.type == "xla" and type(xla_trainer.strategy).__name__ == "XLAStrategy"
    assert xla_trainer.global_step == cpu_trainer.global_step == 12 and len(xla_losses) == 24
    assert max(abs(a - b) for a, b in zip(cpu_losses, xla_losses)) < 1e-5
    assert cpu_losses[0] != cpu_losses[-1]  # it trained
    for key in cpu_weights:
        torch.testing.assert_close(xla_weights[key], cpu_weights[key], atol=1e-5, rtol=0)


def _accelerator_loop(strategy, initial, steps=8):
    seed_everything(1)
    kwargs = {"accelerator": "cpu"} if strategy == "single" else {}
    acc = Accelerator(strategy=strategy, gradient_accumulation_steps=2, **kwargs)
    model = copy.deepcopy(initial)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = acc.prepare(model, optimizer, DataLoader(regression_data(), batch_size=8, shuffle=True))
    losses = []
    for i, (x, y) in enumerate(loader):
        with acc.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.detach())
        if i + 1 == steps:
            break
    return acc, model, [float(v.cpu()) for v in losses]


def test_accelerator_loop_on_xla_matches_the_cpu_strategy_and_its_checkpoint_loads_on_cpu(tmp_path):
    initial = _initial()
    _, _, cpu_losses = _accelerator_loop("single", initial)
    acc, model, xla_losses = _accelerator_loop("xla", initial)
    assert acc.device.type == "xla" and next(model.parameters()).device.type == "xla"
    assert max(abs(a - b) for a, b in zip(cpu_losses, xla_losses)) < 1e-5
    acc.save_state(str(tmp_path / "ckpt"))
    saved = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    on_disk = load_tensors(tmp_path / "ckpt", "model", device="cpu")
    assert all(on_disk[k].device.type == "cpu" and torch.equal(on_disk[k], saved[k]) for k in saved)

    cpu = Accelerator(strategy="single", accelerator="cpu")  # another strategy reads the same checkpoint
    fresh = make_net()
    opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh, opt = cpu.prepare(fresh, opt)
    cpu.load_state(str(tmp_path / "ckpt"))
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, saved[key]), key
    assert opt.state_dict()["state"][0]["step"].item() == 4  # optimizer state (8 micro-batches, 4 steps)


def test_trainer_checkpoint_written_on_xla_resumes_on_cpu(tmp_path):
    initial = _initial()
    _, _, xla_weights = _fit("xla", tmp_path, initial, max_steps=6, every=6)
    trainer, _, weights = _fit("single", tmp_path, initial, max_steps=6, ckpt_path="last")
    assert trainer.global_step == 6
    for key in xla_weights:
        assert torch.equal(weights[key], xla_weights[key]), key  # nothing trained after the resume: loaded as is


def test_exact_resume_on_xla_from_a_mid_epoch_checkpoint(tmp_path):
    """64 samples / batch 8 = 8 steps an epoch; the cut run stops at step 11 (epoch 1, batch 3) with a
    checkpoint there; the resumed run must give the uninterrupted run's weights and losses exactly.
    Dropout draws from torch_xla's own device generator, which the checkpoint saves and restores too;
    torch_xla derives random seeds per executed graph, so the reference run saves at the same step
    (a save cuts the graph)."""
    initial = _initial(dropout=0.2)
    _, full_losses, full = _fit("xla", tmp_path / "full", initial, max_steps=16, every=11)
    _, cut_losses, _ = _fit("xla", tmp_path / "cut", initial, max_steps=11, every=11)
    seed_everything(123)  # the resumed run must not depend on the random state it starts in
    _, resumed_losses, resumed = _fit("xla", tmp_path / "cut", initial, max_steps=16, ckpt_path="last")
    assert cut_losses + resumed_losses == full_losses
    for key in full:
        assert torch.equal(resumed[key], full[key]), key


def test_bf16_on_xla(tmp_path):
    initial = _initial()
    trainer, losses, weights = _fit("xla", tmp_path / "mixed", initial, max_steps=4, precision="bf16-mixed")
    assert all(torch.isfinite(torch.tensor(losses))) and weights["net.0.weight"].dtype == torch.float32
    trainer, losses, weights = _fit("xla", tmp_path / "true", initial, max_steps=4, precision="bf16-true")
    assert weights["net.0.weight"].dtype == torch.bfloat16 and all(torch.isfinite(torch.tensor(losses)))
    with pytest.raises(ConfigurationError, match=r"precision='16-mixed' is not supported with strategy='xla'.*bf16"):
        _fit("xla", tmp_path / "fp16", initial, max_steps=1, precision="16-mixed")


def test_collectives_on_one_xla_device():
    acc = Accelerator(strategy="xla")
    t = torch.arange(3.0, device=acc.device)
    assert torch.equal(acc.reduce(t, "mean").cpu(), torch.arange(3.0))
    assert acc.gather(t).shape == (3,) and acc.broadcast({"a": 1}) == {"a": 1}
    acc.wait_for_everyone()


def test_launch_xla_runs_the_script_on_the_xla_device(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "from trainforge import Accelerator\nacc = Accelerator()\n"
        "print('STRATEGY', acc.strategy.name, acc.device.type, acc.num_processes)\n"
    )
    out = procs.run(
        [sys.executable, "-m", "trainforge", "launch", "--xla", str(script)],
        timeout=300,
        env=procs.test_env(PJRT_DEVICE="CPU"),
    )
    assert "STRATEGY xla xla 1" in out.stdout
