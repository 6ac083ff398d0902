"""GradientNormMonitor: equals clip_grad_norm_'s norm on copies of the same gradients, also sharded."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tests.scripts.cb_launch import multirank
from tests.scripts.cb_standin import StandInTrainer
from trainforge.callbacks.base import Callback
from trainforge.callbacks.grad_norm import GradientNormMonitor, total_norm
from trainforge.strategies.errors import ConfigurationError


class ClipReference(Callback):
    """After the monitor: ``clip_grad_norm_`` on copies of the gradients, keyed like the monitor's log."""

    def __init__(self, norm_type: float) -> None:
        self.norm_type, self.norms, self.per_param = norm_type, {}, {}

    def on_before_optimizer_step(self, trainer, module, optimizer):
        named = [(n, p) for n, p in module.named_parameters() if p.grad is not None]
        copies = []
        for _, p in named:
            c = nn.Parameter(p.detach().clone())
            c.grad = p.grad.detach().clone()
            copies.append(c)
        step = trainer.global_step + 1
        self.norms[step] = float(torch.nn.utils.clip_grad_norm_(copies, max_norm=1e9, norm_type=self.norm_type))
        self.per_param[step] = {
            n: float(torch.linalg.vector_norm(c.grad, self.norm_type)) for (n, _), c in zip(named, copies)
        }


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_equals_clip_grad_norm(norm_type):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 2))
    ref = ClipReference(norm_type)
    trainer = StandInTrainer([GradientNormMonitor(norm_type=norm_type, per_layer=True), ref], log_every_n_steps=2)
    trainer.fit(
        model, [(torch.randn(4, 5),) for _ in range(6)], torch.optim.SGD(model.parameters(), lr=0.1), max_steps=6
    )
    logged = trainer.series("grad_norm/total")
    assert sorted(logged) == [2, 4, 6]  # every log_every_n_steps, at the step being completed
    for step, value in logged.items():
        assert value == pytest.approx(ref.norms[step], rel=1e-6)
        for name, expected in ref.per_param[step].items():
            assert trainer.series(f"grad_norm/{name}")[step] == pytest.approx(expected, rel=1e-6)
    assert len({round(v, 6) for v in logged.values()}) == 3  # the gradients changed: not one stale value


def test_total_norm_of_nothing_and_bad_norm_type():
    assert float(total_norm([])) == 0.0
    with pytest.raises(ConfigurationError, match="norm_type=-1.0"):
        GradientNormMonitor(norm_type=-1)


@pytest.mark.slow
def test_real_trainer_two_ranks_matches_clip_grad_norm():
    for res in multirank("monitors"):
        logged, clip = res["logged"], res["clip_norms"]
        for step in ("4", "8", "12"):
            assert logged[step]["grad_norm/total"] == pytest.approx(clip[step], rel=1e-6)


@pytest.mark.slow
def test_dtensor_shards_give_the_full_norm():
    r0, r1 = multirank("dtensor_grad_norm")
    for norm_type in ("2.0", "1.0", "inf"):
        for res in (r0, r1):
            got = res[norm_type]
            assert got["computed"]["grad_norm/total"] == pytest.approx(got["expected"], rel=1e-5)
            assert got["computed"]["grad_norm/w"] == pytest.approx(got["expected_w"], rel=1e-5)
        # each rank's shard alone gives another number: the reduction across ranks really happened
        assert min(r0[norm_type]["local_shard_norm"], r1[norm_type]["local_shard_norm"]) < r0[norm_type]["expected"]
