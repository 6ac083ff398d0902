"""ThroughputMonitor: rates consistent with a known sleep per step; tokens, FLOPs and MFU."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from tests.scripts.cb_launch import multirank
from tests.scripts.cb_standin import StandInTrainer
from trainforge.callbacks.throughput import ThroughputMonitor, gpu_key, is_transformer, parameter_count, peak_flops_for
from trainforge.strategies.errors import ConfigurationError

BATCH, SEQ, SLEEP = 8, 16, 0.02


def _dict_loader(n_batches: int, with_count: bool = False):
    batches = []
    for _ in range(n_batches):
        b = {"input_ids": torch.randint(0, 10, (BATCH, SEQ)), "x": torch.randn(BATCH, 4)}
        if with_count:
            b["num_tokens"] = torch.tensor(BATCH * SEQ - 3)  # e.g. padding excluded
        batches.append(b)
    return batches


def _sleepy_loss(model, batch):
    time.sleep(SLEEP)
    return model(batch["x"]).pow(2).mean()


def _fit(monitor, loader, model=None, steps=30, log_every=5, **kwargs):
    model = model or nn.Linear(4, 4)
    trainer = StandInTrainer([monitor], log_every_n_steps=log_every)
    trainer.fit(
        model, loader, torch.optim.SGD(model.parameters(), lr=0.01), max_steps=steps, loss_fn=_sleepy_loss, **kwargs
    )
    return trainer


def test_samples_and_tokens_per_second_match_the_sleep():
    trainer = _fit(ThroughputMonitor(window=10), _dict_loader(30))
    rates = trainer.series("throughput/samples_per_sec")
    assert sorted(rates) == [5, 10, 15, 20, 25, 30]
    ideal = BATCH / SLEEP  # the sleep is a lower bound on each step's time
    for value in rates.values():
        assert ideal / 4 < value <= ideal * 1.02
    tokens = trainer.series("throughput/tokens_per_sec")
    for step, value in rates.items():  # same window: tokens/s is exactly SEQ x samples/s here
        assert tokens[step] == pytest.approx(value * SEQ, rel=1e-9)
    assert trainer.series("throughput/samples_per_sec_per_device") == rates  # one process


def test_validation_time_is_not_counted():
    calls = []

    def slow_validation(trainer):  # the validation after step 10 takes 0.6 s, later ones nothing
        calls.append(trainer.global_step)
        time.sleep(0.6 if len(calls) == 1 else 0.0)
        return {}

    trainer = _fit(
        ThroughputMonitor(window=10),
        _dict_loader(20),
        steps=20,
        log_every=10,
        val_every_n_steps=10,
        val_metrics=slow_validation,
    )
    rates = trainer.series("throughput/samples_per_sec")
    # The window ending at step 20 spans that validation. Counted, its rate would be T / (T + 0.6) of the
    # step-10 window's (T = 10 training steps, >= 0.2 s): < 0.6 unless a step took 90 ms. Excluded: alike.
    assert calls[0] == 10 and rates[20] > 0.6 * rates[10]


def test_mfu_from_user_flops_and_peak():
    monitor = ThroughputMonitor(window=10, flops_per_sample=1e6, peak_flops=1e9)
    trainer = _fit(monitor, _dict_loader(20, with_count=True), steps=20)
    samples = trainer.series("throughput/samples_per_sec")
    mfu = trainer.series("throughput/mfu")
    for step, value in samples.items():
        assert mfu[step] == pytest.approx(value * 1e6 / 1e9, rel=1e-9)
    tokens = trainer.series("throughput/tokens_per_sec")  # num_tokens wins over input_ids
    assert tokens[20] == pytest.approx(samples[20] * (BATCH * SEQ - 3) / BATCH, rel=1e-9)


class TinyTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(d_model=4, nhead=2, dim_feedforward=8, batch_first=True)

    def forward(self, x):
        return self.layer(x.unsqueeze(1)).squeeze(1)


def test_transformer_flops_use_the_6n_rule():
    model = TinyTransformer()
    assert is_transformer(model) and not is_transformer(nn.Linear(2, 2))
    trainer = _fit(ThroughputMonitor(window=10), _dict_loader(20), model=model, steps=20)
    tokens = trainer.series("throughput/tokens_per_sec")
    flops = trainer.series("throughput/flops_per_sec_per_device")
    n = sum(p.numel() for p in model.parameters())
    assert parameter_count(model) == n
    assert flops[20] == pytest.approx(6 * n * tokens[20], rel=1e-9)
    assert "throughput/mfu" not in trainer.logged[-1][0]  # CPU: no peak unless given


def test_missing_tokens_key_is_a_clear_error():
    with pytest.raises(ConfigurationError, match=r"tokens_key='ids'.*batch keys: \['input_ids', 'x'\]"):
        _fit(ThroughputMonitor(tokens_key="ids"), _dict_loader(2), steps=2)


def test_peak_table_lookup():
    assert gpu_key("NVIDIA H100 80GB HBM3") == "h100 sxm"
    assert gpu_key("NVIDIA H100 PCIe") == "h100 pcie"
    assert gpu_key("NVIDIA A100-SXM4-80GB") == "a100"
    assert gpu_key("NVIDIA L4") == "l4" and gpu_key("NVIDIA L40S") == "l40s"
    assert gpu_key("NVIDIA GeForce RTX 4090") == "rtx 4090"
    assert gpu_key("Some Unknown Accelerator") is None
    assert peak_flops_for(torch.device("cpu"), "bf16-mixed") is None


def test_bad_arguments():
    with pytest.raises(ConfigurationError, match="window=0"):
        ThroughputMonitor(window=0)
    with pytest.raises(ConfigurationError, match="peak_flops=-1"):
        ThroughputMonitor(peak_flops=-1)


@pytest.mark.slow
def test_real_trainer_two_ranks_sum_samples_per_second():
    r0, r1 = multirank("monitors")  # 4 samples per rank per step, each step sleeps 0.02 s
    ideal_per_device = r0["ideal_per_device"]
    for step in ("4", "8", "12"):
        m0, m1 = r0["logged"][step], r1["logged"][step]
        assert m0["throughput/samples_per_sec"] == m1["throughput/samples_per_sec"]  # reduced: one value
        assert m0["throughput/samples_per_sec"] == pytest.approx(2 * m0["throughput/samples_per_sec_per_device"])
        assert ideal_per_device / 4 < m0["throughput/samples_per_sec_per_device"] <= ideal_per_device * 1.02
