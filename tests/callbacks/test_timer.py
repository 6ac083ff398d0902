"""Timer: duration parsing, stopping a sleeping run, resuming with the time already spent."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
from torch import nn

from tests.scripts.cb_launch import multirank
from tests.scripts.cb_standin import StandInTrainer
from trainforge.callbacks.timer import Timer, parse_duration
from trainforge.strategies.errors import ConfigurationError

STEP_SLEEP = 0.05


def _fit(timer, max_steps=200):
    model = nn.Linear(3, 1)

    def loss_fn(m, batch):
        time.sleep(STEP_SLEEP)
        return m(batch[0]).pow(2).mean()

    trainer = StandInTrainer([timer])
    trainer.fit(
        model,
        [(torch.randn(2, 3),) for _ in range(10)],
        torch.optim.SGD(model.parameters(), lr=0.01),
        max_steps=max_steps,
        loss_fn=loss_fn,
    )
    return trainer


def test_parse_duration():
    assert parse_duration("00:12:00:00") == timedelta(hours=12)
    assert parse_duration("1:02:03:04") == timedelta(days=1, hours=2, minutes=3, seconds=4)
    assert parse_duration(dict(hours=1, minutes=30)) == timedelta(minutes=90)
    assert parse_duration(timedelta(seconds=5)) == timedelta(seconds=5)
    assert parse_duration(None) is None
    with pytest.raises(ConfigurationError, match=r"duration='12:00'.*DD:HH:MM:SS"):
        Timer(duration="12:00")
    with pytest.raises(ConfigurationError, match=r"duration=\{'hour': 1\}.*Valid keys"):
        Timer(duration={"hour": 1})
    with pytest.raises(ConfigurationError, match=r"interval\)='batch' is not one of: step, epoch"):
        Timer(duration="00:00:00:01", interval="batch")
    with pytest.raises(ConfigurationError, match="longer than zero"):
        Timer(duration=dict(seconds=0))


def test_stops_after_the_duration_and_resume_counts_spent_time():
    timer = Timer(duration=dict(seconds=1))
    trainer = _fit(timer)
    assert trainer.should_stop and 1 < trainer.global_step < 200
    spent = timer.time_elapsed("fit")
    assert spent >= 1.0
    assert trainer.global_step * STEP_SLEEP <= spent  # never stopped before enough steps had slept
    assert timer.time_remaining() <= 0

    resumed = Timer(duration=dict(seconds=1.5))
    resumed.load_state_dict(timer.state_dict())
    assert resumed.time_elapsed("fit") == pytest.approx(spent)
    second = _fit(resumed)
    # ~0.5 s were left: far fewer steps than a fresh 1.5 s timer would allow
    assert second.should_stop and second.global_step < trainer.global_step
    assert resumed.time_elapsed("fit") >= 1.5


def test_epoch_interval_and_stage_clocks():
    timer = Timer(duration=dict(seconds=0.2), interval="epoch")
    trainer = _fit(timer, max_steps=200)
    assert trainer.global_step == 10  # 10 batches per epoch: the check waits for the epoch end
    assert timer.time_elapsed("validate") == 0.0 and timer.time_elapsed("test") == 0.0
    with pytest.raises(ConfigurationError, match=r"'train' is not one of: fit, validate, test"):
        timer.time_elapsed("train")


@pytest.mark.slow
def test_two_ranks_stop_together_on_rank0s_clock():
    r0, r1 = multirank("timer")
    # rank 1's own timer said "expired" from the start; rank 0's clock decided for both
    assert r0["steps1"] == r1["steps1"] > 1
    assert r0["elapsed1"] >= 1.0
    # resumed from rank 0's state (>= 1 s spent of 1 s): both stop after the first step
    assert r0["steps2"] == r1["steps2"] == 1
    assert r0["elapsed2"] >= r0["saved"] >= 1.0
