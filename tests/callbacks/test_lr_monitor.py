"""LearningRateMonitor: values follow the scheduler step by step; names follow Lightning's scheme."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.scripts.cb_launch import multirank
from tests.scripts.cb_standin import StandInTrainer
from trainforge.callbacks.lr_monitor import LearningRateMonitor
from trainforge.strategies.errors import ConfigurationError


def _loader(n: int):
    return [(torch.randn(2, 3),) for _ in range(n)]


def _lr_used_per_step(steps: int, step_size: int, gamma: float):
    """Replay the same optimizer + StepLR in a raw loop: the lr each optimizer step used (1-based)."""
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=step_size, gamma=gamma)
    used = {}
    for k in range(1, steps + 1):
        used[k] = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
    return used


def test_step_lr_changes_value_at_the_right_step():
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.1)
    trainer = StandInTrainer([LearningRateMonitor()], log_every_n_steps=1)
    trainer.fit(model, _loader(8), opt, max_steps=8, scheduler=sched)
    logged = trainer.series("lr-SGD")
    expected = _lr_used_per_step(8, 3, 0.1)
    assert logged == pytest.approx(expected)
    assert logged[3] == pytest.approx(1.0) and logged[4] == pytest.approx(0.1)  # the change lands on step 4


def test_log_every_n_steps_and_epoch_interval():
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    trainer = StandInTrainer([LearningRateMonitor()], log_every_n_steps=3)
    trainer.fit(model, _loader(9), opt, max_steps=9, scheduler=sched)
    expected = _lr_used_per_step(9, 2, 0.5)
    assert trainer.series("lr-SGD") == pytest.approx({k: expected[k] for k in (3, 6, 9)})

    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    trainer = StandInTrainer([LearningRateMonitor(logging_interval="epoch")])
    trainer.fit(model, _loader(2), opt, max_steps=8, scheduler=sched)  # 4 epochs of 2 steps
    assert trainer.series("lr-SGD") == pytest.approx({0: 1.0, 2: 1.0, 4: 0.5, 6: 0.5})


def test_names_for_several_optimizers_and_groups():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    sgd0 = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    sgd1 = torch.optim.SGD(b.parameters(), lr=0.2)
    adam = torch.optim.Adam(
        [{"params": a.parameters(), "lr": 0.3}, {"params": b.parameters(), "lr": 0.4}], betas=(0.8, 0.99)
    )
    named = torch.optim.AdamW(
        [{"params": a.parameters(), "name": "enc"}, {"params": b.parameters(), "name": "dec"}], lr=0.5
    )
    sched = torch.optim.lr_scheduler.StepLR(named, step_size=1)
    trainer = StandInTrainer([])
    trainer.optimizers = [sgd0, sgd1, adam, named]
    trainer.lr_scheduler_configs = [{"scheduler": sched, "interval": "step", "frequency": 1, "name": "lr-main"}]
    values = LearningRateMonitor(log_momentum=True).current_values(trainer)
    assert values == pytest.approx(
        {
            "lr-SGD": 0.1,
            "momentum-SGD": 0.9,
            "lr-SGD-1": 0.2,
            "momentum-SGD-1": 0.0,
            "lr-Adam/pg1": 0.3,
            "lr-Adam/pg2": 0.4,
            "momentum-Adam/pg1": 0.8,
            "momentum-Adam/pg2": 0.8,
            "lr-main/enc": 0.5,
            "lr-main/dec": 0.5,
            "momentum-main/enc": 0.9,
            "momentum-main/dec": 0.9,
        }
    )


def test_bad_interval():
    with pytest.raises(ConfigurationError, match=r"logging_interval\)='batch' is not one of: step, epoch"):
        LearningRateMonitor(logging_interval="batch")


@pytest.mark.slow
def test_real_trainer_step_lr():
    expected = _lr_used_per_step(12, 5, 0.5)  # the script's StepLR(step_size=5, gamma=0.5), lr 0.1 -> x 0.1
    for res in multirank("monitors"):
        logged = {int(step): m["lr-SGD"] for step, m in res["logged"].items() if "lr-SGD" in m}
        assert logged == pytest.approx({k: 0.1 * expected[k] for k in (4, 8, 12)})
