"""An Accelerator run resumed on another number of processes (or batch size) continues its
learning-rate schedule where it stopped, or the resume is refused (trainer/checkpoint/scheduler_clock.py)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers import forklaunch, procs
from trainforge import Accelerator, CheckpointError
from trainforge.trainer.checkpoint.scheduler_clock import convert_scheduler_states

SCRIPT = procs.REPO / "tests" / "scripts" / "sched_resume.py"


def _lrs(path):
    return {r["step"]: r["lr"] for r in map(json.loads, path.read_text().splitlines())}


def test_a_two_process_run_resumed_on_one_process_keeps_its_linear_schedule(tmp_path):
    """HF run_clm_no_trainer's schedule (sized in per-process units, stepped once per process per
    optimizer step), the same global batch: the lr of every step after the resume is the lr the
    uninterrupted 2-process run had at that step (before: 0 from the step where 1/2 of it was left)."""
    forklaunch.launch(SCRIPT, tmp_path, "--tag", "full", "--save-at", "5", timeout=180)
    proc = forklaunch.run_script(SCRIPT, tmp_path, "--tag", "resumed", "--save-at", "5", "--resume", timeout=120)
    assert "schedule continues at the same point (scheduler position [10] -> [5])" in proc.stdout
    full, resumed = _lrs(tmp_path / "lr_full.jsonl"), _lrs(tmp_path / "lr_resumed.jsonl")
    assert sorted(resumed) == list(range(6, 17))
    assert {s: full[s] for s in resumed} == resumed  # exactly, float for float
    assert resumed[10] > 0


def _run_epoch(tmp_path, batch, make_sched, resume=False):
    acc = Accelerator()
    data = TensorDataset(torch.randn(16, 2), torch.randn(16, 1))
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader, sched = acc.prepare(model, opt, DataLoader(data, batch_size=batch), make_sched(opt))
    if resume:
        acc.load_state(tmp_path / "ckpt")
        return sched
    for x, y in loader:
        acc.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        sched.step()
        opt.zero_grad()
    acc.save_state(tmp_path / "ckpt")
    return sched


def _lambda(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / 100)


def test_a_lambda_schedule_moves_to_the_new_batch_size_and_the_same_batch_keeps_every_scheduler(tmp_path):
    _run_epoch(tmp_path, 2, _lambda)  # 8 steps of 2 samples
    assert _run_epoch(tmp_path, 4, _lambda, resume=True).last_epoch == 4  # 8 * 2 / 4
    step_lr = lambda opt: torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)  # noqa: E731
    _run_epoch(tmp_path / "same", 2, step_lr)
    resumed = _run_epoch(tmp_path / "same", 2, step_lr, resume=True)
    assert (resumed.last_epoch, resumed.get_last_lr()) == (8, [0.1 * 0.5**2])


def test_a_schedule_that_cannot_continue_exactly_is_refused_with_the_way_out(tmp_path):
    _run_epoch(tmp_path, 2, lambda opt: torch.optim.lr_scheduler.StepLR(opt, 3, 0.5))
    with pytest.raises(CheckpointError, match=r"stepped once per 2 sample.*one step is 4 .*StepLR keeps its lengths"):
        _run_epoch(tmp_path, 4, lambda opt: torch.optim.lr_scheduler.StepLR(opt, 3, 0.5), resume=True)
    _run_epoch(tmp_path / "odd", 1, _lambda)  # 16 steps of 1 sample; 16 * 1 / 3 is not whole
    with pytest.raises(CheckpointError, match=r"position 16 x 1/3 is not a whole step.*same per-process batch"):
        _run_epoch(tmp_path / "odd", 3, _lambda, resume=True)


@pytest.mark.parametrize(
    "clock",
    [
        "ten",
        {"steps_per_optimizer_step": 0, "samples_per_optimizer_step": 8},
        {"steps_per_optimizer_step": 2, "samples_per_optimizer_step": -8},
        {"steps_per_optimizer_step": "2", "samples_per_optimizer_step": 8},
    ],
)
def test_a_damaged_scheduler_clock_in_a_checkpoint_is_refused(clock):
    now = {"steps_per_optimizer_step": 1, "samples_per_optimizer_step": 8}
    with pytest.raises(CheckpointError, match=r"scheduler_clock .* is not what trainforge writes"):
        convert_scheduler_states("ckpt", [{"last_epoch": 4}], clock, now, [])
