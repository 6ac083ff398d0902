"""Accelerate's DummyOptim / DummyScheduler (issue 38 item 5): the DeepSpeed config's optimizer and scheduler
sections, prepared through the stand-ins, with the config's "auto" values filled as Accelerate 1.15's
``_prepare_deepspeed`` fills them; refused by name where Accelerate refuses them (and where it would ignore them)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers import forklaunch, procs
from trainforge import Accelerator, ConfigurationError
from trainforge.strategies import DeepSpeedStrategy
from trainforge.strategies.deepspeed_config import merge_config
from trainforge.trainer.compat.accelerate.deepspeed import config_optimizer
from trainforge.utils import DummyOptim, DummyScheduler

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "accelerate_ds_dummies.py"
OPTIMIZER = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}
SCHEDULER = {"type": "WarmupDecayLR", "params": {"warmup_max_lr": "auto", "total_num_steps": "auto"}}


@pytest.mark.slow
def test_deepspeed_builds_the_configs_optimizer_and_scheduler_from_the_stand_ins(tmp_path):
    """One CPU process: DeepSpeed's AdamW and WarmupLR (linear, 4 steps) give the weights of torch's AdamW stepped
    by hand at the same learning rates, bit for bit; ``scheduler.step()`` does not step twice."""
    forklaunch.launch(SCRIPT, str(tmp_path), nproc=1, env=procs.test_env(DS_ACCELERATOR="cpu"), timeout=300)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["config_optimizer"]["params"] == {"lr": 0.1, "weight_decay": 0.01, "torch_adam": True}
    assert result["config_scheduler"]["params"] == {
        "warmup_min_lr": 0,
        "warmup_max_lr": 0.1,
        "warmup_num_steps": 4,
        "warmup_type": "linear",
    }
    # WarmupLR gives min_lr at iterations -1 and 0, then (t / 4) * 0.1; stepped once per optimizer step
    assert result["lrs"] == pytest.approx([0, 0, 0.025, 0.05, 0.075, 0.1]) and result["last_lr"] == [0.1]
    assert result["max_diff"] == 0.0 and result["optimizer"] == "DeepSpeedZeroOptimizer"


def _objects(lr=3e-4, **scheduler):
    model = nn.Linear(2, 1)
    optimizer = DummyOptim(model.parameters(), lr=lr, weight_decay=0.1)
    return model, optimizer, DummyScheduler(optimizer, **scheduler)


def test_the_auto_values_are_accelerates():
    strategy = DeepSpeedStrategy(config={"optimizer": OPTIMIZER, "scheduler": SCHEDULER})
    objects = _objects(total_num_steps=101, warmup_num_steps=0)
    made = config_optimizer(strategy, objects, num_processes=2, split_batches=False)
    assert made.auto == {
        "optimizer.params.lr": 3e-4,
        "optimizer.params.weight_decay": 0.1,
        "scheduler.params.warmup_min_lr": 0,
        "scheduler.params.warmup_max_lr": 3e-4,
        "scheduler.params.warmup_num_steps": 1,  # max(1, 0): DeepSpeed 0.19.6 refuses 0
        "scheduler.params.total_num_steps": math.ceil(101 / 2),  # per process, unless split_batches
    }
    assert config_optimizer(strategy, objects, 2, True).auto["scheduler.params.total_num_steps"] == 101
    merged = merge_config({"train_batch_size": 8}, strategy.user_config, {}, optimizer_auto=made.auto)
    # only the "auto" entries are filled: WarmupDecayLR's config named no warmup_min_lr / warmup_num_steps
    assert merged["optimizer"] == {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}}
    assert merged["scheduler"]["params"] == {"warmup_max_lr": 3e-4, "total_num_steps": 51}
    assert config_optimizer(strategy, [nn.Linear(1, 1)], 1, False) is None  # no stand-ins: nothing to do


@pytest.mark.parametrize(
    "config, objects, match",
    [
        ({}, "dummies", r"DummyOptim, and the DeepSpeed config has no 'optimizer' section"),
        ({"optimizer": OPTIMIZER}, "dummies", r"DummyScheduler without lr_scheduler_callable, and the DeepSpeed"),
        ({"optimizer": OPTIMIZER}, "scheduler only", r"DummyScheduler without a DummyOptim"),
        ({"optimizer": OPTIMIZER}, "with torch optimizer", r"got a DummyOptim and a torch optimizer"),
        (
            {"optimizer": OPTIMIZER, "scheduler": SCHEDULER},
            "callable",
            r"lr_scheduler_callable=...\) with a 'scheduler' section in the DeepSpeed config",
        ),
    ],
)
def test_what_accelerate_refuses_is_refused_by_name(config, objects, match):
    model, optimizer, scheduler = _objects()
    given = {
        "dummies": [model, optimizer, scheduler],
        "scheduler only": [model, scheduler],
        "with torch optimizer": [model, optimizer, torch.optim.SGD(model.parameters(), lr=0.1)],
        "callable": [model, optimizer, DummyScheduler(optimizer, lr_scheduler_callable=lambda o: None)],
    }[objects]
    with pytest.raises(ConfigurationError, match=match):
        config_optimizer(DeepSpeedStrategy(config=config), given, 1, False)


def test_a_dummy_optim_under_another_strategy_is_refused():
    model, optimizer, _ = _objects()
    with pytest.raises(ConfigurationError, match=r"DummyOptim with strategy 'single'.*DeepSpeedStrategy\(config="):
        Accelerator(cpu=True).prepare(model, optimizer)


def test_a_config_optimizer_with_a_torch_optimizer_names_the_stand_ins():
    with pytest.raises(ConfigurationError, match=r"'optimizer' section.*trainforge.utils.DummyOptim / DummyScheduler"):
        merge_config({}, {"optimizer": OPTIMIZER}, {})
